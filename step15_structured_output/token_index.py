"""词表 × DFA → 每一步允许哪些 token（掩码），以及每个 token 之后 DFA 到哪个状态。

三层对象（名字同 xgrammar，方便对照）：
    TokenIndex        每个分词器一个：每个 token 的原始字节，与所有 token 的前缀树（trie）
    CompiledGrammar   每个 (语法, 分词器) 一个：DFA，以及"DFA 状态 → 掩码与下一状态"的缓存（第一次到达某状态时才算）
    GrammarMatcher    每个请求一个：当前走到哪个状态（一个栈，rollback 就是出栈）

算一个状态的掩码：从 trie 的根出发、与 DFA 一起往下走，每条边吃一个字节；DFA 掉进死状态的分支整棵剪掉
（这个前缀不合法，以它开头的 token 都不合法）。走到的 token 节点就是允许的 token，节点上的 DFA 状态就是
接受它之后的状态。trie 约有 2 × 词表 个节点；允许的 token 很少时（JSON 的标点处）只走几层就停。
一层一层地走（同一层的节点一起算，向量操作），而不是一个节点一个节点地递归：稠密的状态（字符串内部，几乎全部
token 都允许）要走完约 10 万个节点，在 Python 里逐个走是每个节点一次解释器循环。这里用 numpy 而不是 torch：
一层只是几次小数组的 gather，最长的 token 有 80 多个字节就有 80 多层，torch 每个操作的固定开销比 numpy 大几倍。
缓存之后每一步只是把这个状态的位图拷进 (B, ceil(V/32)) 的 int32 张量——与 xgrammar / llguidance 的格式
逐位相同：token i 是第 i // 32 个字的第 i % 32 位（低位在前）。

特殊 token（分词器的 added tokens 里 special 的，SmolLM2 是 id 0–16）不是文本，永远不许出现在语法里面；
EOS 只在 DFA 的接受状态允许，接受了 EOS 匹配就结束（is_terminated）。
"""
import json
from dataclasses import dataclass

import numpy as np
import torch

from .automaton import DEAD, DFA, START, compile_regex
from .regex_parser import GrammarError
from .schema import json_object_regex, schema_to_regex


def gpt2_byte_decoder() -> dict[str, int]:
    """byte-level BPE 把每个字节映射成一个可见字符（GPT-2 的 bytes_to_unicode）；这里是它的逆：字符 → 字节。"""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in visible:
            chars[chr(b)] = b
        else:                                   # 不可见的字节依次映射到 U+0100 起的字符
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def vocab_bytes(hf_tokenizer) -> tuple[list[bytes | None], set[int]]:
    """每个 token id 的原始字节（特殊 token 为 None），与特殊 token 的 id 集合。只支持 byte-level BPE。"""
    decoder = gpt2_byte_decoder()
    added = hf_tokenizer.added_tokens_decoder
    special = {i for i, t in added.items() if t.special} | set(hf_tokenizer.all_special_ids)
    out: list[bytes | None] = []
    for i, piece in enumerate(hf_tokenizer.convert_ids_to_tokens(list(range(len(hf_tokenizer))))):
        if i in special:
            out.append(None)
        elif i in added:                        # 普通的 added token：内容就是文本本身
            out.append(added[i].content.encode())
        else:
            try:
                out.append(bytes(decoder[c] for c in piece))
            except KeyError:
                raise GrammarError(f"token {i} {piece!r} is not byte-level BPE; structured output needs a "
                                   "byte-level BPE tokenizer") from None
    return out, special


