"""张量并行（TP）与流水线并行（PP）的层：每个 rank 只存、只算模型的一份（Megatron-LM 的切法）。

    rank = pp_rank · tp_size + tp_rank        TP 是最内层的一维：一个 stage 的 TP 组是相邻的 rank（同一台机器）

张量并行（一个 stage 里的 tp_size 个 rank 一起算每一层）：

    列切 ColumnParallelLinear   Y = X·W，W (E, out) 按列（输出维）切成 tp 份：rank r 存 W[:, cols_r]，算出 Y[:, cols_r]。
                                不通信：每个 rank 都有完整的 X。q/k/v（按头切）、gate/up（按 F 切）都是列切。
    行切 RowParallelLinear      Y = X·W，W (in, E) 按行（输入维）切：rank r 存 W[rows_r, :]。它的输入正好是上一个列切层
                                留在本 rank 的那几列 X[:, rows_r]，于是 X·W = Σ_r X[:, rows_r]·W[rows_r, :]：
                                各 rank 的部分和加起来就是答案——一次 all-reduce。o_proj（按头）、down（按 F）是行切。

注意力的头彼此独立（softmax 在每个头里做），MLP 的 SwiGLU 是逐元素的：所以"列切 → 本 rank 自己算 → 行切"中间
不需要任何通信，一个注意力、一个 MLP 各一次 all-reduce，一层两次。KV cache 只存本 rank 的 KV 头：池子也是 1/TP。

词表（embedding 与 lm_head，SmolLM2 float32 里两份共 216 MiB，占一个进程全部 621 MiB 权重的 35%）也按行切
（vLLM 的 VocabParallelEmbedding / ParallelLMHead）：
embedding 每个 rank 只查自己那段 token id，查不到的位置给 0，all-reduce 相加就是完整的查表（只有一个 rank 非 0，
加法是精确的）；lm_head 每个 rank 算自己那段词表的 logits，gather 到本 stage 的第一个 rank 拼起来（采样在 rank 0）。
为什么不复制这两块：复制时每个 rank 的权重是 (1/TP 的层 + 整个词表)，TP = 3 时每个 rank 仍有全部权重的 57%；
每个 decode 步多出的通信只是一次 (T, E) 的 all-reduce 和一次 (R, V/TP) 的 gather（章节模式的 [4] 量了两种做法）。

KV 头少于 TP（tp > H_kv，tp 是 H_kv 的倍数）时照 vLLM 的做法复制 KV 头：每个 rank 1 个 KV 头，相邻的 tp / H_kv 个
rank 存同一个（vllm/model_executor/layers/linear.py 的 QKVParallelLinear：num_kv_head_replicas）。query 头总是切开。

流水线并行：stage s 只有第 layers[s] 层（与自己那一份 KV 池子）；第一个 stage 有 embedding，最后一个有 norm 与
lm_head；stage 之间只传 hidden states (B, L, E)：send/recv 给下一个 stage 里同一个 tp_rank 的 rank。

加载（load_shard）：每个 rank 从同一个 safetensors 只读自己那几片（safe_open 的 get_slice：mmap 切片，不读整个张量），
从不在一个 rank 上搭出完整的模型。
"""
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from common.config import ModelConfig
from common.errors import UserError
from common.linear import resolve_linear, use_linear_
from common.model import MLP, Attention, DecoderLayer, Linear, RMSNorm, RotaryEmbedding
from common.weights import check_weights, expected_shapes, safetensors_files


def check_parallel(cfg: ModelConfig, tp: int, pp: int) -> None:
    """这种切法能不能落到这个模型上；不能就一行 error（启动任何进程之前调用）。"""
    if tp < 1 or pp < 1:
        raise UserError(f"--tp and --pp must be >= 1, got {tp} and {pp}")
    H, H_kv = cfg.num_heads, cfg.num_kv_heads
    if H % tp:
        raise UserError(f"--tp {tp} does not divide the model's {H} query heads (choose a divisor of {H})")
    if H_kv % tp and tp % H_kv:
        raise UserError(f"--tp {tp} neither divides the model's {H_kv} KV heads nor is a multiple of them "
                        f"(KV heads are split when tp divides them, replicated when tp is a multiple)")
    if cfg.intermediate_size % tp:
        raise UserError(f"--tp {tp} does not divide the MLP width {cfg.intermediate_size}")
    if pp > cfg.num_layers:
        raise UserError(f"--pp {pp} is more than the model's {cfg.num_layers} layers")


