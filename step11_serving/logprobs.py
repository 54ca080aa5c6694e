"""logprobs 与 echo 的线上格式：引擎交来的 Logprob（step09 的 sequence.py：token id、log 概率、最可能的 k 个）
→ OpenAI 的两种形状。数是什么（模型原始分布的 log_softmax，不经温度与惩罚）见 step09 engine.py 的 token_logprobs。

/v1/completions（旧格式，`logprobs: k`）：每个 choice 一个
    {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}], "text_offset": [int]}
    top_logprobs 的每一项是最可能的 k 个加上采样出的那个（所以至多 k+1 项，与 OpenAI、vLLM 相同）。
    echo 时提示词的 token 排在前面（第一个没有前文：token_logprobs 与 top_logprobs 是 null），text 也以提示词开头。
    text_offset：这个 token 的第一个字节落在 choice 的 text 的第几个字符（增量解码器的已解码文本长度）。
/v1/chat/completions（`logprobs: true, top_logprobs: k`）：
    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}] × k}]}
流式时每个 chunk 带它那几个 token 的（text_offset 仍是在整个 choice 文本里的位置）；echo 的提示词在每个 choice 的第一个 chunk 里。

token 的字符串是单独解码这一个 token（不跳过特殊 token）：一个汉字切成几个 token 时每个都是 "�"，与 vLLM 相同；
chat 的 bytes 是 token 真正的字节（字节级 BPE 的 token 本来就是一串字节），几个 token 的 bytes 接起来就是那个字。
旧格式的 top_logprobs 以字符串为键：两个 token 解码成同一个字符串（例如都是 "�"）时只留概率大的那个。
数都是有限的：JSON 没有 -Infinity（模型的 logits 有限，log_softmax 也有限；万一不是，按 vLLM 的做法写 -9999.0）。
"""
import functools
import json
import math
from dataclasses import dataclass, field
from typing import Optional

from .detokenizer import IncrementalDetokenizer

FLOOR = -9999.0


def _num(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


def _byte_decoder(hf) -> Optional[dict[str, int]]:
    """字节级 BPE（GPT-2、SmolLM2、Qwen 的分词器）的 token 字符串每个字符代表一个字节：返回 字符 → 字节；别的分词器 None。"""
    try:
        decoder = json.loads(hf.backend_tokenizer.to_str()).get("decoder") or {}
    except Exception:
        return None
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    if "ByteLevel" not in kinds:
        return None
    try:                                              # GPT-2 的 字节 → 可打印字符 表（transformers 5 把它挪了地方）
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
    return {c: b for b, c in bytes_to_unicode().items()}


class TokenText:
    """token id → 线上的字符串与字节（查一次记下来）。"""

    def __init__(self, tok):
        self.hf = tok.hf
        self.byte_decoder = _byte_decoder(tok.hf)
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, t: int) -> str:
        if t not in self._text:
            self._text[t] = self.hf.decode([t], skip_special_tokens=False)
        return self._text[t]

    def bytes(self, t: int) -> list[int]:
        if t not in self._bytes:
            piece = self.hf.convert_ids_to_tokens(t) if self.byte_decoder is not None else None
            if piece is not None and all(c in self.byte_decoder for c in piece):
                self._bytes[t] = [self.byte_decoder[c] for c in piece]
            else:                                       # 不是字节级的分词器（或加进来的特殊 token）：文本的 UTF-8
                self._bytes[t] = list(self.text(t).encode("utf-8"))
        return self._bytes[t]

    def completion(self, token_ids: list[int], entries: list, offsets: list[int]) -> dict:
        """旧格式。entries[i] 是 token_ids[i] 的 Logprob（None：echo 的第一个提示词 token）。"""
        top = []
        for t, e in zip(token_ids, entries):
            if e is None:
                top.append(None)
                continue
            d: dict[str, float] = {}
            for i, lp in e.top:                          # 从大到小：同一个字符串只留先到（大）的
                d.setdefault(self.text(i), _num(lp))
            d.setdefault(self.text(t), _num(e.logprob))
            top.append(d)
        return {"tokens": [self.text(t) for t in token_ids],
                "token_logprobs": [None if e is None else _num(e.logprob) for e in entries],
                "top_logprobs": top, "text_offset": list(offsets)}

    def chat(self, entries: list) -> dict:
        def one(t: int, lp: float) -> dict:
            return {"token": self.text(t), "logprob": _num(lp), "bytes": self.bytes(t)}
        return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top]}
                            for e in entries]}


