"""正则表达式的解析：字符串 → 语法树（AST）。树的叶子是"码点集合"，后面（automaton.py）再把它变成 UTF-8 字节上的自动机。

支持的子集（语义同 Python 的 re.fullmatch(p, s, re.ASCII)，整串匹配）：
    字面字符（含任意 Unicode 字符）、转义 \\. \\* \\n \\t \\xhh \\uhhhh ……
    字符类 [abc] [a-z] [^...]，类里也可以有 \\d \\w \\s \\D \\W \\S
    .（除换行外的任意字符）、|、分组 (...) 与 (?:...)
    量词 ? * + {m} {m,} {m,n} {,n}（后面跟 ? 的懒惰写法语言相同，照收）
    \\d = [0-9]、\\w = [A-Za-z0-9_]、\\s = [ \\t\\n\\r\\f\\v]（ASCII 含义，约束解码的惯例）；大写是补集
    开头的 ^、结尾的 $（整串匹配，本来就锚定，等于没写）
不支持的（反向引用、环视、\\b、命名组……）报 GrammarError，信息里带出错的位置。

json_string=True：这个正则描述的是 JSON 字符串的 *内容*（schema 的 pattern），输出的却是 JSON 文本。
字面字符按 JSON 的写法输出（" 写成 \\"，换行写成 \\n）；字符类与 . 去掉必须转义的字符（" \\ 与 U+0000–U+001F）——
这是收窄：模型写不出需要转义的字符，但写出的每个字符串都满足 pattern。
"""
import json
import re
from dataclasses import dataclass

from common.errors import UserError

class GrammarError(UserError, ValueError):
    """正则或 JSON schema 不合法、不支持：是用户的输入（run.py 打印成一行 error:，服务器回 400）。"""


MAX_CODEPOINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)        # UTF-8 不能编码代理码点，所有集合都不含它们
MAX_REPEAT = 1000                    # {m,n} 的上限：展开成 NFA 时每一份都是一个副本


@dataclass(frozen=True)
class Chars:
    """码点集合：有序、不相交的闭区间 [(lo, hi), ...]。"""
    ranges: tuple


@dataclass(frozen=True)
class Concat:
    items: tuple                     # 空 tuple = 空串


@dataclass(frozen=True)
class Alt:
    items: tuple


@dataclass(frozen=True)
class Repeat:
    item: object
    min: int
    max: int | None                  # None = 无上限


def char_set(ranges) -> Chars:
    """排序、合并相邻区间、去掉代理码点。"""
    out = []
    for lo, hi in sorted(ranges):
        for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
            if a > b:
                continue
            if out and a <= out[-1][1] + 1:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
    return Chars(tuple(out))


def complement(c: Chars) -> Chars:
    out, start = [], 0
    for lo, hi in c.ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODEPOINT:
        out.append((start, MAX_CODEPOINT))
    return char_set(out)


def intersect(a: Chars, b: Chars) -> Chars:
    return char_set([(max(x, y), min(p, q)) for x, p in a.ranges for y, q in b.ranges if max(x, y) <= min(p, q)])


def literal(s: str) -> Concat:
    return Concat(tuple(char_set([(ord(c), ord(c))]) for c in s))


DIGIT = char_set([(48, 57)])
WORD = char_set([(48, 57), (65, 90), (95, 95), (97, 122)])
SPACE = char_set([(9, 13), (32, 32)])         # \t \n \v \f \r 空格
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE,
                 "D": complement(DIGIT), "W": complement(WORD), "S": complement(SPACE)}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}
ANY_BUT_NEWLINE = complement(char_set([(10, 10)]))
JSON_SAFE = complement(char_set([(0, 0x1F), (ord('"'), ord('"')), (ord("\\"), ord("\\"))]))
QUANTIFIER = re.compile(r"\{(\d*)(,(\d*))?\}")      # 同 Python：{} 不是量词，是字面字符


def parse_regex(pattern: str, json_string: bool = False):
    """pattern → AST。出错时 GrammarError（"… at position N"）。"""
    return _Parser(pattern, json_string).parse()


