"""step05 引擎：分页 KV cache + 连续批处理 + 重算式抢占。

每一步：调度器选出这一步要算的请求（全 prefill 或全 decode）→ cache.plan 把它们排成张量、算好槽号，
得到这次前向的 PagedForward → 把它当作 cache 传给模型，前向一次（每层经它的 update 写入新 K/V；decode 时再按块表
读回全部 K/V）→ 每个请求用自己的随机数发生器采样一个 token → 结束的请求立刻把块还回去，下一步就可以接纳新请求。

与 step03 逐 token 一致的关键：
- 每个请求在自己的位置上（positions 显式给出）看见且只看见自己的 K/V（块表 + 按位置的掩码）；
- 每个请求一个随机数发生器，按自己的 seed 创建；被抢占后只重算 K/V，已生成的 token 原样保留、不重新采样，
  所以它消耗的随机数序列与 step03 单独生成时完全相同。

记账与 step04 是同一套（step04_static_batching/stats.py）：每次前向一行 StepStats，每个请求的首 token / 结束时刻；
另外记 gather 拷贝的字节数、prefill 时干等的 decode 请求（stall），以及抢占次数和峰值并发。

请求按 Request.arrival_s 到达（ArrivalClock）：调度器只看得到已经到达的请求。本章的负载都在 0 时刻到达；
step07 用同一个引擎跑"请求陆续到达"的负载，与分块 prefill 比较。
"""
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch

from common.errors import UserError
from step02_sampling.sampler import make_generator, sample
from step04_static_batching.request import Request
from step04_static_batching.stats import EngineStats, StepStats
from step05_paged.block_allocator import BlockAllocator
from step05_paged.paged_cache import PagedKVCache
from step05_paged.scheduler import ScheduledBatch, Scheduler
from step05_paged.sequence import Sequence, Status

DEFAULT_KV_MIB = 256               # 不给 --num-blocks 时，池子按这么大的 KV 预算换算块数
DEFAULT_MAX_PREFILL_TOKENS = 2048  # 一次 prefill 前向最多 B × L 个 token 位置（限制 CPU 上的峰值内存和单步延迟）


def num_blocks_for_budget(cfg, block_size: int, dtype: torch.dtype, mib: int = DEFAULT_KV_MIB) -> int:
    return mib * 2**20 // PagedKVCache.bytes_per_block(cfg, block_size, dtype)


