"""step12 章节模式的输入：一段长的英文文本，和 passkey（藏在无关文字里的一个数）的提示词。

长文本：CPython 自带的 `pydoc_data/topics.py`（help() 用的语言参考，英文散文 + 代码），按键排序、用空行连接，
分词后取前 N 个 token。随 Python 一起装好、不用下载，同一个 Python 版本上逐 token 确定（版本号印在表头）。

passkey：Landmark Attention 的提示词（llama.cpp 的 examples/passkey 用同一段）——任务说明、重复的无关句子、
藏在深度 d 处的一句"The pass key is N"、最后问它。提示词在 token 上拼接（每段各自分词），长度与深度都精确可控：
"问题在压缩之后才问"要求上下文恰好在一块 prefill 的边界上结束（chapter.py 解释为什么）。
"""
import random
import re
import sys
from dataclasses import dataclass

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"


def topics_text() -> str:
    """pydoc_data.topics 的全部条目，按键排序，空行隔开。"""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def text_source() -> str:
    return f"CPython {sys.version.split()[0]} 的 pydoc_data/topics.py（按键排序连接）"


def long_text_ids(tok, n: int) -> list[int]:
    """长文本的前 n 个 token（不加特殊 token）。只分词够用的一段前缀：从 6n 个字符起，不够就加倍；
    切口离第 n 个 token 至少还有几十个 token，所以前 n 个与整段分词的前 n 个相同。"""
    text = topics_text()
    chars = 6 * n
    while True:
        ids = tok.hf(text[:chars], add_special_tokens=False, verbose=False).input_ids
        if len(ids) >= n + 64 or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise ValueError(f"the text has only {len(ids)} tokens, asked for {n}")
    return ids[:n]


@dataclass
class Passkey:
    ids: list[int]        # 整个提示词
    key: str              # 藏的数（5 位）
    depth: float          # 藏的那句开头在上下文里的相对位置（0 = 开头）
    context_len: int      # 问题之前的 token 数
    question_len: int     # 问题的 token 数

    def correct(self, text: str) -> bool:
        """生成的文字里第一串数字恰好是 key。"""
        m = re.search(r"\d+", text)
        return m is not None and m.group() == self.key


def encode(tok, text: str) -> list[int]:
    return tok.hf(text, add_special_tokens=False).input_ids


def passkey(tok, context_len: int, depth: float, seed: int) -> Passkey:
    """上下文恰好 context_len 个 token（任务说明 + 无关句子 + 藏在 depth 处的那句 + 无关句子），后接问题。
    藏的那句插在两个无关句子之间，离要求的深度最多半个无关句子（约 12 token）。最后一句无关句子被截短到正好凑满长度。"""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    key = str(random.Random(seed).randint(10000, 99999))
    head, unit, needle, question = encode(tok, TASK), encode(tok, FILLER), encode(tok, NEEDLE.format(key=key)), encode(tok, QUESTION)
    room = context_len - len(head) - len(needle)
    if room < len(unit):
        raise ValueError(f"context_len {context_len} leaves no room for the filler")
    units_before = round(depth * room / len(unit))
    units_before = min(units_before, room // len(unit))
    before = unit * units_before
    after_len = room - len(before)
    after = (unit * (after_len // len(unit) + 1))[:after_len]
    context = head + before + needle + after
    assert len(context) == context_len
    return Passkey(context + question, key, (len(head) + len(before)) / context_len, context_len, len(question))


def passkey_set(tok, context_lens: list[int], depths: list[float], asked_after: bool) -> list[Passkey]:
    """每个 (长度 n, 深度) 一个提示词；种子由两者决定（同一格每次同一个数，两种问法也同一个数）。
    asked_after：上下文正好 n 个 token，问题在它之后（n 是一块 prefill 的整数倍时，问题单独成最后一块）；
    否则上下文少问题那么长，整个提示词正好 n 个 token：问题收在最后一块的末尾，与上下文一起被压缩。"""
    q = len(encode(tok, QUESTION))
    return [passkey(tok, n if asked_after else n - q, d, seed=1000 * n + round(100 * d)) for n in context_lens for d in depths]


def windowed_means(values: list[float], start: int, width: int) -> list[tuple[int, int, float]]:
    """values[i] 是位置 start + i 的量；按宽 width 的不重叠窗口求平均：[(窗口起点, 终点（不含）, 平均), ...]。
    最后一个窗口不满也算（它的终点就是末尾）。"""
    out = []
    for lo in range(0, len(values), width):
        chunk = values[lo:lo + width]
        out.append((start + lo, start + lo + len(chunk), sum(chunk) / len(chunk)))
    return out


def moving_average(values: list[float], width: int) -> list[float]:
    """画图用：以每个位置结尾的 width 个值的平均（开头不满 width 时用已有的）。"""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= width:
            acc -= values[i - width]
        out.append(acc / min(i + 1, width))
    return out
