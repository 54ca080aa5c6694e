"""物理 KV 块的管理：空闲链表 + 引用计数，以及"给一个请求分块 / 收块"。它只管块号，不碰 KV 张量本身
（张量在 kv_cache.py）。

类比操作系统：块 = 物理页帧，块表 = 页表，这里就是页帧分配器。
- allocate(n)：从空闲链表取 n 个块，引用计数置 1；free(blocks)：引用计数 -1，降到 0 的块回到空闲链表；
- 按请求的操作（调度器用）：allocate_seq 按它的全部 token 分块，append_slot 在 decode 写满最后一块时加一块，
  free_seq 把它的块全部还回来。
"""
from collections import deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks           # 0 = 空闲
        self.free_blocks = deque(range(num_blocks))  # 先进先出：刚释放的块最后才被重用，便于调试时看出复用

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        """取 n 个空闲块。调用方（调度器）应先用 can_allocate 检查：块不够时怎么办（等待 / 抢占）是调度策略，
        不是分配器的事，所以这里不够就直接报错。"""
        if n > len(self.free_blocks):
            raise RuntimeError(f"asked for {n} blocks but only {len(self.free_blocks)} are free")
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] == 0:
                raise RuntimeError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)

    # ---- 按请求 ----
    def can_allocate_seq(self, seq: Sequence) -> bool:
        """被抢占过的请求要重算 提示词 + 已生成的 token，所以按 num_tokens（而不只是提示词）算块。"""
        return self.can_allocate(self.blocks_for(seq.num_tokens))

    def allocate_seq(self, seq: Sequence) -> None:
        seq.block_table = self.allocate(self.blocks_for(seq.num_tokens))

    def needs_slot(self, seq: Sequence) -> bool:
        """decode 要写入位置 num_tokens-1（上一步采样出的 token）：它落在块表之外时，要先加一块。"""
        return seq.num_tokens > len(seq.block_table) * self.block_size

    def append_slot(self, seq: Sequence) -> None:
        seq.block_table += self.allocate(1)

    def free_seq(self, seq: Sequence) -> None:
        self.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def usage(self, running: list[Sequence]) -> tuple[int, int]:
        """运行集合为 KV 持有的槽、其中存着真实 token 的 K/V 的槽（差额只来自每个请求最后一块没写满的部分）。"""
        held = sum(len(seq.block_table) for seq in running) * self.block_size
        return held, sum(seq.num_computed_tokens for seq in running)
