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
  读  没有任何行有已进池子的 token（全新的 prefill）：直接返回本次前向自己的 K/V，一个字节都不读池子；
      否则（decode，以及 step06 的"前缀命中、prefill 剩下部分"的行）：按块表把每行的块 gather 成连续的
      (B, H_kv, S, D)——与 step03 的连续缓存返回的形状相同，模型代码一行不改。

gather 是一次真实的拷贝，每层、每个 decode 步都要做：B × max_blocks × block_size 个槽，每槽
cfg.kv_bytes_per_token 字节（全部层的 K 和 V）。AttentionMetadata.gather_bytes 在拷贝发生的地方把它如实累加。
这正是分页本来要省掉的拷贝。attention="paged"（默认）时读池子不拷贝：写完新 K/V 之后，注意力直接按块表去读
池子里的块，逐块做 online softmax（paged_attention.py，CPU float32 上是一个 C++ 内核）；gather 留作可读的参考
（--attention gather），两条路算的是同一个数（测试逐位置对照）。

池子比分配器管的块多一块：最后一块是空块（null block），从不分给任何请求。块表较短的行补齐时指向它，
这样填充读到的永远不是别人的块。每行自己长度之外的位置（补齐的空块、最后一块还没写到的尾巴）K 被掩码遮住，
V 是 0（空块的 V 每次读之前清零，尾巴读回之后清零），所以这些槽里原来是什么（哪怕是 NaN）都进不了输出。
池子本身不记"当前这次前向"。

step07：展平的前向（varlen）。一步里既有 decode（每个 1 个 token），又有 prefill 的块（各几十个 token），
plan 把它们首尾相接排成 (1, T) 的一行，T = 全部新 token 数，没有填充：

    行:   [d0 d1 d2 | a5 a6 a7 a8 | b0 b1 b2]      d = 三个 decode；a = 一个提示词的第 5..8 个 token（前 5 个已在池子里）；
    位置: [37 12 90 |  5  6  7  8 |  0  1  2]      b = 另一个提示词的第一块

线性层、MLP、RMSNorm、RoPE 对每个 token 各算各的，一行 T 个 token 与 (B, L) 里的 T 个真实 token 算的完全一样，
只是不再为填充付钱。只有注意力要知道"谁跟谁是一个请求"：FlashAttention 的 varlen 接口用 cu_seqlens（每个请求
在这一行里的起止下标）告诉内核；这里按段来做（FlatAttentionMetadata.attend）：全部 decode 一段（正是上面的
decode 批），每个 prefill 块一段（1 行 L 个 query，看自己已在池子里的前缀 + 自己这 L 个新 K/V）。每一段就是
一个上面的 AttentionMetadata（_plan_segment 给出）；新的只是"几段共用一行的矩阵乘"。为什么不把所有段拼成一个
(T × ΣS) 的块对角掩码：那样每个 query 都要和所有请求的 key 算分数再遮掉，分数的量随段数平方增长
（analysis/varlen_bench.py 量了三种做法）。attention="paged" 时整行只调用一次内核：每个请求的 query 在行里首尾
相接，内核拿到每个请求的 query 数和 key 数（FlashAttention 的 cu_seqlens_q / seqused_k 就是这两样），按各自的
块表读池子——decode 与 prefill 的块是同一种情况，只是 query 数不同。

step08：量化的池子（--kv-dtype int8 / fp8）。池子存 1 字节的码，每个 (token, 头) 旁边一个 float32 的 scale：

    码     pool   (layers, 2, num_blocks + 1, H_kv, block_size, D)   int8 / float8_e4m3fn（同一布局）
    scale  scales (layers, 2, num_blocks + 1, H_kv, block_size, 1)   float32：一个 token 在一个头里的 D 个数共用一个

写（按 slot_mapping，同一处）：新 token 的 K/V 先量化，码和 scale 各写进自己的槽（quant.py 的 KVFormat）。
读（gather 那条路）：同样的 read_rows 一次 index_select 拷出码，再拷出对应的 scale，乘起来就是反量化后的
(B, H_kv, S, D)——模型代码一行不改。C++ 内核只读 float32 的池子，所以量化的池子总走 gather（反量化本来就要
一份新张量）。全新的 prefill 不读池子，但返回的也是"量化再读回"的 K/V：于是一个 token 在注意力里看到的值与它
何时被写、被切在哪一块、和谁一批都无关。kv_dtype 是另一种浮点（例如 float32 的模型用 bfloat16 存）时没有 scale：
写时转换，读时转回模型的 dtype。默认（fmt=None）池子就是模型的 dtype：精确模式，每一步与 step07 逐位相同。

