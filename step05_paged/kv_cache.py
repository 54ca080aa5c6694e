"""分页 KV cache：所有请求共用一个按块划分的池子，每个请求用块表找到自己的块。

池子  pool: (layers, 2, num_blocks + 1, H_kv, block_size, D)  —— 第二维 0 = K，1 = V；一块 = 每个头 block_size 个位置
槽号  slot = 物理块号 × block_size + 块内偏移              —— 把池子看成 num_blocks·block_size 个"槽"
一个 token 在序列里的逻辑位置 p 落在第 p // block_size 个逻辑块、块内第 p % block_size 个槽，
逻辑块经块表 block_table 映射到物理块。

每次前向之前，引擎调用 plan(seqs, num_new_tokens)，得到这次前向的 AttentionMetadata：这一批请求要算的新 token
排成左填充的 (B, L) 张量，算好 slot_mapping（每个真实新 token 的 K/V 写到哪个槽）、掩码、要不要读池子、读哪些行，
以及要算 logits 的位置（左填充让每行最后一个 token 都在最后一列）。
引擎把它当作 cache 传给模型（common/kv_cache.py 的接口：update + mask），模型的每一层调用
update(layer_idx, k, v)：

  写  按 slot_mapping 把新 K/V 写进池子（每个真实 token 一次，填充不写）；
  读  prefill（被抢占后的重算也是从位置 0 开始的 prefill）：没有任何行有已进池子的 token，直接返回本次前向
      自己的 K/V，一个字节都不读池子；decode：按块表把每行的块 gather 成连续的 (B, H_kv, S, D)——
      与 step03 的连续缓存返回的形状相同，模型代码一行不改。

gather 是一次真实的拷贝，每层、每个 decode 步都要做：B × max_blocks × block_size 个槽，每槽
cfg.kv_bytes_per_token 字节（全部层的 K 和 V）。AttentionMetadata.gather_bytes 在拷贝发生的地方把它如实累加。
这正是分页本来要省掉的拷贝。attention="paged"（默认）时读池子不拷贝：写完新 K/V 之后，注意力直接按块表去读
池子里的块，逐块做 online softmax（paged_attention.py，CPU float32 上是一个 C++ 内核）；gather 留作可读的参考
（--attention gather），两条路算的是同一个数（测试逐位置对照）。

池子比分配器管的块多一块：最后一块是空块（null block），从不分给任何请求。块表较短的行补齐时指向它，
这样填充读到的永远不是别人的块。每行自己长度之外的位置（补齐的空块、最后一块还没写到的尾巴）K 被掩码遮住，
V 是 0（空块的 V 每次读之前清零，尾巴读回之后清零），所以这些槽里原来是什么（哪怕是 NaN）都进不了输出。
池子本身不记"当前这次前向"。
"""
from dataclasses import dataclass
from typing import Optional

import torch

from common.config import ModelConfig
from common.kv_cache import KVCache
from step04_static_batching.batch import PAD_ID, attention_mask

from step05_paged.paged_attention import kernel_available, paged_attention

ATTENTION_CHOICES = ("paged", "gather")


