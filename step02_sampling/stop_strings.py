"""停止字符串：刚生成的那个 token 有没有补全一个停止串。step02 的 generate 与之后每一步的引擎都用这一个函数。

每生成一个 token 就查一次，所以只需要看这个 token 带来的**新文本**：停止串必须**结束**在新文本里（更早结束的，
更早那一步就已经停了），它的开头可以落在新文本之前至多"最长的停止串 − 1"个字符里。于是只解码输出的尾巴
（几个 token），而不是每一步把全部输出重新解码、从头找（那样每个 token 的代价随输出变长，一个请求 O(n²)）。

新文本怎么算（与第 11 章服务器的增量解码器、vLLM 的相同）：解码以半个字（U+FFFD）结尾时，这个 token 还不带来文本；
等补全那个字的 token 到了，从上一次带来文本的地方起，到现在的全部文本一起算作它带来的。一个汉字切成三个 token 时，
第三个 token 带来这个字。

min_tokens（vLLM 的规则）：前 min_tokens 个 token 带来的文本里结束的停止串不算；之后的 token 补全的停止串照样算，
哪怕它的开头在前 min_tokens 个 token 的文本里。
"""
from collections.abc import Sequence

REPLACEMENT = "\ufffd"
# 尾巴从一个字的中间切开时，开头会多出至多 3 个 U+FFFD（UTF-8 一个字至多 4 个字节）：多往前看这么多个字符
CUT_CHARS = 3


def completes_stop_string(tokenizer, output_ids: Sequence[int], stop: Sequence[str], min_tokens: int = 0) -> bool:
    """刚 append 了 output_ids[-1]：它带来的新文本里是否结束了某个停止串（只在新生成的文本里找，提示词不算）。"""
    n = len(output_ids)
    if not stop or n <= min_tokens:
        return False
    lookback = max(map(len, stop)) - 1 + CUT_CHARS   # 新文本之前要看这么多个字符
    k = lookback   # 尾巴里新 token 之前的 token 数：每个 token 至少一个字节；解码出的字符不够（多字节字、特殊 token）就加倍
    while True:
        start = max(0, n - 1 - k)
        text = tokenizer.decode(output_ids[start:n])
        if text.endswith(REPLACEMENT):                   # 还是半个字：这个 token 不带来文本
            return False
        before = _text_so_far(tokenizer, output_ids, start, n - 1)
        if start == 0 or len(before) >= lookback:
            break
        k *= 2
    # 从 len(before) - len(s) + 1 找起：找到的都结束在 before 之后，即新文本里
    return any(text.find(s, max(0, len(before) - len(s) + 1)) >= 0 for s in stop)


def _text_so_far(tokenizer, ids: Sequence[int], start: int, end: int) -> str:
    """ids[start:end] 已经带来的文本：解码以半个字结尾时退到不以它结尾的最长前缀（那几个 token 还没带来文本）。"""
    while True:
        text = tokenizer.decode(ids[start:end])
        if end == start or not text.endswith(REPLACEMENT):
            return text
        end -= 1
