"""step05 引擎：分页 KV cache + 连续批处理 + 重算式抢占。

每一步：调度器选出这一步要算的请求（全 prefill 或全 decode）→ cache.plan 把它们排成张量、算好槽号，
得到这次前向的 PagedForward → 把它当作 cache 传给模型，前向一次（每层经它的 update 写入新 K/V、按块表读回全部 K/V）→ 每个请求用自己的随机数发生器采样一个
token → 结束的请求立刻把块还回去，下一步就可以接纳新请求。

与 step03 逐 token 一致的关键：
- 每个请求在自己的位置上（positions 显式给出）看见且只看见自己的 K/V（块表 + 按位置的掩码）；
- 每个请求一个随机数发生器，按自己的 seed 创建；被抢占后只重算 K/V，已生成的 token 原样保留、不重新采样，
  所以它消耗的随机数序列与 step03 单独生成时完全相同。
"""
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from common.errors import UserError
from step02_sampling.sampler import make_generator, sample
from step04_static_batching.request import Request
from step05_paged.block_allocator import BlockAllocator
from step05_paged.paged_cache import PagedKVCache
from step05_paged.scheduler import Scheduler
from step05_paged.sequence import Sequence, Status

DEFAULT_KV_MIB = 256               # 不给 --num-blocks 时，池子按这么大的 KV 预算换算块数
DEFAULT_MAX_PREFILL_TOKENS = 2048  # 一次 prefill 前向最多 B × L 个 token 位置（限制 CPU 上的峰值内存和单步延迟）


def num_blocks_for_budget(cfg, block_size: int, dtype: torch.dtype, mib: int = DEFAULT_KV_MIB) -> int:
    return mib * 2**20 // PagedKVCache.bytes_per_block(cfg, block_size, dtype)