@dataclass
class AttentionMetadata(KVCache):
    """一次前向的全部"地址"信息（vLLM 叫 attention metadata；nano-vllm 把它放在全局 context 里，我们显式传给模型）。"""
    pool: torch.Tensor          # (layers, 2, num_blocks + 1, H_kv, block_size, D) 整个池子（视图，不复制）
    input_ids: torch.Tensor     # (B, L)  每行是该请求还没进缓存的 token，左填充
    positions: torch.Tensor     # (B, L)  这些 token 的绝对位置；填充处为 0
    mask: Optional[torch.Tensor]  # (B, 1, 1, L, S) True = 可以看。不读池子时 S = L（只看自己），gather 时 S = max_blocks·block_size；paged 不用
    token_index: torch.Tensor   # (N,)    真实 token 在展平的 B·L 里的下标（跳过填充）
    slot_mapping: torch.Tensor  # (N,)    第 n 个真实 token 的 K/V 写到池子的哪个槽
    block_tables: torch.Tensor  # (B, max_blocks) 每行的块表；较短的行用空块补齐
    logits_index: torch.Tensor  # (1,)    要算 logits 的列：左填充后每行的最后一个 token 都在第 L-1 列
    # 读池子用（没有任何行有已缓存的 token 时都是 None：不读）。paged：按块表直接读，只要每行的长度
    seq_lens: Optional[torch.Tensor] = None    # (B,) int32  这次前向之后每行有几个 key
    query_lens: Optional[torch.Tensor] = None  # (B,) int32  每行这次算几个 token（decode 为 1）
    # gather：按块表把块拷成连续的 (B, H_kv, S, D)
    read_rows: Optional[torch.Tensor] = None   # (2·B·H_kv·max_blocks,) 池子一层的视图 (2·(num_blocks+1)·H_kv, block_size·D) 里要拷出的行
    read_buf: Optional[torch.Tensor] = None    # (2·B·H_kv·max_blocks, block_size·D) 拷到这里；每层复用同一块
    v_tail_rows: Optional[torch.Tensor] = None # 读回的 V 看成 (B·H_kv·S, D) 时，各行自己最后一块里还没写到的位置
    gather_bytes: int = 0       # 读池子时拷贝的字节数（全部层累计）

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, L, D)，k/v (B, H_kv, L, D) → (B, H, L, D)。paged：写完新 K/V，注意力直接按块表读池子，
        不拷贝；否则（全新的 prefill 只看自己的 K/V，或 gather）走 KVCache 的 update + attention。"""
        if self.seq_lens is None:
            return super().attend(layer_idx, q, k, v)
        self.write(layer_idx, k, v)
        B, H, L, D = q.shape
        layer = self.pool[layer_idx]
        qs = q.transpose(1, 2).reshape(B * L, H, D)                              # (B, H, L, D) -> (B·L, H, D)
        if L > 1:
            qs = qs[self.token_index]                                            # 去掉左填充：(N, H, D)
        out = paged_attention(qs, layer[0], layer[1], self.block_tables, self.seq_lens, self.query_lens)  # (N, H, D)
        if L > 1:                                                                # 放回左填充的位置（填充处的输出没人用，给 0）
            out = out.new_zeros(B * L, H, D).index_copy_(0, self.token_index, out)
        return out.view(B, L, H, D).transpose(1, 2)                              # (B·L, H, D) -> (B, H, L, D)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (B, H_kv, L, D) 本次的新 K/V（已做 RoPE）→ 按 slot_mapping 写进池子（只写真实 token，填充不写）。"""
        B, H_kv, L, D = k.shape
        layer = self.pool[layer_idx]                                             # (2, num_blocks+1, H_kv, block_size, D)：视图
        bs = layer.shape[3]
        block, offset = self.slot_mapping // bs, self.slot_mapping % bs          # (N,), (N,)
        for kv, new in ((0, k), (1, v)):
            new = new.transpose(1, 2).reshape(B * L, H_kv, D)                    # (B, H_kv, L, D) -> (B·L, H_kv, D)
            layer[kv, block, :, offset] = new[self.token_index]                  # (N, H_kv, D) 写进各自的槽

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """gather 的读法：k, v (B, H_kv, L, D) 写进池子，返回注意力要看的 K/V 各 (B, H_kv, S, D)。"""
        self.write(layer_idx, k, v)
        B, H_kv, L, D = k.shape
        layer, bs = self.pool[layer_idx], self.pool.shape[4]
        if self.read_rows is None:
            return k, v          # 全新的 prefill：要看的正是本次前向自己的 K/V（刚写进池子的那些），不用读回来
        # 一次 index_select 把 K 和 V 一起拷出来：行的顺序是 (K/V, 请求, 头, 逻辑块)，拷出来正好是两个连续的
        # (B, H_kv, S, D)。输出写进每层复用的 read_buf：这一层的注意力用完，下一层才覆盖它
        torch.index_select(layer.view(-1, bs * D), 0, self.read_rows, out=self.read_buf)  # (2·B·H_kv·max_blocks, bs·D)
        self.gather_bytes += self.read_buf.nbytes
        k_all, v_all = self.read_buf.view(2, B, H_kv, -1, D)                     # 各 (B, H_kv, S, D)
        # 每行长度之外的位置：K 的分数会被掩码替换掉（不管是什么值），V 却会以"概率 0 × 值"进入 probs @ v，
        # 而 0 × NaN = NaN。补齐的部分读自空块，plan 已把空块的 V 清零；剩下各行最后一块里还没写到的尾巴
        # （上一个用这块的请求留下的旧数据），在这里清零：每行最多 block_size − 1 个位置
        v_all.view(-1, D).index_fill_(0, self.v_tail_rows, 0)
        return k_all, v_all


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

    def plan(self, seqs, num_new_tokens: list[int]) -> AttentionMetadata:
        """seqs[i] 这一步算位置 num_computed_tokens .. num_computed_tokens + num_new_tokens[i] - 1 的 token
        （prefill：还没进池子的全部；decode：1 个）。调度器负责让块表覆盖到要算的最后一个位置；
        没覆盖到说明调度器有 bug，这里给出清楚的错误。"""
        bs, dev = self.block_size, self.pool.device
        for seq, n in zip(seqs, num_new_tokens):
            end = seq.num_computed_tokens + n
            if not seq.num_computed_tokens < end <= seq.num_tokens:
                raise RuntimeError(f"cannot compute {n} new tokens of a sequence with {seq.num_computed_tokens} of "
                                   f"{seq.num_tokens} tokens computed")
            if end > len(seq.block_table) * bs:
                raise RuntimeError(f"block table of {len(seq.block_table)} blocks x {bs} slots does not cover "
                                   f"position {end - 1}: the scheduler must allocate blocks first")
        B = len(seqs)
        news = [seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + n]    # 每行这次要算的 token
                for seq, n in zip(seqs, num_new_tokens)]
        L = max(len(t) for t in news)
        tables = [seq.block_table for seq in seqs]
        max_blocks = max(map(len, tables))
        computed = torch.tensor([seq.num_computed_tokens for seq in seqs])         # (B,)
        n_new = torch.tensor([len(t) for t in news])                               # (B,)
        # 左填充：真实 token 靠右，last_only 取到的就是每行最后一个真实 token
        input_ids = torch.tensor([[PAD_ID] * (L - len(t)) + t for t in news])      # (B, L)
        block_tables = torch.tensor([t + [self.null_block] * (max_blocks - len(t)) for t in tables])  # (B, max_blocks)
        pad = L - n_new                                                            # (B,) 每行的填充数
        col = torch.arange(L)
        real = col[None, :] >= pad[:, None]                                        # (1, L) >= (B, 1) -> (B, L)
        positions = torch.where(real, computed[:, None] + col[None, :] - pad[:, None], 0)   # (B, L)，填充处 0
        slots = block_tables.gather(1, positions // bs) * bs + positions % bs      # (B, L) 逻辑位置 → 物理槽
        token_index = real.flatten().nonzero().squeeze(1)                          # (N,)
        slot_mapping = slots.flatten()[token_index]                                # (N,)

        logits_index = torch.tensor([L - 1], device=dev)
        if not any(seq.num_computed_tokens for seq in seqs):
            # 全新的 prefill：K/V 就是这次前向自己算出来的 (B, H_kv, L, D)，掩码与 step04 的左填充 prefill 相同
            mask = attention_mask(pad, 0, L)                                       # (B, 1, 1, L, L)
            return AttentionMetadata(self.pool, input_ids.to(dev), positions.to(dev), mask.to(dev),
                                     token_index.to(dev), slot_mapping.to(dev), block_tables.to(dev), logits_index)
        if self.attention == "paged":   # 内核按块表直接读池子：只要每行的长度，不拷贝、不用掩码
            return AttentionMetadata(self.pool, input_ids.to(dev), positions.to(dev), None, token_index.to(dev),
                                     slot_mapping.to(dev), block_tables.to(device=dev, dtype=torch.int32), logits_index,
                                     (computed + n_new).to(device=dev, dtype=torch.int32),
                                     n_new.to(device=dev, dtype=torch.int32))
        S = max_blocks * bs
        # 按绝对位置的因果掩码：位置 p 的 query 只看位置 ≤ p 的 key。块表里还没写（或补齐出来）的槽，
        # 位置都 > 该行任何真实 query 的位置，自然被遮住；填充的 query 位置为 0，只看 key 0，不会整行全遮。
        key_pos = torch.arange(S)
        mask = key_pos[None, None, :] <= positions[:, :, None]                     # (1, 1, S) <= (B, L, 1) -> (B, L, S)
        # 读的行号：池子一层看成 (2·(num_blocks+1)·H_kv, block_size·D)，(K/V, 物理块, 头) 在第 (kv·(num_blocks+1) + 块号)·H_kv + 头 行
        kv = torch.arange(2)[:, None, None, None]                                  # (2, 1, 1, 1)
        heads = torch.arange(self.H_kv)[None, None, :, None]                       # (1, 1, H_kv, 1)
        read_rows = ((kv * (self.num_blocks + 1) + block_tables[None, :, None, :]) * self.H_kv + heads).flatten()
        #            (2, B, H_kv, max_blocks) 展平：拷出来的顺序就是 (K/V, B, H_kv, S)
        length = computed + n_new                                                  # (B,) 这次前向之后每行的长度
        own = torch.tensor([len(t) * bs for t in tables])                          # (B,) 每行自己的块覆盖到哪
        tail = (key_pos[None, :] >= length[:, None]) & (key_pos[None, :] < own[:, None])   # (B, S)
        tail = tail[:, None, :].expand(B, self.H_kv, S)                            # (B, H_kv, S)
        # 空块从不分给任何请求，正常情况下一直是 0；每次读之前把它的 V 再清零一遍（全部层，一块，几百 KiB），
        # 补齐读到的 V 就一定是 0，不依赖"没人写过它"
        self.pool[:, 1, self.null_block].zero_()
        read_buf = torch.empty(2 * B * self.H_kv * max_blocks, bs * self.D, device=dev, dtype=self.pool.dtype)
        return AttentionMetadata(self.pool, input_ids.to(dev), positions.to(dev), mask[:, None, None].to(dev),  # (B, 1, 1, L, S)
                                 token_index.to(dev), slot_mapping.to(dev), block_tables.to(dev), logits_index,
                                 read_rows=read_rows.to(dev), read_buf=read_buf,
                                 v_tail_rows=tail.flatten().nonzero().squeeze(1).to(dev))