@dataclass(frozen=True)
class Shard:
    """rank (tp_rank, pp_rank) 存模型的哪一份。range 里都是完整模型里的编号。"""
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    layers: range       # 这个 stage 的层
    heads: range        # 本 rank 的 query 头
    kv_heads: range     # 本 rank 的 KV 头（复制时几个 rank 的这一项相同）
    ffn: range          # 本 rank 的 MLP 中间维
    vocab: range        # 本 rank 的词表行（最后一个 rank 可能伸出 V 之外：补 0 的行，logits 拼好后截掉）

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def of(cls, cfg: ModelConfig, layout) -> "Shard":
        """layout：distributed.py 的 Layout 或 ParallelContext（rank 在 tp × pp 里的位置只在那里算）。"""
        tp, pp, tp_rank, pp_rank = layout.tp_size, layout.pp_size, layout.tp_rank, layout.pp_rank
        bounds = [i * cfg.num_layers // pp for i in range(pp + 1)]    # 层尽量平均地分给各 stage
        h, f = cfg.num_heads // tp, cfg.intermediate_size // tp
        if tp <= cfg.num_kv_heads:
            kv = cfg.num_kv_heads // tp
            kv_heads = range(tp_rank * kv, (tp_rank + 1) * kv)
        else:                                                          # 复制：每 tp / H_kv 个相邻的 rank 共用一个 KV 头
            kv_heads = range(tp_rank // (tp // cfg.num_kv_heads), tp_rank // (tp // cfg.num_kv_heads) + 1)
        v = -(-cfg.vocab_size // tp)                                   # 向上取整：gather 要求每份一样大
        return cls(tp_rank, tp, pp_rank, pp, range(bounds[pp_rank], bounds[pp_rank + 1]),
                   range(tp_rank * h, (tp_rank + 1) * h), kv_heads, range(tp_rank * f, (tp_rank + 1) * f),
                   range(tp_rank * v, (tp_rank + 1) * v))

    def rank_config(self, cfg: ModelConfig) -> ModelConfig:
        """本 rank 那一份的 ModelConfig：层数、头数、MLP 宽度是它自己的，其余（E、D、词表、上下文长度）不变。
        common/model.py 的 Attention / MLP 按它建出来的正好是切好的形状；PagedKVCache 按它建出来的正好是本 rank 的池子。"""
        return replace(cfg, num_layers=len(self.layers), num_heads=len(self.heads), num_kv_heads=len(self.kv_heads),
                       intermediate_size=len(self.ffn))


class ColumnParallelLinear(Linear):
    """W (in, out) 的第 cols 列：y = x·W[:, cols]，得到输出的第 cols 维。前向与 Linear 完全一样，不通信。"""

    def __init__(self, in_features: int, cols: range, bias: bool):
        super().__init__(in_features, len(cols), bias)
        self.cols = cols


class RowParallelLinear(Linear):
    """W (in, out) 的第 rows 行：输入是 x 的第 rows 维（上一个列切层留在本 rank 的那部分），
    输出是部分和 x[:, rows]·W[rows, :]，all-reduce 之后每个 rank 都得到完整的 x·W。bias 在 all-reduce 之后加一次。"""

    def __init__(self, rows: range, out_features: int, bias: bool, group):
        super().__init__(len(rows), out_features, bias)
        self.rows, self.group = rows, group

    def forward(self, x):
        y = self.matmul(x)                           # (..., in/TP) x (in/TP, out) -> (..., out)：部分和
        self.group.all_reduce(y)                     # Σ_r：每个 rank 都拿到完整的 x·W
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """词表的第 vocab 行。本 rank 管不到的 token 查出 0，all-reduce 相加（只有一个 rank 非 0）就是完整的查表。"""

    def __init__(self, vocab: range, dim: int, group):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(len(vocab), dim))   # (V/TP, E)
        self.vocab, self.group = vocab, group

    def forward(self, input_ids):                                   # (B, L)
        if self.group.size == 1:
            return F.embedding(input_ids, self.weight)              # (B, L, E)：与 nn.Embedding 相同
        local = input_ids - self.vocab.start
        mine = (local >= 0) & (local < len(self.vocab))             # (B, L) 这个 token 的行在不在本 rank
        x = F.embedding(torch.where(mine, local, 0), self.weight)   # (B, L, E)
        x = x.masked_fill(~mine[..., None], 0)
        self.group.all_reduce(x)
        return x


class ParallelLMHead(Linear):
    """lm_head (E, V) 的第 vocab 列：每个 rank 算自己那段词表的 logits (…, V/TP)，gather 到本 stage 的第一个 rank
    拼成 (…, V)（补 0 的列截掉）；其他 rank 得到 None——采样只在 rank 0 做，它们用不到 logits。"""

    def __init__(self, dim: int, vocab: range, vocab_size: int, group):
        super().__init__(dim, len(vocab), bias=False)
        self.vocab, self.vocab_size, self.group = vocab, vocab_size, group

    def forward(self, x) -> Optional[torch.Tensor]:
        y = self.matmul(x)                                          # (B, N, E) x (E, V/TP) -> (B, N, V/TP)
        full = self.group.gather(y)                                 # (B, N, TP·V/TP)，只在组里第一个 rank
        return None if full is None else full[..., :self.vocab_size]


class ParallelDecoderLayer(DecoderLayer):
    """common/model.py 的 DecoderLayer，按本 rank 的 ModelConfig 建（头数、F 已经是 1/TP），再把投影换成切好的层。
    注意力与 MLP 的前向一行不改：它们只看到"头少一些、F 窄一些"的模型，通信藏在两个行切层里。"""

    def __init__(self, rank_cfg: ModelConfig, layer_idx: int, shard: Shard, group):
        super().__init__(rank_cfg, layer_idx)   # layer_idx 是本 stage 里的层号：本 rank 的池子只有这个 stage 的层
        E, D, c = rank_cfg.hidden_size, rank_cfg.head_dim, rank_cfg
        q = range(shard.heads.start * D, shard.heads.stop * D)
        kv = range(shard.kv_heads.start * D, shard.kv_heads.stop * D)
        attn: Attention = self.self_attn
        attn.q_proj = ColumnParallelLinear(E, q, c.qkv_bias)
        attn.k_proj = ColumnParallelLinear(E, kv, c.qkv_bias)
        attn.v_proj = ColumnParallelLinear(E, kv, c.qkv_bias)
        attn.o_proj = RowParallelLinear(q, E, c.o_bias, group)
        mlp: MLP = self.mlp
        mlp.gate_proj = ColumnParallelLinear(E, shard.ffn, c.mlp_bias)
        mlp.up_proj = ColumnParallelLinear(E, shard.ffn, c.mlp_bias)
        mlp.down_proj = RowParallelLinear(shard.ffn, E, c.mlp_bias, group)


class ParallelTransformer(nn.Module):
    """一个 rank 上的那一份模型，接口与 common/model.py 的 Transformer 相同：forward(input_ids, positions, cache, ...)。
    每个 rank 用同一份输入调用它；logits 只在 rank 0 返回（其他 rank 返回 None）。

    pp = 1：embedding → 本 rank 的全部层 → norm → lm_head，每个 TP rank 各算自己的头和词表段。
    pp > 1：第一个 stage 查 embedding，其余从上一个 stage 收 hidden；不是最后一个 stage 就把 hidden 发给下一个；
            最后一个 stage 算 logits，发回 rank 0（rank 0 在第一个 stage：它发完 hidden 就等 logits）。"""

    def __init__(self, cfg: ModelConfig, shard: Shard, parallel):
        super().__init__()
        self.full_cfg, self.shard, self.parallel = cfg, shard, parallel
        self.cfg = shard.rank_config(cfg)            # 引擎按它建 KV 池子：本 stage 的层 × 本 rank 的 KV 头
        tp = parallel.tp_group
        self.embed_tokens = VocabParallelEmbedding(shard.vocab, cfg.hidden_size, tp) if shard.is_first_stage else None
        self.layers = nn.ModuleList(ParallelDecoderLayer(self.cfg, i, shard, tp) for i in range(len(shard.layers)))
        if shard.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = ParallelLMHead(cfg.hidden_size, shard.vocab, cfg.vocab_size, tp)
        else:
            self.norm = self.lm_head = None
        self.rope = RotaryEmbedding(cfg)

    @property
    def device(self):
        return next(self.parameters()).device

    @property
    def dtype(self):
        return next(self.parameters()).dtype

    def forward(self, input_ids, positions, cache=None, last_only=False, logits_index=None) -> Optional[torch.Tensor]:
        """input_ids, positions: (B, L) → rank 0 上是 logits (B, N, V)（N 同 Transformer：L、1 或 len(logits_index)），
        其他 rank 上是 None。每次前向的时间记进本 rank 的账（其中多少花在通信上，见 distributed.CommStats）。"""
        t0 = time.perf_counter()
        logits = self._forward(input_ids, positions, cache, last_only, logits_index)
        self.parallel.stats.add("forward", 0, time.perf_counter() - t0)
        return logits

    def _forward(self, input_ids, positions, cache, last_only, logits_index) -> Optional[torch.Tensor]:
        B, L = input_ids.shape
        par, E = self.parallel, self.full_cfg.hidden_size
        if self.embed_tokens is not None:
            x = self.embed_tokens(input_ids)                           # (B, L) -> (B, L, E)
        else:
            x = par.recv_hidden((B, L, E), self.dtype)                 # 上一个 stage 的 (B, L, E)
        cos, sin = self.rope(positions, x.dtype)                       # (B, L, D)
        for layer in self.layers:
            x = layer(x, cos, sin, cache)
        N = 1 if last_only else L if logits_index is None else len(logits_index)
        if self.lm_head is None:                                       # 不是最后一个 stage：hidden 交给下一个
            par.send_hidden(x)
            return par.recv_logits((B, N, self.full_cfg.vocab_size)) if par.rank == 0 else None
        if last_only:
            x = x[:, -1:]                                              # (B, 1, E)
        elif logits_index is not None:
            x = x[:, logits_index]                                     # (B, L, E) -> (B, N, E)
        logits = self.lm_head(self.norm(x))                            # (B, N, V)，只在本 stage 的第一个 rank
        logits = None if logits is None else logits.float()
        if par.pp_size > 1 and logits is not None:                     # 最后一个 stage 的第一个 rank → rank 0
            par.send_logits(logits)
            return None
        return logits


def checkpoint_slices(cfg: ModelConfig, shard: Shard) -> dict[str, tuple[str, Optional[int], Optional[range]]]:
    """本 rank 的每个参数名 → (检查点里的张量名, 切哪一维, 哪一段)。维度按 HF 的 (out, in) 布局：
    列切 = 切第 0 维（输出），行切 = 切第 1 维（输入），None = 整个（norm、行切层的 bias）。"""
    D = cfg.head_dim
    q = range(shard.heads.start * D, shard.heads.stop * D)
    kv = range(shard.kv_heads.start * D, shard.kv_heads.stop * D)
    names = expected_shapes(cfg)
    out = {}
    for i, g in enumerate(shard.layers):                                # 本 stage 的第 i 层 = 完整模型的第 g 层
        for short, dim, part in (("self_attn.q_proj.weight", 0, q), ("self_attn.q_proj.bias", 0, q),
                                 ("self_attn.k_proj.weight", 0, kv), ("self_attn.k_proj.bias", 0, kv),
                                 ("self_attn.v_proj.weight", 0, kv), ("self_attn.v_proj.bias", 0, kv),
                                 ("self_attn.o_proj.weight", 1, q), ("self_attn.o_proj.bias", None, None),
                                 ("mlp.gate_proj.weight", 0, shard.ffn), ("mlp.gate_proj.bias", 0, shard.ffn),
                                 ("mlp.up_proj.weight", 0, shard.ffn), ("mlp.up_proj.bias", 0, shard.ffn),
                                 ("mlp.down_proj.weight", 1, shard.ffn), ("mlp.down_proj.bias", None, None),
                                 ("input_layernorm.weight", None, None),
                                 ("post_attention_layernorm.weight", None, None),
                                 ("self_attn.q_norm.weight", None, None), ("self_attn.k_norm.weight", None, None)):
            if f"layers.{g}.{short}" in names:
                out[f"layers.{i}.{short}"] = (f"layers.{g}.{short}", dim, part)
    if shard.is_first_stage:
        out["embed_tokens.weight"] = ("embed_tokens.weight", 0, shard.vocab)
    if shard.is_last_stage:
        out["norm.weight"] = ("norm.weight", None, None)
        out["lm_head.weight"] = ("embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight", 0, shard.vocab)
    return out


def read_slice(sf, name: str, dim: Optional[int], part: Optional[range], size: int) -> torch.Tensor:
    """从打开的 safetensors 里只读一个张量的一段（mmap 切片）；part 伸出 size 之外的部分补 0（词表的最后一份）。"""
    if dim is None:
        return sf.get_tensor(name)
    sl = sf.get_slice(name)
    stop = min(part.stop, size)
    t = sl[part.start:stop] if dim == 0 else sl[:, part.start:stop]
    if stop < part.stop:
        pad = list(t.shape)
        pad[dim] = part.stop - stop
        t = torch.cat([t, t.new_zeros(pad)], dim=dim)
    return t


def load_shard(path, parallel, device: str, dtype: torch.dtype, linear: str = "auto") -> ParallelTransformer:
    """rank parallel.rank 的那一份模型：先在 meta 设备上搭骨架（不分配），再只读本 rank 的切片装进去。
    parallel 是 ParallelContext；只装权重、不跑前向时可以是 distributed.Layout。
    linear 同 common/weights.py 的 load_model：切片装好之后，每一片各自打包（common/linear.py）。"""
    impl = resolve_linear(linear, device, dtype)
    cfg = ModelConfig.from_dir(path)
    check_weights(path, cfg)
    check_parallel(cfg, parallel.tp_size, parallel.pp_size)
    shard = Shard.of(cfg, parallel)
    wanted = checkpoint_slices(cfg, shard)
    by_source: dict[str, list[str]] = {}
    for local, (src, _, _) in wanted.items():
        by_source.setdefault(src, []).append(local)     # tie 时 embedding 与 lm_head 读同一个张量
    full = expected_shapes(cfg)
    state = {}
    for f in safetensors_files(path):
        with safe_open(f, framework="pt", device="cpu") as sf:
            for name in sf.keys():
                for local in by_source.get(name.removeprefix("model."), ()):
                    _, dim, part = wanted[local]
                    size = full[wanted[local][0]][dim] if dim is not None else 0
                    t = read_slice(sf, name, dim, part, size).to(device=device, dtype=dtype)
                    # 投影矩阵 (out, in) -> (in, out)，与 common/weights.py 相同；embedding 保持 (V, E)
                    state[local] = t.t().contiguous() if t.dim() == 2 and local != "embed_tokens.weight" else t
    with torch.device("meta"):
        model = ParallelTransformer(cfg, shard, parallel)
    model.load_state_dict(state, strict=True, assign=True)
    state.clear()
    return use_linear_(model, impl).eval()
