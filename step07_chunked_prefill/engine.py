"""step07 引擎：step06（分页 + 连续批处理 + 前缀缓存）+ token 预算 + 展平的混合前向。

每一步：TokenBudgetScheduler 给出这一步的 decode 与 prefill 块（合起来不超过 max_num_batched_tokens 个 token）→
plan_flat 把它们排成没有填充的一行（FlatForward）→ 前向一次，只算要采样的那几个位置的 logits → 每个请求的
num_cached_tokens 往前推它这次算的 token 数；算到最后一个 token 的请求采样（step05 的 emit：时刻、结束、还块）。

chunked_prefill=False（--no-chunked-prefill）时直接用 step06 的 generate：同样的调度、同样的前向、同样的输出。
prefix_caching=False（--no-prefix-cache）时块池从不登记任何块，于是永远查不到、永远不命中。
"""
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from common.errors import UserError
from step02_sampling.sampler import make_generator
from step04_static_batching.request import Request
from step04_static_batching.stats import StepStats
from step05_paged.engine import DEFAULT_MAX_PREFILL_TOKENS, ArrivalClock, PagedOutput
from step05_paged.sequence import Status
from step06_prefix_cache.block_pool import HashFn, PrefixCachingBlockAllocator, chain_hash
from step06_prefix_cache.engine import PrefixCachingEngine, PrefixStats

from .flat_forward import plan_flat
from .scheduler import ChunkedBatch, TokenBudgetScheduler

DEFAULT_MAX_NUM_BATCHED_TOKENS = 256   # 一次前向最多算多少个 token（vLLM 的 max_num_batched_tokens；取值见 docs/07 的预算扫描）


@dataclass
class MixedStepStats(StepStats):
    decode_tokens: int = 0     # 这一行里有几个是 decode 的 token（其余是 prefill 的块）


@dataclass
class ChunkedStats(PrefixStats):
    steps: list[MixedStepStats] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        """prefill 真正算的 token：混合前向里去掉 decode 的那几个。"""
        return sum(st.tokens - st.decode_tokens for st in self.steps if st.prefill)


class UncachedBlockAllocator(PrefixCachingBlockAllocator):
    """--no-prefix-cache 时 step07 用的块池：从不登记写满的块，所以什么也查不到——就是 step05 的分配器，
    只是接口与带缓存的块池相同，调度器不用分两种写。"""

    def cache_block(self, block: int, parent: Optional[int], token_ids: tuple[int, ...]) -> bool:
        return False


class ChunkedPrefillEngine(PrefixCachingEngine):
    budget_scheduler_cls = TokenBudgetScheduler   # step08 换成能换出的调度器（同样的构造参数）

    def __init__(self, model, num_blocks: int, block_size: int = 16, max_batch_size: int = 8,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, chunked_prefill: bool = True,
                 prefix_caching: bool = True, max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
                 hash_fn: HashFn = chain_hash):
        super().__init__(model, num_blocks, block_size, max_batch_size, max_prefill_tokens, prefix_caching, hash_fn)
        self.chunked_prefill = chunked_prefill
        self.max_num_batched_tokens = max_num_batched_tokens
        # >>> step07 新增
        if chunked_prefill:
            if max_num_batched_tokens < max_batch_size:   # 否则批满时这一步连每个 decode 一个 token 都给不起
                raise UserError(f"--max-num-batched-tokens ({max_num_batched_tokens}) must be at least "
                                f"--max-batch-size ({max_batch_size})")
            if not prefix_caching:
                self.allocator = UncachedBlockAllocator(num_blocks, block_size)
        # <<<

    @torch.inference_mode()
    def generate(self, requests: list[Request], eos_ids=(), tokenizer=None,
                 on_step: Optional[Callable[[ChunkedBatch, list], None]] = None) -> PagedOutput:
        if not self.chunked_prefill:
            return super().generate(requests, eos_ids, tokenizer, on_step)     # --no-chunked-prefill：step06 原样
        self.check_fits(requests)
        if tokenizer is None and any(r.stop for r in requests):
            raise ValueError("stop strings need a tokenizer to decode the generated text")
        sched = self.budget_scheduler_cls(self.allocator, self.block_size, self.max_batch_size, self.max_num_batched_tokens)
        seqs = [self.sequence_cls(r, make_generator(r.params.seed, self.model.device)) for r in requests]
        stats = ChunkedStats()      # --no-chunked-prefill 走 step06 的 generate，记的还是 step06 的 PrefixStats
        clock = ArrivalClock(seqs)
        while clock.release(sched):
            t = time.perf_counter()
            batch = sched.schedule()
            # 这一步算到最后一个 token 的请求才采样（decode 都是；prefill 只有最后一块）
            sampling = [seq for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.num_cached_tokens + n == seq.num_tokens]
            fwd = plan_flat(self.cache, batch.seqs, batch.num_new_tokens)             # (1, T) 的一行
            logits = self.model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index)[0]   # (R, V)
            for seq, n in zip(batch.seqs, batch.num_new_tokens):
                seq.num_cached_tokens += n
            # 已经开始输出、这一步却没有前进的请求（decode 总在批里，所以只有被抢占后还没重算完的）
            stalled = [seq for seq in sched.running if seq.output_ids and seq not in sampling]
            held, used = self.kv_slots(sched.running)
            stats.peak_running = max(stats.peak_running, len(sched.running))
            if on_step is not None:
                on_step(batch, list(sched.running))
            self.emit(sched, sampling, logits, eos_ids, tokenizer, clock)
            seconds = time.perf_counter() - t
            for seq in stalled:
                seq.stall_time += seconds
            rows, width = fwd.input_ids.shape
            stats.steps.append(MixedStepStats(batch.is_prefill, rows, width, fwd.num_tokens, 0, held, used, seconds,
                                              fwd.gather_bytes, len(stalled), batch.num_decode_tokens))
        stats.wall_s, stats.idle_s = time.perf_counter() - clock.t0, clock.idle_s
        if any(s.status is not Status.FINISHED for s in seqs):
            raise RuntimeError("scheduler stopped with unfinished requests")
        self.collect(stats, sched, seqs)
        return PagedOutput([s.output_ids for s in seqs], stats)
