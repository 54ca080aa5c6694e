"""每次前向记一行 StepStats，引擎的全部统计都由这些行和每个请求的时刻算出（只数真正发生的，不是事后估算）。
step04 的静态批和 step05 起的每个引擎都记同样的行，所以各步的浪费、TTFT / TPOT 是同一个定义、同一段代码算出来的
（step05 起由 collect_stats 从引擎的 step_stats 和每个请求的 Sequence 汇总）。

    prefill 填充浪费 = Σ_prefill 前向 (B × L − 真实 token) ÷ Σ_prefill 前向 B × L
    decode 空转浪费  = Σ_decode 前向 陪跑的行 ÷ Σ_decode 前向 B
    KV 浪费          = 1 − Σ_前向 存着真实 token 的槽 ÷ Σ_前向 引擎持有的槽
                       （每次前向之后采样一次，按槽数加权平均；"槽"= 一个 token 的 K/V，
                        字节数 = 槽 × cfg.kv_bytes_per_token(每个数的字节数)）

step04 持有的槽是整批预留的 B × max_len；step05 起是运行集合的块数 × block_size（step06 起共享的块只算一次）。
时刻都来自引擎的时钟（common/clock.py）：真实运行是墙钟，测试里是虚拟时钟。

引擎的 step_stats 是有界的 deque（只留最近 STEP_STATS_KEPT 行：服务器一直跑，内存不随运行时间增长），另外用
num_steps 数一共走了几步；一次运行（generate / replay）的行 = 开始以来的 num_steps 之差，用 last_steps 取出。
"""
import itertools
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

# 引擎留最近多少步的账。章节、bench 里最长的一次运行（一次 generate / replay）不到一万步（step05 的完整负载：
# 32 个请求、每个至多 256 个输出 token），这里留出十倍；一行约 300 字节，留满约 30 MB
STEP_STATS_KEPT = 100_000


@dataclass
class StepStats:
    """一次前向。"""
    prefill: bool
    rows: int                  # B：这次前向的行数
    width: int                 # L：每行的 token 位置数（左填充之后）
    tokens: int                # 其中真实 token 的个数（其余是填充）
    idle_rows: int             # 算了但结果扔掉的行（step04：已结束、还在陪跑的行）
    kv_slots_held: int         # 前向之后引擎为 KV 持有的槽
    kv_slots_used: int         # 其中存着真实 token 的 K/V 的槽
    seconds: float             # 这一步的墙钟时间：准备输入 + 前向 + 采样
    gather_bytes: int = 0      # 读 KV 时复制的字节（step05 按块表 gather；step04 读的是视图，0）
    stalled: int = 0           # 这一步里干等的请求数：已经有输出、在运行集合里，这一步却没有产出 token（在等别人的 prefill）
    decode_tokens: int = 0     # tokens 里有几个是 decode 的（step07 起一次前向里 decode 与 prefill 的块混在一起）
    num_running: int = 0       # 前向之后运行集合里的请求数


