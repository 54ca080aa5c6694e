"""把一批长度不同的提示词拼成一个矩形张量：左填充、逐行位置 id、逐行注意力掩码。

"列"是 KV cache 里的槽位下标，所有行共用：第 c 列在每一行都由同一次前向写入。
左填充让每一行最后一个真实 token 都落在最后一列，于是
  - prefill 只取最后一列的 logits，就是每一行的下一个 token 分布（右填充得按行去找各自的最后位置）；
  - decode 时所有行都往同一列写，缓存只需要一个共同的长度（与 step03 相同的 update/advance）。

例：提示词长度 2、4、1（P = 4，pad = 2、0、3；· 是填充）

    列        0  1  2  3            位置 id（填充列取 0，反正被遮住）
    行 0      ·  ·  a  b            0 0 0 1
    行 1      c  d  e  f            0 1 2 3
    行 2      ·  ·  ·  g            0 0 0 0
"""
from dataclasses import dataclass

import torch

from common.kv_cache import KVCache
from step03_kvcache_single.cache import PreallocKVCache

PAD_ID = 0  # 填充位置放什么 token 都行：掩码保证没有任何真实 token 看得到它


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """返回 input_ids (B, P)（P = 最长提示词）和每行的填充数 pad_lens (B,)。"""
    P = max(len(p) for p in prompts)
    rows = [[PAD_ID] * (P - len(p)) + list(p) for p in prompts]
    pad_lens = torch.tensor([P - len(p) for p in prompts], device=device)   # (B,)
    return torch.tensor(rows, device=device), pad_lens                        # (B, P), (B,)


def positions(pad_lens: torch.Tensor, start: int, L: int) -> torch.Tensor:
    """第 start .. start+L-1 列的位置 id (B, L)：每一行从它自己的第一个真实 token 起算 0，
    所以 RoPE 看到的位置与这个请求单独运行时完全相同。填充列算出负数，截成 0（被掩码遮住，取值无所谓）。"""
    cols = torch.arange(start, start + L, device=pad_lens.device)             # (L,)
    return (cols[None, :] - pad_lens[:, None]).clamp(min=0)                   # (1, L) - (B, 1) -> (B, L)


def attention_mask(pad_lens: torch.Tensor, start: int, L: int) -> torch.Tensor:
    """本次前向的 L 个 query（第 start .. start+L-1 列）能看哪些 key（第 0 .. S-1 列，S = start + L）。
    第 c 列的 query 能看第 j 列的 key ⇔ j ≥ pad（不是填充） 且 j ≤ c（因果）。返回 (B, 1, 1, L, S)，True = 可以看。
    prefill：start = 0, L = P；decode：start = 已缓存的列数, L = 1（因果条件恒成立，只剩"不是填充"）。
    填充列上的 query 一个 key 也看不到：模型把整行分数设成 dtype 的最小值，softmax 得到均匀分布而不是 NaN；
    这些位置的输出只写进填充列的 K/V，而填充列对所有真实 query 都被遮住，所以没有人用到它们。"""
    S = start + L
    device = pad_lens.device
    q_cols = torch.arange(start, S, device=device)[:, None]                   # (L, 1)
    k_cols = torch.arange(S, device=device)[None, :]                          # (1, S)
    causal = k_cols <= q_cols                                                 # (L, S)
    real = k_cols >= pad_lens[:, None]                                        # (1, S) >= (B, 1) -> (B, S)
    mask = causal[None, :, :] & real[:, None, :]                              # (1, L, S) & (B, 1, S) -> (B, L, S)
    return mask[:, None, None]                                                # (B, 1, 1, L, S)：对 H_kv、G 两维广播


@dataclass
class MaskedCache(KVCache):
    """一次前向看到的缓存：step03 的 PreallocKVCache（整批共用一个长度，原样读写）+ 这次前向的逐行掩码。
    掩码随每次前向变（S 每步加 1），所以不放在长期存在的缓存对象上，而是每次前向新造一个这样的视图。"""
    cache: PreallocKVCache
    mask: torch.Tensor          # (B, 1, 1, L, S)，见 attention_mask

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        return self.cache.update(layer_idx, k, v)
