"""step05 引擎：分页 KV cache + 连续批处理 + 重算式抢占，一步一步地驱动（与 vLLM 的 LLMEngine 同样的接口）。

    add_request(request) -> request_id     检查请求、放进等待队列（到达时刻 = 时钟的读数）
    step() -> list[RequestOutput]          一次前向：调度 → 排出这次前向的地址（plan）→ 模型 → 采样、结束的还块
    abort(request_id)                      立刻还块；下一次 step() 报告它 finish_reason="abort"
    has_unfinished_requests()
    generate(requests)                     只是上面几个的循环

与 step03 逐 token 一致的关键：
- 每个请求在自己的位置上（positions 显式给出）看见且只看见自己的 K/V（块表 + 按位置的掩码）；
- 每个请求一个随机数发生器，按自己的 seed 创建；被抢占后只重算 K/V，已生成的 token 原样保留、不重新采样，
  所以它消耗的随机数序列与 step03 单独生成时完全相同。

记账：每一步一行 StepStats（common/stats.py，与 step04 同一个定义），每个请求的时刻记在它的 Sequence 上。
"""
from collections import deque
from typing import NamedTuple

import torch

from common.clock import Clock, WallClock
from common.errors import UserError
from common.stats import STEP_STATS_KEPT, EngineStats, StepStats, collect_stats, last_steps
from step02_sampling.sampler import make_generator, sample
from step04_static_batching.request import Request

from .block_manager import BlockManager
from .config import EngineConfig
from .kv_cache import PagedKVCache
from .scheduler import Scheduler, SchedulerOutput
from .sequence import RequestOutput, Sequence

