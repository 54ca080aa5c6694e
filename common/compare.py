"""token 级比较。规则如下（讲解见 docs/01_naive.md 与 docs/03_kvcache.md 的"相同的精确含义"）：

找到两条序列第一个不同的位置；只有当参考序列在该位置的 top-2 logit 差（由参考序列的 teacher-forcing
前向算出，而不是假设）小于容差时才接受（浮点末位不同可以让几乎打平的 argmax 翻转），之后的 token 不再比较。
其余任何不同都是失败。每个被接受的分歧都按名字报告（提示词、位置、差值）。

带种子的采样同理，只是"几乎打平"换成采样自己的量：参考序列在该位置抽到的随机数 u 离它那个 token 在累计分布
上的区间边界有多近（step02 的 `draw_margin`）。logits 的末位不同会让区间边界挪动一点点，u 恰好落在边界附近时
抽到的就是相邻的 token——与贪心的 argmax 翻转是同一回事。容差沿用同一个数（float32 下 1e-3，概率单位）。
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

MARGIN_TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}  # 半精度末位差得多：bf16 只存 7 位尾数，fp16 10 位


@dataclass
class Comparison:
    name: str
    equal: bool                      # 完全一致
    ok: bool                         # 一致，或分歧被接受
    position: Optional[int] = None   # 第一个不同的输出位置
    margin: Optional[float] = None   # 参考序列在该位置离"打平"有多远（见 measure）
    ref_token: Optional[int] = None
    got_token: Optional[int] = None
    measure: str = "top-2 margin"    # margin 是什么：贪心为 top-2 logit 差，采样为抽样点到区间边界的距离

    def describe(self) -> str:
        if self.equal:
            return f"{self.name}: identical"
        verdict = "accepted (near-tie)" if self.ok else "MISMATCH"
        return (f"{self.name}: {verdict} at output position {self.position}: "
                f"ref {self.ref_token} vs got {self.got_token}, ref {self.measure} {self.margin:.2e}")


def top2_margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


@torch.inference_mode()
def compare(name: str, prompt_ids: list[int], ref: list[int], got: list[int],
            logits_fn: Callable[[list[int]], torch.Tensor], tol: float,
            near_tie: Optional[Callable[[torch.Tensor, list[int], int, int], float]] = None) -> Comparison:
    """logits_fn(ids) -> (len(ids), V)：对 prompt+参考输出做一次 teacher-forcing 前向（整段重算）。
    near_tie(logits, history, pos, token) -> float：参考在输出位置 pos 得到 token 时离打平多远；
    默认（None）是贪心用的 top-2 logit 差，带种子的采样传 step02 的 draw_margin(params)（贪心时它返回 None）。"""
    measure = "top-2 margin" if near_tie is None else "draw margin"
    if ref == got:
        return Comparison(name, True, True)
    n = min(len(ref), len(got))
    pos = next((i for i in range(n) if ref[i] != got[i]), None)
    if pos is None:  # 一条是另一条的前缀：长度不同却没有不同的 token，说明停止逻辑有 bug
        return Comparison(name, False, False, n, float("nan"),
                          ref[n] if len(ref) > n else None, got[n] if len(got) > n else None, measure)
    history = prompt_ids + ref[:pos]
    logits = logits_fn(history)[-1]              # 只需要到分歧位置为止
    margin = top2_margin(logits) if near_tie is None else near_tie(logits, history, pos, ref[pos])
    return Comparison(name, False, margin < tol, pos, margin, ref[pos], got[pos], measure)
