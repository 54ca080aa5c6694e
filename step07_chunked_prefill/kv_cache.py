"""分页 KV cache：所有请求共用一个按块划分的池子，每个请求用块表找到自己的块；每一步的新 token 展平成一行。

池子  pool: (layers, 2, num_blocks + 1, H_kv, block_size, D)  —— 第二维 0 = K，1 = V；一块 = 每个头 block_size 个位置
槽号  slot = 物理块号 × block_size + 块内偏移              —— 把池子看成 num_blocks·block_size 个"槽"
一个 token 在序列里的逻辑位置 p 落在第 p // block_size 个逻辑块、块内第 p % block_size 个槽，
逻辑块经块表 block_table 映射到物理块。

step07：展平的前向（varlen）。一步里既有 decode（每个 1 个 token），又有 prefill 的块（各几十个 token），
每次前向之前引擎调用 plan(seqs, num_new_tokens)，把它们首尾相接排成 (1, T) 的一行，T = 全部新 token 数，没有填充：

    行:   [d0 d1 d2 | a5 a6 a7 a8 | b0 b1 b2]      d = 三个 decode；a = 一个提示词的第 5..8 个 token（前 5 个已在池子里）；
    位置: [37 12 90 |  5  6  7  8 |  0  1  2]      b = 另一个提示词的第一块

plan 直接排出这一行的全部地址信息（FlatAttentionMetadata，nano-vllm 的 prepare_prefill / prepare_decode 做的事）：
input_ids、positions、slot_mapping（每个新 token 的 K/V 写到哪个槽）、每个请求的块表、key 数（seq_lens）与
query 数（query_lens）、要算 logits 的下标（logits_index），以及每个请求在 logits 里占哪几行（logits_rows：
引擎按它采样，不用再判断谁这一步算完了）。引擎把它当作 cache 传给模型（common/kv_cache.py 的接口）。

线性层、MLP、RMSNorm、RoPE 对每个 token 各算各的，一行 T 个 token 与 (B, L) 里的 T 个真实 token 算的完全一样，
只是不再为填充付钱。只有注意力要知道"谁跟谁是一个请求"：FlashAttention 的 varlen 接口用 cu_seqlens（每个请求
在这一行里的起止下标）告诉内核。attention="paged"（默认）时整行写进池子、只调用一次内核：每个请求的 query 在行里
首尾相接，内核拿到每个请求的 query 数和 key 数（FlashAttention 的 cu_seqlens_q / seqused_k 就是这两样），按各自的
块表读池子，第 i 个 query 只看位置不超过它的 key——decode 与 prefill 的块是同一种情况，只是 query 数不同。

--attention gather 是可读的参考（gather.py）：全部 decode 一段、每个 prefill 块一段，每一段是 step05/06 的一次
前向（按块表把块拷成连续的 K/V、按位置的掩码），两条路算的是同一个数（测试逐位置对照）。为什么不把所有段拼成一个
(T × ΣS) 的块对角掩码：那样每个 query 都要和所有请求的 key 算分数再遮掉，分数的量随段数平方增长
（analysis/varlen_bench.py 量了几种做法）。

池子比分配器管的块多一块：最后一块是空块（null block），从不分给任何请求，块表较短的请求补齐时指向它。
池子本身不记"当前这次前向"。
"""
from dataclasses import dataclass
from typing import Optional

import torch

from common.config import ModelConfig
from common.kv_cache import KVCache
from step05_paged.paged_attention import kernel_available, paged_attention

from .gather import AttentionMetadata, attend_segments, plan_segments

