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

step12：KV 驱逐。一个请求在池子里占的是槽 0..kv_len−1（sequence.py）：token t 写进槽 t − num_evicted，seq_lens 是
槽数，内核一行不改——它本来就按槽号做因果（第 i 个 query 在槽 seq_len − q_len + i，看槽号不超过它的 key），
留下的 key 按原文顺序排在前面，新 token 接在后面。RoPE 的位置另给：text 是原文位置 t（同 step09），cache 是
写入时的槽号 t − num_evicted（StreamingLLM）。两件新事：

  打分（h2o / snapkv）：内核从不写出注意力概率。要分数的请求（plan 的 score_queries），attend 写完新 K 之后按块表
  把它全部槽的 K 再读一遍，用它最后几个 query 算 softmax(q·Kᵀ/√D)（同样的因果规则，float32），按 KV 组求和，
  加进 seq.kv_scores——代价是每层多读一遍这个请求的 K、多算一遍分数（章节量了）。
  压缩（compact）：把每层、每个头要留的槽（eviction.kept_slots）拷进新分到的块的槽 0..B−1；cache 位置时 key 顺便
  转到新槽号（eviction.rerotate）。先拷出、再写入：新块可能正是刚还掉的旧块。
  16 位的池子（bfloat16 / float16）在 cache 位置下不这样补转：每转一次就舍入一次，挪过几百次的 key 会漂走
  （docs/12 第 3 节量过）。它存 RoPE 之前的 K（pre_rope），模型拿到的位置全是 0（RoPE 成了恒等变换），q 和读回的 K
  在注意力里按槽号各转一次（gather.py；StreamingLLM 自己的代码也是这样），压缩只搬、不转。