@functools.lru_cache(maxsize=4)
def token_text(tok) -> TokenText:
    """每个分词器一个 TokenText（判断字节级要把整个分词器序列化一次，不能每个请求做一遍）。"""
    return TokenText(tok)


def text_offsets(tok, token_ids: list[int]) -> list[int]:
    """每个 token 的第一个字节落在整段解码的第几个字符（echo 的提示词用；生成的 token 由 async_engine 边解码边记）。"""
    det, out = IncrementalDetokenizer(tok), []
    for t in token_ids:
        out.append(len(det.text))
        det.push([t])
    return out


@dataclass
class ChoiceExtras:
    """一个 HTTP 请求的各个 choice 在文本之外多出来的：echo 的提示词、logprobs。
    echo[i]：choice i 的文本前面要加的提示词（None = 不 echo）；logprobs：要不要 logprobs（chat 或 completions 的形状）。"""
    tok: object
    chat: bool
    logprobs: bool
    prompt_ids: list[list[int]]                       # 每个 choice 的提示词 token
    echo: Optional[list[str]] = None
    started: set = field(default_factory=set)         # 已经发过第一个 chunk 的 choice（流式）
    # 非流式：每个 choice 攒起来的
    entries: dict = field(default_factory=dict)       # choice → [Logprob]
    offsets: dict = field(default_factory=dict)       # choice → [int]（相对生成的文本）
    token_ids: dict = field(default_factory=dict)
    prompt: dict = field(default_factory=dict)        # choice → 提示词的 [None, Logprob, ...]

    @property
    def text(self) -> TokenText:
        return token_text(self.tok)

    @property
    def active(self) -> bool:
        return self.logprobs or self.echo is not None

    def _base(self, i: int) -> int:
        return len(self.echo[i]) if self.echo is not None else 0

    def _shape(self, i: int, token_ids, entries, offsets, prompt) -> Optional[dict]:
        """一段 token（echo 时前面接上提示词）的 logprobs。"""
        if not self.logprobs:
            return None
        if self.chat:
            return self.text.chat(entries)
        ids, es, offs = list(token_ids), list(entries), [o + self._base(i) for o in offsets]
        if self.echo is not None and prompt is not None:
            p = self.prompt_ids[i]
            ids, es, offs = p + ids, list(prompt) + es, text_offsets(self.tok, p) + offs
        return self.text.completion(ids, es, offs)

    def chunk(self, d) -> tuple[str, Optional[dict]]:
        """流式：一个 Delta → (这个 chunk 的文本, 它的 logprobs)。每个 choice 的第一个 chunk 以 echo 的提示词开头。"""
        first = d.index not in self.started
        self.started.add(d.index)
        prefix = self.echo[d.index] if self.echo is not None and first else ""
        lps = self._shape(d.index, d.token_ids, d.logprobs or [], d.text_offsets or [],
                          d.prompt_logprobs if first else None)
        return prefix + d.text, lps

    def add(self, d) -> None:
        """非流式：攒一个 Delta。"""
        i = d.index
        self.token_ids.setdefault(i, []).extend(d.token_ids)
        self.entries.setdefault(i, []).extend(d.logprobs or [])
        self.offsets.setdefault(i, []).extend(d.text_offsets or [])
        if d.prompt_logprobs is not None:
            self.prompt[i] = d.prompt_logprobs

    def full(self, i: int, text: str) -> tuple[str, Optional[dict]]:
        """非流式：choice i 的 (完整文本, logprobs)。"""
        prefix = self.echo[i] if self.echo is not None else ""
        return prefix + text, self._shape(i, self.token_ids.get(i, []), self.entries.get(i, []),
                                          self.offsets.get(i, []), self.prompt.get(i))