ATTENTION_CHOICES = ("paged", "gather")


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device, dtype, attention: str = "paged"):
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}")
        self.num_blocks, self.block_size, self.attention = num_blocks, block_size, attention
        self.H_kv, self.D = cfg.num_kv_heads, cfg.head_dim
        # 块内按头排 (H_kv, block_size, D)：同一个头、同一块的 block_size 个位置是一段连续内存，
        # 按 (请求, 头, 逻辑块) 的顺序把这些段拼起来，得到的正好是连续的 (B, H_kv, S, D)——与 step03 的缓存
        # 一样每个头一整块 S×D，注意力的矩阵乘顺序读。若按 (block_size, H_kv, D) 存，取回后还要 transpose，
        # 变成跨步读（docs/05_paged.md 第 3 节）。
        # 用 zeros 而不是 empty：没写过的槽是 0，出 bug 时结果可复现（正确性不靠它：读回后长度之外的位置都被遮住、清零）。
        self.pool = torch.zeros(cfg.num_layers, 2, num_blocks + 1, self.H_kv, block_size, self.D,
                                device=device, dtype=dtype)
        self.null_block = num_blocks   # 多出来的最后一块：从不分配，只给块表补齐用
        if attention == "paged" and torch.device(device).type == "cpu" and dtype == torch.float32:
            kernel_available()         # 第一次用时编译（或从缓存加载）内核：编译不算进第一次前向的时间

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return block_size * cfg.kv_bytes_per_token(dtype.itemsize)

    def plan(self, seqs, num_new_tokens: list[int]) -> "FlatAttentionMetadata":
        """seqs[i] 这一步算 num_new_tokens[i] 个 token（从它的 num_computed_tokens 起），排成一行 (1, T)。
        只算 1 个的（decode，或 prefill 恰好只分到 1 个 token）排在行首，其余（prefill 的块）依次接在后面
        （gather 读法按这个顺序切段）。算到最后一个 token 的请求要采样：logits_index 按 seqs 的顺序给出它的
        最后一个 token 在行里的下标，logits_rows[i] 是 seqs[i] 在模型返回的 logits 里的行（不采样的为空）。
        调度器负责让块表覆盖到要算的最后一个位置；没覆盖到说明调度器有 bug，这里给出清楚的错误。"""
        bs, dev = self.block_size, self.pool.device
        order = [i for i, n in enumerate(num_new_tokens) if n == 1] + [i for i, n in enumerate(num_new_tokens) if n > 1]
        input_ids, positions, slots, tables, seq_lens, start = [], [], [], [], [], {}
        for i in order:
            seq, n = seqs[i], num_new_tokens[i]
            computed, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if not computed < end <= seq.num_tokens:
                raise RuntimeError(f"cannot compute {n} new tokens of a sequence with {computed} of "
                                   f"{seq.num_tokens} tokens computed")
            if end > len(seq.block_table) * bs:
                raise RuntimeError(f"block table of {len(seq.block_table)} blocks x {bs} slots does not cover "
                                   f"position {end - 1}: the scheduler must allocate blocks first")
            # 只用到这次要算的最后一个位置所在的块（一个提示词的块在接纳时一次分好，分块 prefill 的前几块用不到后面的块）
            table = seq.block_table[:-(-end // bs)]
            start[i] = len(input_ids)                                  # 这个请求的 token 在行里从这里开始
            input_ids += seq.token_ids[computed:end]
            positions += range(computed, end)                          # 每个 token 在它自己的请求里的位置
            slots += [table[p // bs] * bs + p % bs for p in range(computed, end)]   # 逻辑位置 → 物理槽
            tables.append(table)
            seq_lens.append(end)
        width = max(map(len, tables))
        logits_index, logits_rows = [], []
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            k = 1 if seq.num_computed_tokens + n == seq.num_tokens else 0            # 采样的请求：它的最后一个 token
            logits_rows.append(range(len(logits_index), len(logits_index) + k))
            logits_index += range(start[i] + n - k, start[i] + n)

        def tensor(x, dtype=torch.long):
            return torch.tensor(x, dtype=dtype, device=dev)
        flat = FlatAttentionMetadata(
            self.pool, tensor([input_ids]), tensor([positions]), tensor(slots),
            tensor([t + [self.null_block] * (width - len(t)) for t in tables], torch.int32),   # 较短的块表用空块补齐
            tensor(seq_lens, torch.int32), tensor([num_new_tokens[i] for i in order], torch.int32),
            tensor(logits_index), logits_rows)
        if self.attention == "gather":   # 参考读法：按段 gather（gather.py）
            flat.segments = plan_segments(self, seqs, num_new_tokens)
        return flat


@dataclass
class FlatAttentionMetadata(KVCache):
    """一次前向的全部地址信息（vLLM 叫 attention metadata；nano-vllm 把它放在全局 context 里，我们显式传给模型）。
    模型照常调用 cache.attend(layer_idx, q, k, v)，形状是 (1, heads, T, D)。R = 行里的请求数，按行里的顺序。"""
    pool: torch.Tensor            # (layers, 2, num_blocks + 1, H_kv, block_size, D) 整个池子（视图，不复制）
    input_ids: torch.Tensor       # (1, T)  各请求的新 token 首尾相接，没有填充
    positions: torch.Tensor       # (1, T)  每个 token 在它自己的请求里的位置
    slot_mapping: torch.Tensor    # (T,)    行里第 t 个 token 的 K/V 写到池子的哪个槽
    block_tables: torch.Tensor    # (R, max_blocks) int32  每个请求的块表；较短的用空块补齐
    seq_lens: torch.Tensor        # (R,) int32  这次前向之后每个请求有几个 key
    query_lens: torch.Tensor      # (R,) int32  每个请求在行里有几个 query（首尾相接）
    logits_index: torch.Tensor    # (n,)    要采样的请求的最后一个 token 在行里的下标，按 plan 的 seqs 的顺序
    logits_rows: list[range]      # 与 plan 的 seqs 一一对应：它在 logits（n 行）里的行；这一步不采样的为空
    segments: Optional[list[AttentionMetadata]] = None   # 只在 --attention gather 时有：按段读（gather.py）
    mask = None                   # paged 不用掩码；gather 的掩码在每一段上

    @property
    def gather_bytes(self) -> int:
        return sum(seg.gather_bytes for seg in self.segments or ())

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, T, D)，k/v (1, H_kv, T, D) → (1, H, T, D)。paged：整行写进池子、一次内核调用；
        gather：每一段各自写入、读回、算注意力，再按原顺序拼回一行（gather.py）。"""
        if self.segments is not None:
            return attend_segments(self.segments, layer_idx, q, k, v)
        layer = self.pool[layer_idx]
        bs = layer.shape[3]
        block, offset = self.slot_mapping // bs, self.slot_mapping % bs           # (T,), (T,)
        for kv, new in ((0, k), (1, v)):
            layer[kv, block, :, offset] = new[0].transpose(0, 1)                 # (1, H_kv, T, D) -> (T, H_kv, D)
        out = paged_attention(q[0].transpose(0, 1), layer[0], layer[1], self.block_tables, self.seq_lens,
                              self.query_lens)                                     # (T, H, D)
        return out.transpose(0, 1)[None]                                           # (T, H, D) -> (1, H, T, D)