@dataclass
class EngineStats:
    steps: list[StepStats] = field(default_factory=list)
    wall_s: float = 0.0
    # 每个请求一项，顺序与 requests 相同（时刻相对本次运行开始，秒）
    first_token_s: list[float] = field(default_factory=list)
    finish_s: list[float] = field(default_factory=list)
    num_outputs: list[int] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    stall_s: list[float] = field(default_factory=list)    # 首 token 之后干等别人 prefill 的总时间（step04 恒为 0）
    # step05 起的引擎还记这些（每个请求一项，顺序同上）；step04 的静态批没有，留空
    arrival_s: list[float] = field(default_factory=list)          # 到达（add_request）的时刻
    token_s: list[list[float]] = field(default_factory=list)      # 每个输出 token 产出的时刻
    preempted: list[int] = field(default_factory=list)            # 被抢占了几次
    cached_tokens: list[int] = field(default_factory=list)        # 提示词里有几个 token 用了前缀缓存（没有前缀缓存的引擎为 0）
    idle_s: float = 0.0        # 没有请求可做、时钟直接拨过去的时间（请求陆续到达时）；不在 wall_s 里

    # ---- 前向次数与 token ----
    @property
    def num_forwards(self) -> int:
        return len(self.steps)

    @property
    def prefill_steps(self) -> int:
        return sum(st.prefill for st in self.steps)

    @property
    def decode_steps(self) -> int:
        return sum(not st.prefill for st in self.steps)

    @property
    def prefill_tokens(self) -> int:
        """prefill 真正算的 token（不含填充，不含混在同一次前向里的 decode）：被抢占后的重算也在里面，
        step06 命中的前缀不在里面。"""
        return sum(st.tokens - st.decode_tokens for st in self.steps if st.prefill)

    @property
    def generated_tokens(self) -> int:
        return sum(self.num_outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def forward_shapes(self) -> list[tuple]:
        """每一次前向算了什么：(是否 prefill, 行数, 每行宽度, 真实 token 数)——两个引擎"每一次前向都相同"就比它。"""
        return [(x.prefill, x.rows, x.width, x.tokens) for x in self.steps]

    # ---- 三种浪费（定义见模块说明）----
    @property
    def prefill_slots(self) -> int:
        return sum(st.rows * st.width for st in self.steps if st.prefill)

    @property
    def prefill_padding_slots(self) -> int:
        return sum(st.rows * st.width - st.tokens for st in self.steps if st.prefill)

    @property
    def decode_row_steps(self) -> int:
        return sum(st.rows for st in self.steps if not st.prefill)

    @property
    def decode_idle_row_steps(self) -> int:
        return sum(st.idle_rows for st in self.steps if not st.prefill)

    @property
    def kv_slot_steps_held(self) -> int:
        return sum(st.kv_slots_held for st in self.steps)

    @property
    def kv_slot_steps_used(self) -> int:
        return sum(st.kv_slots_used for st in self.steps)

    @property
    def preemptions(self) -> int:
        return sum(self.preempted)

    @property
    def peak_running(self) -> int:
        """同时在运行集合里的请求数的峰值。"""
        return max((st.num_running for st in self.steps), default=0)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def hit_rate(self) -> float:
        """前缀缓存命中率 = 用了缓存的提示词 token ÷ 全部提示词 token。"""
        return sum(self.cached_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def peak_kv_slots_held(self) -> int:
        return max((st.kv_slots_held for st in self.steps), default=0)

    @property
    def prefill_padding_waste(self) -> float:
        return self.prefill_padding_slots / self.prefill_slots if self.prefill_slots else 0.0

    @property
    def decode_idle_waste(self) -> float:
        return self.decode_idle_row_steps / self.decode_row_steps if self.decode_row_steps else 0.0

    @property
    def kv_waste(self) -> float:
        return 1 - self.kv_slot_steps_used / self.kv_slot_steps_held if self.kv_slot_steps_held else 0.0

    # ---- 每个请求的时间 ----
    def tpot_s(self, without_stall: bool = False) -> list[Optional[float]]:
        """生成 ≥ 2 个 token 的请求：(结束 − 首 token) ÷ (输出数 − 1)；without_stall 时先减去干等别人 prefill 的时间。
        只有 1 个输出的请求没有 TPOT（None）。"""
        return [(f - t - (s if without_stall else 0.0)) / (n - 1) if n > 1 else None
                for t, f, n, s in zip(self.first_token_s, self.finish_s, self.num_outputs, self.stall_s)]

    def ttft_s(self) -> list[float]:
        """首 token 延迟从请求到达算起（全部在 0 时刻到达时就是 first_token_s）。"""
        arrivals = self.arrival_s or [0.0] * len(self.first_token_s)
        return [f - a for f, a in zip(self.first_token_s, arrivals)]

    def max_gap_s(self) -> list[Optional[float]]:
        """每个请求相邻两个输出 token 之间最长的间隔：它在运行中被卡住的最长一次（只有 1 个输出的请求为 None）。"""
        return [max(b - a for a, b in zip(ts, ts[1:])) if len(ts) > 1 else None for ts in self.token_s]


def last_steps(steps: deque, n: int) -> list[StepStats]:
    """引擎的 step_stats 里最后 n 行（deque 不能切片）。一次运行走了比留下的还多的步时，前面的行已经丢了：
    给出留下的那些并警告（统计只覆盖最后这一段），而不是悄悄少算。"""
    if n > len(steps):
        warnings.warn(f"this run took {n} steps but the engine keeps only the last {len(steps)} step records "
                      f"(STEP_STATS_KEPT): the statistics cover those only", stacklevel=2)
    return list(itertools.islice(steps, max(len(steps) - n, 0), None))


def collect_stats(seqs, steps: list[StepStats], wall_s: float, idle_s: float = 0.0) -> EngineStats:
    """step05 起的引擎跑完一组请求：seqs 是它们的 Sequence（顺序同 requests），steps 是这段时间里的每一步。
    时刻换算成相对第一个请求到达的时刻。"""
    t0 = min((s.arrival_time for s in seqs), default=0.0)
    rel = lambda t: None if t is None else t - t0   # noqa: E731
    return EngineStats(
        steps=list(steps), wall_s=wall_s, idle_s=idle_s,
        first_token_s=[rel(s.first_token_time) for s in seqs], finish_s=[rel(s.finish_time) for s in seqs],
        num_outputs=[len(s.output_ids) for s in seqs], prompt_lens=[len(s.request.prompt_ids) for s in seqs],
        stall_s=[s.stall_time for s in seqs], arrival_s=[rel(s.arrival_time) for s in seqs],
        token_s=[[rel(t) for t in s.token_times] for s in seqs], preempted=[s.num_preemptions for s in seqs],
        cached_tokens=[getattr(s, "num_cached_tokens", 0) or 0 for s in seqs])
