"""异步引擎：HTTP 那一侧（很多并发请求、随时断开的客户端）与引擎那一侧（一个线程、一步一步）之间的一层。

    HTTP 处理函数 ── add() ──▶ 待加入列表 ──（两步之间）──▶ engine.add_request
          ▲                                                      │
          │ await queue.get()                        engine.step()（在专用的一个线程里跑）
          │                                                      │
    每个 HTTP 请求一个 asyncio.Queue ◀── 增量解码 ◀── list[RequestOutput]
    客户端断开 ── abort() ──▶ 待取消列表 ──（下一步之前）──▶ engine.abort（块立刻还回池子）

- 只有一个后台任务（_loop）碰引擎：引擎不是线程安全的。HTTP 处理函数只往两个列表里放东西、叫醒它；它在两步
  之间把新请求加进引擎、把要取消的取消掉，所以运行中来的请求下一步就进了正在跑的批（HTTP 上的连续批处理），
  断开的客户端在下一步之前就还了块。
- step() 放在一个线程里跑（run_in_executor），而不是直接在事件循环里调用：CPU 上真实模型的一步要几十到几百毫秒，
  这段时间事件循环若被占住，就发不出 SSE、收不了新连接、发现不了断开，/health 也会超时。PyTorch 的算子执行时
  释放 GIL，所以这一步在算的时候，事件循环照常处理 HTTP。只有一个线程：一步接一步，从不并发。
  （vLLM V1 更进一步：引擎核心是另一个进程，用 ZMQ 收发请求和输出，连 Python 的调度开销都不跟 HTTP 抢 GIL。）
- 一个 HTTP 请求的 n 个样本是 n 个引擎请求，共用这个 HTTP 请求的一个队列（Delta.index 区分）。
- 停止字符串只在这里找一次（增量解码器看文本的尾巴）：引擎拿到的请求不带停止串，不必把这个 token 再解码一遍；
  找到了就在下一步之前 abort 那个引擎请求（块立刻还回池子），结束原因报 "stop"。
- 失败分两种（vLLM 的 EngineDeadError 是同一个区分）：
  * 属于一个请求的（它的采样——引擎报 finish_reason "error"；它的停止串、增量解码）：只结束这个 HTTP 请求
    （流式：一个 error 事件；非流式：500），它的块还回池子，其他请求照常生成；
  * 引擎自己的（step() 抛出：前向、调度坏了）：引擎的状态已经不可信，每个还在等的请求都收到错误，然后 on_dead
    通知服务器以非零码退出——由 supervisor（systemd、k8s、docker --restart）重启一个干净的进程，而不是留下一个
    对每个请求都回 503 的僵尸。
"""
import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Optional

import torch

from common.errors import UserError

from .detokenizer import IncrementalDetokenizer
from .metrics import RequestTimes, ServerMetrics

log = logging.getLogger("step11_serving")


class ServerBusy(Exception):
    """等待的请求已经到上限（→ 503 + Retry-After）：与其让队列无限长、每个人都超时，不如早点说"稍后再来"。"""


class EngineUnavailable(Exception):
    """正在关闭，或引擎出错停了（→ 503）。"""


class RequestFailed(Exception):
    """只属于这一个请求的失败（它的采样、停止串、增量解码出错）：这个请求结束，别的请求不受影响（→ 500）。"""


STALL_S = 120.0     # 引擎线程这么久没完成一步（有活的时候），/health 就报 503：卡死的进程也要让 supervisor 看见


@dataclass
class Delta:
    """一个样本这一步的新东西。"""
    index: int                          # 第几个样本（choices 的 index）
    text: str                           # 可以显示的新文本（完整的字符，不含停止字符串）
    token_ids: list[int]                # 这一步新产出的 token
    finish_reason: Optional[str] = None  # 最后一个 Delta 才有："stop" / "length" / "abort"
    # 请求要了 logprobs 时（step09 起的引擎）：与 token_ids 一一对应的 Logprob，和每个 token 的第一个字节落在
    # 生成文本的第几个字符；prompt_logprobs 只在第一个 Delta 里（提示词每个 token 一项，第 0 个为 None）
    logprobs: Optional[list] = None
    text_offsets: Optional[list[int]] = None
    prompt_logprobs: Optional[list] = None


