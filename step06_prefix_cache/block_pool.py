"""step06 的块池：step05 的分配器（空闲链表 + 引用计数）+ 前缀缓存（vLLM 的 BlockPool、nano-vllm 的 BlockManager）。

一块写满之后登记进缓存：key = hash(前一块的 key, 这一块的 token id)。key 是链式的，所以 key 相等 ⇔ 从位置 0
到这一块末尾的整段前缀相等（哈希不撞的前提下；撞了也不怕，见 longest_cached_prefix 的核对）。

块的一生（第 06 章有图）：

    空闲（无 key）──allocate──▶ 使用中（ref ≥ 1）──写满、登记──▶ 使用中且带 key ──命中──▶ ref + 1（共享）
         ▲                                                              │ 最后一个持有者 free
         └────────────── 池子要空间：驱逐最久没用的 ◀── 可驱逐（ref = 0，仍带 key，还能被命中）

- free_blocks（继承自 step05）：ref = 0 且没有 key 的块——里面没有值得留的东西，分配时先用它们；
- evictable：ref = 0 但带 key 的块，按"最近一次被释放"的先后排（最前面 = 最久没用）；空块用完了才从这里驱逐；
- 一个块要么在 free_blocks，要么在 evictable，要么 ref ≥ 1，三者互斥（测试用 hypothesis 检查）。
"""
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

from step05_paged.block_allocator import BlockAllocator

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
    next_key: Optional[int]          # 紧接着的那一满块（要重新算的第一块）的 key；后面没有满块时为 None


class PrefixCachingBlockAllocator(BlockAllocator):
    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn = chain_hash):
        super().__init__(num_blocks)
        self.block_size = block_size
        self.hash_fn = hash_fn                           # 测试里换成一个必然碰撞的函数
        self.cached: dict[int, CachedBlock] = {}         # 物理块号 → 它登记的内容（只有写满的块）
        self.key_to_block: dict[int, int] = {}           # key → 物理块号：一个 key 只对应一块
        self.evictable: OrderedDict[int, None] = OrderedDict()  # 哈希表 + 双向链表：O(1) 从中间取出命中的块
        self.num_evictions = 0

    # >>> step06 新增：带 key 的空闲块也算空闲（随时可以驱逐），但分配时排在空块后面
    @property
    def num_free(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks but only {self.num_free} are free")
        while len(self.free_blocks) < n:                 # 空块不够：驱逐最久没用的缓存块，它变回空块
            block, _ = self.evictable.popitem(last=False)
            self._uncache(block)
            self.free_blocks.append(block)
            self.num_evictions += 1
        return super().allocate(n)

    def free(self, blocks: list[int]) -> None:
        """从尾到头释放：同一个请求靠后的块先进 evictable，于是先被驱逐；开头的块（最可能被别人共享）留得最久。
        这也保证了子块总在父块之前被驱逐——缓存里不会留下找不到父块的块。"""
        for b in reversed(blocks):
            if self.ref_counts[b] == 0:
                raise RuntimeError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if b in self.cached:
                    self.evictable[b] = None             # 放到最后 = 最近用过
                else:
                    self.free_blocks.append(b)
    # <<<

    def longest_cached_prefix(self, token_ids: list[int], max_blocks: int) -> PrefixMatch:
        """从第 0 块起逐块查：算 key、查表、核对原像（前一块正是上一步命中的那块，token 完全相同）。
        第一次查不到或核对不上就停。只读，不改引用计数（调度器确定放得下之后再 acquire）。"""
        bs, parent_key, parent = self.block_size, None, None
        blocks = []
        for i in range(len(token_ids) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            key = self.hash_fn(parent_key, tokens)
            b = self.key_to_block.get(key)
            if i == max_blocks or b is None or self.cached[b] != CachedBlock(key, parent, tokens):
                return PrefixMatch(blocks, key)          # 碰撞（key 相同、内容不同）在这里变成未命中
            blocks.append(b)
            parent_key, parent = key, b
        return PrefixMatch(blocks, None)

    def acquire(self, blocks: list[int]) -> None:
        """命中的块：引用计数 +1；原来没人用（在 evictable 里）的先取出来，不再参与驱逐。"""
        for b in blocks:
            if b not in self.cached:
                raise RuntimeError(f"acquire of block {b}, which is not in the prefix cache")
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1

    def cache_block(self, block: int, parent: Optional[int], token_ids: tuple[int, ...]) -> bool:
        """登记一块刚写满的块（它的 K/V 已经在池子里）。返回是否登记了：
        - 前一块没登记（它自己就是重复的，或请求在半路才开始登记）→ 不登记，链断了后面也接不上；
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

    def _uncache(self, block: int) -> None:
        del self.key_to_block[self.cached.pop(block).key]

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)
