"""Llama 系列解码器（llama / qwen2 / qwen3 / mistral / ministral），从零实现，可以从上读到下。

形状记号见 common/shapes.py：B, L, S, E, F, V, H, H_kv, D。

forward(input_ids, positions, cache=None, last_only=False, logits_index=None)：
  - positions 显式传入（RoPE 用真实位置，后面有 KV cache 时要加上偏移）；
  - cache 是本次前向看到的 KV cache（接口见 common/kv_cache.py）：每层调用 `cache.attend(layer_idx, q, k, v)`，
    它把新 K/V 存进去、取回要看的全部 K/V 和掩码，再调用下面的 attention()。
    step01/02 不传（每步重算整段序列，用因果掩码），step03 传入连续缓存，step04 传入带左填充掩码的批缓存，
    step05 传入分页缓存这次前向的视图——模型代码一行不改。
  - 滑动窗口层（cfg.layer_windows，mistral / 开了 use_sliding_window 的 qwen2）：不传 cache 时这里的掩码带窗口；
    传了 cache 时窗口归缓存管（只有 step12 的缓存认识窗口，更早的步骤在加载时就拒绝这种模型，见 common/cli.py）。
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig
from .linear import packed_matmul


class Linear(nn.Module):
    """与 nn.Linear 算的一样（y = x·Wᵀ + b），只是权重按 (in, out) 存放、直接算 x @ W。
    为什么：decode 时每层都是"向量 × 矩阵"，时间几乎全花在读权重上；开发机上 MKL 对 (in, out) 布局的
    矩阵-向量乘比 nn.Linear 的 (out, in) 布局快（差多少随机器而变，复测脚本见 docs/01_naive.md）。
    加载时把 HF 检查点里的 (out, in) 权重转置一次（common/weights.py）。CPU float32 上加载后默认再打包一次
    （packed：只留 oneDNN 块格式的那一份，weight 为 None；为什么、怎么关掉见 common/linear.py）。"""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))  # (in, out)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed = None                           # 打包后的权重（common/linear.py 的 pack_）；None = 用 weight

    def forward(self, x):
        y = self.matmul(x)                           # (..., in) x (in, out) -> (..., out)
        return y if self.bias is None else y + self.bias

    def matmul(self, x):
        """x·W，不加 bias（step10 的行切层在 all-reduce 之后才加 bias）。"""
        return x @ self.weight if self.packed is None else packed_matmul(x, self.packed)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) * weight；在 float32 里算：bf16 只存 7 位尾数会丢精度，fp16 的平方和会溢出。"""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """每对维度 (i, i + D/2) 的旋转角速度 θ_i = theta^(-2i/D)，以及 linear / llama3 两种长上下文缩放。"""
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float() / D))
    rs = cfg.rope_scaling
    if rs["rope_type"] == "linear":
        inv_freq = inv_freq / rs["factor"]
    elif rs["rope_type"] == "llama3":
        # Llama 3.1: 低频（长波长）分量除以 factor，高频不动，中间平滑过渡
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_ctx = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq  # (D/2,)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inv_freq = rope_inv_freq(cfg)  # 普通属性而非 buffer：不进 state_dict，也不受 meta 设备影响

    def forward(self, positions, dtype):
        """positions (B, L) 整数 → cos, sin 各 (B, L, D)。"""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq    # (B, L, 1) * (D/2,) -> (B, L, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)                 # (B, L, D)：前后两半共用同一组角度
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)            # (..., D/2) 各一半
    return torch.cat((-x2, x1), dim=-1)    # 把 (x1, x2) 旋转 90°：(-x2, x1)


def apply_rope(x, cos, sin):
    """x (B, heads, L, D)，cos/sin (B, L, D)：第 i 对分量 (x_i, x_{i+D/2}) 旋转角度 pos·θ_i。"""
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, L, D)，对所有头广播
    return x * cos + rotate_half(x) * sin


def causal_mask(L: int, S: int, device, window=None) -> torch.Tensor:
    """(L, S) 布尔矩阵，True = 可以看。右下对齐：第 i 个 query 位于绝对位置 S-L+i，看得到 key 0..S-L+i。
    没有缓存时 L == S，就是普通的下三角；decode 时 L == 1，唯一的 query 看得到全部 S 个 key。
    window = W（滑动窗口层）：再去掉太老的 key，只留 S-L+i-W < j，即连自己在内最近的 W 个（带状矩阵）。"""
    mask = torch.ones(L, S, dtype=torch.bool, device=device).tril(diagonal=S - L)
    return mask if window is None else mask.triu(diagonal=S - L - window + 1)