class _Parser:
    def __init__(self, pattern: str, json_string: bool):
        self.p, self.i, self.json_string = pattern, 0, json_string

    def error(self, msg: str, pos: int | None = None):
        return GrammarError(f"invalid regex {self.p!r}: {msg} at position {self.i if pos is None else pos}")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def parse(self):
        if self.peek() == "^":
            self.i += 1
        node = self.alternation()
        if self.i < len(self.p):
            raise self.error("unbalanced ')'" if self.peek() == ")" else f"unexpected {self.peek()!r}")
        return node

    def alternation(self):
        items = [self.concat()]
        while self.peek() == "|":
            self.i += 1
            items.append(self.concat())
        return items[0] if len(items) == 1 else Alt(tuple(items))

    def concat(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            if self.peek() == "$" and self.i == len(self.p) - 1:   # 结尾的 $：整串匹配本来就锚定
                self.i += 1
                break
            items.append(self.quantified(self.atom()))
        return items[0] if len(items) == 1 else Concat(tuple(items))

    def quantified(self, node):
        repeated = False                             # (a?)* 合法，a?* 不合法：看的是这里，不是 node 的类型
        while True:
            start, c = self.i, self.peek()
            if c in ("?", "*", "+"):
                self.i += 1
                lo, hi = {"?": (0, 1), "*": (0, None), "+": (1, None)}[c]
            elif c == "{" and (m := self.quantifier_at(self.i)):
                self.i = m.end()
                lo = int(m.group(1) or 0)
                hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                if hi is not None and hi < lo:
                    raise self.error(f"min repeat greater than max repeat in {m.group(0)}", start + 1)
                if max(lo, hi or 0) > MAX_REPEAT:
                    raise self.error(f"repeat count over {MAX_REPEAT} in {m.group(0)}", start)
            else:
                return node
            if repeated:
                raise self.error("multiple repeat", start)
            repeated = True
            if self.peek() == "?":                   # 懒惰量词：整串匹配时语言相同
                self.i += 1
            node = Repeat(node, lo, hi)

    def quantifier_at(self, i: int):
        m = QUANTIFIER.match(self.p, i)
        return m if m and (m.group(1) or m.group(2)) else None

    def atom(self):
        start, c = self.i, self.peek()
        self.i += 1
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.error("unsupported group syntax (?" + (self.p[self.i + 1:self.i + 2]), start)
            node = self.alternation()
            if self.peek() != ")":
                raise self.error("missing ')', unterminated group", start)
            self.i += 1
            return node
        if c in ("*", "+", "?") or (c == "{" and self.quantifier_at(start)):
            raise self.error("nothing to repeat", start)
        if c == "[":
            return self.chars(self.char_class(start))
        if c == ".":
            return self.chars(ANY_BUT_NEWLINE)
        if c in ("^", "$"):
            raise self.error(f"{c!r} is only supported at the start / end of the regex", start)
        if c == "\\":
            esc = self.escape(start)
            return self.chars(esc) if isinstance(esc, Chars) else self.literal_char(esc)
        return self.literal_char(c)

    def escape(self, start: int) -> "Chars | str":
        """反斜杠之后：类转义返回 Chars，其余返回一个字符。"""
        c = self.peek()
        if c is None:
            raise self.error("bad escape (end of pattern)", start)
        self.i += 1
        if c in CLASS_ESCAPES:
            return CLASS_ESCAPES[c]
        if c in CHAR_ESCAPES:
            return CHAR_ESCAPES[c]
        if c in "xu":
            n = 2 if c == "x" else 4
            digits = self.p[self.i:self.i + n]
            if len(digits) != n or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"bad escape \\{c}{digits}", start)
            self.i += n
            return chr(int(digits, 16))
        if c.isascii() and c.isalnum():
            raise self.error(f"unsupported escape \\{c}", start)
        return c                                      # \. \* \\ \[ ……：字符本身

    def char_class(self, start: int) -> Chars:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges, first = [], True
        while True:
            c = self.peek()
            if c is None:
                raise self.error("unterminated character set", start)
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_item()
            if isinstance(lo, Chars):
                ranges += lo.ranges
                continue
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                dash = self.i
                self.i += 1
                hi = self.class_item()
                if isinstance(hi, Chars):
                    raise self.error("bad character range (class escape as bound)", dash)
                if ord(hi) < ord(lo):
                    raise self.error(f"bad character range {lo}-{hi}", dash - 1)
                ranges.append((ord(lo), ord(hi)))
            else:
                ranges.append((ord(lo), ord(lo)))
        cs = char_set(ranges)
        return complement(cs) if negate else cs

    def class_item(self) -> "Chars | str":
        c = self.peek()
        self.i += 1
        return self.escape(self.i - 1) if c == "\\" else c

    def chars(self, cs: Chars):
        # 空集合（[^\s\S]，或 JSON 字符串里的 [\x00-\x1f]）照收，同 Python：那个分支走不通，DFA 剪枝时去掉它
        return intersect(cs, JSON_SAFE) if self.json_string else cs

    def literal_char(self, c: str):
        # JSON 字符串里 " \\ 与控制字符要转义：输出的是转义后的写法（json.dumps 的规则）
        return literal(json.dumps(c, ensure_ascii=False)[1:-1] if self.json_string else c)


def to_regex(node) -> str:
    """AST → 正则字符串（parse_regex 的逆）：schema.py 把 pattern 放进更大的正则时用。"""
    if isinstance(node, Chars):
        if not node.ranges:
            return r"[^\s\S]"                  # 空集
        if len(node.ranges) == 1 and node.ranges[0][0] == node.ranges[0][1]:
            return escape_char(node.ranges[0][0], "\\.^$|?*+()[]{}")
        body = "".join(escape_char(lo, "\\]^-[") + ("" if lo == hi else "-" + escape_char(hi, "\\]^-["))
                       for lo, hi in node.ranges)
        return f"[{body}]"
    if isinstance(node, Concat):
        return "".join(f"(?:{to_regex(x)})" if isinstance(x, Alt) else to_regex(x) for x in node.items)
    if isinstance(node, Alt):
        return "|".join(to_regex(x) for x in node.items)
    if isinstance(node, Repeat):
        inner = to_regex(node.item)
        if not isinstance(node.item, Chars):
            inner = f"(?:{inner})"
        hi = "" if node.max is None else node.max
        return inner + (f"{{{node.min}}}" if node.min == node.max else f"{{{node.min},{hi}}}")
    raise TypeError(node)


def escape_char(cp: int, special: str) -> str:
    c = chr(cp)
    if cp < 0x20 or cp == 0x7F:
        return f"\\x{cp:02x}"
    return "\\" + c if c in special else c
