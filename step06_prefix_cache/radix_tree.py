"""SGLang 式的基数树（RadixCache）：按 token 粒度记"哪些前缀的 K/V 在缓存里"。

每条边是一段 token，从根走到某个节点经过的 token 拼起来就是一段缓存过的前缀。与块哈希（block_manager.py）比：
- 匹配按 token 算，不按块取整：块大小 4 时，缓存里有 "|This is the||end.|"，新请求 "This is the end!" 的
  最后一块没满，块缓存只能用 "This is the"，基数树能用到 "This is the end"（只要 K/V 按 token 存放）；
- 节点按需分裂：新前缀只在分叉处多出一个节点，公共部分只存一份；
- 回收按叶子：最久没访问的、没人锁着的叶子先走，于是总是先丢前缀的尾巴，不会留下断掉的前缀。

这里只管"索引"：不存 K/V 本身（SGLang 的节点里还存每个 token 的 K/V 槽号）。chapter.py 用它在多轮对话负载上
模拟同样容量的 token 粒度缓存，量出它比整块匹配多找到多少 token、又花了什么代价。
"""
import heapq
import itertools
from dataclasses import dataclass
from typing import Optional


class RadixNode:
    def __init__(self, tokens: tuple[int, ...], parent: Optional["RadixNode"]):
        self.tokens = tokens                          # 这条边上的 token（根为空）
        self.parent = parent
        self.children: dict[int, RadixNode] = {}      # 子节点按它第一个 token 索引：同一节点下的子边首 token 各不相同
        self.lock_ref = 0                             # > 0：有正在运行的请求用着这段前缀，不能回收
        self.last_access = 0                          # 逻辑时钟：越大越新


@dataclass
class RadixMatch:
    length: int           # 匹配到的 token 数
    node: RadixNode       # 匹配正好在这个节点的末尾结束（必要时分裂出来）


def common_prefix_len(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RadixTree:
    def __init__(self, capacity_tokens: int):
        self.root = RadixNode((), None)
        self.capacity = capacity_tokens
        self.size = 0                                 # 树里一共存了多少个 token
        self.num_evicted_tokens = 0
        self._clock = itertools.count(1)

    def match_prefix(self, tokens: list[int]) -> RadixMatch:
        """最长匹配：沿着边往下走；在一条边的中间分开时把这条边分裂成两段，好让匹配正好停在一个节点上。"""
        now = next(self._clock)
        node, i = self.root, 0
        node.last_access = now
        while i < len(tokens) and tokens[i] in node.children:
            child = node.children[tokens[i]]
            n = common_prefix_len(child.tokens, tokens[i:])
            if n < len(child.tokens):
                child = self._split(child, n)
            child.last_access = now
            node, i = child, i + n
        return RadixMatch(i, node)

    def insert(self, tokens: list[int]) -> int:
        """把一段（已经算好 K/V 的）前缀放进树里，返回新存了多少个 token。装不下时先回收；
        实在腾不出地方（剩下的都被锁着），只存放得下的那一截。"""
        m = self.match_prefix(tokens)
        rest = tuple(tokens[m.length:])
        if not rest:
            return 0
        self.lock(m.node)                             # 腾地方时不能把要接上去的那条路径回收掉
        self.evict(self.size + len(rest) - self.capacity)
        self.unlock(m.node)
        rest = rest[:self.capacity - self.size]
        if rest:
            leaf = RadixNode(rest, m.node)
            leaf.last_access = m.node.last_access
            m.node.children[rest[0]] = leaf
            self.size += len(rest)
        return len(rest)

    def evict(self, num_tokens: int) -> int:
        """按最近访问时间从旧到新回收没被锁的叶子，直到腾出 num_tokens 个 token；父节点变成叶子后也进候选。"""
        if num_tokens <= 0:
            return 0
        tie = itertools.count()                       # 时间相同时按入堆顺序，避免比较节点对象
        heap = [(n.last_access, next(tie), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            freed += len(leaf.tokens)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        self.size -= freed
        self.num_evicted_tokens += freed
        return freed

    def lock(self, node: RadixNode) -> None:
        """请求开始用这段前缀：从节点到根一路 +1（SGLang 的 inc_lock_ref）。"""
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None:
            if node.lock_ref == 0:
                raise RuntimeError("unlock of a node that is not locked")
            node.lock_ref -= 1
            node = node.parent

    def num_nodes(self) -> int:
        return sum(1 for _ in self._nodes()) - 1      # 不算根

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """把 child 的边在第 n 个 token 处切开：parent ─[:n]→ mid ─[n:]→ child。返回 mid。"""
        mid = RadixNode(child.tokens[:n], child.parent)
        mid.lock_ref, mid.last_access = child.lock_ref, child.last_access
        child.parent.children[child.tokens[0]] = mid
        child.tokens = child.tokens[n:]
        child.parent = mid
        mid.children[child.tokens[0]] = child
        return mid
