"""step06 的调度器：step05 的调度器，接纳请求时先查前缀缓存。

接纳一个请求（新来的，或被抢占后重算的）：
1. 在块池里找它 token 的最长已缓存前缀（整块、从位置 0 起、逐块核对），最多到倒数第二个 token 所在的块之前——
   至少留一个 token 要算：它的 logits 才给出下一个 token；
2. 命中的块按引用计数共享（acquire），其余的块新分配；请求从命中位置开始 prefill（num_cached_tokens = 命中的 token 数）；
3. 同一批里已经有人要算同一块（它要算的第一块和别人要算的第一块 key 相同）时，它等下一步：那时那一块已经写好、
   登记了，它直接命中，而不是在同一次前向里把同样的 K/V 再算一遍（SGLang 叫 in-batch prefix caching）。

每一步开始时（以及请求结束、还块之前），把上一次前向刚写满的块（提示词的，以及 decode 中写满的）登记进缓存。
"""
from .block_pool import PrefixCachingBlockAllocator
from .sequence import Sequence
from step05_paged.scheduler import Scheduler
from step05_paged.sequence import Status


class PrefixCachingScheduler(Scheduler):
    allocator: PrefixCachingBlockAllocator

    def __init__(self, allocator: PrefixCachingBlockAllocator, block_size: int, max_batch_size: int,
                 max_prefill_tokens: int):
        super().__init__(allocator, block_size, max_batch_size, max_prefill_tokens)
        self.evictions0 = allocator.num_evictions      # 块池在多次运行之间共用：记下这次运行开始时的计数

    @property
    def num_evictions(self) -> int:
        return self.allocator.num_evictions - self.evictions0

    # >>> step06 新增：先登记上一步写满的块，再调度（被抢占的请求还块之前，它的块已经登记好了，之后还能命中）
    def schedule(self):
        for seq in self.running:
            self.cache_computed_blocks(seq)
        return super().schedule()

    def finish(self, seq: Sequence) -> None:
        self.cache_computed_blocks(seq)
        super().finish(seq)
    # <<<

    # >>> step06 新增：接纳时先查缓存（替换 step05 的 _admit）
    def _admit(self) -> list[Sequence]:
        batch = []
        computing = set()                 # 这一批里各请求要算的第一个满块的 key
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            match = self.allocator.longest_cached_prefix(seq.token_ids, max_blocks=(seq.num_tokens - 1) // self.block_size)
            if match.next_key is not None and match.next_key in computing:
                break                     # 前面有人正要算同一块：等下一步直接命中（不跳过它去接后面的，保持先来先服务）
            num_hit = len(match.blocks)
            if batch and not self._prefill_fits(batch, seq.num_tokens - num_hit * self.block_size):
                break
            need = self.blocks_for(seq.num_tokens) - num_hit
            reclaimed = sum(self.allocator.ref_counts[b] == 0 for b in match.blocks)   # 命中的块若在 evictable 里，也占空闲额度
            if not self.allocator.can_allocate(need + reclaimed):
                break
            self.allocator.acquire(match.blocks)
            seq.block_table = match.blocks + self.allocator.allocate(need)
            seq.num_cached_tokens = num_hit * self.block_size    # prefill 从命中位置开始
            seq.num_registered_blocks = num_hit
            if seq.cached_tokens is None:  # 只记第一次接纳：抢占后重算时再命中，不算提示词的缓存命中
                seq.cached_tokens = num_hit * self.block_size
            if match.next_key is not None:
                computing.add(match.next_key)
            seq.status = Status.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            batch.append(seq)
        return batch
    # <<<

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """前向之后：块表里新写满的块登记进缓存。前一块没登记上（重复的内容）时，链就此断开，后面的也不登记。"""
        bs, full = self.block_size, seq.num_cached_tokens // self.block_size
        for i in range(seq.num_registered_blocks, full):   # full ≥ num_registered_blocks：已缓存的 token 只增不减
            parent = seq.block_table[i - 1] if i else None
            self.allocator.cache_block(seq.block_table[i], parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
        seq.num_registered_blocks = full
