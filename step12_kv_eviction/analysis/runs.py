"""step12 章节模式怎么驱动引擎：一个"设置"（策略 + 预算 + 位置）、一个请求从头跑到尾并逐步记账。

只读引擎公开的东西：add_request / step / abort、engine.seqs 里这个请求的 Sequence（已算的 token、块表、
被驱逐的个数）、每一步的 StepStats（墙钟、是不是 prefill）、RequestOutput（新 token、prompt logprobs、
结束时持有的块与峰值）。引擎不知道有人在记账。
"""
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

from step02_sampling.sampler import SamplingParams
from step04_static_batching.request import Request


FULL_LABEL = "full"


@dataclass(frozen=True)
class Setting:
    """一种 KV 策略的设置。label 是表格里和 figures 名字里用的名字：full、window_512、sinks4_512_cachepos、
    sinks4_512_textpos、h2o_512、snapkv_512、snapkv-chunked_512（位置不是该策略的默认时加 _cachepos / _textpos；
    sinks 总写明）。"""
    policy: str = "full"
    budget: Optional[int] = None
    positions: Optional[str] = None       # None = 策略的默认：window / sinks 用 cache，h2o / snapkv 用 text
    num_sinks: int = 4

    @property
    def default_positions(self) -> str:
        return "cache" if self.policy in ("window", "sinks") else "text"

    @property
    def label(self) -> str:
        if self.policy == "full":
            return "full"
        pos = self.positions or self.default_positions
        if self.policy == "sinks":
            return f"sinks{self.num_sinks}_{self.budget}_{pos}pos"
        return f"{self.policy}_{self.budget}" + ("" if pos == self.default_positions else f"_{pos}pos")

    def config(self) -> dict:
        """EngineConfig 的字段。"""
        if self.policy == "full":
            return {"kv_policy": "full"}
        kw = {"kv_policy": self.policy, "kv_budget": self.budget}
        if self.positions is not None:
            kw["kv_positions"] = self.positions
        if self.policy == "sinks":
            kw["num_sinks"] = self.num_sinks
        return kw


def parse(label: str) -> Setting:
    """label → Setting（章节的测量计划用名字写，读起来就是表格里的那一行）。"""
    if label == "full":
        return Setting()
    parts = label.split("_")
    pos = next((p[:-3] for p in parts[2:] if p.endswith("pos")), None)
    name, budget = parts[0], int(parts[1])
    if name.startswith("sinks"):
        return Setting("sinks", budget, pos, int(name[5:] or 4))
    return Setting(name, budget, pos)


@dataclass
class Run:
    """一个请求的一生。trace 每一项是一次前向之后：(已算的 token, 持有的块, 被驱逐的 token)。"""
    output_ids: list[int] = field(default_factory=list)
    prompt_logprobs: Optional[list] = None
    trace: list[tuple[int, int, int]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    step_prefill: list[bool] = field(default_factory=list)
    kv_blocks_end: Optional[int] = None
    kv_blocks_peak: Optional[int] = None
    wall_s: float = 0.0

    @property
    def nll(self) -> list[float]:
        """位置 1, 2, … 的 −log p(token | 前文)（位置 0 没有前文）。"""
        return [-lp.logprob for lp in self.prompt_logprobs[1:]]

    @property
    def top1(self) -> list[int]:
        """位置 1, 2, … 上模型最可能的 token（要 prompt_logprobs ≥ 1）。"""
        return [lp.top[0][0] for lp in self.prompt_logprobs[1:]]

    @property
    def decode_step_s(self) -> Optional[float]:
        """decode 一步的中位数（秒）：没有 prefill 的前向。"""
        dec = [s for s, p in zip(self.step_seconds, self.step_prefill) if not p]
        return statistics.median(dec) if dec else None

    @property
    def prefill_s(self) -> float:
        return sum(s for s, p in zip(self.step_seconds, self.step_prefill) if p)

    @property
    def max_evicted(self) -> int:
        return max((v for _, _, v in self.trace), default=0)

    @property
    def peak_blocks(self) -> int:
        traced = max((b for _, b, _ in self.trace), default=0)
        return max(traced, self.kv_blocks_peak or 0)


def run_one(engine, request: Request) -> Run:
    """一个请求单独跑完（引擎里没有别的请求），每次前向之后记一笔（结束的那一步除外）。"""
    rid = engine.add_request(request)
    seq = engine.seqs[rid]
    run, done = Run(), False
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            outs = engine.step()
            st = engine.step_stats[-1]
            run.step_seconds.append(st.seconds)
            run.step_prefill.append(st.prefill)
            for o in outs:
                if o.request_id != rid:
                    continue
                if o.error is not None:
                    raise o.error
                run.output_ids += o.new_token_ids
                if o.prompt_logprobs is not None:
                    run.prompt_logprobs = o.prompt_logprobs
                if o.finished:
                    done = True
                    run.kv_blocks_end = getattr(o, "kv_blocks", None)
                    run.kv_blocks_peak = getattr(o, "kv_blocks_peak", None)
            if not done:     # 结束时块已经还了、计数清零了：最后一步只记 RequestOutput 报的块数（kv_blocks_end）
                run.trace.append((seq.num_computed_tokens, len(seq.block_table), getattr(seq, "num_evicted", 0)))
    finally:
        engine.abort(rid)
    run.wall_s = time.perf_counter() - t0
    return run


def stream_request(ids: list[int], new_tokens: int) -> Request:
    """整段文本当一个提示词：每个位置的 logprob 和最可能的那个 token；之后再贪心 decode new_tokens 个（计时用）。"""
    return Request(ids, new_tokens, SamplingParams(), ignore_eos=True, prompt_logprobs=1)


def greedy_request(ids: list[int], new_tokens: int) -> Request:
    return Request(ids, new_tokens, SamplingParams(), ignore_eos=True)


def agreement(ref: Run, got: Run, lo: int, hi: int) -> tuple[float, float]:
    """teacher forcing（两边喂同一段真实文本）下位置 [lo, hi) 的 top-1 一致率与平均 NLL 差（got − ref，nat/token）。"""
    a, b = ref.top1[lo - 1:hi - 1], got.top1[lo - 1:hi - 1]
    na, nb = ref.nll[lo - 1:hi - 1], got.nll[lo - 1:hi - 1]
    return sum(x == y for x, y in zip(a, b)) / len(a), (sum(nb) - sum(na)) / len(na)


def mean_nll(run: Run, lo: int, hi: int) -> float:
    """位置 [lo, hi) 的平均 NLL（nat/token）。"""
    xs = run.nll[lo - 1:hi - 1]
    return sum(xs) / len(xs)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def pool_blocks(setting: Setting, tokens: int, chunk: int, block_size: int, new_tokens: int = 0) -> int:
    """一个请求（tokens = 提示词 + new_tokens）要的最大块数：full 是全部 token；snapkv 在 prefill 时留着整个提示词，
    压缩之后 预算 + 生成的；其余驱逐策略是 预算 + 一块的余量 + 一次前向的块（snapkv-chunked 的 decode 不驱逐，再加生成的）。
    多给 1 块。"""
    if setting.policy == "full":
        return blocks_for(tokens, block_size) + 1
    if setting.policy == "snapkv":
        slots = max(tokens - new_tokens, setting.budget + new_tokens)
    else:
        slots = setting.budget + block_size - 1 + chunk + (new_tokens if setting.policy == "snapkv-chunked" else 0)
    return blocks_for(min(slots, tokens), block_size) + 1
