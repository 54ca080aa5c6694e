"""分页 KV cache：所有请求共用一个按块划分的池子，每个请求用块表找到自己的块。

池子  pool: (layers, 2, num_blocks + 1, H_kv, block_size, D)  —— 第二维 0 = K，1 = V；一块 = 每个头 block_size 个位置
槽号  slot = 物理块号 × block_size + 块内偏移              —— 把池子看成 num_blocks·block_size 个"槽"
一个 token 在序列里的逻辑位置 p 落在第 p // block_size 个逻辑块、块内第 p % block_size 个槽，
逻辑块经块表 block_table 映射到物理块。

每次前向之前，引擎调用 plan(seqs)，得到这次前向的 PagedForward：这一批请求要算的新 token 排成左填充的
(B, L) 张量，算好 slot_mapping（每个真实新 token 的 K/V 写到哪个槽）、块表和 gather 用的行号、按位置的掩码。
引擎把它当作 cache 传给模型（common/kv_cache.py 的接口：update + mask），模型的每一层调用
update(layer_idx, k, v)：按 slot_mapping 写入新 K/V，再按块表把每个请求的全部 K/V 取回成
(B, H_kv, S, D)——与 step03 的连续缓存返回的形状相同，模型代码一行不改。池子本身不记"当前这次前向"。

池子比分配器管的块多一块：最后一块是空块（null block），从不分给任何请求。块表较短的行补齐时指向它，
这样填充读到的永远不是别人的块。

真正的 PagedAttention 内核在注意力计算里直接按块表读块，不需要先拼成连续张量；这里用纯 PyTorch
先 gather 再交给模型里现成的注意力，多一次拷贝，但在 CPU 和 CUDA 上是同一份代码。
"""
from dataclasses import dataclass

import torch

from common.config import ModelConfig
from common.kv_cache import KVCache