滑动窗口模型（cfg.layer_windows）：窗口层的掩码在 gather.py，内核没有窗口，所以这种模型总走 gather。
"""
from dataclasses import dataclass, field
from typing import Optional

import torch

from common.config import ModelConfig
from common.kv_cache import KVCache
from common.model import rope_inv_freq
from step05_paged.paged_attention import kernel_available, paged_attention

from .eviction import attention_scores, rerotate
from .gather import AttentionMetadata, attend_segments, plan_segments
from .quant import SCALE_DTYPE, KVFormat

ATTENTION_CHOICES = ("paged", "gather")


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device, dtype, attention: str = "paged",
                 fmt: Optional[KVFormat] = None):
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}")
        attention = "gather" if fmt is not None else attention   # 内核只读模型 dtype 的池子：量化的池子走 gather
        # step12：滑动窗口层（cfg.layer_windows）的掩码在 gather.py 里；内核没有窗口，所以这种模型也走 gather
        self.windows = cfg.layer_windows if cfg.sliding else ()
        attention = "gather" if self.windows else attention
        self.num_blocks, self.block_size, self.attention = num_blocks, block_size, attention
        self.fmt, self.dtype = fmt, dtype
        self.H_kv, self.D = cfg.num_kv_heads, cfg.head_dim
        self.num_layers, self.inv_freq = cfg.num_layers, rope_inv_freq(cfg)   # step12：压缩时重新旋转 key 要用
        self.cache_positions = False   # step12：True = RoPE 用槽号（kv_positions=cache）；引擎调用 use_cache_positions
        self.pre_rope = False          # step12：True = 池子里存 RoPE 之前的 K，注意力读出来再按槽号转
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

    def use_cache_positions(self) -> None:
        """step12：RoPE 用槽号（kv_positions=cache）。float32 的池子存转好的 K，压缩时挪了槽的 key 补转一次
        （一千次补转漂约 1e-5，可以不管）；16 位的池子存 RoPE 之前的 K（见文件开头），走 gather 的读法：
        分页内核直接拿池子里的 K 算分数，中间转不了。"""
        self.cache_positions = True
        if self.pool.dtype in (torch.bfloat16, torch.float16):
            self.pre_rope, self.attention = True, "gather"

    @property
    def rerotates_on_compaction(self) -> bool:
        """压缩时挪了槽的 key 要不要补转：cache 位置、池子里是转好的 K 时要。"""
        return self.cache_positions and not self.pre_rope

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

    def plan(self, seqs, num_new_tokens: list[int], prompt_logits: Optional[list[range]] = None,
             score_queries: Optional[list[int]] = None) -> "FlatAttentionMetadata":
        """seqs[i] 这一步算 num_new_tokens[i] 个 token（从它的 num_computed_tokens 起），排成一行 (1, T)。
        只算 1 个的（decode，或 prefill 恰好只分到 1 个 token）排在行首，其余（prefill 的块、验证猜测的 k+1 个）
        依次接在后面（gather 读法按这个顺序切段）。算到最后一个 token 的请求要采样：logits_index 按 seqs 的顺序给出
        它的最后一个 token 在行里的下标（验证猜测的请求：最后 k+1 个），logits_rows[i] 是 seqs[i] 在模型返回的
        logits 里的行（不采样的为空）。prompt_logits[i]（Sequence.prompt_logits）：seqs[i] 还要 logits 的提示词位置，
        落在这一步的那几个排在它采样的行之前，prompt_rows[i] 是它们在 logits 里的行（按位置的顺序）。
        调度器负责让块表覆盖到要算的最后一个位置；没覆盖到说明调度器有 bug，这里给出清楚的错误。
        step12：槽 = 位置 − num_evicted（块表、slot_mapping、seq_lens 都按槽）；score_queries[i] > 0：seqs[i] 最后这么多个
        query 的注意力概率加进它的 kv_scores（打分，见文件开头）。"""
        bs, dev = self.block_size, self.pool.device
        order = [i for i, n in enumerate(num_new_tokens) if n == 1] + [i for i, n in enumerate(num_new_tokens) if n > 1]
        input_ids, positions, slots, tables, seq_lens, start = [], [], [], [], [], {}
        for i in order:
            seq, n = seqs[i], num_new_tokens[i]
            computed, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if not computed < end <= seq.num_tokens_with_spec:
                raise RuntimeError(f"cannot compute {n} new tokens of a sequence with {computed} of "
                                   f"{seq.num_tokens_with_spec} tokens computed")
            first, last = computed - seq.num_evicted, end - seq.num_evicted   # 这次写的槽 first .. last − 1
            if last > len(seq.block_table) * bs:
                raise RuntimeError(f"block table of {len(seq.block_table)} blocks x {bs} slots does not cover "
                                   f"slot {last - 1}: the scheduler must allocate blocks first")
            # 只用到这次要写的最后一个槽所在的块（一个提示词的块在接纳时一次分好，分块 prefill 的前几块用不到后面的块）
            table = seq.block_table[:-(-last // bs)]
            start[i] = len(input_ids)                                  # 这个请求的 token 在行里从这里开始
            input_ids += (seq.token_ids + seq.spec_token_ids)[computed:end]        # 含猜测
            # RoPE 的位置：原文位置（text），或写入时的槽号（cache）；池子存 RoPE 之前的 K 时全是 0（注意力里再转）
            positions += [0] * n if self.pre_rope else range(first, last) if self.cache_positions else range(computed, end)
            slots += [table[s // bs] * bs + s % bs for s in range(first, last)]   # 槽 → 物理槽
            tables.append(table)
            seq_lens.append(last)
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
            tensor(logits_index), logits_rows, prompt_rows=prompt_rows,
            inv_freq=self.inv_freq.to(dev) if self.pre_rope else None)
        if self.attention == "gather":   # 参考读法：按段 gather（gather.py）
            flat.segments = plan_segments(self, seqs, num_new_tokens)
        for i, m in enumerate(score_queries or ()):
            if m > 0:
                seq, n = seqs[i], num_new_tokens[i]
                S = seq.num_computed_tokens + n - seq.num_evicted              # 这次前向之后的槽数
                if seq.kv_scores is None or seq.kv_scores.shape[2] < S:        # 容量跟着块表长
                    grown = torch.zeros(self.num_layers, self.H_kv, len(seq.block_table) * bs, device=dev)
                    if seq.kv_scores is not None:
                        grown[:, :, :seq.kv_scores.shape[2]] = seq.kv_scores
                    seq.kv_scores = grown
                flat.scored.append(ScoreRequest(seq, start[i], n, min(m, n), S,
                                                tensor(seq.block_table[:-(-S // bs)])))
        return flat

    def compact(self, old_table: list[int], new_table: list[int], kept: torch.Tensor,
                deltas: Optional[torch.Tensor] = None) -> None:
        """step12：kept (layers, H_kv, B) 是旧块表里每层、每个头要留的槽（升序）→ 拷进新块表的槽 0..B−1。
        deltas（同形状，cache 位置时）：每个 key 再转多少个位置（eviction.rerotate）；V 不转。"""
        bs, dev = self.block_size, self.pool.device
        old, B = torch.tensor(old_table, device=dev), kept.shape[-1]
        kept = kept.to(dev)
        src_block, src_off = old[kept // bs], kept % bs                       # 各 (layers, H_kv, B)
        dst = torch.arange(B, device=dev)
        dst_block, dst_off = torch.tensor(new_table, device=dev)[dst // bs], dst % bs   # 各 (B,)
        heads = torch.arange(self.H_kv, device=dev)[:, None]                  # (H_kv, 1)：与 (H_kv, B) 的下标广播
        for layer in range(self.num_layers):
            for pool in self.tensors():                                       # 池子（量化时还有 scale：驱逐不与量化同开）
                t = pool[layer]                                               # (2, num_blocks + 1, H_kv, bs, D)
                kv = t[:, src_block[layer], heads, src_off[layer]]            # 拷出 (2, H_kv, B, D)：每个头自己的槽
                if deltas is not None and pool is self.pool:
                    kv[0] = rerotate(kv[0], deltas[layer].to(dev), self.inv_freq)
                t[:, dst_block, heads, dst_off] = kv                          # 写进新块的槽 0..B−1


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
    scored: list["ScoreRequest"] = field(default_factory=list)   # step12：这一步要打分的请求
    inv_freq: Optional[torch.Tensor] = None   # step12：池子存 RoPE 之前的 K 时，打分前把 q 与 K 按槽号转（pre_rope）
    mask = None                   # paged 不用掩码；gather 的掩码在每一段上

    @property
    def gather_bytes(self) -> int:
        return sum(seg.gather_bytes for seg in self.segments or ())

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, T, D)，k/v (1, H_kv, T, D) → (1, H, T, D)。paged：整行写进池子、一次内核调用；
        gather：每一段各自写入、读回、算注意力，再按原顺序拼回一行（gather.py）。"""
        if self.segments is not None:
            out = attend_segments(self.segments, layer_idx, q, k, v)
        else:
            layer = self.pool[layer_idx]
            bs = layer.shape[3]
            block, offset = self.slot_mapping // bs, self.slot_mapping % bs       # (T,), (T,)
            for kv, new in ((0, k), (1, v)):
                layer[kv, block, :, offset] = new[0].transpose(0, 1)             # (1, H_kv, T, D) -> (T, H_kv, D)
            out = paged_attention(q[0].transpose(0, 1), layer[0], layer[1], self.block_tables, self.seq_lens,
                                  self.query_lens).transpose(0, 1)[None]           # (T, H, D) -> (1, H, T, D)
        for r in self.scored:                  # step12：新 K 已经写进池子，再读一遍这个请求的全部 K 来打分
            keys = self.pool[layer_idx, 0, r.blocks]                               # (nb, H_kv, bs, D)
            keys = keys.transpose(0, 1).flatten(1, 2)[:, :r.num_slots]             # (H_kv, nb·bs, D) -> (H_kv, S, D)
            qs = q[0, :, r.start:r.start + r.num_queries]                          # (H, n, D)
            if self.inv_freq is not None:      # 池子里是 RoPE 之前的 K：key 在槽 0..S−1，这 n 个 query 在最后 n 个槽
                keys = rerotate(keys, torch.arange(r.num_slots, device=keys.device), self.inv_freq)
                qs = rerotate(qs, torch.arange(r.num_slots - r.num_queries, r.num_slots, device=qs.device), self.inv_freq)
            r.seq.kv_scores[layer_idx, :, :r.num_slots] += attention_scores(qs, keys, r.num_voters)
        return out


@dataclass
class ScoreRequest:
    """step12：一个要打分的请求在这次前向里的样子。"""
    seq: object                   # 它的 Sequence（分数加进 seq.kv_scores）
    start: int                    # 它的 query 在行里从哪开始
    num_queries: int              # 它这一步有几个 query
    num_voters: int               # 其中最后几个的概率算进分数（h2o：全部；snapkv：观察窗口）
    num_slots: int                # 这次前向之后它有几个槽（S）
    blocks: torch.Tensor          # (blocks_for(S),) 覆盖这些槽的物理块
