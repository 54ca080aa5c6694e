"""step08 的调度器：step07 的 token 预算调度器 + 换出式抢占（--preempt swap）。

step05 起的抢占是"重算"：扔掉被抢占请求的 KV，它回到等待队列，之后重新 prefill 提示词 + 已生成的 token。
换出则保留 KV（vLLM V0 的 PreemptionMode.SWAP）：

- 抢占（_preempt）：把它已经算好的那些块（覆盖前 num_cached_tokens 个 token）拷到第二层（SwapSpace），
  池子里的块照常还给分配器；num_cached_tokens 不清零，请求进入第三个队列 swapped（不是 waiting）。
  第二层装不下，或者它一个 token 都还没算（没什么可换的）：退回重算。
- 接纳（_admit）：先换入——swapped 的队头在池子里分到块、拷回来，块表换成新块号，回到运行集合，这一步就接着
  decode（或接着 prefill 没算完的部分）；swapped 清空之前不接纳新请求（被抢占的请求比等待中的都早到）。
  step07 只在"这一步没有抢占"时才接纳，换入也一样：否则刚换入的请求下一步又会被换出。

换入的块内容与换出时逐位相同，块号变了不影响任何数值：请求之后的计算与从未被抢占时完全相同。
换入的块是新分配的私有块（原来可能与别人共享前缀，现在不再共享）；它们从第 0 块起重新登记进前缀缓存
（同样的内容已经登记过的，按 step06 的规则不再登记）。
"""
from collections import deque
from typing import Optional

from step06_prefix_cache.block_pool import PrefixCachingBlockAllocator
from step07_chunked_prefill.scheduler import TokenBudgetScheduler

from .sequence import Sequence
from .swap import SwapSpace
from step05_paged.sequence import Status


class SwapScheduler(TokenBudgetScheduler):
    def __init__(self, allocator: PrefixCachingBlockAllocator, block_size: int, max_batch_size: int,
                 max_num_batched_tokens: int, swap: Optional[SwapSpace] = None):
        super().__init__(allocator, block_size, max_batch_size, max_num_batched_tokens)
        self.swap = swap                          # None = --preempt recompute：与 step07 完全相同
        self.swapped: deque[Sequence] = deque()   # 被换出的请求，最早到达的在队头
        self.num_swap_outs = 0
        self.num_recompute_preemptions = 0
        self.swap_out_tokens: list[int] = []      # 每次换出时那个请求已算好的 token 数（run.py 拿它算"重算要多久"）

    def has_work(self) -> bool:
        return bool(self.swapped) or super().has_work()

    # >>> step08 修改：抢占时先试着换出
    def _preempt(self, seq: Sequence) -> None:
        n = self.blocks_for(seq.num_cached_tokens)            # 存着已算好 token 的块（最后一块可能没写满）
        if self.swap is None or n == 0 or not self.swap.can_swap_out(n):
            self.num_recompute_preemptions += 1
            super()._preempt(seq)                             # step05：释放、清零、回到等待队列队头
            return
        seq.swap_handle = self.swap.swap_out(seq.block_table[:n])   # 先拷走，再还块（还了就可能被别人覆盖）
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        seq.num_swaps += 1
        self.num_preemptions += 1
        self.num_swap_outs += 1
        self.swap_out_tokens.append(seq.num_cached_tokens)
        self.swapped.appendleft(seq)                          # 被抢占的总是运行集合里最新的：它比已换出的都晚到
    # <<<

    # >>> step08 修改：先换入，swapped 空了才接纳等待中的请求
    def _admit(self) -> list[Sequence]:
        batch = []
        while self.swapped and len(self.running) < self.max_batch_size:
            seq = self.swapped[0]
            remaining = seq.num_tokens - seq.num_cached_tokens   # decode 中被换出的是 1；prefill 到一半的更多
            if batch and not self._prefill_fits(batch, remaining):
                break
            need = self.blocks_for(seq.num_tokens)
            if not self.allocator.can_allocate(need):
                break
            blocks = self.allocator.allocate(need)
            self.swap.swap_in(seq.swap_handle, blocks[:len(seq.swap_handle.cpu_blocks)])
            seq.swap_handle = None
            seq.block_table = blocks
            seq.num_registered_blocks = 0                     # 新块号：从头重新登记（内容与原来相同）
            seq.status = Status.RUNNING
            self.swapped.popleft()
            self.running.append(seq)
            batch.append(seq)
        if self.swapped:
            return batch                                      # 还有没换回来的：先不接新请求
        if batch:                                             # 换入的占掉了一部分预算，step06/07 的接纳只看剩下的
            self.budget_left -= sum(seq.num_tokens - seq.num_cached_tokens for seq in batch)
            if self.budget_left <= 0 or len(self.running) >= self.max_batch_size:
                return batch
        return batch + super()._admit()
    # <<<
