"""量化的分页池子：step05 的池子，存的是 1 字节的码，每个 (token, 头) 旁边一个 float32 的 scale。

    码     pool   (layers, 2, num_blocks + 1, H_kv, block_size, D)   int8 / float8_e4m3fn（与 step05 同一布局）
    scale  scales (layers, 2, num_blocks + 1, H_kv, block_size, 1)   float32：一个 token 在一个头里的 D 个数共用一个

写（按 slot_mapping，与 step05 同一处）：新 token 的 K/V 先量化，码和 scale 各写进自己的槽。
读（与 step05 同一条路）：同样的 read_rows 一次 index_select 拷出码，再拷出对应的 scale，乘起来就是反量化后的
(B, H_kv, S, D)——模型代码一行不改。全新的 prefill 不读池子，但返回的也是"量化再读回"的 K/V：于是一个 token
在注意力里看到的值与它何时被写、被切在哪一块、和谁一批都无关（与 dense_cache.QuantKVCache 看到的完全相同）。

为什么引擎里只用 token 粒度：scale 只看这个 token 自己，写入时就能定，流式、按槽写，不需要给未满的块暂存原值
（block / channel 粒度见 quant.py 与 dense_cache.py；第 08 章第 3、4 节比较了各粒度的质量）。
这与 vLLM 较新的 kv_cache_dtype="int8_per_token_head" / "fp8_per_token_head" 是同一种粒度。

kv_dtype 是另一种浮点（例如 float32 的模型用 bfloat16 存 KV）时没有 scale：写时转换，读时转回模型的 dtype。
"""
from dataclasses import dataclass, fields
from typing import Optional

import torch

from common.config import ModelConfig
from common.errors import UserError
from step05_paged.paged_cache import PagedForward, PagedKVCache

from .quant import SCALE_DTYPE, QuantScheme, compute_scale, dequantize, kv_bytes_per_token, quantize

KV_DTYPE_CHOICES = ("float32", "bfloat16", "int8", "fp8")
FLOAT_KV = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVFormat:
    """池子里 K/V 的存法：码的 dtype，以及（量化时）scale 的方案。"""
    name: str                        # --kv-dtype 的值
    storage_dtype: torch.dtype
    scheme: Optional[QuantScheme]    # None = 不量化，只是换一种浮点存

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

    def bytes_per_token(self, cfg: ModelConfig, block_size: int) -> float:
        """每个 token 在池子里占的字节（全部层的 K 和 V，含 scale）：quant.kv_bytes_per_token。"""
        return kv_bytes_per_token(cfg, self.scheme, self.scheme, block_size, self.storage_dtype)


def kv_format(name: Optional[str], model_dtype: torch.dtype) -> Optional[KVFormat]:
    """--kv-dtype → KVFormat；None（默认）或等于模型 dtype → None：精确模式，用 step05 原来的池子，一行不改。"""
    if name is None or FLOAT_KV.get(name) == model_dtype:
        return None
    if name in ("int8", "fp8"):
        scheme = QuantScheme(name, "token")
        return KVFormat(name, scheme.storage_dtype, scheme)
    if name in FLOAT_KV:
        return KVFormat(name, FLOAT_KV[name], None)
    raise UserError(f"unknown --kv-dtype {name!r} (choose from {', '.join(KV_DTYPE_CHOICES)})")


