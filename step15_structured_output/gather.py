"""--attention gather 的参考读法：按段 gather。引擎里只有 kv_cache.py 的 plan 在 attention="gather" 时用它。

展平的一行 (1, T) 切成几段（kv_cache.py 的 plan 已把它们排成这个顺序）：全部只算 1 个 token 的请求一段（decode 批），
每个 prefill 块一段（1 行 L 个 query）。每一段就是 step05/06 的一次前向：一个左填充的 (B, L) AttentionMetadata
（plan_segment 给出，代码是 step05/06 的 plan）——

  写  按 slot_mapping 把新 K/V 写进池子（每个真实 token 一次，填充不写）；
  读  这一段没有任何行有已进池子的 token（全新的 prefill）：直接返回本次前向自己的 K/V，一个字节都不读池子；
      否则按块表把每行的块 gather 成连续的 (B, H_kv, S, D)，用 common/model.py 的 attention 和按位置的掩码。

gather 是一次真实的拷贝：B × max_blocks × block_size 个槽，每槽 cfg.kv_bytes_per_token 字节（全部层的 K 和 V），
AttentionMetadata.gather_bytes 在拷贝发生的地方把它如实累加。每行自己长度之外的位置（补齐的空块、最后一块还没写到的
尾巴）K 被掩码遮住，V 是 0（空块的 V 每次读之前清零，尾巴读回之后清零）。attend_segments 把一行切成段、各段各自
写、读、算注意力，再按原顺序拼回一行。step07 的 analysis/varlen_bench.py（"左填充 + 掩码"的对照批）与 step08 的
chapter.py（量化池子的整段 prefill）也直接用 plan_segment。

step08：量化的池子（kv_cache.py 的说明）只能走这条路（C++ 内核只读模型 dtype 的池子）。写：新 token 的 K/V 先量化，
码和 scale 各写进自己的槽；读：同样的 read_rows 一次 index_select 拷出码，再拷出对应的 scale，乘起来就是反量化后的
(B, H_kv, S, D)。全新的 prefill 不读池子，但返回的也是"量化再读回"的 K/V。
"""
from dataclasses import dataclass
from typing import Optional

import torch

from common.kv_cache import KVCache
from step04_static_batching.batch import PAD_ID, attention_mask

from .quant import SCALE_DTYPE, KVFormat


