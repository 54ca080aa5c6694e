"""eager 的融合路径：内核快了以后，decode 一步里矩阵乘之外的时间主要是几千个小算子各自的调用开销
（每个 aten 算子几微秒，算的只有几百个数；bench/decode_speed.py 的"其余 ms"与"算子/步"）。这里把每层最碎的几处
换成 kernels.py 里的一次 C++ 调用，模型的数学不变：

    use_block_weights_(model, "q4_1")
    use_fused_ops_(model)           # 每个 DecoderLayer 换成 FusedDecoderLayer；run.py 的 --fused-ops

每层换掉的（括号里是 PyTorch eager 要发的算子数）：
  input_layernorm（8：pow、mean、add、rsqrt、两次 mul、两次 to）      → kernels.rms_norm，1 次调用
  残差相加 + post_attention_layernorm（9）                             → 同一个调用，带 residual
  q、k 的 RoPE（各 8：两次取 cos/sin 的视图、切两半、取负、拼接、两次乘、一次加） → kernels.rope，各 1 次调用（原地）
  q/k/v 三个投影、gate/up 两个投影                                      → 各拼成一个 BlockLinear（linear.fuse_block_linears）：
                                                                        每层 7 次内核调用变 4 次，少了切分前后的几个视图
没有换的：SiLU·mul（2 个算子；C++ 里要一个向量化的 exp 才不比 PyTorch 的慢）、注意力（缓存的 attend 决定，见 step03）、
第二个残差相加（要跨层挪到下一层的 RMSNorm 里，得改 Transformer 的循环）。
数：RoPE 与 PyTorch 逐位相同（同一个算式，不合成 FMA）；RMSNorm 在 C++ 里按另一种顺序求平方和，所以 logits 与
PyTorch 的写法差在最后几位（舍入），贪心 token 按近平局规则相同（tests/test_step14_fused.py）。torch.compile 追踪时这些函数退回 PyTorch 的写法：
inductor 自己会把它们融合成几个 C++ 内核。
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from common.errors import UserError
from common.model import DecoderLayer, RMSNorm, apply_rope, attention, causal_mask

from . import kernels
from .linear import fuse_block_linears


def _fast(*xs) -> bool:
    """这几个张量能不能直接交给 C++：CPU float32、连续，且不在 torch.compile 的追踪里。"""
    return not torch.compiler.is_compiling() and all(
        x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() for x in xs)


def rms_norm(norm: RMSNorm, x: torch.Tensor, residual=None) -> tuple[torch.Tensor, torch.Tensor]:
    """返回 (norm(h), h)，h = x + residual（没有 residual 时 h = x）。有 residual 时 h 原地写进 x：
    x 必须是调用方自己刚算出来、别处不再用的张量（这里是 o_proj 的输出）。"""
    if not _fast(x, norm.weight) or (residual is not None and not _fast(residual)):
        h = x if residual is None else residual + x
        return norm(h), h
    y = torch.empty_like(x)
    E = x.shape[-1]
    kernels.library().rms_norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(), norm.weight.data_ptr(),
                               y.data_ptr(), x.numel() // E, E, norm.eps)
    return y, x


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, L, heads, D)（转置之前的布局，可以是 qkv 输出按列切出来的视图），cos/sin (B, L, D)。
    C++ 路径原地转、返回 x；别的情况（编译时、不是 CPU float32）返回 PyTorch 算出的新张量，同一个算式。"""
    B, L, heads, D = x.shape
    rows_ok = x.stride(3) == 1 and x.stride(2) == D and x.stride(0) == L * x.stride(1)   # 每个 token 一行，行距固定
    if not (rows_ok and _fast(cos, sin) and x.dtype == torch.float32 and x.device.type == "cpu"):
        return apply_rope(x.transpose(1, 2), cos, sin).transpose(1, 2)                   # (B, L, heads, D)
    kernels.library().rope(x.data_ptr(), x.stride(1), B * L, heads, D, cos.data_ptr(), sin.data_ptr())
    return x


def _fused_or_kept(parts: list) -> nn.ModuleList:
    """能拼（linear.fuse_block_linears）就拼成一个，否则原样保留几个。"""
    fused = fuse_block_linears(parts)
    return nn.ModuleList([fused] if fused is not None else parts)


class FusedDecoderLayer(nn.Module):
    """common.model.DecoderLayer 同样的数学，上面那几处换成一次 C++ 调用。Attention、MLP 的代码照抄进 forward，
    只有标了"融合"的几行不同。"""

    def __init__(self, layer: DecoderLayer):
        super().__init__()
        a, m = layer.self_attn, layer.mlp
        self.layer_idx, self.H, self.H_kv, self.D, self.window = a.layer_idx, a.H, a.H_kv, a.D, a.window
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = _fused_or_kept([a.q_proj, a.k_proj, a.v_proj])                 # 1 个 (E, (H + 2·H_kv)·D) 或 3 个
        self.o_proj = a.o_proj
        self.qk_norm = a.qk_norm
        if a.qk_norm:
            self.q_norm, self.k_norm = a.q_norm, a.k_norm
        self.gate_up = _fused_or_kept([m.gate_proj, m.up_proj])                   # 1 个 (E, 2F) 或 2 个
        self.down_proj = m.down_proj

    def forward(self, x, cos, sin, cache=None):
        B, L, _ = x.shape
        H, H_kv, D = self.H, self.H_kv, self.D
        h, _ = rms_norm(self.input_layernorm, x)                                   # 融合：1 次调用
        if len(self.qkv) == 1:
            q, k, v = self.qkv[0](h).split([H * D, H_kv * D, H_kv * D], dim=-1)    # (B, L, (H + 2·H_kv)·D) -> 3 份
        else:
            q, k, v = (p(h) for p in self.qkv)
        q, k, v = q.view(B, L, H, D), k.view(B, L, H_kv, D), v.view(B, L, H_kv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope_(q, cos, sin), rope_(k, cos, sin)                              # 融合：各 1 次调用，原地
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)          # (B, heads, L, D)
        if cache is None:
            mask = None if self.window is None else causal_mask(L, L, x.device, self.window)
            out = attention(q, k, v, mask)                                         # (B, H, L, D)
        else:
            out = cache.attend(self.layer_idx, q, k, v)
        out = self.o_proj(out.transpose(1, 2).reshape(B, L, H * D))               # (B, L, E)
        h, x = rms_norm(self.post_attention_layernorm, out, residual=x)           # 融合：x + attn、RMSNorm 1 次调用
        if len(self.gate_up) == 1:
            gate, up = self.gate_up[0](h).chunk(2, dim=-1)                          # (B, L, 2F) -> 2 × (B, L, F)
        else:
            gate, up = (p(h) for p in self.gate_up)
        return x + self.down_proj(F.silu(gate) * up)                              # (B, L, E)


def use_fused_ops_(model):
    """把模型的每个 DecoderLayer 原地换成 FusedDecoderLayer，返回模型。要 CPU float32 与编译好的 step14 内核库。"""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        raise UserError(f"--fused-ops runs C++ ops on CPU float32 activations, not {model.device}/{model.dtype}")
    if not kernels.kernel_available():
        raise UserError(f"--fused-ops: the C++ kernel library could not be built: {kernels.kernel_build_error()}")
    for i, layer in enumerate(model.layers):
        model.layers[i] = FusedDecoderLayer(layer)
    return model