@dataclass
class QuantPagedForward(PagedForward):
    """step05 的 PagedForward，pool 里是码；另外带着 scale 与反量化的目标 dtype。"""
    scales: Optional[torch.Tensor] = None      # (layers, 2, num_blocks + 1, H_kv, block_size, 1)；不量化时 None
    fmt: Optional[KVFormat] = None
    dtype: Optional[torch.dtype] = None        # 模型的 dtype：读回来的 K/V 是这个 dtype
    scale_buf: Optional[torch.Tensor] = None   # (2·B·H_kv·max_blocks, block_size)：读 scale 用，每层复用

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        """k, v (B, H_kv, L, D) → 量化写进池子；返回反量化后要看的 K/V 各 (B, H_kv, S, D)。"""
        B, H_kv, L, D = k.shape
        codes = self.pool[layer_idx]                                             # (2, num_blocks+1, H_kv, bs, D)：视图
        bs = codes.shape[3]
        block, offset = self.slot_mapping // bs, self.slot_mapping % bs          # (N,), (N,)
        for kv, new in ((0, k), (1, v)):
            new = new.transpose(1, 2).reshape(B * L, H_kv, D)[self.token_index]  # (B, H_kv, L, D) -> (B·L, H_kv, D) -> (N, H_kv, D)
            c, s = self.fmt.encode(new)                                          # (N, H_kv, D), (N, H_kv, 1)
            codes[kv, block, :, offset] = c
            if s is not None:
                self.scales[layer_idx, kv, block, :, offset] = s
        if self.read_rows is None:
            # 全新的 prefill：不读池子，但看的是量化再读回的值（与之后 decode 从池子读到的逐位相同）
            return self.fmt.round_trip(k), self.fmt.round_trip(v)
        # 与 step05 同样的行号：码拷进 read_buf（码的 dtype），scale 拷进 scale_buf，一乘就是反量化
        torch.index_select(codes.view(-1, bs * D), 0, self.read_rows, out=self.read_buf)      # (R, bs·D)
        scale = None
        if self.scales is not None:
            torch.index_select(self.scales[layer_idx].view(-1, bs), 0, self.read_rows, out=self.scale_buf)  # (R, bs)
            scale = self.scale_buf.view(-1, bs, 1)                                             # (R, bs, 1)
            self.gather_bytes += self.scale_buf.nbytes
        self.gather_bytes += self.read_buf.nbytes
        # 反量化：每层新分配一块模型 dtype 的 (R, bs, D)——比 step05 多一次读写，这是量化在读路径上的代价
        x = self.fmt.decode(self.read_buf.view(-1, bs, D), scale, self.dtype)                  # (R, bs, D)
        k_all, v_all = x.view(2, B, H_kv, -1, D)                                 # 各 (B, H_kv, S, D)
        v_all.view(-1, D).index_fill_(0, self.v_tail_rows, 0)                    # 与 step05 相同：长度之外的 V 清零
        return k_all, v_all


class QuantPagedKVCache(PagedKVCache):
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device, dtype, fmt: KVFormat):
        super().__init__(cfg, num_blocks, block_size, device, fmt.storage_dtype)   # pool 存码（空块照旧）
        self.fmt, self.dtype = fmt, dtype
        # 每个 (token, 头) 一个 scale，与码同样按 (K/V, 块, 头, 块内位置) 寻址；初值 1（没写过的槽码是 0，读回 0）
        self.scales = (torch.ones(cfg.num_layers, 2, num_blocks + 1, self.H_kv, block_size, 1, device=device,
                                  dtype=SCALE_DTYPE) if fmt.scheme is not None else None)

    def tensors(self) -> list[torch.Tensor]:
        """按块索引的全部张量（块在第 2 维）：换出 / 换入要原样搬的东西。"""
        return [self.pool] + ([self.scales] if self.scales is not None else [])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def plan(self, seqs, num_new_tokens: Optional[list[int]] = None) -> QuantPagedForward:
        fwd = super().plan(seqs, num_new_tokens)              # step05 的 plan：槽号、掩码、读的行号、码的读缓冲
        scale_buf = None
        if fwd.read_rows is not None and self.scales is not None:
            scale_buf = torch.empty(len(fwd.read_rows), self.block_size, device=self.pool.device, dtype=SCALE_DTYPE)
        return QuantPagedForward(**{f.name: getattr(fwd, f.name) for f in fields(fwd)},
                                 scales=self.scales, fmt=self.fmt, dtype=self.dtype, scale_buf=scale_buf)

    def read_tokens(self, layer: int, block_table: list[int], length: int):
        """测试与检查用：一个请求前 length 个位置反量化后的 K、V，以及 scale（各 (H_kv, length, ·)）。"""
        blocks = torch.tensor(block_table, device=self.pool.device)
        out = []
        for kv in range(2):
            c = self.pool[layer, kv, blocks]                                      # (n, H_kv, bs, D)
            s = self.scales[layer, kv, blocks] if self.scales is not None else None   # (n, H_kv, bs, 1)
            flat = lambda t: t.transpose(0, 1).flatten(1, 2)[:, :length]          # noqa: E731  (n, H_kv, bs, ·) -> (H_kv, length, ·)
            out.append((self.fmt.decode(flat(c), flat(s) if s is not None else None, self.dtype),
                        flat(s) if s is not None else None))
        return out
