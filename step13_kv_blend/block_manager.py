"""物理 KV 块的管理：空闲链表 + 引用计数 + 前缀缓存（vLLM 的 BlockPool、nano-vllm 的 BlockManager）。
它只管块号，不碰 KV 张量本身（张量在 kv_cache.py）。

- allocate(n) / free(blocks)：按引用计数分块、收块；引用计数 > 1 = 几个请求的块表共享同一块（不复制数据）；
- 按请求的操作（调度器用）：allocate_seq 按它的全部 token 分块（命中的前缀块直接共享），append_slot 在 decode
  写满最后一块时加一块，free_seq 把它的块全部还回来；
- 前缀缓存：写满的块按链式的 key = hash(前一块的 key, 这一块的 token id) 登记，match_prefix 从第 0 块起逐块查、
  核对原像。ref = 0 的块：没有 key 的在 free_blocks（先分配它们），带 key 的在 evictable（按最近一次被释放排，
  空块用完才回收最久没用的）；一个块要么在 free_blocks，要么在 evictable，要么 ref ≥ 1。

step07 加 enable_caching=False（--no-prefix-cache）：什么也不登记、什么也查不到，块就只是块（step05 的行为）。

step12（KV 驱逐）：块表覆盖的是槽（seq.kv_len），不再是 token，按请求的块数都按槽算。压缩过的请求（num_evicted > 0）
块里存的不再是一段从 0 开始的 token 前缀，cache_full_blocks 不再登记它；压缩前命中、登记的块照旧共享（压缩把
留下的 K/V 拷进新块，旧块按引用计数还回来，登记过的进 evictable，内容不动）。

step13（非前缀复用）：块缓存（chunk_cache.py）的段块也登记在 cached / key_to_block 里，与前缀块共用引用计数和
evictable 这一条 LRU。标了段、不读前缀缓存的请求（seq.read_prefix_cache 为 False）match_prefix 什么也不返回；
K/V 是拼出来的请求（seq.approx_kv）cache_full_blocks 不登记。
"""
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Optional

from .sequence import Sequence

HashFn = Callable[[Optional[int], tuple[int, ...]], int]


def chain_hash(parent_key: Optional[int], token_ids: tuple[int, ...]) -> int:
    """Python 内置的 hash：整数元组的 hash 在不同进程间也相同（只有 str/bytes 的 hash 按进程随机化；
    None 的 hash 在 3.11 里取自内存地址，所以第 0 块不把 None 放进元组）。64 位、不抗有意构造的碰撞
    （vLLM 默认用 sha256）；我们在命中时核对 token id，碰撞只会变成未命中。"""
    return hash(token_ids) if parent_key is None else hash((parent_key, token_ids))


@dataclass(frozen=True)
class CachedBlock:
    """登记在缓存里的一块：它的 key，以及核对命中用的"原像"（前一块是哪块、这一块的 token）。"""
    key: int
    parent: Optional[int]            # 前一块的物理块号；第 0 块为 None（只有从位置 0 开始的前缀才能复用）
    token_ids: tuple[int, ...]


