"""step08 引擎：step07（分页 + 前缀缓存 + token 预算的混合前向）+ 量化的 KV 池子 + 换出式抢占。

主循环是 step07 的 generate，一行没改；换掉的是它用到的两样东西：
- 池子（cache_cls）：kv_dtype 是 int8 / fp8（或另一种浮点）时换成 QuantPagedKVCache——写时量化、读时反量化，
  都在 step05 的写 / 读路径上；kv_dtype 等于模型的 dtype（默认）时用回 step05 的池子：精确模式，与 step07 逐位相同。
- 调度器（budget_scheduler_cls）：SwapScheduler。preempt="recompute" 时它不带第二层，行为与 step07 完全相同；
  preempt="swap" 时抢占把块换出到 SwapSpace（CPU 内存；池子在 CUDA 上时用锁页内存），重新接纳时换回来。

池子的块数由调用方给（run.py 按同样的 MiB 预算换算：每 token 字节越少，块越多）。
"""
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

from common.errors import UserError
from step07_chunked_prefill.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, ChunkedPrefillEngine

from .paged_quant import KVFormat, QuantPagedKVCache, kv_format
from .scheduler import SwapScheduler
from .sequence import Sequence
from .swap import SwapSpace

PREEMPT_CHOICES = ("recompute", "swap")


def pool_bytes_per_token(cfg, block_size: int, dtype, fmt: Optional[KVFormat]) -> float:
    """池子里每个 token 占的字节（含 scale）；fmt None = 模型 dtype 原样存（step05 的 cfg.kv_bytes_per_token）。"""
    return cfg.kv_bytes_per_token(dtype.itemsize) if fmt is None else fmt.bytes_per_token(cfg, block_size)


def num_blocks_for_mib(cfg, block_size: int, dtype, fmt: Optional[KVFormat], mib: float) -> int:
    """同样的 MiB 预算能放几块：预算 ÷ (block_size × 每 token 字节)。"""
    return int(mib * 2**20 // (block_size * pool_bytes_per_token(cfg, block_size, dtype, fmt)))


@dataclass
class SwapCounters:
    """一次 generate 里换出 / 换入的次数、字节与秒数（从 SwapSpace 的累计计数相减得到）。"""
    swap_outs: int = 0
    swap_ins: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    seconds_out: float = 0.0
    seconds_in: float = 0.0
    recompute_preemptions: int = 0                         # 第二层装不下（或没什么可换）时退回重算的抢占
    tokens: list[int] = field(default_factory=list)       # 每次换出时那个请求已算好的 token 数


class KVQuantEngine(ChunkedPrefillEngine):
    sequence_cls = Sequence

    def __init__(self, model, num_blocks: int, block_size: int = 16, max_batch_size: int = 8,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, chunked_prefill: bool = True,
                 prefix_caching: bool = True, kv_dtype: Optional[str] = None, preempt: str = "recompute",
                 swap_blocks: Optional[int] = None, **kw):
        # >>> step08 新增：池子与调度器换成本步的版本（在父类的 __init__ 创建它们之前）
        if preempt not in PREEMPT_CHOICES:
            raise UserError(f"unknown --preempt {preempt!r} (choose from {', '.join(PREEMPT_CHOICES)})")
        if preempt == "swap" and not chunked_prefill:
            raise UserError("--preempt swap works with chunked prefill only (drop --no-chunked-prefill)")
        self.fmt = kv_format(kv_dtype, model.dtype)
        if self.fmt is not None:
            self.cache_cls = partial(QuantPagedKVCache, fmt=self.fmt)
        # <<<
        super().__init__(model, num_blocks, block_size, max_batch_size, max_num_batched_tokens, chunked_prefill,
                         prefix_caching, **kw)
        # >>> step08 新增：第二层（默认与池子一样多的块）与能换出的调度器
        self.preempt = preempt
        self.swap = None
        if preempt == "swap":
            tensors = self.cache.tensors() if self.fmt is not None else [self.cache.pool]
            self.swap = SwapSpace(tensors, swap_blocks or num_blocks, block_dim=2)
        self.budget_scheduler_cls = partial(SwapScheduler, swap=self.swap)
        self.last_swap = SwapCounters()   # 最近一次 generate 的换出账
        self.last_scheduler = None
        # <<<

    @property
    def pool_nbytes(self) -> int:
        """池子实际占的字节（码 + scale；含从不分配的空块）。"""
        return self.cache.pool.nbytes if self.fmt is None else self.cache.nbytes

    def bytes_per_token(self) -> float:
        return pool_bytes_per_token(self.model.cfg, self.block_size, self.model.dtype, self.fmt)

    def generate(self, requests, eos_ids=(), tokenizer=None, on_step=None):
        """step07 的 generate 原样；--preempt swap 时另把这次运行的换出次数、字节、秒数记进 last_swap。"""
        sw = self.swap
        before = (sw.num_swap_out, sw.num_swap_in, sw.bytes_out, sw.bytes_in, sw.seconds_out, sw.seconds_in) if sw else None
        out = super().generate(requests, eos_ids, tokenizer, on_step)
        if sw is not None:
            now = (sw.num_swap_out, sw.num_swap_in, sw.bytes_out, sw.bytes_in, sw.seconds_out, sw.seconds_in)
            self.last_swap = SwapCounters(*(a - b for a, b in zip(now, before)),
                                          recompute_preemptions=self.last_scheduler.num_recompute_preemptions,
                                          tokens=list(self.last_scheduler.swap_out_tokens))
        return out

    def collect(self, stats, sched, seqs) -> None:
        super().collect(stats, sched, seqs)
        self.last_scheduler = sched      # 这次 generate 的调度器：generate 结束后读它的换出记录
