"""检查采样器的分布：HF transformers 的参考实现 + 总变差距离 (TV) 及其上界。run.py 与测试共用。"""
import math

import torch

from step02_sampling.sampler import SamplingParams


def hf_processors(params: SamplingParams) -> list:
    """用 HF transformers 自己的 logits 处理器（不是我们写的）组成参考处理链，顺序同 HF generate：
    重复惩罚 → 温度 → top-k → top-p → min-p（见 transformers/generation/utils.py 的 _get_logits_processor）。"""
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    procs = []
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
    procs.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k > 0:
        procs.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        procs.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        procs.append(MinPLogitsWarper(params.min_p))
    return procs


@torch.inference_mode()
def hf_filtered_probs(logits: torch.Tensor, history: list[int], params: SamplingParams) -> torch.Tensor:
    """logits (V,) → HF 处理链之后的理论分布 (V,)；被过滤的 token 概率为 0。"""
    input_ids = torch.tensor([history], device=logits.device)   # (1, T)：HF 的处理器按批次工作
    scores = logits[None].clone()                               # (1, V)
    for proc in hf_processors(params):
        scores = proc(input_ids, scores)
    return scores[0].softmax(-1)


def binned(probs: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
    """把分布 (V,) 按 bins（若干 token id）分组：每个 token 一组，其余所有 token 合成最后一组 "其他"。"""
    head = probs[bins]                                       # (M,)
    return torch.cat([head, (probs.sum() - head.sum()).clamp(min=0)[None]])   # (M+1,)


def top_bins(theory: torch.Tensor, max_bins: int = 50) -> torch.Tensor:
    """理论概率最大的（至多）max_bins 个 token：尾部成千上万个小概率 token 合成一组，
    否则 N 次抽样根本估不准它们，TV 的噪声会大到没有意义。"""
    m = min(max_bins, int((theory > 0).sum()))
    return theory.topk(m).indices


def empirical_probs(draws: list[int], vocab_size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(draws), minlength=vocab_size).double() / len(draws)   # (V,)


def tv_distance(p: torch.Tensor, q: torch.Tensor) -> float:
    """总变差距离 TV(p, q) = ½ Σ |p_i - q_i| = 任何事件的概率最多能差多少。"""
    return 0.5 * float((p.double() - q.double()).abs().sum())


def tv_bound(theory_binned: torch.Tensor, n: int, delta: float = 1e-6) -> float:
    """正确的采样器抽 n 次时，分组后的经验 TV 超过这个值的概率 < delta：
    E[TV] ≤ ½ Σ sqrt(p(1-p)/n)（Jensen），而改变一次抽样最多让 TV 变 1/n，
    由 McDiarmid 不等式 P(TV ≥ E[TV] + t) ≤ exp(-2 n t²)，取 t = sqrt(ln(1/delta) / 2n)。"""
    p = theory_binned.double()
    return 0.5 * float((p * (1 - p) / n).sqrt().sum()) + math.sqrt(math.log(1 / delta) / (2 * n))