@dataclass
class AttentionMetadata(KVCache):
    """一段（一个左填充的 (B, L) 批）的地址信息：step05/06 的一次前向。"""
    pool: torch.Tensor          # (layers, 2, num_blocks + 1, H_kv, block_size, D) 整个池子（视图，不复制）
    input_ids: torch.Tensor     # (B, L)  每行是该请求还没进缓存的 token，左填充
    positions: torch.Tensor     # (B, L)  这些 token 的绝对位置；填充处为 0
    mask: torch.Tensor          # (B, 1, 1, L, S) True = 可以看。不读池子时 S = L（只看自己），否则 S = max_blocks·block_size
    token_index: torch.Tensor   # (N,)    真实 token 在展平的 B·L 里的下标（跳过填充）
    slot_mapping: torch.Tensor  # (N,)    第 n 个真实 token 的 K/V 写到池子的哪个槽
    block_tables: torch.Tensor  # (B, max_blocks) 每行的块表；较短的行用空块补齐
    logits_index: torch.Tensor  # (1,)    要算 logits 的列：左填充后每行的最后一个 token 都在第 L-1 列
    # 读池子用（没有任何行有已缓存的 token 时都是 None：不读）：按块表把块拷成连续的 (B, H_kv, S, D)
    read_rows: Optional[torch.Tensor] = None   # (2·B·H_kv·max_blocks,) 池子一层的视图 (2·(num_blocks+1)·H_kv, block_size·D) 里要拷出的行
    read_buf: Optional[torch.Tensor] = None    # (2·B·H_kv·max_blocks, block_size·D) 拷到这里；每层复用同一块
    v_tail_rows: Optional[torch.Tensor] = None # 读回的 V 看成 (B·H_kv·S, D) 时，各行自己最后一块里还没写到的位置
    gather_bytes: int = 0       # 读池子时拷贝的字节数（全部层累计）
    # 量化的池子（fmt 为 None = 精确模式：池子就是模型的 dtype，下面几项不用）
    fmt: Optional[KVFormat] = None
    scales: Optional[torch.Tensor] = None      # (layers, 2, num_blocks + 1, H_kv, block_size, 1)；不量化时 None
    dtype: Optional[torch.dtype] = None        # 模型的 dtype：读回来的 K/V 是这个 dtype
    scale_buf: Optional[torch.Tensor] = None   # (2·B·H_kv·max_blocks, block_size)：读 scale 用，每层复用

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (B, H_kv, L, D) 本次的新 K/V（已做 RoPE）→ 按 slot_mapping 写进池子（只写真实 token，填充不写）。"""
        B, H_kv, L, D = k.shape
        layer = self.pool[layer_idx]                                             # (2, num_blocks+1, H_kv, block_size, D)：视图
        bs = layer.shape[3]
        block, offset = self.slot_mapping // bs, self.slot_mapping % bs          # (N,), (N,)
        for kv, new in ((0, k), (1, v)):
            new = new.transpose(1, 2).reshape(B * L, H_kv, D)[self.token_index]  # (B, H_kv, L, D) -> (B·L, H_kv, D) -> (N, H_kv, D)
            codes, scale = self.fmt.encode(new) if self.fmt is not None else (new, None)   # 量化：(N, H_kv, D), (N, H_kv, 1)
            layer[kv, block, :, offset] = codes                                  # 写进各自的槽
            if scale is not None:
                self.scales[layer_idx, kv, block, :, offset] = scale

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """k, v (B, H_kv, L, D) 写进池子，返回注意力要看的 K/V 各 (B, H_kv, S, D)。"""
        self.write(layer_idx, k, v)
        B, H_kv, L, D = k.shape
        layer, bs = self.pool[layer_idx], self.pool.shape[4]
        if self.read_rows is None:
            # 全新的 prefill：要看的正是本次前向自己的 K/V（刚写进池子的那些），不用读回来；
            # 量化时看"量化再读回"的值（与之后 decode 从池子读到的逐位相同）
            return (k, v) if self.fmt is None else (self.fmt.round_trip(k), self.fmt.round_trip(v))
        # 一次 index_select 把 K 和 V 一起拷出来：行的顺序是 (K/V, 请求, 头, 逻辑块)，拷出来正好是两个连续的
        # (B, H_kv, S, D)。输出写进每层复用的 read_buf：这一层的注意力用完，下一层才覆盖它
        torch.index_select(layer.view(-1, bs * D), 0, self.read_rows, out=self.read_buf)  # (2·B·H_kv·max_blocks, bs·D)
        self.gather_bytes += self.read_buf.nbytes
        kv_all = self.read_buf
        if self.fmt is not None:   # 反量化：同样的行号拷出 scale，码 × scale；每层新分配一块模型 dtype 的 (R, bs, D)
            scale = None
            if self.scales is not None:
                torch.index_select(self.scales[layer_idx].view(-1, bs), 0, self.read_rows, out=self.scale_buf)  # (R, bs)
                scale = self.scale_buf.view(-1, bs, 1)                                                      # (R, bs, 1)
                self.gather_bytes += self.scale_buf.nbytes
            kv_all = self.fmt.decode(self.read_buf.view(-1, bs, D), scale, self.dtype)                      # (R, bs, D)
        k_all, v_all = kv_all.view(2, B, H_kv, -1, D)                            # 各 (B, H_kv, S, D)
        # 每行长度之外的位置：K 的分数会被掩码替换掉（不管是什么值），V 却会以"概率 0 × 值"进入 probs @ v，
        # 而 0 × NaN = NaN。补齐的部分读自空块，plan 已把空块的 V 清零；剩下各行最后一块里还没写到的尾巴
        # （上一个用这块的请求留下的旧数据），在这里清零：每行最多 block_size − 1 个位置
        v_all.view(-1, D).index_fill_(0, self.v_tail_rows, 0)
        return k_all, v_all


def plan_segment(cache, seqs, num_new_tokens: list[int]) -> AttentionMetadata:
    """一段：seqs[i] 这一步算位置 num_computed_tokens .. num_computed_tokens + num_new_tokens[i] - 1 的 token，
    排成左填充的 (B, L)。cache 是 kv_cache.py 的 PagedKVCache（池子、块大小、空块）；检查由它的 plan 做过。"""
    bs, dev, H_kv = cache.block_size, cache.pool.device, cache.H_kv
    B = len(seqs)
    news = [(seq.token_ids + seq.spec_token_ids)[seq.num_computed_tokens:seq.num_computed_tokens + n]
            for seq, n in zip(seqs, num_new_tokens)]                          # 每行这次要算的 token（含猜测）
    L = max(len(t) for t in news)
    # 每行只用到这次要算的最后一个位置所在的块（一个提示词的块在接纳时一次分好，分块 prefill 的前几块用不到后面的块）
    tables = [seq.block_table[:-(-(seq.num_computed_tokens + n) // bs)] for seq, n in zip(seqs, num_new_tokens)]
    max_blocks = max(map(len, tables))
    computed = torch.tensor([seq.num_computed_tokens for seq in seqs])         # (B,)
    n_new = torch.tensor([len(t) for t in news])                               # (B,)
    # 左填充：真实 token 靠右，last_only 取到的就是每行最后一个真实 token
    input_ids = torch.tensor([[PAD_ID] * (L - len(t)) + t for t in news])      # (B, L)
    block_tables = torch.tensor([t + [cache.null_block] * (max_blocks - len(t)) for t in tables])  # (B, max_blocks)
    pad = L - n_new                                                            # (B,) 每行的填充数
    col = torch.arange(L)
    real = col[None, :] >= pad[:, None]                                        # (1, L) >= (B, 1) -> (B, L)
    positions = torch.where(real, computed[:, None] + col[None, :] - pad[:, None], 0)   # (B, L)，填充处 0
    slots = block_tables.gather(1, positions // bs) * bs + positions % bs      # (B, L) 逻辑位置 → 物理槽
    token_index = real.flatten().nonzero().squeeze(1)                          # (N,)
    slot_mapping = slots.flatten()[token_index]                                # (N,)

    logits_index = torch.tensor([L - 1], device=dev)
    quant = dict(fmt=cache.fmt, scales=cache.scales, dtype=cache.dtype)
    if not any(seq.num_computed_tokens for seq in seqs):
        # 全新的 prefill：K/V 就是这次前向自己算出来的 (B, H_kv, L, D)，掩码与 step04 的左填充 prefill 相同
        mask = attention_mask(pad, 0, L)                                       # (B, 1, 1, L, L)
        return AttentionMetadata(cache.pool, input_ids.to(dev), positions.to(dev), mask.to(dev),
                                 token_index.to(dev), slot_mapping.to(dev), block_tables.to(dev), logits_index,
                                 **quant)
    S = max_blocks * bs
    # 按绝对位置的因果掩码：位置 p 的 query 只看位置 ≤ p 的 key。块表里还没写（或补齐出来）的槽，
    # 位置都 > 该行任何真实 query 的位置，自然被遮住；填充的 query 位置为 0，只看 key 0，不会整行全遮。
    key_pos = torch.arange(S)
    mask = key_pos[None, None, :] <= positions[:, :, None]                     # (1, 1, S) <= (B, L, 1) -> (B, L, S)
    # 读的行号：池子一层看成 (2·(num_blocks+1)·H_kv, block_size·D)，(K/V, 物理块, 头) 在第 (kv·(num_blocks+1) + 块号)·H_kv + 头 行
    kv = torch.arange(2)[:, None, None, None]                                  # (2, 1, 1, 1)
    heads = torch.arange(H_kv)[None, None, :, None]                            # (1, 1, H_kv, 1)
    read_rows = ((kv * (cache.num_blocks + 1) + block_tables[None, :, None, :]) * H_kv + heads).flatten()
    #            (2, B, H_kv, max_blocks) 展平：拷出来的顺序就是 (K/V, B, H_kv, S)
    length = computed + n_new                                                  # (B,) 这次前向之后每行的长度
    own = torch.tensor([len(t) * bs for t in tables])                          # (B,) 每行自己的块覆盖到哪
    tail = (key_pos[None, :] >= length[:, None]) & (key_pos[None, :] < own[:, None])   # (B, S)
    tail = tail[:, None, :].expand(B, H_kv, S)                                 # (B, H_kv, S)
    # 空块从不分给任何请求，正常情况下一直是 0；每次读之前把它的 V 再清零一遍（全部层，一块，几百 KiB），
    # 补齐读到的 V 就一定是 0，不依赖"没人写过它"
    cache.pool[:, 1, cache.null_block].zero_()
    read_buf = torch.empty(2 * B * H_kv * max_blocks, bs * cache.D, device=dev, dtype=cache.pool.dtype)
    scale_buf = (torch.empty(len(read_rows), bs, device=dev, dtype=SCALE_DTYPE)
                 if cache.scales is not None else None)
    return AttentionMetadata(cache.pool, input_ids.to(dev), positions.to(dev), mask[:, None, None].to(dev),  # (B, 1, 1, L, S)
                             token_index.to(dev), slot_mapping.to(dev), block_tables.to(dev), logits_index,
                             read_rows=read_rows.to(dev), read_buf=read_buf,
                             v_tail_rows=tail.flatten().nonzero().squeeze(1).to(dev), scale_buf=scale_buf, **quant)


def plan_segments(cache, seqs, num_new_tokens: list[int]) -> list[AttentionMetadata]:
    """按 plan 排好的行顺序切段：只算 1 个 token 的并成一段（decode），其余（prefill 的块、验证猜测的 k+1 个）每个一段。"""
    singles = [i for i, n in enumerate(num_new_tokens) if n == 1]
    groups = ([singles] if singles else []) + [[i] for i, n in enumerate(num_new_tokens) if n > 1]
    return [plan_segment(cache, [seqs[i] for i in g], [num_new_tokens[i] for i in g]) for g in groups]


def attend_segments(segments: list[AttentionMetadata], layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> torch.Tensor:
    """q (1, H, T, D)，k/v (1, H_kv, T, D) → (1, H, T, D)：每一段各自写入、读回、算注意力，再按原顺序拼回一行。"""
    outs, start = [], 0
    for seg in segments:
        B, L = seg.input_ids.shape               # decode 段：B 个请求各 1 个；prefill 块：1 个请求 L 个
        span = slice(start, start + B * L)
        # (1, heads, T, D) 里属于这一段的 B·L 个位置 -> (heads, B, L, D) -> (B, heads, L, D)：段的批形状（视图）
        qs, ks, vs = (x[0, :, span].unflatten(1, (B, L)).transpose(0, 1) for x in (q, k, v))
        out = seg.attend(layer_idx, qs, ks, vs)                    # 写进池子、取回这一段要看的 K/V、注意力：(B, H, L, D)
        outs.append(out.transpose(0, 1).flatten(1, 2))             # (B, H, L, D) -> (H, B, L, D) -> (H, B·L, D)
        start += B * L
    return torch.cat(outs, dim=1)[None]                            # (H, T, D) -> (1, H, T, D)
