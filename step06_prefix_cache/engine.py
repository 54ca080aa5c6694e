"""step06 引擎：step05 的分页引擎 + 前缀缓存。

和 step05 只差三处：
- 块池换成 PrefixCachingBlockAllocator（写满的块带 key，没人用了也先留着，池子要空间时才按 LRU 驱逐）；
- 调度器换成 PrefixCachingScheduler（接纳时命中的前缀直接共享，请求从命中位置开始 prefill；每步开始时
  把上一步写满的块登记进缓存）；
- 账目多了"prefill 实际算了几个 token"、每个请求的 cached_tokens、驱逐次数；KV 浪费按物理块算（共享的块只算一次）。

块池跟着引擎活：generate() 调用之间缓存还在，所以多轮对话的下一轮能命中上一轮。
prefix_caching=False 时用回 step05 的分配器和调度器（--no-prefix-cache）：输出与前向次数都与 step05 相同。
"""
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from step02_sampling.sampler import make_generator, sample
from step04_static_batching.request import Request
from step05_paged.engine import DEFAULT_MAX_PREFILL_TOKENS, EngineStats, PagedEngine
from step05_paged.scheduler import Scheduler
from step05_paged.sequence import Status

from .block_pool import HashFn, PrefixCachingBlockAllocator, chain_hash
from .scheduler import PrefixCachingScheduler
from .sequence import Sequence


@dataclass
class PrefixStats(EngineStats):
    # >>> step06 新增
    prompt_tokens: int = 0       # 全部提示词的 token 数（prefill_tokens 继承自 step05：命中的前缀不算在里面）
    evictions: int = 0           # 这次运行里从缓存驱逐了几块
    cached_tokens: list[int] = field(default_factory=list)   # 每个请求：提示词里有几个 token 用了缓存（按请求顺序）

    @property
    def hit_rate(self) -> float:
        """命中率 = 用了缓存的提示词 token ÷ 全部提示词 token。"""
        return sum(self.cached_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0
    # <<<


class PrefixOutput(NamedTuple):
    outputs: list[list[int]]
    stats: PrefixStats


class PrefixCachingEngine(PagedEngine):
    def __init__(self, model, num_blocks: int, block_size: int = 16, max_batch_size: int = 8,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS, prefix_caching: bool = True,
                 hash_fn: HashFn = chain_hash):
        super().__init__(model, num_blocks, block_size, max_batch_size, max_prefill_tokens)
        self.prefix_caching = prefix_caching
        if prefix_caching:   # >>> step06 新增：换成带前缀缓存的块池
            self.allocator = PrefixCachingBlockAllocator(num_blocks, block_size, hash_fn)

    @torch.inference_mode()
    def generate(self, requests: list[Request], eos_ids=()) -> PrefixOutput:
        """与 step05 的 generate 同一个循环；标出的几行是 step06 的改动。"""
        self.check_fits(requests)
        # >>> step06 新增：带缓存的调度器 / 请求状态；记下驱逐计数的起点（块池在多次调用之间共用）
        scheduler_cls = PrefixCachingScheduler if self.prefix_caching else Scheduler
        sched = scheduler_cls(self.allocator, self.block_size, self.max_batch_size, self.max_prefill_tokens)
        evictions0 = self._num_evictions()
        stats = PrefixStats(prompt_tokens=sum(len(r.prompt_ids) for r in requests))
        # <<<
        seqs = [Sequence(r, make_generator(r.params.seed, self.model.device)) for r in requests]
        for seq in seqs:
            sched.add(seq)
        t0 = time.perf_counter()
        while sched.has_work():
            batch = sched.schedule()
            fwd = self.cache.plan(batch.seqs)
            logits = self.model(fwd.input_ids, fwd.positions, fwd, last_only=True)[:, -1]  # (B, V)
            if batch.is_prefill:
                stats.prefill_tokens += sum(seq.num_tokens - seq.num_cached_tokens for seq in batch.seqs)
            for seq in batch.seqs:
                seq.num_cached_tokens = seq.num_tokens
            self._account(stats, sched, batch.is_prefill)
            for row, seq in enumerate(batch.seqs):
                tok = sample(logits[row], seq.token_ids, seq.request.params, seq.generator)
                now = time.perf_counter() - t0
                if seq.first_token_time is None:
                    seq.first_token_time = now
                if seq.append(tok, eos_ids):
                    seq.finish_time = now
                    sched.finish(seq)
        stats.wall_s = time.perf_counter() - t0
        stats.preemptions = sched.num_preemptions
        stats.generated_tokens = sum(len(s.output_ids) for s in seqs)
        stats.ttft_s = [s.first_token_time for s in seqs]
        stats.tpot_s = [(s.finish_time - s.first_token_time) / (len(s.output_ids) - 1)
                        for s in seqs if len(s.output_ids) > 1]
        stats.preempted = [s.num_preemptions for s in seqs]
        stats.cached_tokens = [s.cached_tokens or 0 for s in seqs]                        # >>> step06 新增
        stats.evictions = self._num_evictions() - evictions0                               # >>> step06 新增
        if any(s.status is not Status.FINISHED for s in seqs):
            raise RuntimeError("scheduler stopped with unfinished requests")
        return PrefixOutput([s.output_ids for s in seqs], stats)

    def _num_evictions(self) -> int:
        return self.allocator.num_evictions if self.prefix_caching else 0

    # >>> step06 修改：按物理块记账——几个请求共享的块只算一次，它存着的 token 也只算一次
    def _account(self, stats: EngineStats, sched: Scheduler, is_prefill: bool) -> None:
        stats.steps += 1
        stats.prefill_steps += is_prefill
        stats.decode_steps += not is_prefill
        stats.peak_running = max(stats.peak_running, len(sched.running))
        filled: dict[int, int] = {}   # 物理块 → 里面存着几个 token 的 K/V
        for s in sched.running:
            for i, b in enumerate(s.block_table):
                filled[b] = max(filled.get(b, 0), min(self.block_size, max(0, s.num_cached_tokens - i * self.block_size)))
        stats.allocated_slot_steps += len(filled) * self.block_size
        stats.used_slot_steps += sum(filled.values())
    # <<<
