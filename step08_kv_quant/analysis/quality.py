"""有损模式的质量指标：量化后的模型与精确模式比，差了多少（不声称相等，量出来）。

teacher forcing：两边喂同一串 token（提示词 + 精确模式的贪心输出），逐位置比较"预测下一个 token"的 logits：

    top-1 一致率      两边 argmax 相同的位置占比
    |Δ logit|         全部位置、全部词表项上 logits 差的绝对值：平均与最大
    NLL 变化          Σ −log p(下一个真实 token)，量化后比精确多了百分之几（困惑度 = exp(平均 NLL)）

自由生成：两边各自贪心生成，找第一个不同的位置，并给出精确模型在那里的 top-2 logit 差（差越小，越是
"本来就几乎打平、一点扰动就翻"）。
"""
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from common.compare import top2_margin


@dataclass
class Quality:
    """可以相加（pool）的原始量；比值由属性给出。"""
    positions: int            # 比较了几个位置
    agree: int                # 其中 argmax 相同的个数
    sum_abs_dlogit: float     # Σ |Δ logit|，全部位置 × 词表
    num_logits: int           # 位置数 × 词表大小
    max_abs_dlogit: float
    nll_ref: float            # Σ −log p_ref(目标)，单位 nat
    nll_got: float

    @property
    def top1_agreement(self) -> float:
        return self.agree / self.positions

    @property
    def mean_abs_dlogit(self) -> float:
        return self.sum_abs_dlogit / self.num_logits

    @property
    def nll_delta_fraction(self) -> float:
        """(NLL_量化 − NLL_精确) / NLL_精确：正数 = 量化后对真实 token 更没把握。"""
        return (self.nll_got - self.nll_ref) / self.nll_ref

    @property
    def ppl_ref(self) -> float:
        return math.exp(self.nll_ref / self.positions)

    @property
    def ppl_got(self) -> float:
        return math.exp(self.nll_got / self.positions)


def teacher_forced_quality(ref_logits: torch.Tensor, got_logits: torch.Tensor, targets: torch.Tensor) -> Quality:
    """ref_logits / got_logits (T, V)：同一串输入上第 t 个位置的 logits；targets (T,)：第 t 个位置该预测的 token。"""
    if ref_logits.shape != got_logits.shape or ref_logits.shape[0] != targets.shape[0]:
        raise ValueError(f"shapes differ: {tuple(ref_logits.shape)}, {tuple(got_logits.shape)}, {tuple(targets.shape)}")
    ref, got = ref_logits.float(), got_logits.float()
    diff = (got - ref).abs()
    nll = lambda lg: float(F.cross_entropy(lg, targets, reduction="sum"))  # noqa: E731
    return Quality(positions=ref.shape[0], agree=int((ref.argmax(-1) == got.argmax(-1)).sum()),
                   sum_abs_dlogit=float(diff.sum()), num_logits=diff.numel(), max_abs_dlogit=float(diff.max()),
                   nll_ref=nll(ref), nll_got=nll(got))


def pool(qs: list[Quality]) -> Quality:
    """把几段文本的结果合成一个（按位置加权）。"""
    return Quality(sum(q.positions for q in qs), sum(q.agree for q in qs), sum(q.sum_abs_dlogit for q in qs),
                   sum(q.num_logits for q in qs), max(q.max_abs_dlogit for q in qs),
                   sum(q.nll_ref for q in qs), sum(q.nll_got for q in qs))


@dataclass
class Divergence:
    position: Optional[int]      # 第一个不同的输出位置；None = 两条完全相同
    compared: int                # 比较了几个 token（两条里较短的长度）
    margin: Optional[float] = None   # 精确模型在该位置的 top-2 logit 差
    ref_token: Optional[int] = None
    got_token: Optional[int] = None

    def describe(self, name: str) -> str:
        if self.position is None:
            return f"{name}: first {self.compared} greedy tokens identical"
        return (f"{name}: greedy output first differs at position {self.position} of {self.compared} "
                f"(exact {self.ref_token} vs {self.got_token}, exact top-2 margin {self.margin:.3g})")


@torch.inference_mode()
def first_divergence(prompt_ids: list[int], ref: list[int], got: list[int],
                     ref_logits_fn: Callable[[list[int]], torch.Tensor]) -> Divergence:
    """ref_logits_fn(ids) -> (len(ids), V)：精确模型对 ids 的 teacher-forcing 前向（common.cli.Session.full_logits）。"""
    n = min(len(ref), len(got))
    pos = next((i for i in range(n) if ref[i] != got[i]), None)
    if pos is None:
        return Divergence(None, n)
    margin = top2_margin(ref_logits_fn(prompt_ids + ref[:pos])[-1])
    return Divergence(pos, n, margin, ref[pos], got[pos])


@torch.inference_mode()
def forced_logits(model, cache, ids: list[int], num_prompt: int) -> torch.Tensor:
    """按引擎的真实顺序把 ids 喂进 step03 式的缓存（length / advance）：先整段 prefill 前 num_prompt 个，
    再逐个 decode 其余的（每个 token 的 K/V 写进缓存时就被量化）。返回 (len(ids) - 1, V)：第 t 行预测 ids[t + 1]。
    为什么不一次 prefill 全部：block / channel 粒度下"未满的块保持原精度"取决于写入的先后，逐个 decode 才是引擎里发生的事。"""
    if cache.length != 0:
        raise ValueError("forced_logits needs an empty cache")
    dev = model.device
    x = torch.tensor([ids[:num_prompt]], device=dev)                                     # (1, P)
    rows = [model(x, torch.arange(num_prompt, device=dev)[None], cache=cache)[0]]          # (P, V)
    cache.advance(num_prompt)
    for t in range(num_prompt, len(ids) - 1):
        rows.append(model(torch.tensor([[ids[t]]], device=dev), torch.tensor([[t]], device=dev),
                          cache=cache)[0])                                                 # (1, V)
        cache.advance(1)
    return torch.cat(rows)                                                                 # (len(ids) - 1, V)
