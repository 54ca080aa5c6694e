"""引擎这一侧的结构化输出：请求带的约束（StructuredOutputsParams，vLLM 的名字）→ 每个请求一个 GrammarMatcher；
一批请求的各行掩码怎么填；投机解码的猜测怎么按语法截断；jump-forward 的 token 怎么定（铺到 logits 上用
token_index.apply_token_bitmask_）。

语法本身（正则 → DFA、JSON Schema → 正则、词表 × DFA → 掩码）在 regex_parser.py / automaton.py / schema.py / token_index.py；
这里只用它们的接口：GrammarCompiler.compile_regex / compile_json_schema / compile_json_object、
GrammarMatcher.accept_token / fill_bitmask / rollback / forced_bytes。

一次前向里，一个有约束的请求有 1 + k 行 logits（k 个猜测，不猜时 k = 0）：第 i 行的掩码是"接受了前 i 个猜测之后"
的允许集合。fill_rows 让匹配器先接受这些猜测、每接受一个填一行，再退回去（rollback）——猜测还没被验证，
真正接受哪几个由 verify 决定，之后由 Sequence.append_token 一个一个推进匹配器。
"""
import json
import weakref
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from common.errors import UserError

from .automaton import START
from .regex_parser import parse_regex
from .schema import literal, schema_to_regex
from .token_index import CompiledGrammar, GrammarCompiler, GrammarMatcher, TokenIndex

JUMP_BACKOFF_TOKENS = 4   # jump-forward 的结尾最多退回几个 token 去检查"有没有更长的 token 跨过边界"（llguidance 的取值）


