"""静态批处理的三种浪费，边跑边数（只数真正发生的，不是事后估算）。

    prefill 填充浪费   = 填充槽位 / prefill 处理的全部槽位（B × P，P = 这批最长的提示词）
    decode 空转浪费    = 已结束的行陪跑的 行·步 / decode 的全部 行·步（B × decode 前向次数）
    KV 预留浪费        = 1 - 存着真实 token 的槽位 / 预留的槽位（B × max_len）

"槽位"以 token 计；KV 字节数 = 槽位 × cfg.kv_bytes_per_token(每个数的字节数)。
"""
from dataclasses import dataclass


@dataclass
class BatchStats:
    num_batches: int = 0
    num_forwards: int = 0              # 前向次数：每批 1 次 prefill + 若干次 decode
    generated_tokens: int = 0
    prefill_slots: int = 0             # Σ B × P
    prefill_padding_slots: int = 0     # Σ 每行的填充数
    decode_row_steps: int = 0          # Σ B × decode 前向次数
    decode_idle_row_steps: int = 0     # 其中已结束的行（它们照样参与计算，结果扔掉）
    kv_slots_reserved: int = 0         # Σ B × max_len：整批开始前就一次性分配
    kv_slots_used: int = 0             # Σ 每行真实 token 的 K/V 数 = 提示词 + 生成数 - 1（最后一个 token 不再喂回）
    peak_kv_slots_reserved: int = 0    # 同一时刻最多预留了多少槽位（一批一批地跑，取最大的一批）

    @property
    def prefill_padding_waste(self) -> float:
        return self.prefill_padding_slots / self.prefill_slots if self.prefill_slots else 0.0

    @property
    def decode_idle_waste(self) -> float:
        return self.decode_idle_row_steps / self.decode_row_steps if self.decode_row_steps else 0.0

    @property
    def kv_reserved_waste(self) -> float:
        return 1 - self.kv_slots_used / self.kv_slots_reserved if self.kv_slots_reserved else 0.0
