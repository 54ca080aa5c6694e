"""展平的前向（varlen）：这一步所有请求的新 token 排成一行，没有填充。

step05/06 的一次前向是一个左填充的 (B, L) 批：decode 与 prefill 不能混在一起（一行 1 个 token 的 decode 会被
补齐到 L），prefill 行之间也要补齐到最长的那行。step07 一步里既有 decode（每个 1 个 token），又有 prefill 的块
（各几十个 token），于是把它们首尾相接排成 (1, T) 的一行，T = 全部新 token 数：

    行:   [d0 d1 d2 | a5 a6 a7 a8 | b0 b1 b2]      d = 三个 decode；a = 一个提示词的第 5..8 个 token（前 5 个已在池子里）；
    位置: [37 12 90 |  5  6  7  8 |  0  1  2]      b = 另一个提示词的第一块

线性层、MLP、RMSNorm、RoPE 对每个 token 各算各的，一行 T 个 token 与 (B, L) 里的 T 个真实 token 算的完全一样，
只是不再为填充付钱。只有注意力要知道"谁跟谁是一个请求"：FlashAttention 的 varlen 接口用 cu_seqlens
（每个请求在这一行里的起止下标）告诉内核；这里用同样的思路，按段来做（FlatForward.attend）：

  - decode 段：所有 decode 一起，每个 1 个 query，正是 step05 的 decode 批（按块表读回自己的 K/V，按位置遮）；
  - 每个 prefill 块一段：1 行 L 个 query，看自己已缓存的前缀（从池子读）+ 自己这 L 个新 K/V，带偏移的因果掩码。

每一段就是一次 step05 的 PagedForward（PagedKVCache.plan 给出，num_new_tokens 指定块的长度），写 K/V、读 K/V、
掩码都与 step05 相同；新的只是"几段共用一行的矩阵乘"。为什么不把所有段拼成一个 (T × ΣS) 的块对角掩码：
那样每个 query 都要和所有请求的 key 算分数再遮掉，分数的量随段数平方增长（varlen_bench.py 量了三种做法）。
"""
from dataclasses import dataclass

import torch

from common.kv_cache import KVCache
from common.model import attention
from step05_paged.paged_cache import PagedForward, PagedKVCache


@dataclass
class FlatForward(KVCache):
    """一次展平前向的全部地址信息。模型照常调用 cache.attend(layer_idx, q, k, v)，形状是 (1, heads, T, D)。"""
    segments: list[PagedForward]   # 按在行里的顺序：先是全部单 token 的（decode）一段，再是每个 prefill 块一段
    input_ids: torch.Tensor        # (1, T)  各段的新 token 首尾相接
    positions: torch.Tensor        # (1, T)  每个 token 在它自己的请求里的位置
    logits_index: torch.Tensor     # (R,)    要采样的请求（这次算到了它的最后一个 token）的最后一个 token 在行里的下标
    mask = None                    # 掩码在每一段上（segment.mask）；KVCache 接口里的这一项不用

    @property
    def num_tokens(self) -> int:
        """这一行里真实 token 的个数（各段 plan 出来的 token_index 之和；没有填充时 = T）。"""
        return sum(len(seg.token_index) for seg in self.segments)

    @property
    def gather_bytes(self) -> int:
        return sum(seg.gather_bytes for seg in self.segments)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, T, D)，k/v (1, H_kv, T, D) → (1, H, T, D)：每一段各自写入、读回、算注意力，再按原顺序拼回一行。"""
        outs, start = [], 0
        for seg in self.segments:
            B, L = seg.input_ids.shape               # decode 段：B 个请求各 1 个；prefill 块：1 个请求 L 个
            span = slice(start, start + B * L)
            # (1, heads, T, D) 里属于这一段的 B·L 个位置 -> (heads, B, L, D) -> (B, heads, L, D)：step05 的批形状（视图）
            qs, ks, vs = (x[0, :, span].unflatten(1, (B, L)).transpose(0, 1) for x in (q, k, v))
            k_all, v_all = seg.update(layer_idx, ks, vs)               # 写进池子；取回这一段要看的 K/V (B, H_kv, S, D)
            out = attention(qs, k_all, v_all, seg.mask)                # (B, H, L, D)
            outs.append(out.transpose(0, 1).flatten(1, 2))             # (B, H, L, D) -> (H, B, L, D) -> (H, B·L, D)
            start += B * L
        return torch.cat(outs, dim=1)[None]                            # (H, T, D) -> (1, H, T, D)


def plan_flat(cache: PagedKVCache, seqs, num_new_tokens: list[int]) -> FlatForward:
    """seqs[i] 这一步算 num_new_tokens[i] 个 token（从它的 num_cached_tokens 起）。只算 1 个的并成一段
    （decode，或 prefill 恰好只分到 1 个 token：注意力的做法相同），其余每个一段。算到最后一个 token 的请求要采样，
    它们按 seqs 里的顺序给出 logits_index。"""
    singles = [i for i, n in enumerate(num_new_tokens) if n == 1]
    groups = ([singles] if singles else []) + [[i] for i, n in enumerate(num_new_tokens) if n > 1]
    segments = [cache.plan([seqs[i] for i in g], [num_new_tokens[i] for i in g]) for g in groups]
    last, start = {}, 0                              # 请求 i 的最后一个新 token 在行里的下标
    for g, seg in zip(groups, segments):
        B, L = seg.input_ids.shape
        for row, i in enumerate(g):
            last[i] = start + row * L + L - 1
        start += B * L
    sampling = [last[i] for i, (seq, n) in enumerate(zip(seqs, num_new_tokens))
                if seq.num_cached_tokens + n == seq.num_tokens]
    dev = cache.pool.device
    return FlatForward(segments,
                       torch.cat([seg.input_ids.flatten() for seg in segments])[None],      # (1, T)
                       torch.cat([seg.positions.flatten() for seg in segments])[None],      # (1, T)
                       torch.tensor(sampling, dtype=torch.long, device=dev))
