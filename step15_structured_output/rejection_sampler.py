"""验证：目标模型对 k 个猜测一次前向，得到 k+1 个位置的 logits，决定留下几个、再补哪一个。

记号：提示词 prompt_ids、已生成 output_ids；猜测 d_1..d_k；logits[i] 是目标模型在 提示词 + 已生成 + d_1..d_i 之后
给出的 logits（位置 0 就是不猜时这一步本来要算的那个）。每个位置都用完整的 step02 处理链得到目标分布 p_i，
接受了的猜测算作已生成的 token（output_ids + d_1..d_i）：惩罚数的次数、min_tokens 数的个数都随之变长——
与一个一个地 decode 时完全相同（所以 min_tokens 之前 EOS / 停止 token 在每个位置都被屏蔽，永远不会被接受）。

贪心：p_i 的 argmax 与 d_{i+1} 相同就接受，继续；第一个不同的位置输出目标的 argmax（更正）然后停；
      k 个全对就再输出位置 k 的 argmax（奖励 token，bonus）。输出与逐个贪心 decode 逐 token 相同。
抽样（Leviathan et al. 2023 / Chen et al. 2023）：d_{i+1} 是从草稿分布 q_i 抽出来的（n-gram 的 q_i 是 one-hot）。
      以 min(1, p_i(d)/q_i(d)) 的概率接受；第一次拒绝时从 normalise(max(p_i − q_i, 0)) 里抽一个作为更正，然后停；
      全部接受就从 p_k 抽奖励 token。这样输出的每个 token 的分布与直接从 p 抽样完全相同（第 09 章有证明）。
随机数都来自这个请求自己的发生器。一次 verify 输出 1..k+1 个 token：接受的猜测 + 一个来自目标的 token。

step15 的结构化输出：logits 进来之前已经铺了语法的掩码（p 在不合法的 token 上为 0），猜测也已在第一个不合法的
token 处截断。截掉的那个猜测本来"必然被拒绝"（p(d) = 0），被拒绝后的更正从 max(p − q, 0) 里抽；截断之后它不见了，
最后那个 token 若照常从 p 抽，输出的分布就偏了（q 放在不合法 token 上的概率，被挪给了草稿本来就猜对的那些 token）。
所以 Proposal.cut_q 带着那个猜测的 q：全部接受之后从 max(p_k − q, 0) 里抽，与不截断时完全相同。
q 是 one-hot（n-gram、贪心）时 max(p − q, 0) 就是 p，没有区别。
"""
import torch

from step02_sampling.sampler import SamplingParams, draw, process_logits, sample

from .proposer import Proposal


def accepts(u: torch.Tensor, p_d: torch.Tensor, q_d: torch.Tensor) -> bool:
    """u ~ U[0, 1)：P(u · q < p) = min(1, p/q)。用严格的 <：p = 0 的 token（被 top-p 等过滤掉的）永远不会被接受。"""
    return bool(u * q_d < p_d)


def leftover(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """被拒绝后的分布 max(p − q, 0)（未归一化，draw 自己归一化）：p 比 q 多出来的那部分概率。
    q 是 one-hot 时就是"p 去掉被拒的那个 token"。"""
    residual = (p - q).clamp_min(0)                    # (V,)
    if not residual.sum() > 0:                          # 只有 p ≈ q 到舍入误差时才会出现：此时从 p 抽就是对的
        return p
    return residual


def verify(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], proposal: Proposal,
           params: SamplingParams, generator: torch.Generator, eos_ids=()) -> list[int]:
    """logits (k+1, V)：目标模型在 k+1 个位置的输出 → 输出的 token（接受的猜测 + 一个更正或奖励 token）。
    eos_ids：会结束这个请求的 EOS（同 sample()，min_tokens 之前屏蔽）。"""
    assert logits.shape[0] == len(proposal.token_ids) + 1, (logits.shape, len(proposal.token_ids))
    logits = logits.float()                            # 模型已经给出 float32（common/model.py）；这里只防别的调用者
    if params.greedy:
        return verify_greedy(logits, prompt_ids, output_ids, proposal.token_ids, params, eos_ids)
    return verify_sampled(logits, prompt_ids, output_ids, proposal, params, generator, eos_ids)


def verify_greedy(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], draft: list[int],
                  params: SamplingParams, eos_ids=()) -> list[int]:
    # 与 step02 的贪心同一个函数 sample()（偏置、惩罚、屏蔽 + argmax，并列时取 id 最小的）；
    # output_ids + out 正是逐个 decode 时的已生成
    out: list[int] = []
    for i, d in enumerate(draft):
        token = sample(logits[i], prompt_ids, output_ids + out, params, None, eos_ids)
        if token != d:
            return out + [token]                        # 第一个不同的位置：目标的 argmax 就是更正
        out.append(d)
    out.append(sample(logits[-1], prompt_ids, output_ids + out, params, None, eos_ids))   # 全部猜对：奖励 token
    return out


def verify_sampled(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], proposal: Proposal,
                   params: SamplingParams, generator: torch.Generator, eos_ids=()) -> list[int]:
    draft, q_all = proposal.token_ids, proposal.draft_probs
    out: list[int] = []
    for i, d in enumerate(draft):
        p = process_logits(logits[i], prompt_ids, output_ids + out, params, eos_ids).softmax(-1)   # (V,)：目标 p_i
        if q_all is None:
            q = torch.zeros_like(p)                                               # (V,)：确定性的猜测，q_i 是 one-hot
            q[d] = 1.0
        else:
            q = q_all[i].to(p)                                                    # (V,)：草稿分布 q_i
        u = torch.rand((), generator=generator, device=p.device)
        if accepts(u, p[d], q[d]):
            out.append(d)
            continue
        out.append(draw(leftover(p, q), generator))     # 被拒绝：从剩下的概率里抽一个更正
        return out
    if proposal.cut_q is not None:   # step15：第 k+1 个猜测被语法截掉了：它必然被拒绝，更正从 max(p_k − q, 0) 抽
        p = process_logits(logits[-1], prompt_ids, output_ids + out, params, eos_ids).softmax(-1)   # (V,)
        out.append(draw(leftover(p, proposal.cut_q.to(p)), generator))
        return out
    # 全部接受：奖励 token 照常从 p_k 抽
    out.append(sample(logits[-1], prompt_ids, output_ids + out, params, generator, eos_ids))
    return out
