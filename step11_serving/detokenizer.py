"""增量解码：一个请求的 token 陆续到来，文本陆续发出去，而且

1. 不把一个字切成两半。一个汉字在 UTF-8 里是 3 个字节，字节级 BPE 的一个 token 可能只带其中 1～2 个字节：
   单独解码这几个 token 得到的是替换符 U+FFFD（"�"）。所以只在新解码出的文本不以 U+FFFD 结尾时才发出。
2. 与整段解码完全相同。每次只解码"上一次发出的那几个 token + 新 token"这个小窗口（vLLM 的 prefix_offset /
   read_offset），新文本 = 窗口的解码去掉上一次那段的解码；结束时再整段解码一次，补上最后留着没发的部分。
3. 不把停止字符串发出去。OpenAI 的语义：返回的文本到停止字符串之前为止、不含它（vLLM 的 include_stop_str_in_output
   时到停止串的末尾为止）。停止字符串可能跨好几个 token 陆续出现，所以文本末尾"可能是某个停止串开头"的那一段先留着，
   确定不是再发。min_tokens（vLLM 的规则）：停止串要结束在前 min_tokens 个 token 之后的文本里才算——前面结束的
   照常发出；开头在前面、结束在后面的算。

服务器的停止字符串只在这里找（引擎拿到的请求不带停止串）：每来一个 token 只看文本的尾巴——还没发出的那段加上
"最长的停止串减一"个已发出的字符——而不是把整段输出重新解码再从头找（那样每个 token 的代价随输出变长而增长，
一个请求是 O(n²)）。停止串的个数与长度由 protocol.py 限制（MAX_STOP_STRINGS、MAX_STOP_CHARS）。
"""
from typing import Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = (), min_tokens: int = 0, include_stop_str: bool = False):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self.stop_from = 0         # 前 min_tokens 个 token 的文本到这里为止：停止串要结束在它之后才算
        self.include_stop_str = include_stop_str   # 发出的文本包含停止串本身（vLLM 的 include_stop_str_in_output）
        self.ids: list[int] = []
        self.prefix_offset = 0     # 窗口从这里开始：上一次发出的那几个 token
        self.read_offset = 0       # 已经变成文本的 token 到这里为止
        self.text = ""             # 已解码出的完整字符
        self.sent = 0              # 其中已经发出去的字符数
        self.stopped = False       # 已经遇到停止字符串：之后什么也不发

    def push(self, token_ids: Sequence[int]) -> str:
        """新来的 token → 现在可以发出去的文本（可能是空串）。一次来几个时也一个一个地解码、找停止串：
        结果与一个一个来时相同（min_tokens 的边界落在第 min_tokens 个 token 上，先结束的停止串先算）。"""
        out = ""
        for t in token_ids:
            self._decode(t)
            out += self._release(final=False)
        return out

    def _decode(self, token_id: int) -> None:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        new = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(new) > len(prefix) and not new.endswith(REPLACEMENT):
            self.text += new[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if len(self.ids) <= self.min_tokens:
            self.stop_from = len(self.text)

    def finish(self) -> str:
        """请求结束：整段解码为准（半个字符到最后也没补全时，这里按解码器的规则变成 U+FFFD），发出剩下的全部。"""
        full = self.tokenizer.decode(self.ids)
        if full.startswith(self.text):
            self.text = full
        else:   # 不应发生：发出去的文本收不回来，只能接着整段解码里对应的位置往后发
            self.text = self.text[:self.sent] + full[self.sent:]
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self.text)
        if self.stop:
            hits = []
            if len(self.ids) > self.min_tokens:
                # 只找结束在已发出的部分（那里结束的早就找过了）与前 min_tokens 个 token 的文本之后的
                lo = max(self.sent, self.stop_from)
                hits = [(i, i + len(s)) for s in self.stop if (i := self.text.find(s, max(0, lo - len(s) + 1))) >= 0]
            if hits:
                at, after = min(hits)                      # 最早出现的那个停止串：从哪开始、到哪结束
                end, self.stopped = (after if self.include_stop_str else at), True
            elif not final:
                end -= self._held_back()
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def _held_back(self) -> int:
        """文本末尾最长的一段、它是某个停止串的开头（但不是整个停止串）：这么多字符先不发。
        候选长度 k 只有停止串里等于文本最后一个字符的那些位置（s[k-1] == text[-1]），从长到短试。"""
        best, last = 0, self.text[-1:]
        if not last:
            return 0
        for s in self.stop:
            k = s.rfind(last, 0, len(s) - 1) + 1
            while k > best:
                if self.text.endswith(s[:k]):
                    best = k
                    break
                k = s.rfind(last, 0, k - 1) + 1
        return best