def blocks_needed(r: Request, block_size: int) -> int:
    """一个请求一生最多占几块：最后采样出的 token 不再喂回模型、不进缓存，所以是 提示词 + N - 1 个 token。"""
    return -(-(len(r.prompt_ids) + r.max_new_tokens - 1) // block_size)


@dataclass
class PagedStats(EngineStats):
    """step04 的 EngineStats（每次前向一行 + 每个请求的时刻），再加上分页与调度特有的几项。"""
    preemptions: int = 0
    peak_running: int = 0                                  # 同时在运行集合里的请求数的峰值
    preempted: list[int] = field(default_factory=list)     # 每个请求被抢占了几次（按请求顺序）
    # 请求陆续到达时（step07 的负载）：每个请求的到达时刻、每个输出 token 的时刻；wall_s 是引擎真正花掉的时间，
    # 没有请求可做、时钟直接拨过去的空闲不在里面（记在 idle_s）
    arrival_s: list[float] = field(default_factory=list)
    token_s: list[list[float]] = field(default_factory=list)
    idle_s: float = 0.0

    def ttft_s(self) -> list[float]:
        """首 token 延迟从请求到达算起（全部在 0 时刻到达时就是 first_token_s）。"""
        return [f - a for f, a in zip(self.first_token_s, self.arrival_s)]

    def max_gap_s(self) -> list[Optional[float]]:
        """每个请求相邻两个输出 token 之间最长的间隔：它在运行中被卡住的最长一次（只有 1 个输出的请求为 None）。"""
        return [max(b - a for a, b in zip(ts, ts[1:])) if len(ts) > 1 else None for ts in self.token_s]


class ArrivalClock:
    """本次运行的时钟（秒，从 0 开始）和还没到达的请求（按到达时刻排好，同一时刻按给定顺序）。

    引擎每一步之前调用 release：把已经到达的请求交给调度器。调度器没活、下一个请求还没到时，时钟直接拨到它
    到达的时刻——不真的睡（那段时间引擎本来就闲着），拨过去的时间记在 idle_s。全部请求都在 0 时刻到达时，
    第一步就全部交出，与没有到达时间的引擎一模一样。"""

    def __init__(self, seqs: list[Sequence]):
        self.pending = deque(sorted(seqs, key=lambda seq: seq.request.arrival_s))
        self.t0 = time.perf_counter()
        self.idle_s = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0 + self.idle_s

    def release(self, sched: Scheduler) -> bool:
        """交出已经到达的请求；返回调度器有没有活（False = 全部请求都到过、都做完了）。"""
        while True:
            while self.pending and self.pending[0].request.arrival_s <= self.now():
                sched.add(self.pending.popleft())
            if sched.has_work() or not self.pending:
                return sched.has_work()
            self.idle_s += max(0.0, self.pending[0].request.arrival_s - self.now())


class PagedOutput(NamedTuple):
    outputs: list[list[int]]   # 每个请求的新 token，顺序与 requests 相同
    stats: PagedStats


class PagedEngine:
    # 主循环用到的几个类；step06 的子类换成带前缀缓存的版本，主循环本身不用再写一遍
    scheduler_cls = Scheduler
    sequence_cls = Sequence
    stats_cls = PagedStats
    cache_cls = PagedKVCache      # step08 换成存量化码的池子（同样的构造参数）

    def __init__(self, model, num_blocks: int, block_size: int = 16, max_batch_size: int = 8,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS):
        self.model = model
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.allocator = BlockAllocator(num_blocks)
        try:  # 整个池子只分配一次；--num-blocks 过大时给一行 error 而不是 traceback
            self.cache = self.cache_cls(model.cfg, num_blocks, block_size, model.device, model.dtype)
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
    def generate(self, requests: list[Request], eos_ids=(), tokenizer=None,
                 on_step: Optional[Callable[[ScheduledBatch, list[Sequence]], None]] = None) -> PagedOutput:
        """用连续批处理跑完全部请求（各自在 arrival_s 到达，默认都是 0）。tokenizer：有请求带停止字符串时需要。
        on_step(batch, running)：每次前向之后、采样之前调用一次（块表还是这次前向用的），给想逐步观察池子的人
        （docs/notebooks/03 画池子占用）；不改变任何结果。"""
        self.check_fits(requests)
        if tokenizer is None and any(r.stop for r in requests):
            raise ValueError("stop strings need a tokenizer to decode the generated text")
        sched = self.scheduler_cls(self.allocator, self.block_size, self.max_batch_size, self.max_prefill_tokens)
        seqs = [self.sequence_cls(r, make_generator(r.params.seed, self.model.device)) for r in requests]
        stats = self.stats_cls()
        clock = ArrivalClock(seqs)
        while clock.release(sched):                          # 只调度已经到达的请求
            t = time.perf_counter()
            batch = sched.schedule()
            fwd = self.cache.plan(batch.seqs)                    # 这次前向的地址信息（PagedForward）
            logits = self.model(fwd.input_ids, fwd.positions, fwd, last_only=True)[:, -1]  # (B, V)
            for seq in batch.seqs:
                seq.num_cached_tokens = seq.num_tokens   # 这次前向把它的全部 token 都写进池子了
            # prefill 这一步，运行集合里其余的请求（都已经在 decode）一个 token 也没前进：它们在干等
            stalled = [seq for seq in sched.running if seq not in batch.seqs] if batch.is_prefill else []
            held, used = self.kv_slots(sched.running)
            stats.peak_running = max(stats.peak_running, len(sched.running))
            if on_step is not None:
                on_step(batch, list(sched.running))
            self.emit(sched, batch.seqs, logits, eos_ids, tokenizer, clock)
            seconds = time.perf_counter() - t
            for seq in stalled:
                seq.stall_time += seconds
            B, L = fwd.input_ids.shape
            stats.steps.append(StepStats(batch.is_prefill, B, L, len(fwd.token_index), 0, held, used, seconds,
                                         fwd.gather_bytes, len(stalled)))
        stats.wall_s, stats.idle_s = time.perf_counter() - clock.t0, clock.idle_s
        if any(s.status is not Status.FINISHED for s in seqs):
            raise RuntimeError("scheduler stopped with unfinished requests")
        self.collect(stats, sched, seqs)
        return PagedOutput([s.output_ids for s in seqs], stats)

    def emit(self, sched: Scheduler, seqs: list[Sequence], logits: torch.Tensor, eos_ids, tokenizer,
             clock: ArrivalClock) -> None:
        """logits (len(seqs), V)：每个请求采一个 token，这一步的 token 一起产出（记下时刻）；结束的请求立刻还块。"""
        for row, seq in enumerate(seqs):
            # 与 step03 调用同一个 sample()：history = 提示词 + 已生成，发生器是这个请求自己的
            seq.append(sample(logits[row], seq.token_ids, seq.request.params, seq.generator), eos_ids, tokenizer)
        now = clock.now()
        for seq in seqs:
            seq.token_times.append(now)
            if seq.first_token_time is None:         # 被抢占后重算的那次 prefill 不算"首 token"
                seq.first_token_time = now
            if seq.finished:
                seq.finish_time = now
                sched.finish(seq)                    # 立刻还块：下一步就能接纳新请求

    def kv_slots(self, running: list[Sequence]) -> tuple[int, int]:
        """运行集合为 KV 持有的槽、其中存着真实 token 的 K/V 的槽（差额只来自每个请求最后一块没写满的部分）。"""
        held = sum(len(seq.block_table) for seq in running) * self.block_size
        used = sum(seq.num_cached_tokens for seq in running)
        return held, used

    def collect(self, stats: PagedStats, sched: Scheduler, seqs: list[Sequence]) -> None:
        """一次运行结束：每个请求的时刻、输出数、干等时间、被抢占次数（顺序与 requests 相同）。"""
        stats.first_token_s = [s.first_token_time for s in seqs]
        stats.finish_s = [s.finish_time for s in seqs]
        stats.num_outputs = [len(s.output_ids) for s in seqs]
        stats.stall_s = [s.stall_time for s in seqs]
        stats.preemptions = sched.num_preemptions
        stats.preempted = [s.num_preemptions for s in seqs]
        stats.arrival_s = [s.request.arrival_s for s in seqs]
        stats.token_s = [s.token_times for s in seqs]