@dataclass
class PrefixMatch:
    blocks: list[int]                # 命中的物理块，按逻辑块顺序；第 i 块存位置 i·block_size .. (i+1)·block_size-1
    next_key: Optional[int]          # 紧接着那一块（要重新算、以后还能被命中的第一块）的 key；没有这样的块时为 None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, hash_fn: HashFn = chain_hash):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        self.ref_counts = [0] * num_blocks           # 0 = 空闲
        self.free_blocks = deque(range(num_blocks))  # 先进先出：刚释放的块最后才被重用，便于调试时看出复用
        self.hash_fn = hash_fn                           # 测试里换成一个必然碰撞的函数
        self.cached: dict[int, CachedBlock] = {}         # 物理块号 → 它登记的内容（只有写满的块）
        self.key_to_block: dict[int, int] = {}           # key → 物理块号：一个 key 只对应一块
        self.evictable: OrderedDict[int, None] = OrderedDict()  # 哈希表 + 双向链表：O(1) 从中间取出命中的块
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """带 key 的空闲块也算空闲（随时可以回收），但分配时排在空块后面。"""
        return len(self.free_blocks) + len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        """取 n 个空闲块。调用方（调度器）应先用 can_allocate 检查：块不够时怎么办（等待 / 抢占）是调度策略，
        不是分配器的事，所以这里不够就直接报错。空块不够时回收最久没用的缓存块，它变回空块。"""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks but only {self.num_free_blocks} are free")
        while len(self.free_blocks) < n:
            block, _ = self.evictable.popitem(last=False)
            del self.key_to_block[self.cached.pop(block).key]
            self.free_blocks.append(block)
            self.num_evictions += 1
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """从尾到头释放：同一个请求靠后的块先进 evictable，于是先被回收；开头的块（最可能被别人共享）留得最久。
        这也保证了子块总在父块之前被回收——缓存里不会留下找不到父块的块。"""
        for b in reversed(blocks):
            if self.ref_counts[b] == 0:
                raise RuntimeError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if b in self.cached:
                    self.evictable[b] = None             # 放到最后 = 最近用过
                else:
                    self.free_blocks.append(b)

    # ---- 前缀缓存 ----
    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """从第 0 块起逐块查：算 key、查表、核对原像（前一块正是上一步命中的那块，token 完全相同）。第一次查不到
        或核对不上就停。最多到倒数第二个 token 所在的块之前：至少留一个 token 要算，它的 logits 才给出下一个 token。
        只读，不改引用计数（调度器确定放得下之后 allocate_seq 再接手）。
        step09：还要 prompt logprobs 的位置（seq.prompt_logits）不从缓存拿——要的正是这些位置的 logits，命中就不算了
        （vLLM 对要 prompt logprobs 的请求同样不读前缀缓存）。它算出的满块照常登记，别的请求照样命中。"""
        bs, token_ids, parent_key, parent = self.block_size, seq.token_ids, None, None
        max_blocks = (len(token_ids) - 1) // bs if self.enable_caching and seq.read_prefix_cache else 0
        if seq.prompt_logits:
            max_blocks = min(max_blocks, seq.prompt_logits.start // bs)
        blocks = []
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            key = self.hash_fn(parent_key, tokens)
            b = self.key_to_block.get(key)
            if b is None or self.cached[b] != CachedBlock(key, parent, tokens):
                return PrefixMatch(blocks, key)          # 碰撞（key 相同、内容不同）在这里变成未命中
            blocks.append(b)
            parent_key, parent = key, b
        return PrefixMatch(blocks, None)   # 后面那块含最后一个 token：无论如何都要算，等别人算它也命中不了

    def cache_full_blocks(self, seq: Sequence) -> None:
        """前向之后：块表里新写满的块登记进缓存。前一块没登记上（重复的内容）时，链就此断开，后面的也不登记。"""
        bs, full = self.block_size, seq.num_computed_tokens // self.block_size
        # 压缩过（step12）或 K/V 是拼出来的（step13）：块里不是这段 token 前缀的精确 K/V，谁也不该命中它
        if not self.enable_caching or seq.num_evicted or seq.approx_kv:
            return
        for i in range(seq.num_registered_blocks, full):   # full ≥ num_registered_blocks：已算的 token 只增不减
            parent = seq.block_table[i - 1] if i else None
            self._cache_block(seq.block_table[i], parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def _cache_block(self, block: int, parent: Optional[int], token_ids: tuple[int, ...]) -> bool:
        """登记一块刚写满的块（它的 K/V 已经在池子里）。返回是否登记了：
        - 前一块没登记（它自己就是重复的）→ 不登记，链断了后面也接不上；
        - 同样的 key 已经由别的块登记（同一内容算了两遍，例如两个一模一样的采样）→ 不登记，一个 key 只留一块；
          这一块就是普通块，释放时回到 free_blocks。vLLM 同样不做合并：块表只追加、不改写。"""
        if block in self.cached:
            return True                                  # 命中得来的块：早就登记过
        if len(token_ids) != self.block_size or self.ref_counts[block] == 0:
            raise RuntimeError(f"only a full block in use can be cached (block {block})")
        if parent is not None and parent not in self.cached:
            return False
        key = self.hash_fn(self.cached[parent].key if parent is not None else None, token_ids)
        if key in self.key_to_block:
            return False
        self.cached[block] = CachedBlock(key, parent, token_ids)
        self.key_to_block[key] = block
        return True

    # ---- 按请求 ----
    def can_allocate_seq(self, seq: Sequence, match: PrefixMatch, num_slots: Optional[int] = None) -> bool:
        """被抢占过的请求要重算 提示词 + 已生成的 token，所以按 num_tokens（而不只是提示词）算块；
        命中的块若正在 evictable 里（没人用），取出来也要占空闲额度。
        step12：num_slots = 先只为前几个槽分块（驱逐时只分第一块 prefill 要写的，之后边算边加）；None = 全部 token。"""
        reclaimed = sum(self.ref_counts[b] == 0 for b in match.blocks)
        slots = seq.num_tokens if num_slots is None else num_slots
        return self.can_allocate(self.blocks_for(slots) - len(match.blocks) + reclaimed)

    def allocate_seq(self, seq: Sequence, match: PrefixMatch, num_slots: Optional[int] = None) -> None:
        """命中的块共享（引用计数 +1，原来没人用的从 evictable 取出、不再参与回收），其余新分配；
        请求从命中位置开始 prefill。num_slots 同 can_allocate_seq。"""
        for b in match.blocks:
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1
        slots = seq.num_tokens if num_slots is None else num_slots
        seq.block_table = match.blocks + self.allocate(self.blocks_for(slots) - len(match.blocks))
        seq.num_computed_tokens = len(match.blocks) * self.block_size
        seq.num_registered_blocks = len(match.blocks)
        if seq.num_cached_tokens is None:   # 只记第一次接纳：抢占后重算时再命中，不算提示词的缓存命中
            seq.num_cached_tokens = seq.num_computed_tokens

    def needs_slot(self, seq: Sequence) -> bool:
        """decode 要写入位置 num_tokens-1（上一步采样出的 token），即槽 num_tokens-1-num_evicted：它落在块表之外时，要先加一块。"""
        return seq.num_tokens - seq.num_evicted > len(seq.block_table) * self.block_size

    def append_slot(self, seq: Sequence) -> None:
        seq.block_table += self.allocate(1)

    def free_seq(self, seq: Sequence) -> None:
        self.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_evicted, seq.kv_scores = 0, None   # 重算时从头来过：策略一块一块地重新作用（与抢占前的缓存不同）

    def can_replace(self, table: list[int], n: int) -> bool:
        """step12 的压缩：先还掉 table、再分 n 个新块，够不够？只有引用计数为 1 的块（只有它自己用）还回来会变空闲；
        与别人共享的块还了也还在别人手里。"""
        return n <= self.num_free_blocks + sum(self.ref_counts[b] == 1 for b in table)

    def usage(self, running: list[Sequence]) -> tuple[int, int]:
        """运行集合为 KV 持有的槽、其中存着真实 token 的 K/V 的槽，按物理块算：几个请求共享的块只算一次，
        它存着的 token 也只算一次（差额只来自每个请求最后一块没写满的部分）。"""
        filled: dict[int, int] = {}   # 物理块 → 里面存着几个 token 的 K/V
        for seq in running:
            for i, b in enumerate(seq.block_table):
                n = min(self.block_size, max(0, seq.kv_len - i * self.block_size))
                filled[b] = max(filled.get(b, 0), n)
        return len(filled) * self.block_size, sum(filled.values())
