"""KV 量化的数学：对称 int8 / fp8 (e4m3)，每组数共用一个 scale；以及把码和 scale 并排存放的块存储。

量化一组数 x（同一个 scale 管的那些数）：

    scale = max|x| / qmax                     int8: qmax = 127；fp8 e4m3: qmax = 448（e4m3fn 能表示的最大值）
    int8: code = clamp(round(x / scale), -127, 127)     存 1 字节的整数
    fp8 : code = fp8(clamp(x / scale, -448, 448))        存 1 字节的浮点数（torch.float8_e4m3fn，就近舍入）
    读回: x̂ = code · scale

int8 的误差是绝对的：每个数最多差半个台阶 scale / 2，无论它本身多大——所以一组里只要有一个很大的数（离群值），
scale 就大，同组的小数被量化得很粗。fp8 是浮点数：3 位尾数，误差与数本身成比例（正规数最多差 2⁻⁴ = 6.25%），
scale 只负责把这组数挪进 e4m3 的表示范围。

为什么 int8 只用 [-127, 127] 而不用 -128：对称的码表里 0 就是 0，x 与 -x 的码互为相反数；scale = max|x| / 127
本来也产生不了 -128（|x / scale| ≤ 127）。代价是 256 个码只用了 255 个。

scale 由谁共享（粒度），以一块 (H_kv, block_size, D) 为单位：

    token    每个 (token, 头) 一个 scale：     scale 形状 (…, H_kv, block_size, 1)
    block    每个 (块, 头) 一个 scale：         scale 形状 (…, H_kv, 1, 1)
    channel  每个 (块, 头, 通道) 一个 scale：   scale 形状 (…, H_kv, 1, D)      —— 给 K 用（K 有离群通道）
    tensor   一个固定的 scale（不从数据算）：   scale 形状 (…, 1, 1, 1)        —— vLLM fp8 默认 scale = 1.0

流式缓存里每个 token 的 K/V 算出来就写一次，以后不许再改。token 粒度的 scale 只看这个 token 自己，写入时就能定；
block / channel 粒度的 scale 要看整块 block_size 个 token，块没写满时还定不下来——所以这两种粒度只在块写满时
量化整块，没写满的那一块以原精度暂存（KIVI 的做法：最近的一段保持全精度）。见 needs_full_block。
"""
from dataclasses import dataclass
from typing import Optional

import torch

KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": 448.0}
GRANULARITIES = ("token", "block", "channel", "tensor")
SCALE_DTYPE = torch.float32  # scale 用 float32 存：它只有 1/D（或更少）的份量，省下的字节不值得再引入一层舍入误差


@dataclass(frozen=True)
class QuantScheme:
    dtype: str                            # "int8" | "fp8"
    granularity: str                      # 见 GRANULARITIES
    static_scale: Optional[float] = None  # 只给 "tensor"：固定的 scale（vLLM 不做校准时 k_scale = v_scale = 1.0）

    def __post_init__(self):
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"unknown KV quantization dtype {self.dtype!r} (choose from {', '.join(KV_DTYPES)})")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"unknown granularity {self.granularity!r} (choose from {', '.join(GRANULARITIES)})")
        if (self.granularity == "tensor") != (self.static_scale is not None):
            raise ValueError("static_scale is given exactly when granularity is 'tensor'")

    @property
    def name(self) -> str:
        return f"{self.dtype}/{self.granularity}" + (f"={self.static_scale:g}" if self.static_scale else "")

    @property
    def storage_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.dtype]

    @property
    def qmax(self) -> float:
        return QMAX[self.dtype]

    @property
    def needs_full_block(self) -> bool:
        """scale 跨多个 token（block / channel）：块写满才能量化，未满的块以原精度暂存。"""
        return self.granularity in ("block", "channel")

    def scale_shape(self, H_kv: int, block_size: int, D: int) -> tuple[int, int, int]:
        """一块 (H_kv, block_size, D) 配的 scale 的形状（可广播回这一块）。"""
        return {"token": (H_kv, block_size, 1), "block": (H_kv, 1, 1),
                "channel": (H_kv, 1, D), "tensor": (1, 1, 1)}[self.granularity]


