"""step03 的两种 KV cache：接口相同，存法不同。

两者都实现 common/kv_cache.py 的 KVCache 接口。模型的每一层在算完本次前向新 token 的 K/V（已做 RoPE）后，
经 cache.attend 调用

    k_all, v_all = cache.update(layer_idx, k, v)
        k, v          (B, H_kv, L, D)   本次新算出的 L 个位置
        k_all, v_all  (B, H_kv, S, D)   S = length + L：历史 + 新的，注意力就对它们算

引擎在 *整次前向*（全部层）结束后调用一次 `advance(L)`，把 `length` 往前推 L。
为什么不在 update 里推：update 每层都会被调用一次；若每层都推，第 1 层会把自己的 K/V 写到第 0 层
之后的位置，各层的数据错开，结果就错了（tests/test_step03_kvcache.py 演示了这个经典 bug）。

只缓存 H_kv 个 KV 头（GQA：SmolLM2 的 9 个 query 头共享 3 个 KV 头），不缓存复制后的 H 个头。
mask = None：单个请求、没有填充，模型用右下对齐的因果掩码。
step04 直接复用 PreallocKVCache（整批共用一个 length，update / advance 不变，另加本次前向的左填充掩码）；
step05 的分页缓存实现同一个 update / mask 接口，但"长度"变成了每个请求自己的，由引擎按请求记账。
"""
import torch

from common.config import ModelConfig
from common.errors import UserError
from common.kv_cache import KVCache


def _check_room(length: int, new: int, max_len: int) -> None:
    if length + new > max_len:
        raise UserError(f"KV cache overflow: {length} cached + {new} new tokens exceeds max_len {max_len}")


class CatKVCache(KVCache):
    """直观版：每层一对 K/V 张量，每次前向用 torch.cat 把新的 K/V 接在后面。

    代价：torch.cat 每次都分配一块新内存，把旧的 S-L 个位置连同新的 L 个位置整段复制过去。
    decode 第 t 步（S = 提示词长度 + t）复制 S 个位置，生成 N 个 token 共复制 O(N² + N·提示词长度) 个位置；
    bytes_copied 把这些字节数如实累加，run.py 拿它和预分配版比较。"""

    mask = None   # 单个请求、没有填充：因果掩码

    def __init__(self, cfg: ModelConfig, max_len: int, device=None, dtype=None):
        # device / dtype 不需要（张量在第一次 update 时按传入的 K/V 建立），保留参数是为了与 PreallocKVCache 同一种构造方式
        self.max_len = max_len
        self.k: list[torch.Tensor | None] = [None] * cfg.num_layers   # 每层 (B, H_kv, length, D)
        self.v: list[torch.Tensor | None] = [None] * cfg.num_layers
        self.length = 0          # 已缓存的位置数（所有层相同）
        self.bytes_copied = 0    # torch.cat 累计写出的字节数（K 和 V 一起）

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        _check_room(self.length, k.shape[2], self.max_len)
        if self.k[layer_idx] is None:                       # 第一次（prefill 时）：历史为空
            self.k[layer_idx], self.v[layer_idx] = k[:, :, :0], v[:, :, :0]
        if self.k[layer_idx].shape[2] != self.length:       # 每层都应正好存着 length 个位置
            raise RuntimeError(f"layer {layer_idx} holds {self.k[layer_idx].shape[2]} positions, "
                               f"cache length is {self.length}: advance() must run once per forward")
        # (B, H_kv, S-L, D) 接 (B, H_kv, L, D) -> (B, H_kv, S, D)：新分配一块，旧内容整段复制
        self.k[layer_idx] = torch.cat([self.k[layer_idx], k], dim=2)
        self.v[layer_idx] = torch.cat([self.v[layer_idx], v], dim=2)
        self.bytes_copied += self.k[layer_idx].nbytes + self.v[layer_idx].nbytes
        return self.k[layer_idx], self.v[layer_idx]

    def advance(self, n: int) -> None:
        _check_room(self.length, n, self.max_len)
        self.length += n

    def nbytes(self) -> int:
        """此刻缓存里 K/V 张量实际占用的字节数。"""
        return sum(t.nbytes for t in self.k + self.v if t is not None)


class PreallocKVCache(KVCache):
    """生产做法：一开始就按 max_len 分配好全部空间，之后只把新位置的 K/V 原地写进去，读取时返回切片视图。

    每次前向只写 L 个新位置（decode 时就 1 个），历史一个字节都不搬；读取 [:S] 是视图，也不复制。"""

    mask = None   # 单个请求、没有填充：因果掩码（step04 批处理时由 MaskedCache 另给逐行掩码）

    def __init__(self, cfg: ModelConfig, max_len: int, device, dtype, batch_size: int = 1):
        self.max_len = max_len
        self.batch_size = batch_size
        # 布局 (layers, 2, B, H_kv, max_len, D)，2 = K 和 V。
        # 为什么把位置维放在 H_kv 之后、D 之前：每个头的 (max_len, D) 是一整块连续内存，
        # 取前 S 个位置得到的 (B, H_kv, S, D) 视图里，每个头仍是一块连续的 S×D 矩阵，
        # 正好是注意力里 q @ kᵀ、probs @ v 要读的形状：零复制、顺序读。
        # 若按 token 排成 (max_len, H_kv, D)，读时要 transpose 成 (H_kv, S, D)，同一个头相邻两行
        # 隔着 H_kv·D 个数，变成跨步读（matmul 可能还要先复制成连续的）。
        # 用 zeros 而不是 empty：还没写到的位置是 0 而不是随机内存，出 bug 时结果可复现。
        self.kv = torch.zeros(cfg.num_layers, 2, batch_size, cfg.num_kv_heads, max_len, cfg.head_dim,
                              device=device, dtype=dtype)
        self.length = 0          # 已写入的位置数（所有层相同）；只由 advance 推进
        self.bytes_copied = 0    # 累计写入的字节数（只有新位置的 K/V）

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        B, _, L, _ = k.shape
        if B != self.batch_size:  # 切片赋值会把 B=1 悄悄广播到整批，所以显式检查
            raise ValueError(f"cache was allocated for batch {self.batch_size}, got K/V for batch {B}")
        _check_room(self.length, L, self.max_len)
        start, end = self.length, self.length + L
        self.kv[layer_idx, 0, :, :, start:end] = k      # (B, H_kv, L, D) 原地写进位置 [start, end)
        self.kv[layer_idx, 1, :, :, start:end] = v
        self.bytes_copied += k.nbytes + v.nbytes
        # 注意这里不推进 length：同一次前向的其余层还要写到同样的 [start, end)
        return self.kv[layer_idx, 0, :, :, :end], self.kv[layer_idx, 1, :, :, :end]  # 视图 (B, H_kv, S, D)

    def advance(self, n: int) -> None:
        _check_room(self.length, n, self.max_len)
        self.length += n

    def nbytes(self) -> int:
        """缓冲区实际占用的字节数（按 max_len 预留，不论用了多少）。"""
        return self.kv.nbytes


CACHES = {"prealloc": PreallocKVCache, "cat": CatKVCache}