def blocks_needed(r: Request, block_size: int) -> int:
    """一个请求一生最多占几块：最后采样出的 token 不再喂回模型、不进缓存，所以是 提示词 + N - 1 个 token。"""
    return -(-(len(r.prompt_ids) + r.max_new_tokens - 1) // block_size)


class GenerateOutput(NamedTuple):
    outputs: list[list[int]]   # 每个请求的新 token，顺序与 requests 相同
    stats: EngineStats


class LLMEngine:
    def __init__(self, model, config: EngineConfig, tokenizer=None, eos_ids=(), clock: Clock | None = None):
        config.validate()
        self.model, self.config = model, config
        self.tokenizer, self.eos_ids = tokenizer, tuple(eos_ids)   # tokenizer：有请求带停止字符串时需要
        self.clock = clock or WallClock()
        self.block_manager = BlockManager(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_batch_size, config.max_prefill_tokens)
        try:  # 整个池子只分配一次；--num-blocks 过大时给一行 error 而不是 traceback
            self.kv_cache = PagedKVCache(model.cfg, config.num_blocks, config.block_size, model.device, model.dtype,
                                         config.attention)
        except (RuntimeError, MemoryError) as e:
            raise UserError(f"cannot allocate a KV pool of {config.num_blocks} blocks x {config.block_size} "
                            f"tokens: {e}") from None
        self.seqs: dict[int, Sequence] = {}          # 还没结束的请求
        self.step_stats: deque[StepStats] = deque(maxlen=STEP_STATS_KEPT)   # 每一步一行，只留最近的（服务器一直跑）
        self.num_steps = 0                           # 一共走过几步（step_stats 留满以后也照数）
        self._aborted: list[RequestOutput] = []      # abort 过、还没在 step() 里报告的
        self._next_id = 0

    def add_request(self, request: Request) -> int:
        """检查请求（非法输入抛 UserError），放进等待队列，返回 request_id。"""
        request.validate(self.model.cfg.max_position_embeddings, self.model.cfg.vocab_size)  # 空提示词、N ≤ 0、超出上下文、采样参数
        need, have = blocks_needed(request, self.config.block_size), self.config.num_blocks
        if need > have:   # 单独一个就放不进池子的请求永远跑不完（抢占别人也腾不出更多块）
            raise UserError(f"a request needs up to {need} KV blocks of {self.config.block_size} tokens (prompt "
                            f"{len(request.prompt_ids)} + max_new_tokens {request.max_new_tokens} - 1) but the pool "
                            f"has only {have}: raise --num-blocks or lower --max-new-tokens")
        if request.stop and self.tokenizer is None:
            raise UserError("stop strings need a tokenizer to decode the generated text")
        rid, self._next_id = self._next_id, self._next_id + 1
        seq = Sequence(rid, request, make_generator(request.params.seed, self.model.device), self.clock.now())
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: int) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return           # 不认识或已经结束：什么也不做
        self.scheduler.finish(seq, "abort")
        self._aborted.append(RequestOutput(request_id, [], True, "abort"))

    def has_unfinished_requests(self) -> bool:
        """还有没结束的请求，或者还有 abort 的结果没交出去（下一次 step() 交）。"""
        return bool(self.seqs or self._aborted)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        if not self.scheduler.has_unfinished():
            return outputs
        t0 = self.clock.now()
        batch = self.scheduler.schedule()
        fwd = self.kv_cache.plan(batch.seqs, batch.num_new_tokens)           # 这次前向的地址信息
        logits = self.model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index).flatten(0, 1)  # (B, V)
        new = self._postprocess(batch, logits)
        self._record(batch, fwd, self.clock.now() - t0, new)
        for o in new:
            if o.finished:                           # 记完这一步的账再还块：下一步就能接纳新请求
                self.scheduler.finish(self.seqs.pop(o.request_id), o.finish_reason)
        return outputs + new

    def _postprocess(self, batch: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        """每个请求的 K/V 往前推它这一步算的 token 数；算到了最后一个 token 的请求采一个 token（step05 里是全部）。
        这一步的 token 一起产出（记下同一个时刻）；结束的请求由 step() 记完账后立刻还块。"""
        outputs, row, now = [], 0, self.clock.now()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            # 与 step03 调用同一个 sample()：提示词、已生成的 token、会结束它的 EOS（min_tokens 用），发生器是这个请求自己的
            r = seq.request
            token = sample(logits[row], r.prompt_ids, seq.output_ids, r.params, seq.generator, r.end_ids(self.eos_ids))
            row += 1
            reason = seq.append_token(token, self.eos_ids, self.tokenizer)
            seq.token_times.append(now)
            if seq.first_token_time is None:         # 被抢占后重算的那次 prefill 不算"首 token"
                seq.first_token_time = now
            if reason is not None:
                seq.finish_time = now
            outputs.append(RequestOutput(seq.request_id, [token], reason is not None, reason))
        return outputs

    def _record(self, batch: SchedulerOutput, fwd, seconds: float, outputs: list[RequestOutput]) -> None:
        """这一步的一行账。干等 = 运行集合里已经有输出、这一步却没有产出 token 的请求（在等别人的 prefill）。"""
        produced = {o.request_id for o in outputs}
        stalled = [seq for seq in self.scheduler.running if seq.output_ids and seq.request_id not in produced]
        for seq in stalled:
            seq.stall_time += seconds
        held, used = self.block_manager.usage(self.scheduler.running)
        B, L = fwd.input_ids.shape
        self.step_stats.append(StepStats(
            prefill=batch.is_prefill, rows=B, width=L, tokens=len(fwd.token_index), idle_rows=0, kv_slots_held=held,
            kv_slots_used=used, seconds=seconds, gather_bytes=fwd.gather_bytes, stalled=len(stalled),
            decode_tokens=0 if batch.is_prefill else len(batch.seqs), num_running=len(self.scheduler.running)))
        self.num_steps += 1

    def generate(self, requests: list[Request]) -> GenerateOutput:
        """用连续批处理跑完全部请求（都在此刻到达）。先检查全部请求，任何一个不合法都在开始生成之前报告；
        中途出错（包括 Ctrl-C）时把这些请求全部 abort，块一个不少地还回去。"""
        seqs, first_step, t0 = [], self.num_steps, self.clock.now()
        try:
            for r in requests:
                seqs.append(self.seqs[self.add_request(r)])
            while self.has_unfinished_requests():
                self.step()
        finally:
            ids = {seq.request_id for seq in seqs}
            for i in ids:
                self.abort(i)                        # 已经结束的请求 abort 什么也不做
            self._aborted = [o for o in self._aborted if o.request_id not in ids]   # 自己的收尾，不留给下一次 step()
        steps = last_steps(self.step_stats, self.num_steps - first_step)   # 这次运行的每一步
        return GenerateOutput([s.output_ids for s in seqs], collect_stats(seqs, steps, self.clock.now() - t0))
