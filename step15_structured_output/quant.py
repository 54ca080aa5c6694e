"""KV 量化的数学：对称 int8 / fp8 (e4m3)，每组数共用一个 scale；以及池子里 K/V 的存法（KVFormat）。

量化一组数 x（同一个 scale 管的那些数）：

    scale = max(max|x| / qmax, 最小正规数)                      int8: qmax = 127；fp8 e4m3: qmax = 448（e4m3fn 能表示的最大值）
    int8: code = clamp(round(x / scale), -127, 127)     存 1 字节的整数
    fp8 : code = fp8(clamp(x / scale, -448, 448))        存 1 字节的浮点数（torch.float8_e4m3fn，就近舍入）
    读回: x̂ = code · scale

边界情况都给有限、有界的结果：整组都是 0 时 scale = 1（码全是 0）；max|x| 小到除出来是非正规数时 scale 取
float32 的最小正规数（码接近 0，不会除以 0）；NaN 的码是 0、±inf 截断到 ±qmax（算 scale 时只看有限的数）——
正常的模型里不会出现这些值，出现了也不会把整块的 scale 变成 NaN、把别的 token 一起毁掉。

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
引擎的池子只用 token 粒度（KVFormat）；其余粒度在 analysis/（第 08 章比较各粒度的质量）。
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch

from common.errors import UserError

KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": 448.0}
GRANULARITIES = ("token", "block", "channel", "tensor")
SCALE_DTYPE = torch.float32  # scale 用 float32 存：它只有 1/D（或更少）的份量，省下的字节不值得再引入一层舍入误差
SCALE_FLOOR = torch.finfo(SCALE_DTYPE).tiny   # scale 的下限：float32 的最小正规数
KV_DTYPE_CHOICES = ("float32", "bfloat16", "int8", "fp8")
FLOAT_KV = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        if self.static_scale is not None and not (math.isfinite(self.static_scale) and self.static_scale > 0):
            raise ValueError(f"static_scale must be a finite number > 0, got {self.static_scale}")

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
    a = x.abs().to(SCALE_DTYPE)
    amax = torch.where(torch.isfinite(a), a, 0.0).amax(dim=dims, keepdim=True)   # 只看有限的数
    # 整组都是 0 时 scale 取任何正数都行（码全是 0）；取 1。其余的不低于最小正规数：不会除出 inf / NaN
    return torch.where(amax > 0, (amax / scheme.qmax).clamp_min(SCALE_FLOOR), torch.ones_like(amax))


def quantize(x: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """x / scale → 1 字节的码。超出 ±qmax 的截断（clipping）：absmax 算出的 scale 不会超，固定 scale 可能超；
    ±inf 也截断到 ±qmax，NaN 变成 0（不能让它落进 int8 的类型转换：那是未定义的值）。"""
    y = (x.to(SCALE_DTYPE) / scale).clamp(-scheme.qmax, scheme.qmax).nan_to_num(0.0)
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


@dataclass(frozen=True)
class KVFormat:
    """池子里 K/V 的存法（--kv-dtype）：码的 dtype，以及（量化时）scale 的方案——每个 (token, 头) 一个 scale。
    为什么引擎里只用 token 粒度：scale 只看这个 token 自己，写入时就能定，流式、按槽写，不需要给未满的块暂存原值。
    这与 vLLM 较新的 kv_cache_dtype="int8_per_token_head" / "fp8_per_token_head" 是同一种粒度。"""
    name: str                        # --kv-dtype 的值
    storage_dtype: torch.dtype
    scheme: Optional[QuantScheme]    # None = 不量化，只是换一种浮点存（例如 float32 的模型用 bfloat16 存 KV）

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x (…, D) → 码 (…, D) 与 scale (…, 1)（不量化时 scale 为 None）。"""
        if self.scheme is None:
            return x.to(self.storage_dtype), None
        scale = compute_scale(x, self.scheme)                       # (…, 1)：每个 (token, 头) 一个
        return quantize(x, scale, self.scheme), scale

    def decode(self, codes: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return codes.to(dtype) if scale is None else dequantize(codes, scale, dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """x 写进池子再读出来是什么（逐位与真的写、读相同：同样的运算、同样的输入）。"""
        return self.decode(*self.encode(x), x.dtype)

    def bytes_per_token(self, cfg, block_size: int) -> float:
        """每个 token 在池子里占的字节（全部层的 K 和 V，含 scale）。"""
        return kv_bytes_per_token(cfg, self.scheme, self.scheme, block_size, self.storage_dtype)


def kv_format(name: Optional[str], model_dtype: torch.dtype) -> Optional[KVFormat]:
    """--kv-dtype → KVFormat；None（默认）或等于模型 dtype → None：精确模式，池子与 step07 的相同。"""
    if name is None or FLOAT_KV.get(name) == model_dtype:
        return None
    if name in ("int8", "fp8"):
        scheme = QuantScheme(name, "token")
        return KVFormat(name, scheme.storage_dtype, scheme)
    if name in FLOAT_KV:
        return KVFormat(name, FLOAT_KV[name], None)
    raise UserError(f"unknown --kv-dtype {name!r} (choose from {', '.join(KV_DTYPE_CHOICES)})")