class RequestHandle:
    """一个 HTTP 请求在异步引擎里的全部状态：n 个引擎请求、一个输出队列、每个样本的增量解码器与计时。"""

    def __init__(self, owner: "AsyncLLMEngine", requests, arrival: float, x_request_id: Optional[str] = None):
        n = len(requests)
        self.owner, self.requests, self.arrival = owner, requests, arrival
        self.x_request_id = x_request_id    # HTTP 的 X-Request-Id：日志里用它认出这个请求（引擎的 id 仍是整数）
        self.times = [RequestTimes(arrival) for _ in range(n)]   # 每个样本的几个时刻（vllm:* 的请求级指标）
        self.queue: asyncio.Queue = asyncio.Queue()
        self.added = asyncio.get_running_loop().create_future()   # 引擎接下（或拒绝）这些请求时完成
        self.request_ids: list[int] = []
        self.detoks = [IncrementalDetokenizer(owner.tokenizer, r.stop, r.params.min_tokens,
                                              getattr(r, "include_stop_str_in_output", False)) for r in requests]
        self.first_token: list[Optional[float]] = [None] * n
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.cached_tokens = [0] * n
        self.finish_reasons: list[Optional[str]] = [None] * n
        self.cancelled = False

    async def deltas(self):
        """按产出的顺序给出 Delta，直到 n 个样本都结束。"""
        left = len(self.requests)
        while left:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            left -= item.finish_reason is not None
            yield item

    def abort(self) -> None:
        """客户端走了（或处理函数因任何原因退出）：还没结束的样本全部取消。重复调用、已结束时调用都没有影响。"""
        self.owner._abort(self)


