"""step07 的调度器：每一步一个 token 预算（max_num_batched_tokens），decode 与 prefill 的块混在同一次前向里。

step05/06 的一步要么全是 prefill、要么全是 decode：一个长提示词到了，这一步就只给它做 prefill，所有正在 decode 的
请求都干等一整次长 prefill。这里（与 vLLM V1 的调度器相同的思路）每一步：

1. 登记上一步写满的块（step06），decode 要写的下一个位置没有块就要一块，池子空了抢占最新的请求（step05）；
2. 先 decode：运行中每个只差 1 个 token 的请求各占 1 个预算；
3. 剩下的预算按进入运行集合的顺序给还没 prefill 完的请求（上一步分到的块没做完的）：每个拿 min(剩下的, 预算)；
4. 预算还有剩、这一步没有抢占：从等待队列按先来先服务接纳新请求（step06 的 _admit：先查前缀缓存），
   接纳条件从"左填充后的 B × L 不超限"换成"前面接纳的还没把预算用完"。

一个提示词可能要分好几步才 prefill 完：它的 num_cached_tokens 每步往前推一块，最后一块算完的那一步才采样出首 token。
块在接纳时按整段提示词一次分好（与 step05/06 相同），所以 prefill 到一半的请求不会因为缺块而卡住；写满的块每步
登记进前缀缓存，被抢占后重新接纳时能直接命中自己算过的部分。
"""
from dataclasses import dataclass

from step05_paged.scheduler import ScheduledBatch
from step06_prefix_cache.block_pool import PrefixCachingBlockAllocator
from step06_prefix_cache.scheduler import PrefixCachingScheduler
from step06_prefix_cache.sequence import Sequence


@dataclass
class ChunkedBatch(ScheduledBatch):
    """seqs 先是只差 1 个 token 的（decode），再是 prefill 的块；is_prefill = 这一步有没有算提示词（或被抢占后重算）的 token。"""
    num_new_tokens: list[int]    # 与 seqs 一一对应：这一步算几个 token（decode 为 1）
    num_decode_tokens: int       # 其中 decode 的 token 数（已经有输出、这一步只算它上一步采样出的那个 token）

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class TokenBudgetScheduler(PrefixCachingScheduler):
    def __init__(self, allocator: PrefixCachingBlockAllocator, block_size: int, max_batch_size: int,
                 max_num_batched_tokens: int):
        super().__init__(allocator, block_size, max_batch_size, max_prefill_tokens=max_num_batched_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.budget_left = 0         # 接纳新请求时这一步还剩多少预算（_prefill_fits 用）

    def schedule(self) -> ChunkedBatch:
        for seq in self.running:     # step06：上一次前向写满的块登记进缓存
            self.cache_computed_blocks(seq)
        preemptions = self.num_preemptions
        self._grow_for_decode()      # step05：decode 要写的位置没有块就要一块；池子空了抢占最新的请求

        # 1) decode：只差 1 个 token 的请求（它上一步刚采样出的 token 还没进缓存）
        seqs = [seq for seq in self.running if seq.num_tokens - seq.num_cached_tokens == 1]
        num_new = [1] * len(seqs)
        budget = self.max_num_batched_tokens - len(seqs)
        # 2) 还没 prefill 完的运行中请求，按进入运行集合的先后
        for seq in self.running:
            remaining = seq.num_tokens - seq.num_cached_tokens
            if remaining > 1 and budget > 0:
                seqs.append(seq)
                num_new.append(min(remaining, budget))
                budget -= num_new[-1]
        # 3) 接纳新请求。这一步抢占过就不接：刚腾出来的块正是被抢占的请求要的，接了新请求它下一步又会被抢占
        if budget > 0 and self.num_preemptions == preemptions:
            self.budget_left = budget
            for seq in self._admit():
                seqs.append(seq)
                num_new.append(min(seq.num_tokens - seq.num_cached_tokens, budget))
                budget -= num_new[-1]
        num_decode = sum(n == 1 and seq.num_tokens - seq.num_cached_tokens == 1 and bool(seq.output_ids)
                         for seq, n in zip(seqs, num_new))
        return ChunkedBatch(seqs, sum(num_new) > num_decode, num_new, num_decode)

    # >>> step07 修改：接纳新请求的条件按 token 预算（step05/06 是左填充后的 B × L）
    def _prefill_fits(self, batch: list[Sequence], num_new_tokens: int) -> bool:
        """前面接纳的请求（各自要算的 token 之和）还没用完这一步剩下的预算，就再接一个：它分到剩下的部分。"""
        return sum(seq.num_tokens - seq.num_cached_tokens for seq in batch) < self.budget_left
    # <<<
