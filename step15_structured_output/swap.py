"""换出式抢占（swap）的第二层存储：把被抢占请求的块原样拷到更慢、更大的内存里，重新接纳时再拷回来。

step05 的抢占是"重算"：扔掉 KV，之后重新 prefill 提示词 + 已生成的 token。换出则保留 KV：

    swap_out(blocks)            池子里这些块 → 第二层（CPU 内存；池子在 CUDA 上时用锁页内存），返回一个 SwapHandle
    swap_in(handle, new_blocks) 第二层 → 池子里新分到的块（块号可以不同，块表换成新的就行）

拷贝是逐位的（int8 / fp8 的码与 scale 一起搬），所以被换出过的请求之后的计算与从未被抢占时完全相同。
第二层有自己的空闲链表，装满了就不能再换出（调度器那时只能退回重算）；被换出的请求被 abort 时，free 把它在
第二层的块还回去。

布局：池子里块是第 block_dim 维（step05 起：(layers, 2, num_blocks + 1, H_kv, block_size, D) 的第 2 维），一块分散在
layers × 2 段内存里；第二层把块放在第 0 维，(num_cpu_blocks, layers, 2, H_kv, block_size, D)，一块是一整段连续内存，
一次 DMA 就能搬完。代价：每块一次 copy_，一次换出 n 块就是 n 次（vLLM 的 swap_blocks 也是按块逐个拷）。
"""
import time
from collections import deque
from dataclasses import dataclass

import torch

from common.bench import sync


@dataclass
class SwapHandle:
    cpu_blocks: list[int]     # 第二层里的块号，与换出时的块一一对应
    nbytes: int               # 这次搬了多少字节


class SwapSpace:
    def __init__(self, pool_tensors: list[torch.Tensor], num_cpu_blocks: int, block_dim: int):
        """pool_tensors：池子里按块索引的全部张量（原精度池子就是 [pool]；量化池子是码和 scale 各一个），
        块都在第 block_dim 维。"""
        self.pool_tensors, self.block_dim = pool_tensors, block_dim
        self.device = pool_tensors[0].device
        pin = self.device.type == "cuda"   # 锁页内存：GPU 可以直接 DMA，non_blocking 的拷贝才真的异步
        self.cpu_tensors = [torch.zeros((num_cpu_blocks, *self._block_shape(t)), dtype=t.dtype, pin_memory=pin)
                            for t in pool_tensors]
        self.num_blocks = num_cpu_blocks
        self.free_blocks = deque(range(num_cpu_blocks))
        self.bytes_per_block = sum(c[0].nbytes for c in self.cpu_tensors)
        # 累计计数：章节拿它们和重算的时间比
        self.bytes_out = self.bytes_in = 0
        self.seconds_out = self.seconds_in = 0.0
        self.num_swap_out = self.num_swap_in = 0
        self.tokens_out: list[int] = []     # 每次换出时那个请求已算好的 token 数（重算同样多要多久，章节去量）

    def _block_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        return tuple(s for i, s in enumerate(t.shape) if i != self.block_dim)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def can_swap_out(self, n: int) -> bool:
        return n <= len(self.free_blocks)

    def swap_out(self, blocks: list[int], num_tokens: int) -> SwapHandle:
        """把池子里的 blocks（存着前 num_tokens 个 token 的 K/V）拷到第二层。之后这些块可以还给池子的块管理器
        （那是调度器的事）。"""
        if not self.can_swap_out(len(blocks)):
            raise RuntimeError(f"swap space has {len(self.free_blocks)} free blocks, {len(blocks)} asked")
        t0 = time.perf_counter()
        cpu_blocks = [self.free_blocks.popleft() for _ in blocks]
        for src, dst in zip(self.pool_tensors, self.cpu_tensors):
            for b, c in zip(blocks, cpu_blocks):
                dst[c].copy_(src.select(self.block_dim, b), non_blocking=True)   # 一块：(layers, 2, H_kv, bs, D) 之类
        sync(self.device)   # 换出的块马上要分给别人、被覆盖：必须等拷贝真正完成
        handle = SwapHandle(cpu_blocks, len(blocks) * self.bytes_per_block)
        self.seconds_out += time.perf_counter() - t0
        self.bytes_out += handle.nbytes
        self.num_swap_out += 1
        self.tokens_out.append(num_tokens)
        return handle

    def swap_in(self, handle: SwapHandle, blocks: list[int]) -> None:
        """把 handle 的内容拷进池子新分到的 blocks（与换出时的块号无关），然后释放第二层的块。"""
        if len(blocks) != len(handle.cpu_blocks):
            raise ValueError(f"swap_in into {len(blocks)} blocks, handle holds {len(handle.cpu_blocks)}")
        t0 = time.perf_counter()
        for dst, src in zip(self.pool_tensors, self.cpu_tensors):
            for b, c in zip(blocks, handle.cpu_blocks):
                dst.select(self.block_dim, b).copy_(src[c], non_blocking=True)
        sync(self.device)   # 下一次前向就要读这些块
        self.free(handle)
        self.seconds_in += time.perf_counter() - t0
        self.bytes_in += handle.nbytes
        self.num_swap_in += 1

    def free(self, handle: SwapHandle) -> None:
        """第二层的块还回去（换入之后，或被换出的请求被 abort 时）。"""
        self.free_blocks.extend(handle.cpu_blocks)
        handle.cpu_blocks = []