def blocks_needed(r: Request, block_size: int) -> int:
    """一个请求一生最多占几块：最后采样出的 token 不再喂回模型、不进缓存，所以是 提示词 + N - 1 个 token。"""
    return -(-(len(r.prompt_ids) + r.max_new_tokens - 1) // block_size)


@dataclass
class EngineStats:
    wall_s: float = 0.0
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    preemptions: int = 0
    peak_running: int = 0               # 同时在运行集合里的请求数的峰值
    allocated_slot_steps: int = 0       # Σ 每步运行集合持有的槽数
    used_slot_steps: int = 0            # Σ 每步其中真正存着 token K/V 的槽数
    generated_tokens: int = 0
    prefill_tokens: int = 0             # prefill 实际算了多少个 token（被抢占后重算的也算）
    ttft_s: list[float] = field(default_factory=list)   # 每个请求的首 token 时间（所有请求都在 t=0 到达）
    tpot_s: list[float] = field(default_factory=list)   # 生成 ≥ 2 个 token 的请求：(结束 − 首 token) ÷ (输出数 − 1)
    preempted: list[int] = field(default_factory=list)  # 每个请求被抢占了几次（按请求顺序）

    @property
    def kv_waste(self) -> float:
        """(已分配槽 − 存着真实 token 的槽) ÷ 已分配槽：每步采样一次，按槽数加权平均。"""
        return 1 - self.used_slot_steps / self.allocated_slot_steps if self.allocated_slot_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0


class PagedOutput(NamedTuple):
    outputs: list[list[int]]   # 每个请求的新 token，顺序与 requests 相同
    stats: EngineStats


class PagedEngine:
    def __init__(self, model, num_blocks: int, block_size: int = 16, max_batch_size: int = 8,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS):
        self.model = model
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.allocator = BlockAllocator(num_blocks)
        try:  # 整个池子只分配一次；--num-blocks 过大时给一行 error 而不是 traceback
            self.cache = PagedKVCache(model.cfg, num_blocks, block_size, model.device, model.dtype)
        except (RuntimeError, MemoryError) as e:
            raise UserError(f"cannot allocate a KV pool of {num_blocks} blocks x {block_size} tokens: {e}") from None

    def check_fits(self, requests: list[Request]) -> None:
        """开始之前检查全部请求。单独一个就放不进池子的请求永远跑不完（抢占别人也腾不出更多块），直接报错。"""
        for i, r in enumerate(requests):
            r.validate(self.model.cfg.max_position_embeddings)   # step04 的检查：空提示词、N ≤ 0、超出上下文、采样参数
            need = blocks_needed(r, self.block_size)
            if need > self.allocator.num_blocks:
                raise UserError(
                    f"request {i} needs up to {need} KV blocks of {self.block_size} tokens (prompt "
                    f"{len(r.prompt_ids)} + max_new_tokens {r.max_new_tokens} - 1) but the pool has only "
                    f"{self.allocator.num_blocks}: raise --num-blocks or lower --max-new-tokens")

    @torch.inference_mode()
    def generate(self, requests: list[Request], eos_ids=()) -> PagedOutput:
        """用连续批处理跑完全部请求（都在 t=0 到达）。"""
        self.check_fits(requests)
        sched = Scheduler(self.allocator, self.block_size, self.max_batch_size, self.max_prefill_tokens)
        seqs = [Sequence(r, make_generator(r.params.seed, self.model.device)) for r in requests]
        for seq in seqs:
            sched.add(seq)
        stats = EngineStats()
        t0 = time.perf_counter()
        while sched.has_work():
            batch = sched.schedule()
            fwd = self.cache.plan(batch.seqs)                    # 这次前向的地址信息（PagedForward）
            logits = self.model(fwd.input_ids, fwd.positions, fwd, last_only=True)[:, -1]  # (B, V)
            if batch.is_prefill:
                stats.prefill_tokens += sum(seq.num_tokens - seq.num_cached_tokens for seq in batch.seqs)
            for seq in batch.seqs:
                seq.num_cached_tokens = seq.num_tokens   # 这次前向把它的全部 token 都写进池子了
            self._account(stats, sched, batch.is_prefill)
            for row, seq in enumerate(batch.seqs):
                # 与 step03 调用同一个 sample()：history = 提示词 + 已生成，发生器是这个请求自己的
                tok = sample(logits[row], seq.token_ids, seq.request.params, seq.generator)
                now = time.perf_counter() - t0
                if seq.first_token_time is None:         # 被抢占后重算的那次 prefill 不算"首 token"
                    seq.first_token_time = now
                if seq.append(tok, eos_ids):
                    seq.finish_time = now
                    sched.finish(seq)                    # 立刻还块：下一步就能接纳新请求
        stats.wall_s = time.perf_counter() - t0
        stats.preemptions = sched.num_preemptions
        stats.generated_tokens = sum(len(s.output_ids) for s in seqs)
        stats.ttft_s = [s.first_token_time for s in seqs]
        stats.tpot_s = [(s.finish_time - s.first_token_time) / (len(s.output_ids) - 1)
                        for s in seqs if len(s.output_ids) > 1]
        stats.preempted = [s.num_preemptions for s in seqs]
        if any(s.status is not Status.FINISHED for s in seqs):
            raise RuntimeError("scheduler stopped with unfinished requests")
        return PagedOutput([s.output_ids for s in seqs], stats)

    def _account(self, stats: EngineStats, sched: Scheduler, is_prefill: bool) -> None:
        """每步记一次：运行集合持有多少槽、其中多少存着真实 token 的 K/V（差额只来自每个请求最后一块没写满的部分）。"""
        stats.steps += 1
        stats.prefill_steps += is_prefill
        stats.decode_steps += not is_prefill
        stats.peak_running = max(stats.peak_running, len(sched.running))
        stats.allocated_slot_steps += sum(len(s.block_table) for s in sched.running) * self.block_size
        stats.used_slot_steps += sum(s.num_cached_tokens for s in sched.running)