class TokenIndex:
    """分词器这一侧：token 的字节与 trie。trie 的节点是所有 token 的所有前缀，按 (长度, 字节) 排序：
    第 d 层（长度为 d 的前缀）是连续的一段 level_start[d]:level_start[d+1]，每个节点记着父节点与最后一个字节。"""

    def __init__(self, token_bytes: list[bytes | None], eos_ids, vocab_size: int):
        self.token_bytes, self.eos_ids, self.vocab_size = token_bytes, sorted(eos_ids), vocab_size
        if len(token_bytes) > vocab_size:
            raise ValueError(f"tokenizer has {len(token_bytes)} tokens, more than the vocab size {vocab_size}")
        text = [(i, b) for i, b in enumerate(token_bytes) if b]
        nodes = sorted({b[:k] for _, b in text for k in range(len(b) + 1)}, key=lambda p: (len(p), p))
        node_of = {p: n for n, p in enumerate(nodes)}                # 节点 0 是根（空前缀）
        self.num_nodes = len(nodes)
        self.parent = np.array([node_of[p[:-1]] if p else 0 for p in nodes], dtype=np.int64)
        self.byte = np.array([p[-1] if p else 0 for p in nodes], dtype=np.int64)
        self.level_start = np.searchsorted([len(p) for p in nodes], np.arange(len(nodes[-1]) + 2)).tolist()
        self.text_ids = np.array([i for i, _ in text], dtype=np.int64)          # 文本 token 的 id（升序）
        self.text_node = np.array([node_of[b] for _, b in text], dtype=np.int64)  # 它在 trie 里的节点

    @classmethod
    def from_tokenizer(cls, hf_tokenizer, eos_ids, vocab_size: int) -> "TokenIndex":
        token_bytes, _ = vocab_bytes(hf_tokenizer)
        return cls(token_bytes, eos_ids, vocab_size)

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32


def pack_bits(allowed: np.ndarray) -> torch.Tensor:
    """bool (32 * W,) → int32 (W,)：token i 在第 i // 32 个字的第 i % 32 位（小端机器上就是按字节小端打包）。"""
    return torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32))


