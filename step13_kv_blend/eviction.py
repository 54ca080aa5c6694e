"""KV 驱逐的策略：一个请求的 KV 超出预算时留哪些槽、给槽打的分、挪了槽的 key 怎么重新旋转。

这里只有纯函数（张量进、张量出），不碰池子、块表和调度：引擎在每次前向之后调用 kept_slots 选出要留的槽，
kv_cache.py 的 compact 把它们搬进新分到的块（旧块还回池子：内存真的空出来），挪了位置的 key 用 rerotate 转到新位置。

一个请求的槽 0..S-1 按原文顺序存着它还留着的 token（每层、每个 KV 头各一套：h2o / snapkv 每个头留的可以不同）。
预算 B = 每层每个头留几个；压缩后正好 B 个，新 token 接着往后写。要留的槽（每层、每个头，升序）：

    window   最后 B 个                                   （最简单的基线：开头的 token 一走就崩）
    sinks    槽 0..S-1（注意力的"汇"）+ 最后 B-S 个       （StreamingLLM）
    h2o      最后 R 个 + 其余槽里累计注意力最多的 B-R 个   （H2O：heavy hitter + recent）
    snapkv   最后 w 个 + 其余槽里投票（最大池化后）最高的 B-w 个   （SnapKV：提示词最后 w 个 token 投票；
             snapkv-chunked 同一条规则，只是每块 prefill 各投各的）

分数一样时留靠前的槽（稳定排序）。打分本身（softmax(q·Kᵀ/√D) 按 KV 组求和）在 kv_cache.py 的 attend 里做：
融合的注意力内核从不把概率写出来，所以要分数的请求再读一遍自己的 K 算一遍。

重新旋转（kv_positions = cache，StreamingLLM 的做法）：RoPE 把位置 p 的 key 转了角度 p·θ。key 从槽 o 挪到槽 n，
要的是 R(n)·k，手里有的是 R(o)·k；旋转可以相加，R(n)·k = R(n − o)·R(o)·k，所以再转一个角度 (n − o)·θ 就行
（n < o，转回去一点）。V 没有位置，不转；text 位置下 key 保留原文位置，什么也不转。
"""
import torch
import torch.nn.functional as F

from common.model import rotate_half


def kept_slots(policy: str, kv_len: int, budget: int, num_layers: int, num_kv_heads: int, *, sinks: int = 0,
               recent: int = 0, scores: torch.Tensor | None = None, pool_kernel: int = 1) -> torch.Tensor:
    """kv_len 个槽里留 budget 个：返回 (layers, H_kv, budget) 的槽号，每行升序。
    scores (layers, H_kv, ≥ kv_len)：h2o 的累计分数，或 snapkv / snapkv-chunked 的投票（此时 recent = 观察窗口 w）。"""
    L, H, B = num_layers, num_kv_heads, budget
    if policy == "window":
        keep = torch.arange(kv_len - B, kv_len)
    elif policy == "sinks":
        keep = torch.cat([torch.arange(sinks), torch.arange(kv_len - (B - sinks), kv_len)])
    else:
        return top_slots(scores[:, :, :kv_len - recent], B - recent, kv_len, recent, pool_kernel)
    return keep.expand(L, H, B).to(scores.device if scores is not None else "cpu")


def top_slots(scores: torch.Tensor, k: int, kv_len: int, recent: int, pool_kernel: int = 1) -> torch.Tensor:
    """h2o / snapkv：最后 recent 个槽全留，其余槽（scores (layers, H_kv, kv_len − recent)）按分数留 k 个。
    pool_kernel > 1（snapkv）：先做一维最大池化（步长 1、两边补 k//2），一个高分的槽把邻居也带上，留下的是成片的上下文。
    返回 (layers, H_kv, k + recent) 的槽号，每行升序。"""
    L, H, n = scores.shape
    if pool_kernel > 1:
        scores = F.max_pool1d(scores.reshape(L * H, 1, n), pool_kernel, stride=1,
                              padding=pool_kernel // 2).reshape(L, H, n)   # (L·H, 1, n) -> 同形状
    # 稳定排序 −分数：分数一样时槽号小的在前
    top = torch.sort(-scores, dim=-1, stable=True).indices[..., :k]                    # (L, H, k)
    tail = torch.arange(kv_len - recent, kv_len, device=scores.device).expand(L, H, recent)   # (L, H, recent)
    return torch.cat([top, tail], dim=-1).sort(dim=-1).values                           # (L, H, k + recent)


def rotation_deltas(kept: torch.Tensor) -> torch.Tensor:
    """kept (layers, H_kv, B)：第 n 个留下的槽挪到槽 n，转角度 (n − 原槽号)·θ。返回同形状的 n − o（≤ 0）。"""
    return torch.arange(kept.shape[-1], device=kept.device) - kept


def rerotate(k: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """k (..., D)：已经按旧位置转过的 key；delta (...)：每个 key 要再挪多少位置 → R(delta)·k，同形状同 dtype。
    与 common/model.py 的 apply_rope 同一个 rotate_half 写法，在 float32 里算。"""
    freqs = delta[..., None].float() * inv_freq.to(k.device)          # (..., 1) * (D/2,) -> (..., D/2)
    emb = torch.cat((freqs, freqs), dim=-1)                            # (..., D)：前后两半共用同一组角度
    x = k.float()
    return (x * emb.cos() + rotate_half(x) * emb.sin()).to(k.dtype)


def attention_scores(q: torch.Tensor, k: torch.Tensor, num_voters: int) -> torch.Tensor:
    """一个请求的注意力概率按 KV 组求和：q (H, n, D) 是它这次前向的 n 个 query（已做 RoPE），k (H_kv, S, D) 是它
    全部 S 个槽的 key（含这次新写的）。query i 在槽 S − n + i，只看槽 ≤ 它的（与内核同一条因果规则）。
    只用最后 num_voters 个 query；返回 (H_kv, S) float32：每个槽从这些 query、同组的 query 头得到的概率之和。"""
    H, n, D = q.shape
    H_kv, S = k.shape[0], k.shape[1]
    G, m = H // H_kv, num_voters
    qv = q[:, n - m:].float().reshape(H_kv, G * m, D)                  # (H, m, D) -> (H_kv, G·m, D)：query 头 h 用 KV 头 h // G
    s = qv @ k.float().transpose(1, 2) / D ** 0.5                      # (H_kv, G·m, D) x (H_kv, D, S) -> (H_kv, G·m, S)
    slot = torch.arange(S, device=q.device)
    own = S - m + torch.arange(m, device=q.device)                     # (m,) 每个投票的 query 自己的槽
    visible = slot[None, :] <= own[:, None]                            # (m, S)
    s = s.view(H_kv, G, m, S).masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1).sum(dim=(1, 2))                    # (H_kv, G, m, S) -> (H_kv, S)