@dataclass
class PagedForward(KVCache):
    """一次前向的全部"地址"信息（nano-vllm 把它放在全局 context 里；我们显式传给模型）。"""
    pool: torch.Tensor          # (layers, 2, num_blocks + 1, H_kv, block_size, D) 整个池子（视图，不复制）
    input_ids: torch.Tensor     # (B, L)  每行是该请求还没进缓存的 token，左填充
    positions: torch.Tensor     # (B, L)  这些 token 的绝对位置；填充处为 0
    mask: torch.Tensor          # (B, 1, 1, L, S) True = 可以看
    token_index: torch.Tensor   # (N,)    真实 token 在展平的 B·L 里的下标（跳过填充）
    slot_mapping: torch.Tensor  # (N,)    第 n 个真实 token 的 K/V 写到池子的哪个槽
    block_tables: torch.Tensor  # (B, max_blocks) 每行的块表；较短的行用空块补齐（补出来的 key 都被 mask 遮住）
    gather_rows: torch.Tensor   # (B·H_kv·max_blocks,) 按块表读回时，池子 ((num_blocks+1)·H_kv, block_size·D) 视图的行号

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """k, v: (B, H_kv, L, D) 本次的新 K/V（已做 RoPE）→ 写进池子，返回全部 K/V 各 (B, H_kv, S, D)。"""
        B, H_kv, L, D = k.shape
        bs = self.pool.shape[4]
        block, offset = self.slot_mapping // bs, self.slot_mapping % bs          # (N,), (N,)
        out = []
        for kv, new in ((0, k), (1, v)):
            cache = self.pool[layer_idx, kv]                                     # (num_blocks+1, H_kv, block_size, D)：视图
            new = new.transpose(1, 2).reshape(B * L, H_kv, D)                    # (B, H_kv, L, D) -> (B·L, H_kv, D)
            cache[block, :, offset] = new[self.token_index]                      # 只写真实 token：(N, H_kv, D) 写进各自的槽
            rows = cache.view(-1, bs * D).index_select(0, self.gather_rows)      # (B·H_kv·max_blocks, block_size·D)：拷贝
            out.append(rows.view(B, H_kv, -1, D))                                # (B, H_kv, S, D)，连续
        return out[0], out[1]


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device, dtype):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.H_kv, self.D = cfg.num_kv_heads, cfg.head_dim
        # 块内按头排 (H_kv, block_size, D)：同一个头、同一块的 block_size 个位置是一段连续内存，
        # 按 (请求, 头, 逻辑块) 的顺序把这些段拼起来，得到的正好是连续的 (B, H_kv, S, D)——与 step03 的缓存
        # 一样每个头一整块 S×D，注意力的矩阵乘顺序读。若按 (block_size, H_kv, D) 存，取回后还要 transpose，
        # 变成跨步读（docs/05_paged.md 里量过两种布局）。
        # 用 zeros 而不是 empty：gather 会读到没写过的槽（随后被 mask 成概率 0），
        # 未初始化的内存里可能恰好是 NaN/inf，而 0 × NaN = NaN 会污染输出。
        self.pool = torch.zeros(cfg.num_layers, 2, num_blocks + 1, self.H_kv, block_size, self.D,
                                device=device, dtype=dtype)
        self.null_block = num_blocks   # 多出来的最后一块：从不分配，只给块表补齐用

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return block_size * cfg.kv_bytes_per_token(dtype.itemsize)

    def plan(self, seqs) -> PagedForward:
        """seqs 里每个请求：位置 num_cached_tokens .. num_tokens-1 的 token 要算（prefill：整段；decode：1 个）。
        调度器负责让块表覆盖到 num_tokens-1；没覆盖到说明调度器有 bug，这里给出清楚的错误。"""
        bs, dev = self.block_size, self.pool.device
        for seq in seqs:
            if seq.num_tokens > len(seq.block_table) * bs:
                raise RuntimeError(f"block table of {len(seq.block_table)} blocks x {bs} slots does not cover "
                                   f"position {seq.num_tokens - 1}: the scheduler must allocate blocks first")
        news = [seq.token_ids[seq.num_cached_tokens:] for seq in seqs]
        B, L = len(seqs), max(len(t) for t in news)
        max_blocks = max(len(seq.block_table) for seq in seqs)
        input_ids = torch.zeros(B, L, dtype=torch.long)
        positions = torch.zeros(B, L, dtype=torch.long)
        block_tables = torch.full((B, max_blocks), self.null_block, dtype=torch.long)
        token_index, slots = [], []
        for i, (seq, new) in enumerate(zip(seqs, news)):
            pad = L - len(new)                                   # 左填充：真实 token 靠右，last_only 取到的就是最后一个真实 token
            start = seq.num_cached_tokens
            input_ids[i, pad:] = torch.tensor(new)
            positions[i, pad:] = torch.arange(start, start + len(new))
            block_tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table)
            for j, p in enumerate(range(start, start + len(new))):
                token_index.append(i * L + pad + j)
                slots.append(seq.block_table[p // bs] * bs + p % bs)  # 逻辑位置 → 物理槽
        S = max_blocks * bs
        # 第 (b, h, j) 段 = 物理块 block_tables[b, j] 的第 h 个头 → 视图 (num_blocks·H_kv, block_size·D) 的第 块号·H_kv + h 行
        heads = torch.arange(self.H_kv)
        gather_rows = (block_tables[:, None, :] * self.H_kv + heads[None, :, None]).flatten()  # (B, H_kv, max_blocks) 展平
        # 按绝对位置的因果掩码：位置 p 的 query 只看位置 ≤ p 的 key。块表里还没写（或补齐出来）的槽，
        # 位置都 > 该行任何真实 query 的位置，自然被遮住；填充的 query 位置为 0，只看 key 0，不会整行全遮。
        key_pos = torch.arange(S)
        mask = key_pos[None, None, :] <= positions[:, :, None]   # (B, L, S)
        return PagedForward(self.pool, input_ids.to(dev), positions.to(dev), mask[:, None, None].to(dev),  # (B, 1, 1, L, S)
                            torch.tensor(token_index, device=dev), torch.tensor(slots, device=dev),
                            block_tables.to(dev), gather_rows.to(dev))
