"""step03 的 decode 之外的几条"快路"，各自是一课，简单路径（common/model.py、step03）一行没改；
bench/decode_speed.py 逐级测量：

0. 融合投影（精确到舍入）：q/k/v 三个投影、gate/up 两个投影各拼成一个矩阵，一次矩阵乘读完
   （每层少 3 次矩阵乘和它们前后的小算子）。fuse_projections_ 把模型里的 Attention / MLP 原地换成融合版本。
1. SDPA（精确到舍入）：注意力换成 PyTorch 的融合内核 F.scaled_dot_product_attention，一个算子代替十来个；
   用法是换一个缓存（缓存的 attend 决定用哪个注意力内核，模型代码不变）。
2. 静态形状 + torch.compile（精确到舍入）：StaticKVCache 让每个 decode 步的所有张量形状都相同，
   于是整步只编译一次，几百个小算子融合成少数几个 C++ 内核，Python 每步只调用一次。
3. 只量化权重的 int8（有损）：Int8Linear 把每个投影矩阵存成 int8 + 每个输出通道一个 float32 缩放，
   用 PyTorch 自带的 CPU 内核 aten._weight_int8pack_mm 直接算，权重读取量减到约 1/4。
"""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.errors import UserError
from common.kv_cache import KVCache
from common.linear import dense_weight, pack_
from common.model import MLP, Attention, Linear, apply_rope, attention, causal_mask
from step02_sampling.sampler import SamplingParams, sample
from step03_kvcache_single.cache import PreallocKVCache
from step03_kvcache_single.engine import forward
from step14_weight_quant.linear import BlockLinear, fuse_block_linears


# ---------------------------------------------------------------- 0. 融合投影


def fused_linear(parts: list[Linear]) -> Linear:
    """几个输入相同的 Linear 沿输出维拼成一个：(in, out_1), (in, out_2), ... -> (in, out_1 + out_2 + ...)。
    一次矩阵乘读完全部权重，输出按列切回几份，每一列的数学与分开算时相同。
    step14 的 BlockLinear 也行：行组接在一起（step14_weight_quant/linear.py 的 fuse_block_linears）。"""
    if all(isinstance(p, BlockLinear) for p in parts):
        fused = fuse_block_linears(parts)
        if fused is None:
            raise ValueError(f"cannot fuse {[p.extra_repr() for p in parts]} (see fuse_block_linears)")
        return fused
    with torch.no_grad():
        w = torch.cat([dense_weight(p) for p in parts], dim=1)              # (in, Σ out_i)
        fused = Linear(w.shape[0], w.shape[1], bias=parts[0].bias is not None)
        fused.weight = nn.Parameter(w, requires_grad=False)
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)   # (Σ out_i,)
        if parts[0].packed is not None:                                     # 与原模型同一种线性层（common/linear.py）
            pack_(fused)
    return fused


class FusedAttention(nn.Module):
    """common.model.Attention，q/k/v 三个投影换成一个 qkv_proj；其余（qk_norm、RoPE、cache.attend、o_proj）照抄。"""

    def __init__(self, a: Attention):
        super().__init__()
        self.layer_idx, self.H, self.H_kv, self.D, self.qk_norm = a.layer_idx, a.H, a.H_kv, a.D, a.qk_norm
        self.qkv_proj = fused_linear([a.q_proj, a.k_proj, a.v_proj])         # (E, (H + 2·H_kv)·D)
        self.o_proj = a.o_proj
        if a.qk_norm:
            self.q_norm, self.k_norm = a.q_norm, a.k_norm

    def forward(self, x, cos, sin, cache=None):
        B, L, _ = x.shape
        H, H_kv, D = self.H, self.H_kv, self.D
        q, k, v = self.qkv_proj(x).split([H * D, H_kv * D, H_kv * D], dim=-1)  # (B, L, E) -> (B, L, (H + 2·H_kv)·D) -> 3 份
        q = q.view(B, L, H, D)                                              # (B, L, H·D) -> (B, L, H, D)
        k = k.view(B, L, H_kv, D)                                           # (B, L, H_kv, D)
        v = v.view(B, L, H_kv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, L, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v) if cache is None else cache.attend(self.layer_idx, q, k, v)   # (B, H, L, D)
        out = out.transpose(1, 2).reshape(B, L, H * D)                      # (B, H, L, D) -> (B, L, H·D)
        return self.o_proj(out)                                             # (B, L, E)


