"""单请求的量化 KV cache：step03 的预分配缓存，只是存的是量化后的码 + scale，读的时候反量化。

用来在分页引擎之外单独量"量化 K/V 让模型差了多少"（analyze_kv.py 的粒度对比、quality.py 的指标）：
缓存的生命周期与 PreallocKVCache 完全相同（length / advance / mask），step03 的 generate 直接能用。

写入（update）：token / tensor 粒度的 K/V 一算出来就量化进去；block / channel 粒度要整块的统计量，
所以只在一块写满时量化整块，未满的最后一块以原精度暂存在 tail 里（每层 K、V 各一块）。
已经写进去的码以后不再改：后来的 token 不会改变前面 token 的量化结果（流式缓存能做到的正是这样）。
读取：把用到的块全部反量化，再用 tail 里的原值盖住未满的那一块——与分页池子"在读路径里反量化"是同一回事。
"""
from typing import Optional

import torch

from common.config import ModelConfig
from step03_kvcache_single.cache import PreallocKVCache, _check_room

from step08_kv_quant.quant import SCALE_DTYPE, QuantScheme, compute_scale, dequantize, quantize



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


class QuantKVCache(PreallocKVCache):
    """只支持批大小 1。k_scheme / v_scheme 为 None 的一方不量化（原 dtype 存，用来单独看 K 或 V 的影响）。"""

    def __init__(self, cfg: ModelConfig, max_len: int, device, dtype, k_scheme: Optional[QuantScheme],
                 v_scheme: Optional[QuantScheme], block_size: int = 16):
        # 不调用 PreallocKVCache.__init__：它会按 max_len 分配一整份原精度的 K/V，这里恰恰不要。
        # 其余状态（length、advance、mask、溢出检查）与它相同。
        self.max_len, self.batch_size = max_len, 1
        self.length = 0
        self.dtype, self.block_size = dtype, block_size
        self.schemes = (k_scheme, v_scheme)
        num_blocks = -(-max_len // block_size)
        H_kv, D = cfg.num_kv_heads, cfg.head_dim
        shape = (cfg.num_layers, num_blocks, H_kv, block_size, D)
        # stores[0] = K，stores[1] = V：量化的是 QuantizedBlocks，不量化的一方就是原 dtype 的张量
        self.stores = [QuantizedBlocks(s, cfg.num_layers, num_blocks, H_kv, block_size, D, device) if s is not None
                       else torch.zeros(shape, device=device, dtype=dtype) for s in self.schemes]
        # 未满那一块的原值：(layers, 2, H_kv, block_size, D)；只有 block / channel 粒度需要
        self.tail = (torch.zeros(cfg.num_layers, 2, H_kv, block_size, D, device=device, dtype=dtype)
                     if any(s is not None and s.needs_full_block for s in self.schemes) else None)
        self.device = device

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        B, H_kv, L, D = k.shape
        if B != 1:
            raise ValueError(f"QuantKVCache holds one request, got K/V for batch {B}")
        _check_room(self.length, L, self.max_len)
        start, end, bs = self.length, self.length + L, self.block_size
        out = []
        for kv, (new, scheme, store) in enumerate(zip((k, v), self.schemes, self.stores)):
            new = new[0]                                                        # (H_kv, L, D)
            if scheme is None or not scheme.needs_full_block:
                pos = torch.arange(start, end, device=new.device)
                blocks, offsets = pos // bs, pos % bs                           # (L,), (L,)
                if scheme is None:
                    store[layer_idx, blocks, :, offsets] = new.transpose(0, 1)  # (L, H_kv, D) 写进各自的槽
                else:
                    store.write_tokens(layer_idx, blocks, offsets, new.transpose(0, 1))
            else:
                # 从当前未满块的开头算起：tail 里已有的 start % bs 个 + 新来的 L 个
                first = start // bs
                seg = torch.cat([self.tail[layer_idx, kv, :, :start % bs], new], dim=1)  # (H_kv, end - first·bs, D)
                n_full = end // bs - first                                      # 这次写满了几块
                if n_full:
                    full = seg[:, :n_full * bs].reshape(H_kv, n_full, bs, D).transpose(0, 1)  # (n_full, H_kv, bs, D)
                    store.write_blocks(layer_idx, torch.arange(first, first + n_full, device=new.device), full)
                rest = seg[:, n_full * bs:]                                     # (H_kv, end % bs, D)：还没满的部分
                self.tail[layer_idx, kv, :, :rest.shape[1]] = rest
            out.append(self._read(layer_idx, kv, end))
        # 与 PreallocKVCache 一样不在这里推进 length：同一次前向的其余层还要写同样的位置
        return out[0], out[1]

    def _read(self, layer_idx: int, kv: int, end: int) -> torch.Tensor:
        """位置 [0, end) 的 K 或 V → (1, H_kv, end, D)。"""
        bs = self.block_size
        n = -(-end // bs)
        blocks = torch.arange(n, device=self.device)
        store = self.stores[kv]
        if isinstance(store, QuantizedBlocks):
            x = store.read(layer_idx, blocks, self.dtype)                       # (n, H_kv, bs, D)：反量化（一次拷贝）
        else:
            x = store[layer_idx, :n]                                            # (n, H_kv, bs, D)
        x = x.transpose(0, 1).reshape(x.shape[1], n * bs, x.shape[3])[:, :end]  # (H_kv, n·bs, D) -> (H_kv, S, D)
        scheme = self.schemes[kv]
        if scheme is not None and scheme.needs_full_block and end % bs:
            x[:, end - end % bs:] = self.tail[layer_idx, kv, :, :end % bs]     # 未满的一块用原值
        return x[None]                                                          # (1, H_kv, S, D)

    def nbytes(self) -> int:
        """存储实际占用的字节数：码 + scale（+ 不量化一方的原精度张量）+ 暂存未满块的 tail。"""
        return sum(s.nbytes for s in self.stores) + (self.tail.nbytes if self.tail is not None else 0)