step09：验证猜测。decode 中带着 k 个猜测的请求这一步算 k+1 个位置（上一步采样出的 token + k 个猜测），
与一个 prefill 块的做法完全相同：从 num_computed_tokens 起写进块表里的槽，看自己已在池子里的前缀 + 这 k+1 个
新 K/V（paged 时就是内核的 query 数 = k+1）。不同的只有两点：要算的 token 取自 token_ids + spec_token_ids
（猜测不是请求的 token）；这 k+1 个位置每个都要 logits（第 i 个位置的 logits 判断第 i+1 个猜测）。
被拒绝的猜测写进去的 K/V 留在槽里不管：num_computed_tokens 不把它们算进去，之后写这些位置时直接覆盖。
"""
from dataclasses import dataclass
from typing import Optional

import torch

from common.config import ModelConfig
from common.kv_cache import KVCache
from step04_static_batching.batch import PAD_ID, attention_mask

from step05_paged.paged_attention import kernel_available, paged_attention
from .quant import SCALE_DTYPE, KVFormat

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
    # 量化的池子（fmt 为 None = 精确模式：池子就是模型的 dtype，下面几项不用）
    fmt: Optional[KVFormat] = None
    scales: Optional[torch.Tensor] = None      # (layers, 2, num_blocks + 1, H_kv, block_size, 1)；不量化时 None
    dtype: Optional[torch.dtype] = None        # 模型的 dtype：读回来的 K/V 是这个 dtype
    scale_buf: Optional[torch.Tensor] = None   # (2·B·H_kv·max_blocks, block_size)：读 scale 用，每层复用

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
            new = new.transpose(1, 2).reshape(B * L, H_kv, D)[self.token_index]  # (B, H_kv, L, D) -> (B·L, H_kv, D) -> (N, H_kv, D)
            codes, scale = self.fmt.encode(new) if self.fmt is not None else (new, None)   # 量化：(N, H_kv, D), (N, H_kv, 1)
            layer[kv, block, :, offset] = codes                                  # 写进各自的槽
            if scale is not None:
                self.scales[layer_idx, kv, block, :, offset] = scale

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """gather 的读法：k, v (B, H_kv, L, D) 写进池子，返回注意力要看的 K/V 各 (B, H_kv, S, D)。"""
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


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device, dtype, attention: str = "paged",
                 fmt: Optional[KVFormat] = None):
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}")
        attention = "gather" if fmt is not None else attention   # 内核只读模型 dtype 的池子：量化的池子走 gather
        self.num_blocks, self.block_size, self.attention = num_blocks, block_size, attention
        self.fmt, self.dtype = fmt, dtype
        self.H_kv, self.D = cfg.num_kv_heads, cfg.head_dim
        # 块内按头排 (H_kv, block_size, D)：同一个头、同一块的 block_size 个位置是一段连续内存，
        # 按 (请求, 头, 逻辑块) 的顺序把这些段拼起来，得到的正好是连续的 (B, H_kv, S, D)——与 step03 的缓存
        # 一样每个头一整块 S×D，注意力的矩阵乘顺序读。若按 (block_size, H_kv, D) 存，取回后还要 transpose，
        # 变成跨步读（docs/05_paged.md 第 3 节）。
        # 用 zeros 而不是 empty：没写过的槽是 0，出 bug 时结果可复现（正确性不靠它：读回后长度之外的位置都被遮住、清零）。
        self.pool = torch.zeros(cfg.num_layers, 2, num_blocks + 1, self.H_kv, block_size, self.D,
                                device=device, dtype=dtype if fmt is None else fmt.storage_dtype)
        self.null_block = num_blocks   # 多出来的最后一块：从不分配，只给块表补齐用
        # 量化时每个 (token, 头) 一个 scale，与码同样按 (K/V, 块, 头, 块内位置) 寻址；初值 1（没写过的槽码是 0，读回 0）
        self.scales = (torch.ones(cfg.num_layers, 2, num_blocks + 1, self.H_kv, block_size, 1, device=device,
                                  dtype=SCALE_DTYPE) if fmt is not None and fmt.scheme is not None else None)
        if attention == "paged" and torch.device(device).type == "cpu" and dtype == torch.float32:
            kernel_available()         # 第一次用时编译（或从缓存加载）内核：编译不算进第一次前向的时间

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, fmt: Optional[KVFormat] = None) -> float:
        """一块在池子里占的字节（全部层的 K 和 V，含 scale）。"""
        return block_size * (cfg.kv_bytes_per_token(dtype.itemsize) if fmt is None else fmt.bytes_per_token(cfg, block_size))

    def tensors(self) -> list[torch.Tensor]:
        """按块索引的全部张量（块在第 2 维）：换出 / 换入要原样搬的东西。"""
        return [self.pool] + ([self.scales] if self.scales is not None else [])

    @property
    def nbytes(self) -> int:
        """池子实际占的字节（码 + scale；含从不分配的空块）。"""
        return sum(t.nbytes for t in self.tensors())

    def plan(self, seqs, num_new_tokens: list[int]) -> "FlatAttentionMetadata":
        """seqs[i] 这一步算 num_new_tokens[i] 个 token（从它的 num_computed_tokens 起）。只算 1 个的并成一段
        （decode，或 prefill 恰好只分到 1 个 token：注意力的做法相同），其余（prefill 的块、验证猜测的 k+1 个）每个一段。
        算到最后一个 token 的请求要采样，它们按 seqs 里的顺序给出 logits_index；验证猜测的请求给 1 + len(spec_token_ids) 个。"""
        singles = [i for i, n in enumerate(num_new_tokens) if n == 1]
        groups = ([singles] if singles else []) + [[i] for i, n in enumerate(num_new_tokens) if n > 1]
        segments = [self._plan_segment([seqs[i] for i in g], [num_new_tokens[i] for i in g]) for g in groups]
        last, start = {}, 0                              # 请求 i 的最后一个新 token 在行里的下标
        for g, seg in zip(groups, segments):
            B, L = seg.input_ids.shape
            for row, i in enumerate(g):
                last[i] = start + row * L + L - 1
            start += B * L
        sampling = [j for i, (seq, n) in enumerate(zip(seqs, num_new_tokens))   # 验证的行：最后 k+1 个位置都要
                    if seq.num_computed_tokens + n == seq.num_tokens_with_spec
                    for j in range(last[i] - len(seq.spec_token_ids), last[i] + 1)]
        dev = self.pool.device
        flat = FlatAttentionMetadata(segments,
                                     torch.cat([seg.input_ids.flatten() for seg in segments])[None],  # (1, T)
                                     torch.cat([seg.positions.flatten() for seg in segments])[None],  # (1, T)
                                     torch.tensor(sampling, dtype=torch.long, device=dev), self.pool)
        if self.attention == "paged":   # 整行一次内核调用：请求按行里的顺序，各自的块表、key 数、query 数
            rows = [i for g in groups for i in g]
            ends = [seqs[i].num_computed_tokens + num_new_tokens[i] for i in rows]
            tables = [seqs[i].block_table[:-(-end // self.block_size)] for i, end in zip(rows, ends)]
            width = max(map(len, tables))
            flat.block_tables = torch.tensor([t + [self.null_block] * (width - len(t)) for t in tables],
                                             dtype=torch.int32, device=dev)                       # (R, max_blocks)
            flat.seq_lens = torch.tensor(ends, dtype=torch.int32, device=dev)                       # (R,)
            flat.query_lens = torch.tensor([num_new_tokens[i] for i in rows], dtype=torch.int32, device=dev)
            flat.slot_mapping = torch.cat([seg.slot_mapping for seg in segments])                 # (T,)
        return flat

    def _plan_segment(self, seqs, num_new_tokens: list[int]) -> AttentionMetadata:
        """一段：seqs[i] 这一步算位置 num_computed_tokens .. num_computed_tokens + num_new_tokens[i] - 1 的 token
        （prefill：还没进池子的全部；decode：1 个，带 k 个猜测时 k+1 个）。调度器负责让块表覆盖到要算的最后一个位置；
        没覆盖到说明调度器有 bug，这里给出清楚的错误。"""
        bs, dev = self.block_size, self.pool.device
        for seq, n in zip(seqs, num_new_tokens):
            end = seq.num_computed_tokens + n
            if not seq.num_computed_tokens < end <= seq.num_tokens_with_spec:
                raise RuntimeError(f"cannot compute {n} new tokens of a sequence with {seq.num_computed_tokens} of "
                                   f"{seq.num_tokens_with_spec} tokens computed")
            if end > len(seq.block_table) * bs:
                raise RuntimeError(f"block table of {len(seq.block_table)} blocks x {bs} slots does not cover "
                                   f"position {end - 1}: the scheduler must allocate blocks first")
        B = len(seqs)
        news = [(seq.token_ids + seq.spec_token_ids)[seq.num_computed_tokens:seq.num_computed_tokens + n]
                for seq, n in zip(seqs, num_new_tokens)]                          # 每行这次要算的 token（含猜测）
        L = max(len(t) for t in news)
        # 每行只用到这次要算的最后一个位置所在的块（一个提示词的块在接纳时一次分好，分块 prefill 的前几块用不到后面的块）
        tables = [seq.block_table[:-(-(seq.num_computed_tokens + n) // bs)] for seq, n in zip(seqs, num_new_tokens)]
        max_blocks = max(map(len, tables))
        cached = torch.tensor([seq.num_computed_tokens for seq in seqs])           # (B,)
        n_new = torch.tensor([len(t) for t in news])                               # (B,)
        # 左填充：真实 token 靠右，last_only 取到的就是每行最后一个真实 token
        input_ids = torch.tensor([[PAD_ID] * (L - len(t)) + t for t in news])      # (B, L)
        block_tables = torch.tensor([t + [self.null_block] * (max_blocks - len(t)) for t in tables])  # (B, max_blocks)
        pad = L - n_new                                                            # (B,) 每行的填充数
        col = torch.arange(L)
        real = col[None, :] >= pad[:, None]                                        # (1, L) >= (B, 1) -> (B, L)
        positions = torch.where(real, cached[:, None] + col[None, :] - pad[:, None], 0)   # (B, L)，填充处 0
        slots = block_tables.gather(1, positions // bs) * bs + positions % bs      # (B, L) 逻辑位置 → 物理槽
        token_index = real.flatten().nonzero().squeeze(1)                          # (N,)
        slot_mapping = slots.flatten()[token_index]                                # (N,)

        logits_index = torch.tensor([L - 1], device=dev)
        quant = dict(fmt=self.fmt, scales=self.scales, dtype=self.dtype)
        if not any(seq.num_computed_tokens for seq in seqs):
            # 全新的 prefill：K/V 就是这次前向自己算出来的 (B, H_kv, L, D)，掩码与 step04 的左填充 prefill 相同
            mask = attention_mask(pad, 0, L)                                       # (B, 1, 1, L, L)
            return AttentionMetadata(self.pool, input_ids.to(dev), positions.to(dev), mask.to(dev),
                                     token_index.to(dev), slot_mapping.to(dev), block_tables.to(dev), logits_index,
                                     **quant)
        if self.attention == "paged":   # 内核按块表直接读池子：只要每行的长度，不拷贝、不用掩码
            return AttentionMetadata(self.pool, input_ids.to(dev), positions.to(dev), None, token_index.to(dev),
                                     slot_mapping.to(dev), block_tables.to(device=dev, dtype=torch.int32), logits_index,
                                     (cached + n_new).to(device=dev, dtype=torch.int32),
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
        length = cached + n_new                                                    # (B,) 这次前向之后每行的长度
        own = torch.tensor([len(t) * bs for t in tables])                          # (B,) 每行自己的块覆盖到哪
        tail = (key_pos[None, :] >= length[:, None]) & (key_pos[None, :] < own[:, None])   # (B, S)
        tail = tail[:, None, :].expand(B, self.H_kv, S)                            # (B, H_kv, S)
        # 空块从不分给任何请求，正常情况下一直是 0；每次读之前把它的 V 再清零一遍（全部层，一块，几百 KiB），
        # 补齐读到的 V 就一定是 0，不依赖"没人写过它"
        self.pool[:, 1, self.null_block].zero_()
        read_buf = torch.empty(2 * B * self.H_kv * max_blocks, bs * self.D, device=dev, dtype=self.pool.dtype)
        scale_buf = (torch.empty(len(read_rows), bs, device=dev, dtype=SCALE_DTYPE)
                     if self.scales is not None else None)
        return AttentionMetadata(self.pool, input_ids.to(dev), positions.to(dev), mask[:, None, None].to(dev),  # (B, 1, 1, L, S)
                                 token_index.to(dev), slot_mapping.to(dev), block_tables.to(dev), logits_index,
                                 read_rows=read_rows.to(dev), read_buf=read_buf,
                                 v_tail_rows=tail.flatten().nonzero().squeeze(1).to(dev), scale_buf=scale_buf, **quant)


@dataclass
class FlatAttentionMetadata(KVCache):
    """一次展平前向的全部地址信息。模型照常调用 cache.attend(layer_idx, q, k, v)，形状是 (1, heads, T, D)。"""
    segments: list[AttentionMetadata]   # 按在行里的顺序：先是全部单 token 的（decode）一段，再是每个 prefill 块一段
    input_ids: torch.Tensor             # (1, T)  各段的新 token 首尾相接
    positions: torch.Tensor             # (1, T)  每个 token 在它自己的请求里的位置
    logits_index: torch.Tensor          # (R,)    要采样的请求（这次算到了它的最后一个 token）的最后一个 token 在行里的下标；
                                        #         验证猜测的请求是它最后 k+1 个 token 的下标
    pool: torch.Tensor                  # (layers, 2, num_blocks + 1, H_kv, block_size, D)
    # paged：整行一次写入、一次内核调用（gather 时是 None，每段各自写、读、算）
    slot_mapping: Optional[torch.Tensor] = None   # (T,)  行里第 t 个 token 的 K/V 写到哪个槽
    block_tables: Optional[torch.Tensor] = None   # (R, max_blocks) int32，R = 行里的请求数，按行里的顺序
    seq_lens: Optional[torch.Tensor] = None       # (R,) int32  这次前向之后每个请求有几个 key
    query_lens: Optional[torch.Tensor] = None     # (R,) int32  每个请求在行里有几个 query（首尾相接）
    mask = None                         # 掩码在每一段上（segment.mask）；KVCache 接口里的这一项不用

    @property
    def token_index(self) -> torch.Tensor:
        """这一行里真实 token 的下标（没有填充：0..T-1）；长度 = 真实 token 数。"""
        return torch.arange(sum(len(seg.token_index) for seg in self.segments))

    @property
    def gather_bytes(self) -> int:
        return sum(seg.gather_bytes for seg in self.segments)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, T, D)，k/v (1, H_kv, T, D) → (1, H, T, D)。paged：整行写进池子、一次内核调用；
        gather：每一段各自写入、读回、算注意力，再按原顺序拼回一行。"""
        if self.seq_lens is not None:
            layer = self.pool[layer_idx]
            bs = layer.shape[3]
            block, offset = self.slot_mapping // bs, self.slot_mapping % bs       # (T,), (T,)
            for kv, new in ((0, k), (1, v)):
                layer[kv, block, :, offset] = new[0].transpose(0, 1)             # (1, H_kv, T, D) -> (T, H_kv, D)
            out = paged_attention(q[0].transpose(0, 1), layer[0], layer[1], self.block_tables, self.seq_lens,
                                  self.query_lens)                                 # (T, H, D)
            return out.transpose(0, 1)[None]                                       # (T, H, D) -> (1, H, T, D)
        outs, start = [], 0
        for seg in self.segments:
            B, L = seg.input_ids.shape               # decode 段：B 个请求各 1 个；prefill 块：1 个请求 L 个
            span = slice(start, start + B * L)
            # (1, heads, T, D) 里属于这一段的 B·L 个位置 -> (heads, B, L, D) -> (B, heads, L, D)：上面的批形状（视图）
            qs, ks, vs = (x[0, :, span].unflatten(1, (B, L)).transpose(0, 1) for x in (q, k, v))
            out = seg.attend(layer_idx, qs, ks, vs)                    # 写进池子、取回这一段要看的 K/V、注意力：(B, H, L, D)
            outs.append(out.transpose(0, 1).flatten(1, 2))             # (B, H, L, D) -> (H, B, L, D) -> (H, B·L, D)
            start += B * L
        return torch.cat(outs, dim=1)[None]                            # (H, T, D) -> (1, H, T, D)
