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

from .quant import QuantizedBlocks, QuantScheme


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
