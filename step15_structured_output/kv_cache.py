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

step08：量化的池子（--kv-dtype int8 / fp8）。池子存 1 字节的码，每个 (token, 头) 旁边一个 float32 的 scale：

    码     pool   (layers, 2, num_blocks + 1, H_kv, block_size, D)   int8 / float8_e4m3fn（同一布局）
    scale  scales (layers, 2, num_blocks + 1, H_kv, block_size, 1)   float32：一个 token 在一个头里的 D 个数共用一个

写（按 slot_mapping，同一处）：新 token 的 K/V 先量化，码和 scale 各写进自己的槽（quant.py 的 KVFormat）。
读（gather.py 那条路）：同样的 read_rows 一次 index_select 拷出码，再拷出对应的 scale，乘起来就是反量化后的
(B, H_kv, S, D)——模型代码一行不改。C++ 内核只读 float32 的池子，所以量化的池子总走 gather（反量化本来就要
一份新张量）。全新的 prefill 不读池子，但返回的也是"量化再读回"的 K/V：于是一个 token 在注意力里看到的值与它
何时被写、被切在哪一块、和谁一批都无关。kv_dtype 是另一种浮点（例如 float32 的模型用 bfloat16 存）时没有 scale：
写时转换，读时转回模型的 dtype。默认（fmt=None）池子就是模型的 dtype：精确模式，每一步与 step07 逐位相同。

step09：验证猜测。decode 中带着 k 个猜测的请求这一步算 k+1 个位置（上一步采样出的 token + k 个猜测），
与一个 prefill 块的做法完全相同：从 num_computed_tokens 起写进块表里的槽，看自己已在池子里的前缀 + 这 k+1 个
新 K/V（paged 时就是内核的 query 数 = k+1）。不同的只有两点：要算的 token 取自 token_ids + spec_token_ids
（猜测不是请求的 token）；这 k+1 个位置每个都要 logits（第 i 个位置的 logits 判断第 i+1 个猜测）。
被拒绝的猜测写进去的 K/V 留在槽里不管：num_computed_tokens 不把它们算进去，之后写这些位置时直接覆盖。

step09 还给服务器的 prompt logprobs 多排 logits 行（plan 的 prompt_logits）：要了它的请求，这一块里每个还要的
提示词位置都算 logits（prompt_rows），只为这个请求、只在它的 prefill 里；别的请求照旧只算采样的那一行。
"""
from dataclasses import dataclass
from typing import Optional

import torch

from common.config import ModelConfig
from common.kv_cache import KVCache
from step05_paged.paged_attention import kernel_available, paged_attention

from .gather import AttentionMetadata, attend_segments, plan_segments
from .quant import SCALE_DTYPE, KVFormat

ATTENTION_CHOICES = ("paged", "gather")


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

    def plan(self, seqs, num_new_tokens: list[int], prompt_logits: Optional[list[range]] = None) -> "FlatAttentionMetadata":
        """seqs[i] 这一步算 num_new_tokens[i] 个 token（从它的 num_computed_tokens 起），排成一行 (1, T)。
        只算 1 个的（decode，或 prefill 恰好只分到 1 个 token）排在行首，其余（prefill 的块、验证猜测的 k+1 个）
        依次接在后面（gather 读法按这个顺序切段）。算到最后一个 token 的请求要采样：logits_index 按 seqs 的顺序给出
        它的最后一个 token 在行里的下标（验证猜测的请求：最后 k+1 个），logits_rows[i] 是 seqs[i] 在模型返回的
        logits 里的行（不采样的为空）。prompt_logits[i]（Sequence.prompt_logits）：seqs[i] 还要 logits 的提示词位置，
        落在这一步的那几个排在它采样的行之前，prompt_rows[i] 是它们在 logits 里的行（按位置的顺序）。
        调度器负责让块表覆盖到要算的最后一个位置；没覆盖到说明调度器有 bug，这里给出清楚的错误。"""
        bs, dev = self.block_size, self.pool.device
        order = [i for i, n in enumerate(num_new_tokens) if n == 1] + [i for i, n in enumerate(num_new_tokens) if n > 1]
        input_ids, positions, slots, tables, seq_lens, start = [], [], [], [], [], {}
        for i in order:
            seq, n = seqs[i], num_new_tokens[i]
            computed, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if not computed < end <= seq.num_tokens_with_spec:
                raise RuntimeError(f"cannot compute {n} new tokens of a sequence with {computed} of "
                                   f"{seq.num_tokens_with_spec} tokens computed")
            if end > len(seq.block_table) * bs:
                raise RuntimeError(f"block table of {len(seq.block_table)} blocks x {bs} slots does not cover "
                                   f"position {end - 1}: the scheduler must allocate blocks first")
            # 只用到这次要算的最后一个位置所在的块（一个提示词的块在接纳时一次分好，分块 prefill 的前几块用不到后面的块）
            table = seq.block_table[:-(-end // bs)]
            start[i] = len(input_ids)                                  # 这个请求的 token 在行里从这里开始
            input_ids += (seq.token_ids + seq.spec_token_ids)[computed:end]        # 含猜测
            positions += range(computed, end)                          # 每个 token 在它自己的请求里的位置
            slots += [table[p // bs] * bs + p % bs for p in range(computed, end)]   # 逻辑位置 → 物理槽
            tables.append(table)
            seq_lens.append(end)
        width = max(map(len, tables))
        logits_index, logits_rows, prompt_rows = [], [], []
        for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            c, want = seq.num_computed_tokens, prompt_logits[i] if prompt_logits is not None else range(0)
            lo, hi = max(c, want.start), min(c + n, want.stop)     # 这一块里还要 logits 的提示词位置
            prompt_rows.append(range(len(logits_index), len(logits_index) + max(hi - lo, 0)))
            logits_index += range(start[i] + lo - c, start[i] + hi - c)
            # 采样的请求：它的最后一个 token；验证猜测的：最后 k+1 个（第 i 个位置的 logits 判断第 i+1 个猜测）
            k = 1 + len(seq.spec_token_ids) if c + n == seq.num_tokens_with_spec else 0
            logits_rows.append(range(len(logits_index), len(logits_index) + k))
            logits_index += range(start[i] + n - k, start[i] + n)

        def tensor(x, dtype=torch.long):
            return torch.tensor(x, dtype=dtype, device=dev)
        flat = FlatAttentionMetadata(
            self.pool, tensor([input_ids]), tensor([positions]), tensor(slots),
            tensor([t + [self.null_block] * (width - len(t)) for t in tables], torch.int32),   # 较短的块表用空块补齐
            tensor(seq_lens, torch.int32), tensor([num_new_tokens[i] for i in order], torch.int32),
            tensor(logits_index), logits_rows, prompt_rows=prompt_rows)
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
    logits_index: torch.Tensor    # (n,)    要采样的请求的最后一个 token 在行里的下标，按 plan 的 seqs 的顺序；
                                  #         验证猜测的请求是它最后 k+1 个 token 的下标
    logits_rows: list[range]      # 与 plan 的 seqs 一一对应：它在 logits（n 行）里的行；这一步不采样的为空
    segments: Optional[list[AttentionMetadata]] = None   # 只在 --attention gather 时有：按段读（gather.py）
    prompt_rows: Optional[list[range]] = None   # step09：与 seqs 一一对应，它这一步的提示词位置在 logits 里的行（prompt logprobs）
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