class FusedMLP(nn.Module):
    """common.model.MLP，gate/up 换成一个 gate_up_proj。"""

    def __init__(self, m: MLP):
        super().__init__()
        self.gate_up_proj = fused_linear([m.gate_proj, m.up_proj])          # (E, 2F)
        self.down_proj = m.down_proj

    def forward(self, x):                                                   # (B, L, E)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)                    # (B, L, 2F) -> 2 × (B, L, F)
        return self.down_proj(F.silu(gate) * up)                            # (B, L, F) -> (B, L, E)


def fuse_projections_(model) -> nn.Module:
    """把模型每一层的 self_attn / mlp 原地换成融合版本（权重拼接后，分开的那几份随旧模块释放）。"""
    for layer in model.layers:
        layer.self_attn = FusedAttention(layer.self_attn)
        layer.mlp = FusedMLP(layer.mlp)
    return model


# ---------------------------------------------------------------- 1. SDPA


def sdpa(q, k, v, mask=None):
    """与 common.model.attention 同样的输入输出和数学（GQA 不复制 K/V、布尔掩码 True = 可以看），
    换成 PyTorch 的融合内核。唯一的不同在整行都被遮住的 query（填充行）上：它输出 0，我们的 attention 输出
    全部 V 的平均；这些行的结果本来就不用，这里也只用在没有填充的单请求上。"""
    if mask is None:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)                  # (L, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)   # (B, H, L, D)


class SdpaKVCache(PreallocKVCache):
    """step03 的预分配缓存，注意力换成 sdpa（common/kv_cache.py 的默认 attend = update + attention）。"""

    def attend(self, layer_idx: int, q, k, v):
        k, v = self.update(layer_idx, k, v)                                     # (B, H_kv, S, D)
        return sdpa(q, k, v, self.mask)


# ---------------------------------------------------------------- 2. 静态形状 + torch.compile


