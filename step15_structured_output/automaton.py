"""正则 AST → 字节上的 Thompson NFA → 子集构造得到 DFA → 剪掉死状态。

为什么在字节上而不是字符上：byte-level BPE 的 token 是任意字节串，一个汉字（3 个字节）可能被切在两个 token 里。
自动机一次吃一个字节，token 是否合法就是"沿着它的字节走，不掉进死状态"，与 token 怎么切无关（outlines-core、
llguidance 也这样做）。于是一个码点区间要变成若干条 UTF-8 字节序列的并（utf8_sequences）。

DFA 的表示：trans[s] 是长 256 的 list，trans[s][b] = 下一个状态；状态 0 是死状态 DEAD（永远回到自己，
从它到不了任何接受状态），状态 1 是起点。死状态剪枝之后，"不是 DEAD"就等于"还能走到接受状态"——
掩码只要看走完 token 之后是否还活着。
"""
from dataclasses import dataclass

from .regex_parser import Alt, Chars, Concat, GrammarError, Repeat, parse_regex

DEAD, START = 0, 1
MAX_NFA_STATES = 200_000        # 防止 {m,n} 嵌套把 NFA 撑爆（每一份重复都是一个副本）


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """码点区间 [lo, hi] → 字节区间序列的列表：每个序列 [(b0lo, b0hi), (b1lo, b1hi), ...] 表示
    "第 k 个字节落在第 k 个区间里"，这些序列的并恰好是区间内全部码点的 UTF-8 编码（没有别的）。
    做法：先按编码长度（1/2/3/4 字节）切开，再切到"除第一个字节外每个续字节都取满或都只在一个前缀下"为止。"""
    for bound in (0x7F, 0x7FF, 0xFFFF):
        if lo <= bound < hi:
            return utf8_sequences(lo, bound) + utf8_sequences(bound + 1, hi)
    if hi <= 0x7F:
        return [[(lo, hi)]]
    for i in (1, 2, 3):
        m = (1 << (6 * i)) - 1                  # 低 i 个续字节的位
        if lo & ~m != hi & ~m:                  # 高位不同：低位必须从 00…0 取到 11…1，否则先切开
            if lo & m:
                return utf8_sequences(lo, lo | m) + utf8_sequences((lo | m) + 1, hi)
            if hi & m != m:
                return utf8_sequences(lo, (hi & ~m) - 1) + utf8_sequences(hi & ~m, hi)
    return [list(zip(chr(lo).encode(), chr(hi).encode()))]


class NFA:
    """Thompson 构造：每个状态有若干 ε 边与字节区间边 (lo, hi, 目标)。一个片段是 (入口, 出口)。"""

    def __init__(self):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []

    def state(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise GrammarError(f"regex too large: more than {MAX_NFA_STATES} automaton states")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node) -> tuple[int, int]:
        s, e = self.state(), self.state()
        if isinstance(node, Chars):
            for lo, hi in node.ranges:
                for seq in utf8_sequences(lo, hi):   # 每条字节序列是 s → … → e 的一条链
                    cur = s
                    for k, (b0, b1) in enumerate(seq):
                        nxt = e if k == len(seq) - 1 else self.state()
                        self.edges[cur].append((b0, b1, nxt))
                        cur = nxt
        elif isinstance(node, Concat):
            cur, prev, prev_frag = s, None, None
            for item in node.items:
                if (prev is not None and isinstance(item, Repeat) and (item.min, item.max) == (0, None)
                        and isinstance(item.item, Concat) and item.item.items[-1:] == (prev,)):
                    # X(?:S X)*：列表的写法（JSON 的数组、对象）。不再造 X 的第二个副本，而是从 X 的出口经过 S
                    # 回到同一个 X 的入口——语言相同，DFA 却少一半状态（两个副本在子集构造里是不同的状态）
                    sa, sb = self.build(Concat(item.item.items[:-1]))
                    self.eps[cur].append(sa)
                    self.eps[sb].append(prev_frag[0])
                    continue
                a, b = self.build(item)
                self.eps[cur].append(a)
                cur, prev, prev_frag = b, item, (a, b)
            self.eps[cur].append(e)
        elif isinstance(node, Alt):
            for item in node.items:
                a, b = self.build(item)
                self.eps[s].append(a)
                self.eps[b].append(e)
        elif isinstance(node, Repeat):
            cur = s
            for _ in range(node.min):                # 必选的 min 份
                a, b = self.build(node.item)
                self.eps[cur].append(a)
                cur = b
            if node.max is None:                     # 之后任意多份：一个带回边的副本
                a, b = self.build(node.item)
                self.eps[cur] += [a, e]
                self.eps[b] += [a, e]
            else:                                    # 之后最多 max-min 份：每份之后都可以直接结束
                for _ in range(node.max - node.min):
                    a, b = self.build(node.item)
                    self.eps[cur] += [a, e]
                    cur = b
                self.eps[cur].append(e)
        else:
            raise TypeError(node)
        return s, e

    def closure(self, states) -> frozenset:
        seen, stack = set(states), list(states)
        while stack:
            for t in self.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)


