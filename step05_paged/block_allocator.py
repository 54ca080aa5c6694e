"""物理 KV 块的分配器：空闲链表 + 引用计数。它只管"块号"，不碰 KV 张量本身（张量在 paged_cache.py）。

类比操作系统：块 = 物理页帧，块表 = 页表，这里就是页帧分配器。
- allocate(n)：从空闲链表取 n 个块，引用计数置 1；
- fork(blocks)：让另一个请求共享同一批块（引用计数 +1，不复制数据）——前缀共享 / 并行采样的基础；
- free(blocks)：引用计数 -1，降到 0 的块才回到空闲链表。
"""
from collections import deque


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks          # 0 = 空闲
        self.free_blocks = deque(range(num_blocks))  # 先进先出：刚释放的块最后才被重用，便于调试时看出复用

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_blocks)

    def allocate(self, n: int) -> list[int]:
        """取 n 个空闲块。调用方（调度器）应先用 can_allocate 检查：块不够时怎么办（等待 / 抢占）是调度策略，
        不是分配器的事，所以这里不够就直接报错。"""
        if n > len(self.free_blocks):
            raise RuntimeError(f"asked for {n} blocks but only {len(self.free_blocks)} are free")
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def fork(self, blocks: list[int]) -> list[int]:
        """共享：返回同样的块号（新的块表可以指向它们），每块引用计数 +1。
        之后谁要改写共享块里的内容，就得先复制一份（copy-on-write）；只追加新块的用法不需要复制。"""
        for b in blocks:
            if self.ref_counts[b] == 0:
                raise RuntimeError(f"fork of free block {b}")
        for b in blocks:
            self.ref_counts[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] == 0:
                raise RuntimeError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)