@dataclass(frozen=True)
class StructuredOutputsParams:
    """一个请求的约束，四种里恰好给一种（vLLM 的 StructuredOutputsParams 的同名字段）：
    json         JSON Schema（dict 或 JSON 文本；支持的关键字见 schema.py）
    regex        正则（整串匹配；支持的语法见 regex_parser.py）
    choice       几个字符串之一（原样，不是正则）
    json_object  任意 JSON 对象（OpenAI 的 response_format {"type": "json_object"}；嵌套深度有上限，见 schema.py）"""
    json: Union[dict, str, bool, None] = None
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    json_object: bool = False

    def check(self) -> None:
        """不用分词器就能查出的错（服务器收到请求时先查，400 指名字段）：给了几种、schema 里不支持的关键字、
        正则的语法。"什么也匹配不了"要等编译成 DFA 才知道（Grammars.compile，在 add_request 里）。"""
        kind = self.kind()
        try:
            if kind == "json":
                if not isinstance(self.json, (dict, str, bool)):
                    raise ValueError(f"a JSON schema must be an object, got {json.dumps(self.json)}")
                parse_regex(schema_to_regex(self.json))
            elif kind == "regex":
                if not isinstance(self.regex, str):
                    raise ValueError("regex must be a string")
                parse_regex(self.regex)
            elif kind == "choice":
                parse_regex(choice_regex(self.choice))
        except (ValueError, RecursionError) as e:
            raise UserError(f"structured output ({kind}): {e}") from None

    def kind(self) -> str:
        given = [k for k in ("json", "regex", "choice") if getattr(self, k) is not None] + \
                (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise UserError(f"structured output needs exactly one of json, regex, choice, json_object; "
                            f"got {', '.join(given) or 'none'}")
        return given[0]


def choice_regex(choices) -> str:
    """几个字符串之一 → 正则：每个原样转义，用 | 连起来。"""
    if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise UserError("choice must be a non-empty list of non-empty strings")
    return "(?:" + "|".join(literal(c) for c in choices) + ")"


# 分词器 → {(EOS, 词表大小): GrammarCompiler}：同一个分词器的 TokenIndex 只建一次，几个引擎（章节模式、测试里
# 一次建很多个）共用它和编译好的语法。缓存的都是由分词器与语法决定的纯数据，谁来用结果都一样；分词器没了它也跟着走
_COMPILERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class Grammars:
    """引擎里的一份：分词器的 TokenIndex（第一次有约束的请求来时才建，SmolLM2 约 1.5 秒）与编译缓存
    （同一个语法只编译一次，状态的掩码缓存跨请求共用）。没有约束的请求从不碰它：与 step09 一样快。"""

    def __init__(self, hf_tokenizer, eos_ids, vocab_size: int):
        self.hf, self.eos_ids, self.vocab_size = hf_tokenizer, sorted(eos_ids), vocab_size
        self._compiler: Optional[GrammarCompiler] = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            key = (tuple(self.eos_ids), self.vocab_size)
            shared = _COMPILERS.setdefault(self.hf, {})
            if key not in shared:
                try:
                    shared[key] = GrammarCompiler(TokenIndex.from_tokenizer(self.hf, self.eos_ids, self.vocab_size))
                except ValueError as e:      # 不是 byte-level BPE 的分词器
                    raise UserError(f"structured output: {e}") from None
            self._compiler = shared[key]
            self.token_len = np.array([len(b) if b else 0 for b in self._compiler.index.token_bytes],
                                      dtype=np.int64)   # (文本 token 数,)：每个 token 几个字节
        return self._compiler

    @property
    def index(self) -> TokenIndex:
        return self.compiler.index

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """编译（或取缓存）；语法写错、用了不支持的关键字、什么也匹配不了 → UserError（消息里有关键字的名字）。
        起点状态的掩码在这里就算：一个 token 也接不上的语法在 add_request 就被拒绝，而不是在第一步采样时。"""
        kind = params.kind()
        try:
            if kind == "json":
                schema = params.json
                if not isinstance(schema, (dict, str, bool)):
                    raise ValueError(f"a JSON schema must be an object, got {json.dumps(schema)}")
                grammar = self.compiler.compile_json_schema(schema)
            elif kind == "json_object":
                grammar = self.compiler.compile_json_object()
            elif kind == "choice":
                grammar = self.compiler.compile_regex(choice_regex(params.choice))
            else:
                if not isinstance(params.regex, str):
                    raise ValueError("regex must be a string")
                grammar = self.compiler.compile_regex(params.regex)
            grammar.masks(START)
        except (ValueError, RecursionError) as e:
            raise UserError(f"structured output ({kind}): {e}") from None
        return grammar

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        return GrammarMatcher(self.compile(params))

    def encode(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False).input_ids


# ---------------- 掩码 ----------------

def fill_rows(matcher: GrammarMatcher, spec: list[int], bitmask: torch.Tensor, row: int) -> None:
    """bitmask[row + i] = 接受了 spec 的前 i 个之后的允许集合（i = 0..len(spec)），匹配器最后退回原处。
    spec 已经按语法截断过（legal_prefix），每个都接受得了。"""
    matcher.fill_bitmask(bitmask, row)
    for i, token in enumerate(spec):
        if not matcher.accept_token(token):
            raise RuntimeError(f"draft token {token} is not allowed by the grammar: drafts must be cut first")
        matcher.fill_bitmask(bitmask, row + i + 1)
    matcher.rollback(len(spec))


def legal_prefix(matcher: GrammarMatcher, tokens: list[int]) -> int:
    """tokens 从头起有几个是语法允许的（一个一个接受，最后退回原处）。投机解码的猜测在第一个不合法的 token 处截断
    （vLLM 的 validate_tokens）：不合法的猜测反正会被拒绝，不值得为它算一个位置。"""
    n = 0
    for token in tokens:
        if not matcher.accept_token(token):
            break
        n += 1
    matcher.rollback(n)
    return n


def check_sampled(matcher: GrammarMatcher, tokens: list[int]) -> None:
    """验证出的 token 在语法里都合法（匹配器接受了 EOS 之后的不算：append 时就停在 EOS 了）。掩码保证了这一点，
    不合法只能是 logits 坏了（NaN 时 argmax 可能落在被屏蔽的 token 上）：只让这个请求出错。"""
    n = 0
    for token in tokens:
        if matcher.is_terminated():
            break
        if not matcher.accept_token(token):
            matcher.rollback(n)
            raise ValueError(f"sampled token {token} is not allowed by the grammar")
        n += 1
    matcher.rollback(n)


# ---------------- jump-forward ----------------

def complete_utf8(data: bytes) -> int:
    """data 去掉结尾不完整的那个 UTF-8 字符后的长度（forced_bytes 可能停在一个字符中间：分词器只能切完整的文本）。"""
    k = len(data)
    while k > 0 and 0x80 <= data[k - 1] < 0xC0:      # 往回跳过续字节，找到最后一个字符的首字节
        k -= 1
    if k == 0:
        return len(data)                              # 全是续字节：交给 decode 去报错（不跳）
    lead = data[k - 1]
    need = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    return len(data) if k - 1 + need <= len(data) else k - 1


def jump_forward_tokens(matcher: GrammarMatcher, grammars: Grammars, cap: int, with_eos: bool = True) -> list[int]:
    """从匹配器现在的状态起，语法唯一确定的那段字节（forced_bytes）变成的 token，至多 cap 个；不接受它们。

    字节 → token：把这段文本单独分词（分词器自己的切法，canonical）。陷阱在结尾：分词器在这里切开，只因为文本在这里
    结束了；模型看到的训练数据里，结尾的字节常常和后面的字节连成一个更长的 token。例如强制的 `{"name": "` 之后是
    自由的字符串，SmolLM2 的词表里有 ` ""`、` "_`、` "(` 这样以 ` "` 开头、跨过边界的 token（27 个，都是引号后面跟标点；
    没有 ` "A` 这种跟字母的）——替模型把 ` "` 定死，名字若以 `_` 开头，就逼它从一个训练时很少见的切分接着写，
    输出的分布被扭曲（llguidance 的 docs/fast_forward.md 有 Llama-3 上 `orderId` 的例子）。所以与 llguidance 一样退回：在结尾最多
    JUMP_BACKOFF_TOKENS 个 token 的字节范围内，找最靠前的一个位置 idx，使得从"强制串的前 idx 个字节"之后的状态出发，
    语法允许某个比剩下的 forced[idx:] 更长的 token（它一定以 forced[idx:] 开头：这段字节是强制的）——也就是有 token
    能跨过边界；从结尾扔掉 token，直到剩下的不超过 idx 个字节。扔掉的那几个字节留给模型自己采样（它可以选更长的 token）。

    with_eos：强制串之后（或者本来就）停在一个只剩 EOS 可选的接受状态、EOS 又只有一个时，把它也当作强制的 token
    （贪心和抽样都只能选它）。add_request 时不这样做：那时请求还一个 token 都没生成。"""
    if cap <= 0 or matcher.is_terminated():
        return []
    index, grammar = grammars.index, matcher.grammar
    forced, tokens = matcher.forced_bytes(), []
    forced = forced[:complete_utf8(forced)]
    if forced:
        try:     # 开头是半个字符（补完上一个 token 留下的）时解不开：不跳，照常采样
            tokens = grammars.encode(forced.decode("utf-8"))
        except UnicodeDecodeError:
            return []
        spelled = [index.token_bytes[t] if t < len(index.token_bytes) else None for t in tokens]
        if any(b is None for b in spelled) or b"".join(spelled) != forced:
            return []            # 分词器拼不出这段字节（例如把文本认成了特殊 token）：不跳，照常一个一个采样
        states = [matcher.state]
        for b in forced:
            states.append(grammar.dfa.trans[states[-1]][b])
        tail = sum(len(b) for b in spelled[-JUMP_BACKOFF_TOKENS:])
        cut = len(forced)
        for idx in range(len(forced) - tail, len(forced)):
            ids = grammar.masks(states[idx]).token_ids
            if (grammars.token_len[ids] > len(forced) - idx).any():      # 有 token 跨过强制串的结尾
                cut = idx
                break
        while tokens and sum(len(b) for b in spelled[:len(tokens)]) > cut:
            tokens.pop()
        tokens = tokens[:cap]
    if with_eos and len(tokens) < cap and len(index.eos_ids) == 1:
        state = grammar.dfa.walk(matcher.state, b"".join(index.token_bytes[t] for t in tokens))
        if grammar.dfa.accepting[state] and not len(grammar.masks(state).token_ids):
            tokens.append(index.eos_ids[0])
    return tokens

