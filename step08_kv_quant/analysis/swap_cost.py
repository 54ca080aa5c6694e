"""换出 vs 重算：同样 n 个 token 的 KV，搬出去再搬回来要多久，重新 prefill 一遍要多久。

    换出：2 × n × 每 token 字节数 / 拷贝带宽（+ 每块一次拷贝的固定开销）——随 n 线性增长
    重算：prefill n 个 token —— 一次读全部权重的固定开销 + 每 token 的矩阵乘 + 随 n² 增长的注意力

哪个便宜取决于拷贝带宽与 prefill 速度之比；break_even_bandwidth 给出"拷贝带宽高于多少时换出更便宜"。
只测量，不断言（计时有噪声）；run.py 把结果印成表。
"""
from dataclasses import dataclass
from typing import Optional

import torch

from common.bench import median_time
from step03_kvcache_single.cache import PreallocKVCache
from step03_kvcache_single.engine import forward

from step08_kv_quant.analysis.dense_cache import QuantizedBlocks
from step08_kv_quant.quant import QuantScheme
from step08_kv_quant.swap import SwapSpace


@dataclass
class SwapVsRecompute:
    tokens: int
    swap_bytes: int        # 单程字节数（换出与换入各搬一次）
    swap_out_s: float
    swap_in_s: float
    recompute_s: float     # prefill 这 n 个 token 的时间

    @property
    def swap_s(self) -> float:
        return self.swap_out_s + self.swap_in_s

    @property
    def swap_over_recompute(self) -> float:
        return self.swap_s / self.recompute_s

    @property
    def copy_bandwidth(self) -> float:
        """实测的往返平均拷贝带宽（字节/秒）。"""
        return 2 * self.swap_bytes / self.swap_s

    @property
    def break_even_bandwidth(self) -> float:
        """拷贝带宽高于它时换出比重算快（字节/秒）：2 × 字节数 / 重算时间。"""
        return 2 * self.swap_bytes / self.recompute_s


def pool_tensors(cfg, num_blocks: int, block_size: int, device, dtype,
                 scheme: Optional[tuple[QuantScheme, QuantScheme]]) -> tuple[list[torch.Tensor], int]:
    """造一个装着随机数的池子（内容不影响拷贝速度），返回 (按块索引的张量, 块所在的维)。
    scheme=None：step05 的原精度池子 (layers, 2, num_blocks, H_kv, block_size, D)；否则 K、V 各一份 QuantizedBlocks。"""
    shape = (cfg.num_layers, 2, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
    if scheme is None:
        return [torch.randn(shape, device=device).to(dtype)], 2
    stores = [QuantizedBlocks(s, cfg.num_layers, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim, device)
              for s in scheme]
    return [t for st in stores for t in st.tensors()], 1


@torch.inference_mode()   # 不建计算图：否则 prefill 的全部中间结果挂在缓存上，n = 1024 时要好几 GB
def measure_swap_vs_recompute(model, lengths: list[int], block_size: int = 16, repeats: int = 3,
                              scheme: Optional[tuple[QuantScheme, QuantScheme]] = None) -> list[SwapVsRecompute]:
    """对每个长度 n：换出 + 换入 ⌈n / block_size⌉ 块的时间（中位数），与 prefill n 个 token 的时间（中位数）。"""
    cfg, dev, dtype = model.cfg, model.device, model.dtype
    max_blocks = -(-max(lengths) // block_size)
    tensors, block_dim = pool_tensors(cfg, max_blocks, block_size, dev, dtype, scheme)
    space = SwapSpace(tensors, max_blocks, block_dim)
    rows = []
    for n in lengths:
        blocks = list(range(-(-n // block_size)))
        outs, ins = [], []

        def round_trip():
            before_out, before_in = space.seconds_out, space.seconds_in
            space.swap_in(space.swap_out(blocks, n), blocks)
            outs.append(space.seconds_out - before_out)
            ins.append(space.seconds_in - before_in)

        median_time(round_trip, repeats=repeats, warmup=1, device=dev)
        outs, ins = sorted(outs[1:]), sorted(ins[1:])                  # 去掉预热那次，取中位数
        ids = torch.randint(0, cfg.vocab_size, (n,)).tolist()          # 内容不影响计算量
        recompute = median_time(lambda: forward(model, PreallocKVCache(cfg, n, dev, dtype), ids, 0),
                                repeats=repeats, warmup=1, device=dev)
        rows.append(SwapVsRecompute(n, len(blocks) * space.bytes_per_block, outs[len(outs) // 2],
                                    ins[len(ins) // 2], recompute))
    return rows


def crossover(rows: list[SwapVsRecompute]) -> Optional[float]:
    """换出与重算一样贵的上下文长度（在相邻两个测量点之间线性插值）；测量范围内一方总是更便宜时返回 None。"""
    for a, b in zip(rows, rows[1:]):
        da, db = a.swap_s - a.recompute_s, b.swap_s - b.recompute_s
        if da == 0:
            return float(a.tokens)
        if (da < 0) != (db < 0):
            return a.tokens + (b.tokens - a.tokens) * da / (da - db)
    return None