@dataclass
class DFA:
    trans: list[list[int]]          # (状态数, 256)
    accepting: list[bool]

    @property
    def num_states(self) -> int:
        return len(self.trans)

    def walk(self, state: int, data: bytes) -> int:
        for b in data:
            state = self.trans[state][b]
        return state

    def fullmatch(self, text: str) -> bool:
        return self.accepting[self.walk(START, text.encode())]


def byte_classes(nfa: NFA) -> list[tuple[int, int]]:
    """把 0..255 切成区间，使每条边的字节区间都是整段区间的并：子集构造只需对每个区间算一次（RE2 的 byte class）。"""
    cuts = {0, 256}
    for edges in nfa.edges:
        for lo, hi, _ in edges:
            cuts |= {lo, hi + 1}
    cuts = sorted(cuts)
    return list(zip(cuts[:-1], cuts[1:]))


def determinize(nfa: NFA, start: int, end: int) -> DFA:
    """子集构造：DFA 状态 = NFA 状态集合（ε 闭包）。状态 0 是空集 = 死状态。"""
    classes = byte_classes(nfa)
    class_of = [0] * 256
    for k, (lo, hi) in enumerate(classes):
        class_of[lo:hi] = [k] * (hi - lo)
    sets = [frozenset(), nfa.closure([start])]
    index = {s: i for i, s in enumerate(sets)}
    trans = []
    for cur in sets:                                # sets 在循环里增长：worklist
        targets = [set() for _ in classes]          # 每个字节类 → 一步能到的 NFA 状态
        for s in cur:
            for lo, hi, t in nfa.edges[s]:
                for k in range(class_of[lo], class_of[hi] + 1):
                    targets[k].add(t)
        row = [DEAD] * 256
        for (lo, hi), tk in zip(classes, targets):
            if tk:
                nxt = nfa.closure(tk)
                if nxt not in index:
                    index[nxt] = len(sets)
                    sets.append(nxt)
                row[lo:hi] = [index[nxt]] * (hi - lo)
        trans.append(row)
    return DFA(trans, [end in s for s in sets])


def prune_dead(dfa: DFA) -> DFA:
    """到不了接受状态的状态都并进 DEAD，再把剩下的重新编号（START 仍是 1；起点本身死了就是一个空语言）。"""
    n = dfa.num_states
    preds = [set() for _ in range(n)]
    for s, row in enumerate(dfa.trans):
        for t in set(row):
            preds[t].add(s)
    alive = {s for s in range(n) if dfa.accepting[s]}
    stack = list(alive)
    while stack:
        for p in preds[stack.pop()]:
            if p not in alive:
                alive.add(p)
                stack.append(p)
    if START not in alive:
        raise GrammarError("the regex matches no string")
    order = [DEAD, START] + [s for s in range(2, n) if s in alive]
    new = {s: i for i, s in enumerate(order)}
    trans = [[new.get(t, DEAD) for t in dfa.trans[s]] for s in order]
    trans[DEAD] = [DEAD] * 256
    return DFA(trans, [s != DEAD and dfa.accepting[s] for s in order])


def compile_regex(pattern: str) -> DFA:
    """正则 → 剪枝后的 DFA。"""
    nfa = NFA()
    start, end = nfa.build(parse_regex(pattern))
    return prune_dead(determinize(nfa, start, end))
