"""KV cache 的接口：模型在一次前向里看到的"缓存"。

模型每一层算完新 token 的 q、k、v（k 已做 RoPE）后调用 `cache.attend(layer_idx, q, k, v)`。默认的 attend
只做两件事：

    k_all, v_all = cache.update(layer_idx, k, v)   # 把新 K/V 存进去，取回这次要看的全部 K/V
    out = attention(q, k_all, v_all, cache.mask)   # 注意力的数学（common/model.py），所有缓存共用

所以每种缓存只需要实现 update 和 mask：

    step03  CatKVCache / PreallocKVCache   缓存对象本身传给模型；mask = None（右下对齐的因果掩码）
    step04  MaskedCache                     预分配缓存 + 本次前向的逐行掩码（左填充），每次前向造一个
    step05  AttentionMetadata               PagedKVCache.plan(seqs, n) 每次前向返回一个：按槽写、按块表读
                                            （paged 时它自己重写 attend：注意力直接按块表读池子，见 step05_paged/kv_cache.py）

一次前向的全部状态（要写哪些槽、读哪些块、掩码）都在传给模型的这个对象上；长期存在的池子上没有
"当前这次前向"之类的隐藏状态。缓存活多久（length / advance、块的分配与释放）是引擎的事，不在这个接口里。
"""
from typing import Optional, Protocol

import torch

from .model import attention


class KVCache(Protocol):
    mask: Optional[torch.Tensor]   # 可广播到 (B, 1, 1, L, S) 的布尔张量，True = 可以看；None = 右下对齐的因果掩码

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, H_kv, L, D)：本次前向新算出的 L 个位置 → 存进缓存；返回注意力要看的 K/V，各 (B, H_kv, S, D)。"""
        ...

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, L, D)，k/v (B, H_kv, L, D) → (B, H, L, D)。"""
        k, v = self.update(layer_idx, k, v)
        return attention(q, k, v, self.mask)