class AsyncLLMEngine:
    def __init__(self, engine, tokenizer, max_waiting: int = 64, on_dead=None, stall_s: float = STALL_S):
        """on_dead(error)：引擎死了、每个在等的请求都已收到错误之后调用一次（服务器用它以非零码退出）。"""
        self.engine, self.tokenizer, self.max_waiting = engine, tokenizer, max_waiting
        self.on_dead, self.stall_s = on_dead, stall_s
        self._step_started: Optional[float] = None       # 引擎线程正在跑的这一步从什么时候开始（没在跑：None）
        self.metrics = ServerMetrics()           # /metrics 读它；状态快照与每个请求的计时都在这个循环里记
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._pending: list[RequestHandle] = []          # 等着在下一个间隙加进引擎
        self._aborts: list[int] = []                     # 等着在下一个间隙取消的引擎请求 id
        self._live: dict[int, tuple[RequestHandle, int]] = {}   # 引擎请求 id → (所属 HTTP 请求, 样本号)
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._closing = False
        self.error: Optional[BaseException] = None
        # 引擎状态的快照（循环在两步之间记下；别的协程只读这些，不碰引擎）
        self.num_running = self.num_waiting = self.peak_running = self.num_steps = 0
        self._preemptions_seen: dict[int, int] = {}      # 引擎请求 id → 上一步之后读到的 seq.num_preemptions
        self._spec_seen = (0, 0, 0)                      # 上一步之后读到的 spec_stats（验证次数、猜测、接受）
        self._structured_seen = (0, 0.0, 0, 0)           # 上一步之后读到的 structured_stats（step15）
        self._last_step_started = 0.0                   # 刚做完的那一步从什么时候开始

    # ---------------- HTTP 处理函数调用的 ----------------
    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="engine-loop")

    @property
    def healthy(self) -> bool:
        return self.health_problem() is None

    def health_problem(self) -> Optional[str]:
        """/health 用：None = 健康；否则是原因。循环任务意外结束、或一步跑了超过 stall_s 秒都算不健康。"""
        if self.error is not None:
            return f"the engine failed: {type(self.error).__name__}: {self.error}"
        if self._closing:
            return "shutting down"
        if self._task is not None and self._task.done():
            return "the engine loop is not running"
        worker_failure = getattr(self.engine, "worker_failure", None)    # step10：别的 rank 还在吗（不通信、不阻塞）
        if worker_failure is not None and (why := worker_failure()) is not None:
            return f"a parallel worker is gone: {why}"                    # 下一步会失败，进程随之以非零码退出
        started = self._step_started
        if started is not None and time.perf_counter() - started > self.stall_s:
            return f"the engine has not completed a step for more than {self.stall_s:g} s"
        return None

    def num_queued(self) -> int:
        return self.num_waiting + sum(len(h.requests) for h in self._pending)

    async def add(self, requests, arrival: Optional[float] = None, x_request_id: Optional[str] = None) -> RequestHandle:
        """把一个 HTTP 请求的引擎请求交给循环，等引擎接下。引擎的检查失败（提示词太长、池子放不下……）时抛出
        它的 UserError；排队的已经太多时抛 ServerBusy。x_request_id：日志里这个请求的名字（引擎接下时记下它 ↔ 引擎 id）。"""
        if self.error is not None:
            raise EngineUnavailable(f"the engine stopped after an error: {self.error}")
        if self._closing:
            raise EngineUnavailable("the server is shutting down")
        if len(requests) > self.max_waiting:       # 永远进不了队列：503 + Retry-After 会让客户端一直重试
            raise UserError(f"this request needs {len(requests)} engine requests (n x prompts) but at most "
                            f"{self.max_waiting} can wait (--max-waiting): it can never be admitted")
        if self.num_queued() + len(requests) > self.max_waiting:
            raise ServerBusy(f"{self.num_queued()} requests are already waiting (limit {self.max_waiting})")
        h = RequestHandle(self, requests, time.perf_counter() if arrival is None else arrival, x_request_id)
        self._pending.append(h)
        self._wake.set()
        try:
            await h.added
        except asyncio.CancelledError:     # 客户端在排队时就走了
            h.abort()
            raise
        return h

    def _abort(self, h: RequestHandle) -> None:
        if h.cancelled:
            return
        h.cancelled = True                 # 还在待加入列表里的：循环会跳过它
        self._aborts += [rid for i, rid in enumerate(h.request_ids) if h.finish_reasons[i] is None]
        if self._aborts:
            self._wake.set()

    def abort_all(self) -> None:
        """优雅关闭的宽限期到了：不再接新请求，还在跑的全部取消——还在听的客户端收到 finish_reason "abort" 和
        [DONE]，而不是一个被掐断的连接。"""
        self._closing = True
        for h in self._pending:
            if not h.added.done():
                h.added.set_exception(EngineUnavailable("the server is shutting down"))
        self._pending = []
        self._aborts += list(self._live)
        if self._wake is not None:
            self._wake.set()

    async def shutdown(self) -> bool:
        """优雅关闭的最后一步（uvicorn 已经停止接收、等过了正在进行的响应）：取消剩下的请求，跑完手上这一步，
        停下循环。返回 True 当且仅当引擎里每个块都还回来了。"""
        self.abort_all()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)
        bm = self.engine.block_manager
        return self.error is None and not self._live and bm.num_free_blocks == bm.num_blocks

    # ---------------- 循环：唯一碰引擎的地方 ----------------
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply()                              # 两步之间：加入新请求、取消断开的请求
                self._snapshot()
                if not self.engine.has_unfinished_requests():
                    if self._closing:
                        return
                    self._wake.clear()                     # 没活：睡到下一个 add / abort
                    await self._wake.wait()
                    continue
                self._step_started = time.perf_counter()
                try:
                    outs = await loop.run_in_executor(self._executor, self._step)
                finally:
                    started, self._step_started = self._step_started, None
                self.num_steps += 1
                self._after_step(started)
                self._dispatch(outs)
        except Exception as e:                             # 引擎（或这一层）坏了：让每个等着的客户端都知道，不让它们挂着
            self._fail(e)

    def _step(self):
        with torch.inference_mode():                       # 线程局部的：在引擎线程里打开
            outs = self.engine.step()
        return outs

    def _apply(self) -> None:
        pending, self._pending = self._pending, []
        for h in pending:
            if h.cancelled or h.added.done():
                continue
            try:
                for r in h.requests:                       # 停止串由这一层找（见文件开头），引擎不必每步重新解码
                    chunks = getattr(r, "chunks", None)   # 段标记（step13）：给了才传，别的引擎的 add_request 没有这个参数
                    marks = () if chunks is None else (list(chunks),)
                    so = getattr(r, "structured_output", None)   # 约束（step15）：同上，给了才传
                    extra = {} if so is None else {"structured_output": so}
                    h.request_ids.append(self.engine.add_request(replace(r, stop=()), *marks, **extra))
            except Exception as e:                         # 通常是 UserError：这个 HTTP 请求得到 400
                for rid in h.request_ids:                  # n 个样本里前几个已经加进去了：一起撤回
                    self.engine.abort(rid)
                h.request_ids = []
                h.added.set_exception(e)
                continue
            now = time.perf_counter()
            for i, rid in enumerate(h.request_ids):
                self._live[rid] = (h, i)
                h.times[i].added = now
            log.info("request %s: engine request ids %s", h.x_request_id, h.request_ids)
            h.added.set_result(None)
        aborts, self._aborts = self._aborts, []
        now = time.perf_counter()
        for rid in aborts:
            if rid in self._live:
                h, i = self._live.pop(rid)
                self.engine.abort(rid)                     # 块在这里就还回池子，下一步之前
                self._finish(h, i, "abort", now)

    def _dispatch(self, outs) -> None:
        now = time.perf_counter()
        for out in outs:
            entry = self._live.get(out.request_id)
            if entry is None:                              # 已经取消了的（引擎在下一步报告它 abort）
                continue
            h, i = entry
            try:                                           # 这里出的错只属于这个请求：只结束它
                self._dispatch_one(h, i, out, now)
            except Exception as e:
                self._fail_request(h, e)

    def _dispatch_one(self, h: RequestHandle, i: int, out, now: float) -> None:
        if out.finish_reason == "error":                   # 引擎在这个请求的后处理（采样……）里出错，已经把它结束了
            err = getattr(out, "error", None)
            raise RequestFailed(f"{type(err).__name__}: {err}" if err is not None else "the engine failed this request")
        det, text, kept, offsets = h.detoks[i], "", [], []
        for j, t in enumerate(out.new_token_ids):          # 一个一个喂：投机解码一步出几个 token，停止串之后的不要
            offsets.append(len(det.text))                  # logprobs 的 text_offset：这个 token 之前已解码出的字符数
            kept.append(t)
            # 引擎报 "stop" 只可能是最后这个 token 是 EOS 或停止 token（停止串只在这一层找）：它的 id 在输出里，
            # 文本不发（vLLM 相同；EOS 是特殊 token，本来就解码成空串），除非 include_stop_str_in_output
            if out.finish_reason == "stop" and j == len(out.new_token_ids) - 1 and not det.include_stop_str:
                break
            text += det.push([t])
            if det.stopped:
                break
        if kept:
            self._on_tokens(h, i, len(kept), now, getattr(out, "num_cached_tokens", 0))
            h.token_ids[i] += kept
            if h.first_token[i] is None:
                h.first_token[i] = now
                h.cached_tokens[i] = getattr(out, "num_cached_tokens", 0)   # step05 没有前缀缓存
        lps = getattr(out, "logprobs", None)              # step09 起的引擎才有这两项
        extra = dict(logprobs=None if lps is None else lps[:len(kept)], text_offsets=None if lps is None else offsets,
                     prompt_logprobs=getattr(out, "prompt_logprobs", None))
        if det.stopped or out.finished:
            del self._live[out.request_id]
            if not out.finished:                           # 停止串是这里找到的：引擎还不知道，下一步之前取消它
                self.engine.abort(out.request_id)
            reason = "stop" if det.stopped else out.finish_reason
            self._finish(h, i, reason, now, text + det.finish(), kept, **extra)
        else:
            h.queue.put_nowait(Delta(i, text, kept, **extra))

    def _fail_request(self, h: RequestHandle, e: BaseException) -> None:
        """一个请求的失败：它还没结束的样本全部从引擎里取消（块立刻还回去），处理函数收到 RequestFailed。"""
        log.error("request %s failed; only this request gets an error", h.x_request_id, exc_info=e)
        now = time.perf_counter()
        for i, rid in enumerate(h.request_ids):
            if self._live.pop(rid, None) is not None:
                self.engine.abort(rid)
            if h.finish_reasons[i] is None:
                self._record_finish(h, i, "error", now)
        h.queue.put_nowait(e if isinstance(e, RequestFailed) else RequestFailed(f"{type(e).__name__}: {e}"))

    def _finish(self, h: RequestHandle, i: int, reason: str, now: float, text: str = "", token_ids=(), **extra) -> None:
        self._record_finish(h, i, reason, now)
        h.queue.put_nowait(Delta(i, text, list(token_ids), reason, **extra))
        log.debug("request %s: engine request %d finished (%s, %d tokens)", h.x_request_id, h.request_ids[i],
                  reason, len(h.token_ids[i]))

    def _record_finish(self, h: RequestHandle, i: int, reason: str, now: float) -> None:
        """样本 i 结束了：记下原因，两套指标（llm_* 与 vllm:*）各记一次。"""
        h.finish_reasons[i] = reason
        self.metrics.request_finished(reason, len(h.requests[i].prompt_ids), h.cached_tokens[i],
                                      len(h.token_ids[i]), h.arrival, h.first_token[i], now)
        self.metrics.vllm_finished(reason, h.times[i], now)

    def _on_tokens(self, h: RequestHandle, i: int, num_tokens: int, now: float, cached: int) -> None:
        """vllm:* 的逐步指标：这一步发给客户端的 token 数；第一次时的首 token 延迟，之后的 token 间隔。"""
        t = h.times[i]
        first = t.first_token is None
        self.metrics.vllm_tokens(num_tokens, now - h.arrival if first else None, None if first else now - t.last_token,
                                 len(h.requests[i].prompt_ids) if first else 0, cached if first else 0)
        if t.scheduled is None:           # 同一步里被调度、又结束了（已经不在运行集合里）
            t.scheduled = self._last_step_started
        if first:
            t.first_token = now
        t.last_token = now
        t.num_tokens += num_tokens

    def _after_step(self, started: float) -> None:
        """一步刚做完、下一步还没开始（引擎线程闲着）：读引擎的计数。谁第一次进了批（排队到此为止），
        这一步多了几次抢占（每个请求的 seq.num_preemptions 的增量；被抢占的请求回到等待队列，还在 engine.seqs 里），
        step09/10 的投机解码这一步验证了几次、猜了几个、接受了几个（engine.spec_stats 的增量）；step15 这一步铺掩码
        花了多久、jump-forward 追加了几个 token（engine.structured_stats 的增量）。"""
        self._last_step_started = started
        running = {seq.request_id for seq in self.engine.scheduler.running}
        for rid, (h, i) in self._live.items():
            if h.times[i].scheduled is None and rid in running:
                h.times[i].scheduled = started
        preempted, seen = 0, {}
        for rid, seq in getattr(self.engine, "seqs", {}).items():
            seen[rid] = seq.num_preemptions
            preempted += seq.num_preemptions - self._preemptions_seen.get(rid, 0)
        self._preemptions_seen = seen
        spec = getattr(self.engine, "spec_stats", None)
        now_spec = (spec.verifications, spec.proposed, spec.accepted) if spec is not None else (0, 0, 0)
        drafts, draft_tokens, accepted = (a - b for a, b in zip(now_spec, self._spec_seen))
        self._spec_seen = now_spec
        self.metrics.vllm_engine_counts(preempted, drafts, draft_tokens, accepted)
        so = getattr(self.engine, "structured_stats", None)           # step15：掩码的时间、jump-forward 的 token
        if so is not None:
            now_so = (so.mask_steps, so.mask_seconds, so.masked_rows, so.jump_tokens)
            self.metrics.structured_step(*(a - b for a, b in zip(now_so, self._structured_seen)))
            self._structured_seen = now_so

    def _snapshot(self) -> None:
        sched, bm = self.engine.scheduler, self.engine.block_manager
        self.num_running, self.num_waiting = len(sched.running), len(sched.waiting)
        self.peak_running = max(self.peak_running, self.num_running)
        self.metrics.snapshot(self.num_running, self.num_queued(), bm.num_blocks, bm.num_free_blocks)

    def _fail(self, e: BaseException) -> None:
        log.error("engine step failed; every request in flight gets an error", exc_info=e)
        self.error = e
        err = EngineUnavailable(f"the engine failed: {type(e).__name__}: {e}")
        for rid, (h, _) in list(self._live.items()):
            h.queue.put_nowait(err)
            try:
                self.engine.abort(rid)
            except Exception:                              # 引擎已经坏了：尽力而为
                pass
        self._live.clear()
        for h in self._pending:
            if not h.added.done():
                h.added.set_exception(err)
        self._pending = []
        if self.on_dead is not None:                       # 每个在等的都知道了：让服务器退出，交给 supervisor 重启
            self.on_dead(e)
