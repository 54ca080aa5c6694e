"""step06 引擎：step05 的分页引擎 + 前缀缓存。

主循环就是 step05 的 PagedEngine.generate，一行没改；换掉的是它用到的几样东西：
- 块池：PrefixCachingBlockAllocator（写满的块带 key，没人用了也先留着，池子要空间时才按 LRU 驱逐）；
- 调度器：PrefixCachingScheduler（接纳时命中的前缀直接共享，请求从命中位置开始 prefill；每步开始时
  把上一步写满的块登记进缓存）；请求状态：step06 的 Sequence（登记到第几块、cached_tokens）；
- 记账：KV 按物理块算（共享的块只算一次）；每个请求的 cached_tokens、命中率、驱逐次数。

块池跟着引擎活：generate() 调用之间缓存还在，所以多轮对话的下一轮能命中上一轮。
prefix_caching=False 时用回 step05 的分配器和调度器（--no-prefix-cache）：输出与前向次数都与 step05 相同。
"""
from dataclasses import dataclass, field

from step05_paged.engine import DEFAULT_MAX_PREFILL_TOKENS, PagedEngine, PagedStats
from step05_paged.scheduler import Scheduler

from .block_pool import HashFn, PrefixCachingBlockAllocator, chain_hash
from .scheduler import PrefixCachingScheduler
from .sequence import Sequence


@dataclass
class PrefixStats(PagedStats):
    # >>> step06 新增（prefill_tokens 是 step04 就有的统计：prefill 真正算的 token，命中的前缀不在里面）
    prompt_tokens: int = 0                                   # 全部提示词的 token 数
    evictions: int = 0                                       # 这次运行里从缓存驱逐了几块
    cached_tokens: list[int] = field(default_factory=list)   # 每个请求：提示词里有几个 token 用了缓存（按请求顺序）

    @property
    def hit_rate(self) -> float:
        """命中率 = 用了缓存的提示词 token ÷ 全部提示词 token。"""
        return sum(self.cached_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0
    # <<<


class PrefixCachingEngine(PagedEngine):
    sequence_cls = Sequence
    stats_cls = PrefixStats

    def __init__(self, model, num_blocks: int, block_size: int = 16, max_batch_size: int = 8,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS, prefix_caching: bool = True,
                 hash_fn: HashFn = chain_hash):
        super().__init__(model, num_blocks, block_size, max_batch_size, max_prefill_tokens)
        self.prefix_caching = prefix_caching
        if prefix_caching:   # >>> step06 新增：换成带前缀缓存的块池与调度器
            self.allocator = PrefixCachingBlockAllocator(num_blocks, block_size, hash_fn)
            self.scheduler_cls = PrefixCachingScheduler

    # >>> step06 修改：按物理块记账——几个请求共享的块只算一次，它存着的 token 也只算一次
    def kv_slots(self, running: list[Sequence]) -> tuple[int, int]:
        filled: dict[int, int] = {}   # 物理块 → 里面存着几个 token 的 K/V
        for seq in running:
            for i, b in enumerate(seq.block_table):
                filled[b] = max(filled.get(b, 0), min(self.block_size, max(0, seq.num_cached_tokens - i * self.block_size)))
        return len(filled) * self.block_size, sum(filled.values())
    # <<<

    def collect(self, stats: PrefixStats, sched: Scheduler, seqs: list[Sequence]) -> None:
        super().collect(stats, sched, seqs)
        # >>> step06 新增
        stats.prompt_tokens = sum(len(s.request.prompt_ids) for s in seqs)
        stats.cached_tokens = [s.cached_tokens or 0 for s in seqs]    # --no-prefix-cache 时从没设过：0
        stats.evictions = sched.num_evictions if self.prefix_caching else 0
        # <<<