def compute_scale(x: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """x (…, H_kv, T, D)：T 个 token（block / channel 粒度时 T = 整块 block_size）→ scale，形状同 x 但被共享的维为 1。"""
    if scheme.granularity == "tensor":
        return torch.full((1,) * x.dim(), scheme.static_scale, dtype=SCALE_DTYPE, device=x.device)
    dims = {"token": (-1,), "block": (-2, -1), "channel": (-2,)}[scheme.granularity]
    amax = x.abs().amax(dim=dims, keepdim=True).to(SCALE_DTYPE)
    # 整组都是 0 时 scale 取任何正数都行（码全是 0）；取 1 免得除以 0
    return torch.where(amax > 0, amax / scheme.qmax, torch.ones_like(amax))


def quantize(x: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """x / scale → 1 字节的码。超出 ±qmax 的截断（clipping）：absmax 算出的 scale 不会超，固定 scale 可能超。"""
    y = (x.to(SCALE_DTYPE) / scale).clamp(-scheme.qmax, scheme.qmax)
    if scheme.dtype == "int8":
        y = y.round()            # 就近舍入（.5 取偶），再截断到 [-127, 127]（上面的 clamp）
    return y.to(scheme.storage_dtype)  # fp8：转换本身就是就近舍入到 e4m3 的某个值


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """码 · scale → dtype。先转 float32 再乘（fp8 / int8 在 CPU 上没有直接的乘法）。"""
    return (codes.to(SCALE_DTYPE) * scale).to(dtype)


def fake_quantize(x: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """量化再读回：x 经过一次缓存之后变成什么（x (…, H_kv, T, D)）。"""
    scale = compute_scale(x, scheme)
    return dequantize(quantize(x, scale, scheme), scale, x.dtype)


def bytes_per_token_per_head(scheme: Optional[QuantScheme], block_size: int, D: int, dtype: torch.dtype) -> float:
    """一个 token、一个 KV 头、K 或 V 之一：码 D 字节 + 分摊到每个 token 的 scale 字节。None = 不量化（dtype 原样存）。"""
    if scheme is None:
        return D * dtype.itemsize
    h, t, d = scheme.scale_shape(1, block_size, D)
    scale_bytes = h * t * d * SCALE_DTYPE.itemsize / block_size       # 一块的 scale 摊到 block_size 个 token
    if scheme.granularity == "tensor":
        scale_bytes = 0.0                                             # 每层一个常数，不随 token 数增长
    return D * scheme.storage_dtype.itemsize + scale_bytes


def kv_bytes_per_token(cfg, k: Optional[QuantScheme], v: Optional[QuantScheme], block_size: int,
                       dtype: torch.dtype) -> float:
    """每个 token 在 KV 池里占的字节数（含 scale），对应 ModelConfig.kv_bytes_per_token 的量化版。"""
    per_head = (bytes_per_token_per_head(k, block_size, cfg.head_dim, dtype)
                + bytes_per_token_per_head(v, block_size, cfg.head_dim, dtype))
    return cfg.num_layers * cfg.num_kv_heads * per_head


class QuantizedBlocks:
    """一份 K 或 V 的量化存储：码与 scale 并排放在一起，按块寻址（与 step05 的池子同一种块内布局）。

        codes  (layers, num_blocks, H_kv, block_size, D)         int8 / float8_e4m3fn
        scales (layers, num_blocks) + scheme.scale_shape(...)     float32（tensor 粒度：每层一个数 (layers, 1, 1, 1, 1)）

    写：write_blocks 量化整块（任何粒度）；write_tokens 量化单个 token（只有 token / tensor 粒度可以，
    其余粒度的 scale 要等整块）。读：read 把若干块反量化成原 dtype。"""

    def __init__(self, scheme: QuantScheme, num_layers: int, num_blocks: int, H_kv: int, block_size: int, D: int,
                 device=None):
        self.scheme, self.block_size = scheme, block_size
        # 用 zeros：没写过的槽读出来是 0（随后被 mask 遮住），不会是随机内存里的 NaN
        self.codes = torch.zeros(num_layers, num_blocks, H_kv, block_size, D, dtype=scheme.storage_dtype,
                                 device=device)
        if scheme.granularity == "tensor":   # 固定 scale：每层一个数 (layers, 1, 1, 1, 1)，不随块走
            self.scales = torch.full((num_layers, 1, 1, 1, 1), scheme.static_scale, dtype=SCALE_DTYPE, device=device)
        else:
            self.scales = torch.ones(num_layers, num_blocks, *scheme.scale_shape(H_kv, block_size, D),
                                     dtype=SCALE_DTYPE, device=device)

    def tensors(self) -> list[torch.Tensor]:
        """按块索引的全部张量（块是第 1 维）：换出 / 换入时要原样搬的东西。固定 scale 不随块走，不在其中。"""
        return [self.codes] if self.scheme.granularity == "tensor" else [self.codes, self.scales]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def _scales(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        return self.scales[layer] if self.scheme.granularity == "tensor" else self.scales[layer, blocks]

    def write_blocks(self, layer: int, blocks: torch.Tensor, x: torch.Tensor) -> None:
        """blocks (n,) 物理块号；x (n, H_kv, block_size, D) 这些块的全部 block_size 个 token。"""
        scale = compute_scale(x, self.scheme)                               # (n, H_kv, bs|1, D|1)
        self.codes[layer, blocks] = quantize(x, scale, self.scheme)
        if self.scheme.granularity != "tensor":
            self.scales[layer, blocks] = scale

    def write_tokens(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor) -> None:
        """第 i 个 token 写到块 blocks[i] 的第 offsets[i] 个槽；x (N, H_kv, D)。"""
        if self.scheme.needs_full_block:
            raise RuntimeError(f"{self.scheme.name}: a scale spans the whole block; write full blocks only")
        x = x[:, :, None]                                                   # (N, H_kv, D) -> (N, H_kv, 1, D)：每个 token 自成一组
        scale = compute_scale(x, self.scheme)                               # (N, H_kv, 1, 1)
        self.codes[layer, blocks, :, offsets] = quantize(x, scale, self.scheme)[:, :, 0]   # (N, H_kv, D) 进各自的槽
        if self.scheme.granularity == "token":
            self.scales[layer, blocks, :, offsets] = scale[:, :, 0]          # (N, H_kv, 1)

    def read(self, layer: int, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """blocks (n,) → 反量化后的 (n, H_kv, block_size, D)，dtype 为模型的 dtype。"""
        return dequantize(self.codes[layer, blocks], self._scales(layer, blocks), dtype)