class StaticKVCache(KVCache):
    """decode 步（L = 1）的形状与内存位置永远不变的 KV cache，为 torch.compile 准备：

    - 写入位置是一个张量 `pos`（advance 在图外原地更新它），不是 Python 整数——编译器按 Python 整数的值
      特化整张图，每步一个新值就是每步一次重新编译；
    - 注意力看整个缓冲区 (B, H_kv, max_len, D)，而不是前 S 个位置的切片（切片长度每步都变），
      还没写到的位置用掩码遮住：位置 j 可见当且仅当 j ≤ pos；
    - 每层的 K、V 各是一块独立分配的张量，而不是一个大张量 (layers, 2, ...) 的切片：编译器要把图里的原地写入
      改写成函数式的写法，写入的目标越小、越独立，改写后要搬的数据就越少。
    代价：每步注意力读满 max_len 个位置（多读的是 0），所以 max_len 按需要取，不要取模型的最大上下文。
    prefill（L > 1，只跑一次，不编译）与 PreallocKVCache 的写法相同。"""

    mask = None                                       # prefill：右下对齐的因果掩码（decode 在 attend 里自己给）

    def __init__(self, cfg, max_len: int, device, dtype, kernel=attention):
        shape = (1, cfg.num_kv_heads, max_len, cfg.head_dim)                  # (B, H_kv, max_len, D)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.max_len, self.length = max_len, 0
        self.kernel = kernel                                                    # attention 或 sdpa
        self.slots = torch.arange(max_len, device=device)                       # (max_len,)
        self.pos = torch.zeros(1, 1, dtype=torch.long, device=device)           # (B, L) = (1, 1)：本步的位置

    def update(self, layer_idx: int, k, v):                                     # prefill（eager）
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise UserError(f"KV cache overflow: {end} positions exceed max_len {self.max_len}")
        self.k[layer_idx][:, :, self.length:end] = k                            # (B, H_kv, L, D)
        self.v[layer_idx][:, :, self.length:end] = v
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]     # (B, H_kv, S, D)

    def attend(self, layer_idx: int, q, k, v):
        if k.shape[2] != 1:
            return super().attend(layer_idx, q, k, v)                           # prefill：update + 因果注意力
        k_all, v_all = self.k[layer_idx], self.v[layer_idx]                     # (B, H_kv, max_len, D)
        k_all.index_copy_(2, self.pos[0], k)          # 原地写第 pos 个位置 ← (B, H_kv, 1, D)
        v_all.index_copy_(2, self.pos[0], v)
        mask = self.slots[None, :] <= self.pos[0][:, None]                      # (L, S) = (1, max_len)
        return self.kernel(q, k_all, v_all, mask)                               # (B, H, 1, D)

    def advance(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise UserError(f"KV cache overflow: {self.length + n} positions exceed max_len {self.max_len}")
        self.length += n
        self.pos.fill_(self.length)                   # 下一个 decode 步的位置：原地改，编译好的图读的是同一个张量


def decode_step(model, cache: StaticKVCache, tok: torch.Tensor) -> torch.Tensor:
    """一个 decode 步：tok (1, 1) 喂进去，位置 cache.pos，返回 logits (V,)。所有输入都是固定的张量。"""
    return model(tok, cache.pos, cache=cache, last_only=True)[0, -1]


def compiled_decode_step(**options):
    """整步编译成一张图：fullgraph=True（有图断裂就报错，而不是悄悄退回 Python），dynamic=False（形状都是常数）。"""
    return torch.compile(decode_step, fullgraph=True, dynamic=False, **options)


@torch.inference_mode()
def generate_static(model, prompt_ids: list[int], max_new_tokens: int, step=decode_step, max_len=None,
                    kernel=attention, stamps=None) -> list[int]:
    """贪心生成（与 step03 generate 在贪心、ignore_eos 时相同的 token），decode 步由 step 执行。
    max_len 固定（例如按 256 向上取整）时，不同提示词长度复用同一张编译好的图。
    stamps：给一个列表就在 prefill 与每个 decode 步结束时记下 time.perf_counter()（基准用；编译的图里挂不了钩子）。"""
    max_len = max_len or len(prompt_ids) + max_new_tokens - 1
    cache = StaticKVCache(model.cfg, max_len, model.device, model.dtype, kernel)
    logits = forward(model, cache, prompt_ids, start=0)                        # prefill：eager
    tok_buf = torch.zeros(1, 1, dtype=torch.long, device=model.device)         # (1, 1)：固定的输入缓冲
    ids, out = list(prompt_ids), []
    while True:
        if stamps is not None:
            stamps.append(time.perf_counter())
        tok = sample(logits, prompt_ids, out, SamplingParams(), None)
        ids.append(tok)
        out.append(tok)
        if len(out) == max_new_tokens:
            return out
        tok_buf.fill_(tok)
        logits = step(model, cache, tok_buf)
        cache.advance(1)


# ---------------------------------------------------------------- 3. 只量化权重的 int8（有损）


class Int8Linear(nn.Module):
    """只量化权重：int8 权重 (out, in) + 每个输出通道一个缩放 (out,)，对称量化 w ≈ q · scale，|q| ≤ 127。
    激活仍是 float32；aten._weight_int8pack_mm 在内核里边读 int8 边乘缩放，读的字节约是 float32 的 1/4。"""

    def __init__(self, linear: Linear):
        super().__init__()
        dense = dense_weight(linear)                                           # (in, out)，打包过也一样
        w = dense.detach().t().float()                                         # (in, out) -> (out, in)
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127                     # (out,)
        self.weight = nn.Parameter((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous(),
                                   requires_grad=False)
        self.scale = nn.Parameter(scale.to(dense.dtype), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x):
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.weight, self.scale)  # (N, in) -> (N, out)
        y = y.view(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def quantize_int8_(model) -> nn.Module:
    """把模型里每个 Linear（含 lm_head）原地换成 Int8Linear；词嵌入表不动（查表只读一行）。"""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Linear):
                setattr(module, child_name, Int8Linear(child))
    return model
