"""每次前向记一行 StepStats，引擎的全部统计都由这些行和每个请求的时刻算出（只数真正发生的，不是事后估算）。
step05 原样沿用这两个类，所以两步的浪费、TTFT / TPOT 是同一个定义、同一段代码算出来的。

    prefill 填充浪费 = Σ_prefill 前向 (B × L − 真实 token) ÷ Σ_prefill 前向 B × L
    decode 空转浪费  = Σ_decode 前向 陪跑的行 ÷ Σ_decode 前向 B
    KV 浪费          = 1 − Σ_前向 存着真实 token 的槽 ÷ Σ_前向 引擎持有的槽
                       （每次前向之后采样一次，按槽数加权平均；"槽"= 一个 token 的 K/V，
                        字节数 = 槽 × cfg.kv_bytes_per_token(每个数的字节数)）

step04 持有的槽是整批预留的 B × max_len；step05 是运行集合的块数 × block_size。
"""
from dataclasses import dataclass, field
from typing import Optional


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
    stalled: int = 0           # 这一步里干等的请求数：已经在 decode、却因为这一步是别人的 prefill 而没有前进（step05）


@dataclass
class EngineStats:
    steps: list[StepStats] = field(default_factory=list)
    wall_s: float = 0.0
    # 每个请求一项，顺序与 requests 相同（时刻相对本次运行开始，秒）
    first_token_s: list[float] = field(default_factory=list)
    finish_s: list[float] = field(default_factory=list)
    num_outputs: list[int] = field(default_factory=list)
    stall_s: list[float] = field(default_factory=list)    # 首 token 之后干等别人 prefill 的总时间（step04 恒为 0）

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
        """prefill 前向里真正算的 token（不含填充）：step05 被抢占后的重算也在里面，step06 命中的前缀不在里面。"""
        return sum(st.tokens for st in self.steps if st.prefill)

    @property
    def generated_tokens(self) -> int:
        return sum(self.num_outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0

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