def unpack_bits(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 (..., W) → bool (..., vocab_size)。"""
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits[..., :vocab_size].view(bool))


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits (B, V) 里不允许的 token 原地设成 -inf（采样之前、惩罚与温度之前）。"""
    return logits.masked_fill_(~unpack_bits(bitmask, logits.shape[-1]).to(logits.device), float("-inf"))


def allocate_token_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    return torch.zeros(batch, (vocab_size + 31) // 32, dtype=torch.int32)


@dataclass
class StateMasks:
    """一个 DFA 状态的缓存：位图、允许的文本 token（升序）、各自之后的 DFA 状态。"""
    bitmask: torch.Tensor           # int32 (W,)
    token_ids: np.ndarray           # int32 (n,)
    next_state: np.ndarray          # int32 (n,)


class CompiledGrammar:
    def __init__(self, dfa: DFA, index: TokenIndex):
        self.dfa, self.index = dfa, index
        self.trans = np.array(dfa.trans, dtype=np.int64).reshape(-1)      # (状态数 * 256,)
        self.cache: dict[int, StateMasks] = {}
        eos = np.zeros(index.words * 32, dtype=bool)
        eos[index.eos_ids] = True
        self.eos_bitmask = pack_bits(eos)

    def masks(self, state: int) -> StateMasks:
        if state not in self.cache:
            self.cache[state] = self.compute(state)
        return self.cache[state]

    def compute(self, state: int) -> StateMasks:
        """从根出发一层一层往下走：第 d 层每个节点的 DFA 状态 = trans[父节点的状态, 它的字节]。
        死前缀的整棵子树都死（DEAD 只回到自己）；一整层都死了就停——允许的 token 少时只走几层。"""
        ix = self.index
        node_state = np.zeros(ix.num_nodes, dtype=np.int64)         # DEAD = 0
        node_state[0] = state
        for d in range(1, len(ix.level_start) - 1):
            lo, hi = ix.level_start[d], ix.level_start[d + 1]
            level = self.trans[node_state[ix.parent[lo:hi]] * 256 + ix.byte[lo:hi]]
            node_state[lo:hi] = level
            if not level.any():
                break
        after = node_state[ix.text_node].astype(np.int32)
        ok = after != DEAD
        allowed = np.zeros(ix.words * 32, dtype=bool)
        allowed[ix.text_ids[ok]] = True
        if self.dfa.accepting[state]:
            allowed[ix.eos_ids] = True
        elif not ok.any():
            raise GrammarError(f"no token of the vocabulary can continue the grammar from DFA state {state}")
        return StateMasks(pack_bits(allowed), ix.text_ids[ok].astype(np.int32), after[ok])

    def next_state(self, state: int, token_id: int) -> int | None:
        m = self.masks(state)
        k = int(np.searchsorted(m.token_ids, token_id))
        if k < len(m.token_ids) and int(m.token_ids[k]) == token_id:
            return int(m.next_state[k])
        return None


class GrammarCompiler:
    """每个分词器一个；同一个语法只编译一次（缓存 CompiledGrammar，它的状态缓存也就跨请求共用）。"""

    def __init__(self, index: TokenIndex):
        self.index = index
        self.grammars: dict[str, CompiledGrammar] = {}

    def compile_regex(self, pattern: str) -> CompiledGrammar:
        if pattern not in self.grammars:
            self.grammars[pattern] = CompiledGrammar(compile_regex(pattern), self.index)
        return self.grammars[pattern]

    def compile_json_schema(self, schema) -> CompiledGrammar:
        return self.compile_regex(schema_to_regex(schema if isinstance(schema, str) else json.dumps(schema)))

    def compile_json_object(self) -> CompiledGrammar:
        return self.compile_regex(json_object_regex())


class GrammarMatcher:
    """一个请求的匹配状态：states 是接受过的每个 token 之后的 DFA 状态（栈底是起点）。"""

    def __init__(self, grammar: CompiledGrammar):
        self.grammar = grammar
        self.states = [START]
        self.terminated = False

    @property
    def state(self) -> int:
        return self.states[-1]

    def accept_token(self, token_id: int) -> bool:
        """合法就前进并返回 True；不合法返回 False，状态不变。"""
        if self.terminated:
            return False
        if token_id in self.grammar.index.eos_ids:
            if not self.grammar.dfa.accepting[self.state]:
                return False
            self.states.append(self.state)
            self.terminated = True
            return True
        nxt = self.grammar.next_state(self.state, token_id)
        if nxt is None:
            return False
        self.states.append(nxt)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """把下一个 token 的允许集合写进 bitmask[row]（int32，(B, ceil(V/32))）。结束之后只允许 EOS。"""
        bitmask[row].copy_(self.grammar.eos_bitmask if self.terminated else self.grammar.masks(self.state).bitmask)

    def is_accepting(self) -> bool:
        """现在停下（接受 EOS）是否合法。"""
        return not self.terminated and self.grammar.dfa.accepting[self.state]

    def is_terminated(self) -> bool:
        return self.terminated

    def rollback(self, n: int) -> None:
        """撤销最后 n 个接受的 token（投机解码：草稿里被拒的部分）。"""
        if not 0 <= n < len(self.states):
            raise ValueError(f"cannot roll back {n} tokens, only {len(self.states) - 1} accepted")
        if n:
            del self.states[-n:]
            self.terminated = False

    def forced_bytes(self) -> bytes:
        """从当前状态起，语法唯一确定的字节串（jump-forward 用）：每一步只有一个字节能活下去，且还不能停。
        是字节，不一定是完整的字符：开头可能补完上一个 token 留下的半个字符，结尾可能停在一个字符中间
        （"(?:é|è)" 只确定共同的首字节 0xC3）——与 xgrammar 的 find_jump_forward_string 底下的字节相同。"""
        dfa, s, out = self.grammar.dfa, self.state, bytearray()
        while not self.terminated and not dfa.accepting[s]:
            live = [b for b in range(256) if dfa.trans[s][b] != DEAD]
            if len(live) != 1:
                break
            out.append(live[0])
            s = dfa.trans[s][live[0]]
        return bytes(out)