def attention(q, k, v, mask=None):
    """缩放点积注意力，GQA 不复制 K/V。q (B, H, L, D)，k/v (B, H_kv, S, D) → (B, H, L, D)。
    mask：可广播到 (B, 1, 1, L, S) 的布尔张量（H_kv、G 两维广播），True = 可以看；None = causal_mask(L, S)。"""
    B, H, L, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    G = H // H_kv
    # GQA：query 头 h 使用 KV 头 h // G。把 H 拆成 (H_kv, G)，同组 G 个头和 L 个位置并成一维，
    # 这样一次 matmul 就让 G 个 query 头共享同一份 K/V，不需要把 K/V 复制 G 份。
    q = q.reshape(B, H_kv, G * L, D)                          # (B, H, L, D) -> (B, H_kv, G·L, D)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)           # (B, H_kv, G·L, D) x (B, H_kv, D, S) -> (B, H_kv, G·L, S)
    scores = scores.view(B, H_kv, G, L, S)
    if mask is None:
        mask = causal_mask(L, S, q.device)                    # (L, S)
    # 用 dtype 的最小值而不是 -inf：整行都被遮住（填充行）时 softmax 不会出 NaN
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # 在 float32 里做 softmax
    out = probs.view(B, H_kv, G * L, S) @ v                   # (B, H_kv, G·L, S) x (B, H_kv, S, D) -> (B, H_kv, G·L, D)
    return out.view(B, H, L, D)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.H, self.H_kv, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        E = cfg.hidden_size
        self.q_proj = Linear(E, self.H * self.D, bias=cfg.qkv_bias)
        self.k_proj = Linear(E, self.H_kv * self.D, bias=cfg.qkv_bias)
        self.v_proj = Linear(E, self.H_kv * self.D, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.H * self.D, E, bias=cfg.o_bias)
        if cfg.qk_norm:  # qwen3：每个头的 q、k 在 RoPE 之前各做一次 RMSNorm
            self.q_norm = RMSNorm(self.D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.D, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.window = cfg.layer_windows[layer_idx]   # 滑动窗口 W，None = 全注意力

    def forward(self, x, cos, sin, cache=None):
        B, L, _ = x.shape
        H, H_kv, D = self.H, self.H_kv, self.D
        q = self.q_proj(x).view(B, L, H, D)        # (B, L, E) -> (B, L, H, D)
        k = self.k_proj(x).view(B, L, H_kv, D)     # (B, L, H_kv, D)
        v = self.v_proj(x).view(B, L, H_kv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, L, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        if cache is None:   # 没有缓存：本次前向的 K/V 就是全部，因果掩码（滑动窗口层再去掉窗口外的 key）
            mask = None if self.window is None else causal_mask(L, L, x.device, self.window)
            out = attention(q, k, v, mask)                        # (B, H, L, D)
        else:               # 缓存只存 H_kv 个头（不存重复后的 H 个头），决定新 K/V 存哪、这次看哪些 K/V
            out = cache.attend(self.layer_idx, q, k, v)           # (B, H, L, D)
        out = out.transpose(1, 2).reshape(B, L, H * D)            # (B, H, L, D) -> (B, L, H·D)
        return self.o_proj(out)                                   # (B, L, E)


class MLP(nn.Module):
    """SwiGLU：down( silu(gate(x)) * up(x) )。"""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, Fd = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(E, Fd, bias=cfg.mlp_bias)
        self.up_proj = Linear(E, Fd, bias=cfg.mlp_bias)
        self.down_proj = Linear(Fd, E, bias=cfg.mlp_bias)

    def forward(self, x):                                         # (B, L, E)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, L, F) -> (B, L, E)


class DecoderLayer(nn.Module):
    """Pre-norm 残差块：x + Attn(Norm(x))，再 x + MLP(Norm(x))。"""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """参数名与 HF 的 `model.*` / `lm_head.*` 一一对应（去掉前缀 "model."），权重可以直接装进来。"""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # 权重总是从检查点装进来：给一个未初始化的张量，跳过 nn.Embedding 的随机初始化
        # （在 meta 设备上第一次 normal_ 要先 import 一整套元函数，每个进程多花约 2 s）
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # tie 时装入 embed_tokens 的转置副本
        self.rope = RotaryEmbedding(cfg)

    # 看最后那个 RMSNorm 的权重：它总是一个普通的 dtype 张量，而词嵌入表可以被换成别的存法（量化的块）
    @property
    def device(self):
        return self.norm.weight.device

    @property
    def dtype(self):
        return self.norm.weight.dtype

    def forward(self, input_ids, positions, cache=None, last_only=False, logits_index=None):
        """input_ids, positions: (B, L) → logits (B, L, V)；last_only=True 时只算最后一个位置 (B, 1, V)；
        logits_index (N,) 时只算每行这 N 个位置 (B, N, V)（step07：展平成一行的批里，只有每个要采样的请求的最后一个 token）。"""
        x = self.embed_tokens(input_ids)                 # (B, L) -> (B, L, E)
        cos, sin = self.rope(positions, x.dtype)         # (B, L, D) 各一份，所有层共用
        for layer in self.layers:
            x = layer(x, cos, sin, cache)
        if last_only:
            x = x[:, -1:]                                # 生成只需要最后一个位置：省掉 (L-1)·E·V 次乘加
        elif logits_index is not None:
            x = x[:, logits_index]                       # (B, L, E) -> (B, N, E)：其余 L-N 个位置的 logits 没人用
        return self.lm_head(self.norm(x)).float()        # (B, L, E) x (E, V) -> (B, L, V)，logits 统一用 float32
