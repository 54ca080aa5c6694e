"""批 1 的一步花在哪：同一个模型、同一段上下文，在同一次运行里量下面几样并拆开——

1. step03 的一次 decode 前向（没有引擎：PreallocKVCache + forward）；
2. 引擎的 engine.step()（step07 / step09 / step10 …，默认参数、一个请求），拆成 调度 / plan（这次前向的地址）/
   前向 / 采样 / 其余后处理 / 记账 / 其它；三种线程状态：主线程（进程里只有它一个 OpenMP 线程池，同离线的 run.py）、
   专用线程而主线程的池还在（两个池，服务器改之前的样子）、专用线程且只有它一个池（改之后，见 common/openmp.py）；
   每一步另记整个进程的自愿上下文切换（OpenMP 的线程在并行区之间睡下一次记一次）；再走几步把前向拆成
   线性层 / 注意力 / 其余（计时器：Linear 上的钩子、KV cache 的 attend）；
3. 同一个请求经过 step11 的服务器流式返回（本进程起服务器，监听 127.0.0.1 的空闲端口；一个客户端，httpx，
   /v1/completions，return_token_ids），两种状态（主线程的池还在 / 还掉之后）各量：客户端收到的相邻两个 token 的
   间隔拆成 引擎线程里的一步、executor 交给线程、等事件循环接手、循环里的分发（增量解码、放进队列）、循环的其余部分，
   SSE 发出与客户端收到的时刻另列；同一个引擎在自己的线程里直接跑同一个请求做对照。客户端是另一个进程（像真实的
   客户端），再一遍是本进程里的一个线程。最后起一个命令行的服务器（另一个进程）看它的 token 间隔与上下文切换；
4. 第 07 章 [2] 的负载重放一遍，把 TPOT 拆成 批 1 的一步 + 批大于 1 多出的 + prefill 块多出的。

    python bench/step_overhead.py [--quick] [--json] [--context 256] [--tokens 64] [--engines step07,step09,step10]

1、2 每一轮各走一步（上下文一起变长），各取中位数：机器的带宽在几分钟里也会漂，轮流让它们受到同样的影响。
只测量，不断言；--json 在最后打印一行 JSON（各项的中位数、比值）。表头印机器与 load avg：负载高时数字不可信——
而且方向会反过来：CPU 被别的进程占着时，忙等的 OpenMP 线程等的是被换下去的同伴，睡下反而快（见 docs/11 第 10 节）。
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.bench import machine, table  # noqa: E402
from common.prompts import LONG_PROMPT  # noqa: E402

ENGINE_PHASES = ["propose", "schedule", "plan", "forward", "sample", "postprocess", "record", "other"]
PHASE_NAMES = {"propose": "猜测", "schedule": "调度", "plan": "plan", "forward": "前向", "sample": "采样",
               "postprocess": "其余后处理", "record": "记账", "other": "其它"}
FORWARD_PARTS = ["forward", "matmul", "attention", "rest"]
PART_NAMES = {"forward": "前向（带钩子）", "matmul": "线性层", "attention": "注意力（写 KV、读、算）",
              "rest": "其余（小算子与 Python）"}
LOOP_PARTS = ["engine_step", "to_thread", "to_loop", "dispatch", "loop_rest"]
LOOP_NAMES = {"engine_step": "引擎线程里的一步", "to_thread": "executor 交给线程", "to_loop": "等事件循环接手",
              "dispatch": "分发（增量解码、放进队列）", "loop_rest": "循环的其余部分"}


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def load_avg() -> float:
    return os.getloadavg()[0]


# ---------------- 1. step03 的一次 decode 前向 ----------------

class BareForward:
    """step03：整段上下文 prefill 进一个 PreallocKVCache，之后每次 step() 是一次 decode 前向（贪心，喂回去）。"""

    def __init__(self, s, ids: list[int], steps: int, split: "ForwardSplit"):
        from step03_kvcache_single.cache import PreallocKVCache
        from step03_kvcache_single.engine import forward
        self.s, self.forward = s, forward
        self.cache = PreallocKVCache(s.cfg, len(ids) + steps + 1, s.model.device, s.model.dtype)
        with torch.inference_mode():
            self.tok = int(forward(s.model, self.cache, ids, 0).argmax())
        self.tokens = [self.tok]
        split.wrap_attend(self.cache)        # 只在 split 打开时计时

    @torch.inference_mode()
    def step(self) -> float:
        t = time.perf_counter()
        logits = self.forward(self.s.model, self.cache, [self.tok], self.cache.length)
        self.tok = int(logits.argmax())
        dt = time.perf_counter() - t
        self.tokens.append(self.tok)
        return dt


# ---------------- 2. 引擎的 step()，拆开 ----------------

class PhaseTimer:
    """包住几个方法（只在这个引擎对象上，类和别的引擎不受影响），记下每一步里各花了多少秒。"""

    def __init__(self):
        self.cur: dict[str, float] = defaultdict(float)

    def wrap(self, obj, attr: str, phase: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.cur[phase] += time.perf_counter() - t
        setattr(obj, attr, timed)

    def take(self) -> dict[str, float]:
        cur, self.cur = self.cur, defaultdict(float)
        return cur


class EngineProbe:
    """一个引擎（那一步的 EngineConfig 默认值，池子按默认的 KV 预算）、一个贪心请求；step() 一步一步走并记下各部分。"""

    def __init__(self, s, name: str, split: "ForwardSplit"):
        import importlib

        from step11_serving.engines import ENGINES, engine_module
        mod, conf = engine_module(name), importlib.import_module(f"{ENGINES[name]}.config")
        self.name, self.mod, self.s = name, mod, s
        cfg = mod.EngineConfig(num_blocks=int(conf.num_blocks_for_budget(s.cfg, 16, s.model.dtype, conf.DEFAULT_KV_MIB)))
        self.engine = e = mod.LLMEngine(s.model, cfg, tokenizer=s.tok, eos_ids=s.tok.eos_ids)
        self.timer = t = PhaseTimer()
        runner = getattr(e, "runner", None)                 # step10：plan 与前向在 ModelRunner 里
        t.wrap(e.scheduler, "schedule", "schedule")
        kv = e.kv_cache if runner is None else runner.kv_cache
        plan = kv.plan

        def timed_plan(*a, **kw):
            t0 = time.perf_counter()
            fwd = plan(*a, **kw)
            t.cur["plan"] += time.perf_counter() - t0
            split.wrap_attend(fwd)
            return fwd
        kv.plan = timed_plan
        t.wrap(e, "_postprocess", "postprocess")
        t.wrap(e, "_record", "record")
        if hasattr(e, "_propose"):
            t.wrap(e, "_propose", "propose")
        # 采样：step07 的 _postprocess 调 sample()，step09 起调 verify()（没有猜测时就是一次 sample()）
        self._sampler = next(a for a in ("verify", "sample") if hasattr(mod, a))
        self._orig_sampler = getattr(mod, self._sampler)

    def start(self, ids: list[int], max_new_tokens: int) -> "EngineProbe":
        """加一个贪心请求（ignore_eos），走完它的 prefill；之后每次 step() 是它的一步 decode。"""
        from step04_static_batching.request import Request
        e = self.engine
        self.rid = e.add_request(Request(list(ids), max_new_tokens, ignore_eos=True))
        self.tokens: list[int] = []
        with torch.inference_mode():
            while not self.tokens:                           # 上下文 ≤ 预算时一步；更长时分块 prefill 走完
                self._collect(e.step())
        return self

    def finish(self) -> list[dict]:
        """走完这个请求剩下的步（返回每一步的拆分）。"""
        steps = []
        while self.engine.has_unfinished_requests():
            steps.append(self.step())
        return steps

    def _collect(self, outs) -> None:
        for o in outs:
            if o.request_id == self.rid:
                self.tokens += list(o.new_token_ids)

    @contextmanager
    def timed(self):
        """这段时间里：前向（模型上的钩子）与采样（模块里的 sample / verify）记进 PhaseTimer。"""
        model, t = self.s.model, self.timer
        start = {}
        pre = model.register_forward_pre_hook(lambda m, a: start.__setitem__("t", time.perf_counter()))
        post = model.register_forward_hook(
            lambda m, a, out: t.cur.__setitem__("forward", t.cur["forward"] + time.perf_counter() - start["t"]))
        orig = self._orig_sampler

        def sampler(*a, **kw):
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                t.cur["sample"] += time.perf_counter() - t0
        setattr(self.mod, self._sampler, sampler)
        try:
            yield
        finally:
            setattr(self.mod, self._sampler, orig)
            pre.remove()
            post.remove()

    def step(self) -> dict[str, float]:
        """一步（在调用它的线程里）：返回 total 与各部分的秒数；postprocess 不含其中的采样。"""
        with self.timed():
            t0, c0 = time.perf_counter(), time.thread_time()
            with torch.inference_mode():                     # 与 AsyncLLMEngine._step 相同：线程局部，在这里打开
                outs = self.engine.step()
            total, cpu = time.perf_counter() - t0, time.thread_time() - c0
        self._collect(outs)
        p = self.timer.take()
        p["postprocess"] -= p["sample"]
        p["other"] = total - sum(p[k] for k in ENGINE_PHASES if k != "other")
        return {"total": total, "thread_cpu": cpu, **{k: p.get(k, 0.0) for k in ENGINE_PHASES}}


class ForwardSplit:
    """前向里线性层（每个 Linear 上一对钩子）与注意力（KV cache 的 attend：写 KV、读、算）各花多少秒；
    其余 = 前向 − 两者（RMSNorm、RoPE、残差、嵌入等小算子与它们之间的 Python）。只在拆分的那几步打开：
    钩子本身每个 Linear 多花一两微秒。这里不用 torch.profiler：在这台 2 核机器上它让一次 decode 前向慢近十倍，
    连矩阵乘本身也被拖慢，比例也就不可信了。"""

    def __init__(self, model):
        self.model = model
        self.t: dict[str, float] = defaultdict(float)
        self.active = False

    @contextmanager
    def on(self):
        from common.linear import linears
        start: dict[int, float] = {}

        def pre(m, a):
            start[id(m)] = time.perf_counter()

        def post(m, a, out):
            self.t["matmul"] += time.perf_counter() - start[id(m)]
        handles = [h for m in linears(self.model) for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
        self.t.clear()
        self.active = True
        try:
            yield
        finally:
            self.active = False
            for h in handles:
                h.remove()

    def wrap_attend(self, cache) -> None:
        """cache.attend 记进 attention（只换这个对象上的：step03 的缓存，或引擎这一步的 FlatAttentionMetadata）。"""
        fn = cache.attend

        def attend(*a, **kw):
            if not self.active:
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.t["attention"] += time.perf_counter() - t
        cache.attend = attend

    def take(self) -> dict[str, float]:
        t, self.t = self.t, defaultdict(float)
        return t


def split_forward(step, split: ForwardSplit, steps: int) -> dict[str, float]:
    """打开钩子走 steps 步（step() 返回这一步前向的秒数），各部分取中位数。"""
    rows = []
    with split.on():
        for _ in range(steps):
            fwd = step()
            t = split.take()
            rows.append({"forward": fwd, "matmul": t["matmul"], "attention": t["attention"],
                         "rest": fwd - t["matmul"] - t["attention"]})
    return {k: median([r[k] for r in rows]) for k in FORWARD_PARTS}


# ---------------- 3. 经过服务器 ----------------

class LoopTrace:
    """包住 AsyncLLMEngine 这个对象的几个方法，记下每一步的时刻（time.perf_counter，跨进程可比：CLOCK_MONOTONIC）：
    submit（循环把这一步交给 executor）、thread_start / thread_end（引擎线程里 engine.step 的开始与结束）、
    resumed（循环拿回结果）、dispatched（分发完：增量解码、Delta 进了队列）。"""

    def __init__(self, aengine, probe: EngineProbe):
        self.rows: list[dict] = []
        self.thread_threads: set[int] = set()           # 引擎线程里看到的 torch.get_num_threads()
        cur: dict = {}
        step, after, dispatch = aengine._step, aengine._after_step, aengine._dispatch

        def _step():
            self.thread_threads.add(torch.get_num_threads())
            with probe.timed():
                t, c = time.perf_counter(), time.thread_time()
                out = step()
                cur.update(thread_start=t, thread_end=time.perf_counter(), thread_cpu=time.thread_time() - c)
            p = probe.timer.take()
            cur.update(forward=p["forward"], sample=p["sample"])
            return out

        def _after_step(started):
            cur.update(submit=started, resumed=time.perf_counter())
            after(started)

        def _dispatch(outs):
            dispatch(outs)
            cur.update(dispatched=time.perf_counter(), tokens=sum(len(o.new_token_ids) for o in outs))
            self.rows.append(dict(cur))
            cur.clear()

        aengine._step, aengine._after_step, aengine._dispatch = _step, _after_step, _dispatch


class SendTimes:
    """纯 ASGI 的一层：记下流式响应每一块 body 交给 uvicorn 的时刻（SSE 发出）。"""

    def __init__(self, app, sink: list):
        self.app, self.sink = app, sink

    async def __call__(self, scope, receive, send):
        async def timed_send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                self.sink.append(time.perf_counter())
            await send(message)
        await self.app(scope, receive, timed_send)


def client_priority() -> None:
    """整个基准用实时优先级跑时（chrt -f N：机器上还有别人的进程，又要近似空闲机器的调度），客户端比服务器高一级：
    同一优先级的 SCHED_FIFO 线程互不抢占，忙等的 OpenMP 线程会让客户端一直等到它自己睡下。普通调度时什么也不做。
    Linux 上 pid 0 只改调用它的这个线程。"""
    if os.sched_getscheduler(0) == os.SCHED_FIFO:
        os.sched_setparam(0, os.sched_param(os.sched_getparam(0).sched_priority + 1))


def sched_desc() -> str:
    policy = os.sched_getscheduler(0)
    if policy == os.SCHED_OTHER:
        return "普通调度"
    return f"SCHED_FIFO 优先级 {os.sched_getparam(0).sched_priority}" if policy == os.SCHED_FIFO else f"调度策略 {policy}"


def stream_request(url: str, body: dict) -> dict:
    """一个流式请求：每个 SSE chunk 收到的时刻与它的 token id。"""
    import httpx
    client_priority()
    times, tokens = [], []
    with httpx.Client(timeout=600) as c:
        t0 = time.perf_counter()
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    now = time.perf_counter()
                    ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                    if ids:
                        times.append(now)
                        tokens.append(ids)
    return {"t0": t0, "times": times, "tokens": tokens}


def client_main(url: str, body: str) -> None:
    """--client：在另一个进程里当客户端（stdout 一行 JSON）。"""
    print(json.dumps(stream_request(url, json.loads(body))))


def run_client(url: str, body: dict, where: str) -> dict:
    if where == "thread":                                # 本进程里的一个线程（与服务器抢同一个 GIL）
        box = {}
        th = threading.Thread(target=lambda: box.update(stream_request(url, body)), name="client")
        th.start()
        th.join()
        return box
    out = subprocess.run([sys.executable, __file__, "--client", url, json.dumps(body)], capture_output=True, text=True,
                         timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"the client process failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def split_server_run(trace_rows: list[dict], sends: list[float], got: dict) -> dict:
    """一个请求的逐 token 间隔（客户端收到的时刻之差，不含首 token）与服务器这一侧的拆分（decode 的各步取中位数）。"""
    recv = got["times"]
    itl = [b - a for a, b in zip(recv, recv[1:])]
    rows = [r for r in trace_rows if r.get("tokens")]
    dec = rows[1:]                                        # 第一步是 prefill
    parts = defaultdict(list)
    for prev, r in zip(dec, dec[1:]):
        parts["engine_step"].append(r["thread_end"] - r["thread_start"])
        parts["to_thread"].append(r["thread_start"] - r["submit"])
        parts["to_loop"].append(r["resumed"] - r["thread_end"])
        parts["dispatch"].append(r["dispatched"] - r["resumed"])
        parts["loop_rest"].append(r["submit"] - prev["dispatched"])
        parts["cycle"].append(r["dispatched"] - prev["dispatched"])
        parts["forward"].append(r["forward"])
        parts["sample"].append(r["sample"])
        parts["thread_cpu"].append(r["thread_cpu"])
    # 每个 token 的 SSE chunk：分发完 → 交给 uvicorn（sse），交给 uvicorn → 客户端收到（net）
    n = min(len(rows), len(sends), len(recv))
    sse = [sends[i] - rows[i]["dispatched"] for i in range(1, n)]
    net = [recv[i] - sends[i] for i in range(1, n)]
    out = {k: median(v) for k, v in parts.items()}
    return out | {"itl": median(itl), "itl_mean": statistics.fmean(itl) if itl else float("nan"),
                  "ttft": recv[0] - got["t0"] if recv else float("nan"),
                  "sse": median(sse), "net": median(net), "tokens": sum(map(len, got["tokens"]))}


OFFLINE_MODES = {"main": "主线程（一个池）", "two_pools": "专用线程，主线程的池还在", "one_pool": "专用线程，只有它一个池"}
SERVER_MODES = {"two_pools": "主线程的池还在（改之前）", "one_pool": "还掉主线程的池（改之后）"}


def server_runs(s, name: str, ids: list[int], n_tokens: int, clients: list[str], repeats: int) -> dict:
    """本进程里起服务器（ServerThread），每一轮两种状态各量一遍：主线程的 OpenMP 池还在（本进程的主线程跑过前面的
    离线部分，和命令行服务器加载模型之后一样），和还掉它之后（api_server.main 开始服务前做的事）。每种状态先让同一个
    引擎在它自己的线程里直接跑同一个请求（服务器空着，循环在等新请求，不碰引擎）：离线的一步，与经过服务器的请求
    轮流量；再各用每种客户端发一个流式请求。"""
    from common.openmp import release_thread_pool
    from step11_serving.api_server import build_app, settings_for
    from step11_serving.async_engine import AsyncLLMEngine
    from step11_serving.server_thread import ServerThread
    probe = EngineProbe(s, name, ForwardSplit(s.model))  # 建引擎（带计时的包装），先用一个短请求走完
    probe.start(ids[:8], 2).finish()
    e = probe.engine
    aengine = AsyncLLMEngine(e, s.tok)
    sends: list[float] = []
    app = build_app(aengine, s.tok, settings_for(s, e, e.config.block_size))
    app.add_middleware(SendTimes, sink=sends)
    trace = LoopTrace(aengine, probe)
    body = {"model": s.path.name, "prompt": list(ids), "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    results = defaultdict(list)
    tokens = {}
    server = ServerThread(app).start()
    try:
        run_client(server.url, {**body, "max_tokens": 4}, "thread")          # 预热：HTTP、分词、一次 prefill
        for _ in range(repeats):
            for mode in SERVER_MODES:
                if mode == "two_pools":
                    touch_pool()                                              # 主线程的池（又）建起来
                else:
                    release_thread_pool()
                with Switches() as sw:
                    steps = aengine._executor.submit(lambda: probe.start(ids, n_tokens).finish()).result()
                results[(mode, "direct")].append({
                    "engine_step": median([r["total"] for r in steps]), "forward": median([r["forward"] for r in steps]),
                    "switches_per_token": sw.count / n_tokens})
                tokens["direct"] = probe.tokens
                for where in clients:
                    trace.rows.clear()
                    sends.clear()
                    with Switches() as sw:
                        got = run_client(server.url, body, where)
                    r = split_server_run(list(trace.rows), list(sends), got)
                    results[(mode, where)].append(r | {"switches_per_token": sw.count / r["tokens"]})
                    tokens[where] = [t for chunk in got["tokens"] for t in chunk]
    finally:
        server.stop()
    out = defaultdict(dict)
    for (mode, where), runs in results.items():
        out[mode][where] = {k: median([r[k] for r in runs]) for k in runs[0]}
    return {"modes": dict(out), "tokens": tokens, "engine_thread_torch_threads": sorted(trace.thread_threads)}


def cli_server_itl(s, name: str, ids: list[int], n_tokens: int, repeats: int) -> dict:
    """对照：命令行的服务器（python -m step11_serving.api_server，另一个进程，uvicorn 在它的主线程里），客户端在本进程；
    客户端（本进程里的一个线程）量到的 token 间隔，和服务器进程每个 token 的自愿上下文切换（读 /proc/<pid>）。
    本进程在这段时间里只等网络。"""
    import tempfile

    import httpx

    from step11_serving.api_server import bind
    root = Path(__file__).resolve().parents[1]
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    log = tempfile.TemporaryFile(mode="w+")                # 服务器的日志（每个请求几行）：管道满了会卡住它
    proc = subprocess.Popen([sys.executable, "-m", "step11_serving.api_server", "--engine", name, "--port", str(port),
                             "--model", str(s.path), "--device", "cpu", "--dtype", "float32"], cwd=root,
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the server exited: {log.read()[-500:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 300:
                raise RuntimeError("the server did not start in 300 s")
            time.sleep(0.2)
        body = {"model": s.path.name, "prompt": list(ids), "max_tokens": n_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        run_client(url, {**body, "max_tokens": 4}, "thread")
        itl, switches, tokens = [], [], []
        for _ in range(repeats):
            with Switches(proc.pid) as sw:
                got = run_client(url, body, "thread")
            switches.append(sw.count / n_tokens)
            itl.append(median([b - a for a, b in zip(got["times"], got["times"][1:])]))
            tokens = [t for chunk in got["tokens"] for t in chunk]
        threads = len(list(Path(f"/proc/{proc.pid}/task").glob("*")))
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    return {"itl": median(itl), "switches_per_token": median(switches), "threads": threads, "tokens": tokens}


# ---------------- 4. 第 07 章负载里的 TPOT ----------------

def chapter07_tpot(s, quick: bool, batch1_step: Optional[float] = None) -> dict:
    """第 07 章 [2] 的负载（arrival_workload，同样的种子与到达间隔的量法），step07 默认预算 256，重放一遍，把 TPOT 拆开：
    一个请求相邻两个 token 的间隔就是那一步的时间（replay 步与步之间不等），所以按"这一步给几个 decode 出了 token"
    加权的平均步长 ≈ 平均 TPOT。步分两种：只有 decode 的（按批大小 B 分组）和带 prefill 块的。
    加权平均步长拆成 批 1 的一步 + 批大于 1 多出的 + prefill 块多出的；批 1 的一步取这个负载里只有一个 decode 的那几步
    （同一段时间里量的：机器的速度几分钟里就会漂），负载里没有这种步时用 batch1_step（[2] 里 step07 的一步）。"""
    from common.bench import median_time
    from common.clock import WallClock
    from common.harness import percentile, replay
    from step07_chunked_prefill.analysis.workload import arrival_workload
    from step07_chunked_prefill.config import num_blocks_for_budget
    from step07_chunked_prefill.engine import EngineConfig, LLMEngine
    cfg = EngineConfig(num_blocks=int(num_blocks_for_budget(s.cfg, 16, s.model.dtype)))
    x = torch.zeros(cfg.max_batch_size, 1, dtype=torch.long)     # 与 chapter.py 的 calibrate 相同：B 行、位置 0
    with torch.inference_mode():
        step_s = median_time(lambda: s.model(x, x, last_only=True), repeats=5, warmup=2)
    arrivals = arrival_workload(s.tok, quick, step_s)
    clock = WallClock()
    engine = LLMEngine(s.model, cfg, tokenizer=s.tok, eos_ids=s.tok.eos_ids, clock=clock)
    st = replay(engine, arrivals, clock).stats
    tpot = [t for t in st.tpot_s() if t is not None]
    groups: dict[str, list] = defaultdict(list)             # 种类 → [(秒, decode 个数)]
    for step in st.steps:
        if step.decode_tokens == 0:
            continue                                         # 没有 decode 的 prefill：不在任何人的 TPOT 里
        kind = f"decode B={step.decode_tokens}" if step.tokens == step.decode_tokens else "decode + prefill 块"
        groups[kind].append((step.seconds, step.decode_tokens))
    total_w = sum(d for g in groups.values() for _, d in g)
    weighted = sum(t * d for g in groups.values() for t, d in g) / total_w
    kinds = {}
    for kind in sorted(groups, key=lambda k: (k.startswith("decode +"), len(k), k)):
        g = groups[kind]
        w = sum(d for _, d in g)
        kinds[kind] = {"steps": len(g), "share": w / total_w, "mean_s": statistics.fmean(t for t, _ in g),
                       "mean_batch": w / len(g)}
    pure = [(t, d) for k, g in groups.items() if not k.startswith("decode +") for t, d in g]
    t1 = kinds["decode B=1"]["mean_s"] if "decode B=1" in kinds else batch1_step if batch1_step is not None else weighted
    mixed = kinds.get("decode + prefill 块", {"share": 0.0, "mean_s": t1})
    split = {"batch1_step": t1, "prefill_chunks": mixed["share"] * (mixed["mean_s"] - t1)}
    split["batch_gt1"] = weighted - t1 - split["prefill_chunks"]
    return {"split": split,"calibrate_step_s": step_s, "requests": len(arrivals), "tpot_p50": percentile(tpot, .5),
            "tpot_mean": statistics.fmean(tpot), "weighted_step": weighted, "kinds": kinds,
            "pure_decode_weighted": sum(t * d for t, d in pure) / max(1, sum(d for _, d in pure)),
            "mean_decode_batch": total_w / sum(len(g) for g in groups.values())}


# ---------------- 主程序 ----------------

def context_ids(tok, n: int) -> list[int]:
    ids = tok.encode(LONG_PROMPT)
    while len(ids) < n:
        ids += ids
    return ids[:n]


class Switches:
    """一个进程所有线程自愿让出 CPU 的次数（/proc 里每个线程的 voluntary_ctxt_switches）：OpenMP 的线程在并行区之间
    睡下（futex）一次记一次。不是时间，机器忙不忙它都差不多：看它就知道 libgomp 在忙等还是在睡。
    with Switches(pid) as sw: ... 之后 sw.count 是这段时间里的次数（只算两头都在的线程和中途新起的线程）。"""

    def __init__(self, pid="self"):
        self.pid, self.count = pid, 0

    def read(self) -> dict[str, int]:
        out = {}
        for task in Path(f"/proc/{self.pid}/task").glob("*"):
            try:
                out[task.name] = next(int(line.split()[1]) for line in (task / "status").read_text().splitlines()
                                      if line.startswith("voluntary_ctxt_switches"))
            except (OSError, StopIteration):
                pass                                     # 线程刚好结束了
        return out

    def __enter__(self):
        self.before = self.read()
        return self

    def __exit__(self, *exc):
        after = self.read()
        self.count = sum(n - self.before.get(tid, 0) for tid, n in after.items())


def touch_pool() -> None:
    """在调用它的线程里跑一个并行算子：这个线程的 OpenMP 线程池（还没有的话）现在就建好，不算进下一步的时间。"""
    torch.ones(1 << 20).sum()


def offline(s, ids: list[int], engines: list[str], steps: int, split_steps: int):
    """1 与 2：每一轮 step03 的前向、每个引擎在主线程的一步（进程里只有主线程一个 OpenMP 池：与离线的 run.py 相同）；
    再在一个新的专用线程里各走一步（主线程的池还在：两个池，= 服务器改之前），还掉主线程的池后再各走一步（只有专用
    线程一个池，= 改之后）；专用线程结束（它的池随之还掉），下一轮。之后各走 split_steps 步拆开前向。"""
    from common.openmp import release_thread_pool
    split = ForwardSplit(s.model)
    bare = BareForward(s, ids, steps + split_steps + 8, split)
    probes = {name: EngineProbe(s, name, split).start(ids, 3 * steps + split_steps + 8) for name in engines}
    rows = {mode: defaultdict(list) for mode in ("main", "two_pools", "one_pool")}
    bare_rows = []

    def run(step):
        with Switches() as sw:
            r = step()
        return r | {"switches": sw.count}
    released = True
    for i in range(steps + 1):                           # 第 0 轮是预热，不记
        touch_pool()
        b = run(lambda: {"total": bare.step()})
        main = {name: run(p.step) for name, p in probes.items()}
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step") as ex:
            ex.submit(touch_pool).result()
            two = {name: run(lambda: ex.submit(p.step).result()) for name, p in probes.items()}
            released &= release_thread_pool()
            one = {name: run(lambda: ex.submit(p.step).result()) for name, p in probes.items()}
            threads_worker = ex.submit(torch.get_num_threads).result()
        if i == 0:
            continue
        bare_rows.append(b)
        for mode, got in (("main", main), ("two_pools", two), ("one_pool", one)):
            for name, r in got.items():
                rows[mode][name].append(r)
    touch_pool()
    parts = {"step03": split_forward(bare.step, split, split_steps)}
    for name, p in probes.items():
        parts[name] = split_forward(lambda: p.step()["forward"], split, split_steps)
    same = {name: p.tokens[:len(bare.tokens)] == bare.tokens[:len(p.tokens)] for name, p in probes.items()}

    def med(rs):
        return {k: median([r[k] for r in rs]) for k in rs[0]}
    return {"bare_forward": median([r["total"] for r in bare_rows]),
            "bare_switches": median([r["switches"] for r in bare_rows]),
            **{mode: {n: med(r) for n, r in by.items()} for mode, by in rows.items()},
            "released": released, "forward_split": parts, "tokens_equal_step03": same,
            "torch_threads": {"main": torch.get_num_threads(), "executor_thread": threads_worker},
            "bare_tokens": bare.tokens}


def report_server(s, off: dict, server_engine: str, ids: list[int], N: int, repeats: int, cli: bool):
    """第 3 部分：跑、打印；返回 (srv, cli_srv)。"""
    srv = server_runs(s, server_engine, ids, N, ["process", "thread"], repeats)
    print(f"\n[3] 经过服务器（本进程，{server_engine} 的引擎，/v1/completions 流式，{N} 个 token，每种状态、每种客户端 "
          f"{repeats} 个请求取中位数；引擎线程里 torch 线程数 {srv['engine_thread_torch_threads']}）。"
          "\"直接跑\"= 同一个引擎在它自己的线程里直接跑同一个请求（两次请求之间，服务器空着）：")
    rows = []
    for mode, by in srv["modes"].items():
        d = by["direct"]
        rows.append([SERVER_MODES[mode], "（直接跑）", ms(d["engine_step"]), "-", ms(d["engine_step"]), *["-"] * 4,
                     ms(d["forward"]), "-", "-", "-", f"{d['switches_per_token']:.0f}", "1.00"])
        for where in ("process", "thread"):
            r = by[where]
            rows.append([SERVER_MODES[mode], "另一个进程" if where == "process" else "本进程的线程", ms(r["itl"]),
                         ms(r["cycle"]), *[ms(r[k]) for k in LOOP_PARTS], ms(r["forward"]), ms(r["thread_cpu"]),
                         ms(r["sse"]), ms(r["net"]), f"{r['switches_per_token']:.0f}",
                         f"{r['itl'] / d['engine_step']:.2f}"])
    print(table(["状态", "客户端", "token 间隔 (ms)", "循环一圈", *[LOOP_NAMES[k] for k in LOOP_PARTS], "其中前向",
                 "引擎线程的 CPU", "分发完→SSE 发出", "发出→客户端收到", "自愿切换/token", "÷ 直接跑的一步"], rows))
    cli_srv = None
    if cli:
        cli_srv = cli_server_itl(s, server_engine, ids, N, repeats)
        srv["tokens"]["cli_server"] = cli_srv["tokens"]
        main_step = off["main"].get(server_engine, {}).get("total")
        print(f"命令行的服务器（python -m step11_serving.api_server，另一个进程，客户端在本进程，{repeats} 个请求）："
              f"token 间隔 {ms(cli_srv['itl'])} ms，服务器进程每个 token 自愿切换 {cli_srv['switches_per_token']:.0f} 次、"
              f"{cli_srv['threads']} 个线程"
              + (f"；÷ [2] 里 {server_engine} 在主线程的一步 {cli_srv['itl'] / main_step:.2f}（不轮流：先后跑的）"
                 if main_step else ""))
    return srv, cli_srv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="冒烟：上下文 64、16 个 token、只有 step09 与服务器")
    ap.add_argument("--json", action="store_true", help="最后打印一行 JSON")
    ap.add_argument("--context", type=int, help="上下文长度（默认 256，--quick 64）")
    ap.add_argument("--tokens", type=int, help="量几步 / 服务器生成几个 token（默认 64，--quick 16）")
    ap.add_argument("--engines", help="逗号分隔（默认 step07,step09,step10；--quick step09）")
    ap.add_argument("--server-engine", default=None, help="服务器挂哪一步的引擎（默认 step10；--quick step09）")
    ap.add_argument("--repeats", type=int, default=None, help="服务器每种客户端跑几个请求（默认 3，--quick 1）")
    ap.add_argument("--model", help="模型目录（默认：默认模型）")
    ap.add_argument("--no-server", action="store_true", help="不跑第 3 部分（服务器）")
    ap.add_argument("--no-cli-server", action="store_true", help="不起命令行的服务器（另一个进程）做对照")
    ap.add_argument("--no-ch07", action="store_true", help="不跑第 4 部分（第 07 章负载的 TPOT，完整模式约 1.5 分钟）")
    ap.add_argument("--client", nargs=2, metavar=("URL", "BODY"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        client_main(*args.client)
        return 0
    from common.cli import open_session
    q = args.quick
    C = args.context or (64 if q else 256)
    N = args.tokens or (16 if q else 64)
    engines = (args.engines or ("step09" if q else "step07,step09,step10")).split(",")
    server_engine = args.server_engine or ("step09" if q else "step10")
    repeats = args.repeats or (1 if q else 3)
    s = open_session(args.model, "cpu", "float32")
    ids = context_ids(s.tok, C)
    load0 = load_avg()
    print(f"机器: {machine()}；{sched_desc()}；模型 {s.path.name}，cpu/float32；批 1，上下文 {C} token，量 {N} 步",
          flush=True)
    t_start = time.time()
    off = offline(s, ids, engines, N, 2 if q else 5)
    bare = off["bare_forward"]
    print(f"\n[1] step03 一次 decode 前向（中位数）：{ms(bare)} ms，每步自愿上下文切换 {off['bare_switches']:.0f} 次；"
          f"torch 线程：主线程 {off['torch_threads']['main']}，专用线程 {off['torch_threads']['executor_thread']}")
    rows = []
    for mode in OFFLINE_MODES:
        for name, r in off[mode].items():
            rows.append([name, OFFLINE_MODES[mode], ms(r["total"]), f"{r['total'] / bare:.2f}",
                         *[ms(r[k]) for k in ENGINE_PHASES], ms(r["thread_cpu"]), f"{r['switches']:.0f}"])
    print("\n[2] engine.step()，批 1（各部分是中位数，加起来不一定等于一步的中位数；三种线程状态每轮各一步，轮流）：")
    print(table(["引擎", "在哪个线程", "一步 (ms)", "÷ step03 前向", *[PHASE_NAMES[k] for k in ENGINE_PHASES],
                 "调用线程的 CPU", "自愿切换/步"], rows))
    prow = [[n, *[ms(p[k]) for k in FORWARD_PARTS]] for n, p in off["forward_split"].items()]
    print("\n前向拆开（主线程另走几步，Linear 上挂钩子、KV cache 的 attend 计时；中位数）：")
    print(table(["", *[PART_NAMES[k] for k in FORWARD_PARTS]], prow))
    print(f"贪心 token 与 step03 相同：{off['tokens_equal_step03']}")

    srv = cli_srv = None
    served_ok = {}
    if not args.no_server:
        srv, cli_srv = report_server(s, off, server_engine, ids, N, repeats, not args.no_cli_server)
        ref = off["bare_tokens"]
        served_ok = {w: t == ref[:len(t)] and len(t) == N for w, t in srv["tokens"].items()}
        print(f"服务器流式返回的 token 与 step03 相同：{served_ok}")
    ch07 = None
    if not args.no_ch07:
        t1 = off["main"].get("step07", {}).get("total")
        ch07 = chapter07_tpot(s, q, t1)
        sp = ch07["split"]
        print(f"\n[4] 第 07 章 [2] 的负载（{'--quick' if q else '完整'}，{ch07['requests']} 个请求，step07 预算 256）："
              f"TPOT p50 {ms(ch07['tpot_p50'])} ms、平均 {ms(ch07['tpot_mean'])} ms；按 decode token 加权的平均步长 "
              f"{ms(ch07['weighted_step'])} ms，其中只有 decode 的步 {ms(ch07['pure_decode_weighted'])} ms；"
              f"一步里平均 {ch07['mean_decode_batch']:.1f} 个 decode"
              + (f"；对照 [2] 的 step07 批 1 一步 {ms(t1)} ms" if t1 else ""))
        print(table(["这一步", "步数", "占 TPOT 间隔", "平均一步 (ms)"],
                    [[k, v["steps"], f"{v['share']:.0%}", ms(v["mean_s"])] for k, v in ch07["kinds"].items()]))
        print(f"加权平均步长 {ms(ch07['weighted_step'])} ms = 批 1 的一步 {ms(sp['batch1_step'])} + 批大于 1 多出的 "
              f"{ms(sp['batch_gt1'])} + prefill 块多出的 {ms(sp['prefill_chunks'])}")
    load1 = load_avg()
    print(f"\nload avg 开始 {load0:.2f}、结束 {load1:.2f}；墙钟 {time.time() - t_start:.0f} s")
    ratios = {f"{n}_step_vs_bare": round(r["total"] / bare, 3) for n, r in off["main"].items()}
    for mode, by in (srv["modes"] if srv else {}).items():
        ratios[f"server_itl_vs_direct_step_{mode}"] = round(by["process"]["itl"] / by["direct"]["engine_step"], 3)
    if srv and server_engine in off["main"]:
        main_step = off["main"][server_engine]["total"]
        ratios["server_itl_one_pool_vs_main_step"] = round(srv["modes"]["one_pool"]["process"]["itl"] / main_step, 3)
        if cli_srv:
            ratios["cli_server_itl_vs_main_step"] = round(cli_srv["itl"] / main_step, 3)
    if args.json:
        print(json.dumps({"machine": machine(), "sched": sched_desc(), "load_avg": [round(load0, 2), round(load1, 2)],
                          "context": C,
                          "tokens": N, "bare_forward_s": bare, "bare_switches": off["bare_switches"],
                          "engine_step": {m: off[m] for m in OFFLINE_MODES}, "released": off["released"],
                          "forward_split": off["forward_split"],
                          "torch_threads": off["torch_threads"] | {"server_engine_thread": srv and srv["engine_thread_torch_threads"]},
                          "server_engine": server_engine, "server": srv and srv["modes"],
                          "cli_server": cli_srv and {k: v for k, v in cli_srv.items() if k != "tokens"},
                          "ratios": ratios,
                          "tokens_equal_step03": off["tokens_equal_step03"], "served_tokens_equal_step03": served_ok,
                          "chapter07": ch07},
                         ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
