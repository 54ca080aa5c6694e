"""章节模式（chapter.py）共用的东西：检查清单、进度提示、分位数、按到达时刻驱动引擎（replay），以及收尾
（打印检查、输出 JSON、决定退出码）。计时、带宽、剖析、表格在 common/bench.py。引擎从不调用这里的代码。"""
import math
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from . import cli
from .clock import Clock
from .stats import EngineStats, collect_stats, last_steps


@dataclass
class Checks:
    """章节的检查清单：名字 → 是否通过（真实算出来的结果），以及随检查一起打印的说明（例如被接受的分歧）。"""
    results: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def __setitem__(self, name: str, ok) -> None:
        self.results[name] = bool(ok)

    def __getitem__(self, name: str) -> bool:
        return self.results[name]

    def note(self, text: str) -> None:
        self.notes.append(text)

    @property
    def all_passed(self) -> bool:
        return all(self.results.values())


def finish(step: str, s: "cli.Session", checks: Checks, figures: dict, as_json: bool) -> bool:
    """章节模式的收尾：打印检查（✅ 只给真正通过的），--json 时最后一行输出 JSON；返回是否全部通过（run_main 据此定退出码）。"""
    cli.print_checks(checks.results, checks.notes)
    if as_json:
        cli.emit_json(cli.chapter_json(step, s, checks.results, figures))
    return checks.all_passed


def stage(msg: str) -> float:
    """打印一个阶段的标题（立刻刷出，长时间的运行能看到走到哪了），返回开始的时刻。"""
    print(msg, flush=True)
    return time.perf_counter()


def percentile(xs: list[Optional[float]], q: float) -> float:
    """最近秩分位数（不插值）：p90 就是排序后第 ⌈0.9·n⌉ 个。None（没有这个量的请求）不参与。"""
    xs = sorted(x for x in xs if x is not None)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def pool_is_free(engine) -> bool:
    """引擎的块全部还回来了：没有请求还拿着块（前缀缓存留着的块引用计数为 0，也算可用）。"""
    bm = engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


@dataclass
class Arrival:
    time: float        # 到达时刻（秒，从 0 起）
    request: Any       # step04 的 Request


class RunOutput(NamedTuple):
    outputs: list[list[int]]   # 每个请求的新 token，顺序同 arrivals
    stats: EngineStats


def replay(engine, arrivals: list[Arrival], clock: Clock) -> RunOutput:
    """按到达时刻把请求交给引擎（同一时刻按给定顺序），一步一步跑完。引擎必须用同一个 clock 构造（它用
    clock.now() 记到达与出 token 的时刻）。没有请求可做、下一个还没到时，时钟直接拨到它到达的时刻
    （不真的等，记在 idle_s）。任何一步出错：已经交给引擎的请求全部 abort，块一个不少地还回去。
    全部在 0 时刻到达时，它与 engine.generate(requests) 做的事相同。"""
    if any(not a.time >= 0 for a in arrivals):      # 也挡住 NaN
        raise ValueError("arrival times must be >= 0")
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i].time)
    seqs: list = [None] * len(arrivals)
    first_step, nxt = engine.num_steps, 0
    idle0, t0 = clock.idle_s, clock.now()
    try:
        while nxt < len(order) or engine.has_unfinished_requests():
            while nxt < len(order) and arrivals[order[nxt]].time <= clock.now() - t0:
                i = order[nxt]
                seqs[i] = engine.seqs[engine.add_request(arrivals[i].request)]
                nxt += 1
            if engine.has_unfinished_requests():
                engine.step()
                clock.tick()
            elif nxt < len(order):
                clock.advance_to(t0 + arrivals[order[nxt]].time)
    finally:
        for seq in seqs:
            if seq is not None:
                engine.abort(seq.request_id)     # 已经结束的请求 abort 什么也不做
    idle = clock.idle_s - idle0
    steps = last_steps(engine.step_stats, engine.num_steps - first_step)   # 这次运行的每一步
    return RunOutput([seq.output_ids for seq in seqs], collect_stats(seqs, steps, clock.now() - t0 - idle, idle))
