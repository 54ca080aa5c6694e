"""检查采样器的分布：HF transformers 的参考实现 + 总变差距离 (TV) 及其上界。run.py 与测试共用。"""
import math
from collections import Counter

import torch

from step02_sampling.sampler import SamplingParams


def openai_penalties(num_prompt: int, presence: float, frequency: float):
    """HF 没有 presence / frequency 惩罚：按 OpenAI 文档的定义逐个 token 写出来（不是 sampler 里 bincount 的写法），
    接口与 HF 的处理器相同 (input_ids, scores) → scores。只数 input_ids 里提示词之后的部分（已生成的 token）。"""
    def proc(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = scores.clone()
        for t, c in Counter(input_ids[0, num_prompt:].tolist()).items():
            out[0, t] -= c * frequency + (1 if c > 0 else 0) * presence
        return out
    return proc


def hf_processors(params: SamplingParams, num_prompt: int = 0, eos_ids=()) -> list:
    """用 HF transformers 自己的 logits 处理器（不是我们写的）组成参考处理链，顺序同 HF generate：
    logit_bias（SequenceBias）→ 重复惩罚 → [presence/frequency，HF 没有，按定义] → min_tokens（MinNewTokensLength）
    → 温度 → top-k → top-p → min-p（见 transformers/generation/utils.py 的 _get_logits_processor）。"""
    from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                        RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    procs = []
    if params.logit_bias:
        procs.append(SequenceBiasLogitsProcessor([[[t], float(b)] for t, b in params.logit_bias.items()]))
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
    if params.presence_penalty != 0 or params.frequency_penalty != 0:
        procs.append(openai_penalties(num_prompt, params.presence_penalty, params.frequency_penalty))
    end_ids = sorted({*eos_ids, *params.stop_token_ids})
    if params.min_tokens > 0 and end_ids:
        procs.append(MinNewTokensLengthLogitsProcessor(num_prompt, params.min_tokens, end_ids))
    procs.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k > 0:
        procs.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        procs.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        procs.append(MinPLogitsWarper(params.min_p))
    return procs


@torch.inference_mode()
def hf_filtered_probs(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], params: SamplingParams,
                      eos_ids=()) -> torch.Tensor:
    """logits (V,) → HF 处理链之后的理论分布 (V,)；被过滤的 token 概率为 0。参数与 sampler.process_logits 相同。"""
    input_ids = torch.tensor([list(prompt_ids) + list(output_ids)], device=logits.device)   # (1, T)：HF 的处理器按批次工作
    scores = logits[None].clone()                               # (1, V)
    for proc in hf_processors(params, len(prompt_ids), eos_ids):
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
