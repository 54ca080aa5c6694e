"""step15：token 掩码逐步对照 xgrammar 0.2.8 与 outlines-core 0.2.14（默认模型 SmolLM2 的 49152 词表）。

沿着一条 token 路径，每一步我们允许的 token 集合要与两个同行的完全相同，位图要与 xgrammar 的逐位相同。
路径：先从我们自己的掩码里随机抽若干个 token（有种子），再走最短的路到接受状态、输出 EOS；另有一条用真实模型
贪心解码的路径。走完的输出：正则的要 re.fullmatch，schema 的要 json.loads 且 jsonschema 验证通过。

特殊 token：SmolLM2 的 17 个 added token（id 0–16）都标着 special。我们的掩码里它们永远不出现，只有 EOS（id 2，
<|im_end|>）在接受状态出现——每一步都检查。xgrammar 的 TokenizerInfo.special_token_ids 是空的，它把 id 0、1、
3–16 当作普通文本（例如字符串里允许 <|im_start|>），所以与 xgrammar 比较时两边都去掉这 16 个 id，EOS 照样比较。
outlines-core 的词表由我们的 vocab_bytes 建（特殊 token 不在里面），不去掉任何 id。
"""
import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr
from outlines_core import Guide, Index, Vocabulary

from common.config import ModelConfig
from common.prepare import prepare_default_model
from common.tokenizer import Tokenizer
from step03_kvcache_single.cache import PreallocKVCache
from step03_kvcache_single.engine import forward
from step15_structured_output.schema import json_object_regex, schema_to_regex
from step15_structured_output.token_index import (GrammarCompiler, GrammarMatcher, TokenIndex,
                                                  allocate_token_bitmask, apply_token_bitmask_, unpack_bits,
                                                  vocab_bytes)

EOS = 2
TEXT_SPECIALS = set(range(17)) - {EOS}          # xgrammar 当作文本的特殊 token（见文件开头）


class Setup:
    def __init__(self):
        path = prepare_default_model()
        self.tok = Tokenizer(path)
        self.vocab_size = ModelConfig.from_dir(path).vocab_size
        assert self.tok.eos_ids == [EOS] or set(self.tok.eos_ids) == {EOS}
        self.token_bytes, self.special = vocab_bytes(self.tok.hf)
        self.ours = GrammarCompiler(TokenIndex(self.token_bytes, self.tok.eos_ids, self.vocab_size))
        self.xgr = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(self.tok.hf, vocab_size=self.vocab_size),
                                       max_threads=1)
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(self.token_bytes):
            if b:
                by_bytes.setdefault(b, []).append(i)
        self.outlines_vocab = Vocabulary(EOS, by_bytes)


@pytest.fixture(scope="module")
def env() -> Setup:
    return Setup()


def ids_of(row: torch.Tensor) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little")).tolist())


class XgrammarPeer:
    def __init__(self, name, compiled, vocab_size):
        self.name, self.m = name, xgr.GrammarMatcher(compiled)
        self.bm = xgr.allocate_token_bitmask(1, vocab_size)

    def allowed(self) -> set[int]:
        self.m.fill_next_token_bitmask(self.bm)
        return ids_of(self.bm[0]) - TEXT_SPECIALS

    def raw_row(self) -> torch.Tensor:
        """xgrammar 的位图，清掉它当作文本的那 16 个特殊 token 的位（都在第 0 个字里）。"""
        row = self.bm[0].clone()
        row[0] &= ~sum(1 << i for i in TEXT_SPECIALS)
        return row

    def advance(self, t):
        assert self.m.accept_token(t), (self.name, t)


class OutlinesPeer:
    """outlines-core 的自动机（Rust 的 regex_automata）用"最左优先"的匹配语义，不是整串匹配：
    到达一个接受位置之后，它丢掉"除最后一个字节外已经到达接受状态、整个 token 却停在非接受状态"的 token
    （例如 JSON 数字在 "0" 之后的 "."，或 `c.{1,3}` 在 "ct" 之后单独一个 UTF-8 首字节）；`(?:a|ab)+` 它不接受 "ab"。
    Python 的 re.fullmatch 与 xgrammar 都允许这些。所以比较的是：它的集合 == 我们的集合 − narrowed(...)
    （只有这一种差别）；正则里不放有歧义的分支。路径走进它不允许的 token 之后，这一条路径上不再与它比较。"""
    name = "outlines-core"

    def __init__(self, rx, vocab):
        self.g = Guide(Index(rx, vocab))
        self.detached = False

    def allowed(self) -> set[int]:
        self.last = set(self.g.get_tokens())
        return self.last

    def advance(self, t):
        if t == EOS:                             # outlines-core 的 Guide 不接受 EOS（它在 get_tokens 里表示"可以停"）
            assert EOS in self.last
        elif t not in self.last:
            self.detached = True
        else:
            self.g.advance(t)


def narrowed(matcher, ours: set[int]) -> set[int]:
    """outlines-core 不允许而我们允许的 token（见 OutlinesPeer）。"""
    dfa, out = matcher.grammar.dfa, set()
    for t in ours - {EOS}:
        data = matcher.grammar.index.token_bytes[t]
        before_last = dfa.walk(matcher.state, data[:-1])
        if dfa.accepting[before_last] and not dfa.accepting[dfa.trans[before_last][data[-1]]]:
            out.add(t)
    return out


def distances(dfa) -> list[float]:
    """每个 DFA 状态到最近的接受状态还要几个字节（反向 BFS）。"""
    dist = [float("inf")] * dfa.num_states
    frontier = [s for s in range(dfa.num_states) if dfa.accepting[s]]
    for s in frontier:
        dist[s] = 0
    preds = [set() for _ in range(dfa.num_states)]
    for s, row in enumerate(dfa.trans):
        for t in set(row):
            preds[t].add(s)
    while frontier:
        nxt = []
        for t in frontier:
            for s in preds[t]:
                if dist[s] == float("inf"):
                    dist[s] = dist[t] + 1
                    nxt.append(s)
        frontier = nxt
    return dist


def random_then_finish(seed: int, random_steps: int):
    """前 random_steps 步从允许的 token 里随机抽（不抽 EOS），之后每步选让剩余最短路径最短的 token，能停就停。"""
    rng = random.Random(seed)
    dist_cache = {}

    def choose(step, matcher, allowed):
        g = matcher.grammar
        if step < random_steps and allowed - {EOS}:
            return rng.choice(sorted(allowed - {EOS}))
        if matcher.is_accepting():
            return EOS
        dist = dist_cache.setdefault(id(g), distances(g.dfa))
        m = g.masks(matcher.state)
        return min(zip(m.token_ids.tolist(), m.next_state.tolist()), key=lambda p: (dist[p[1]], p[0]))[0]
    return choose


def drive(grammar, peers, choose, vocab_size, max_steps=120) -> bytes:
    """沿 choose 选出的路径走，每一步比较掩码；返回生成的字节（不含 EOS）。"""
    m = GrammarMatcher(grammar)
    bm = allocate_token_bitmask(2, vocab_size)
    out = bytearray()
    for step in range(max_steps):
        m.fill_bitmask(bm, 1)
        ours = ids_of(bm[1])
        assert not ours & (set(range(17)) - {EOS}), "a special token is allowed"
        assert (EOS in ours) == m.is_accepting()
        assert ours == set(unpack_bits(bm[1], vocab_size).nonzero().flatten().tolist())
        for p in peers:
            if isinstance(p, OutlinesPeer) and p.detached:
                continue
            theirs = p.allowed()
            expected = ours - narrowed(m, ours) if isinstance(p, OutlinesPeer) else ours
            assert theirs == expected, (p.name, step, bytes(out), sorted(expected - theirs)[:8],
                                        sorted(theirs - expected)[:8])
            if isinstance(p, XgrammarPeer):
                assert torch.equal(p.raw_row(), bm[1]), (p.name, step)      # 同一个位序：逐位相同
        t = choose(step, m, ours)
        assert m.accept_token(t)
        for p in peers:
            p.advance(t)
        if t == EOS:
            assert m.is_terminated() and not m.accept_token(EOS)
            return bytes(out)
        out += m.grammar.index.token_bytes[t]
    raise AssertionError(f"no EOS after {max_steps} steps: {bytes(out)!r}")


# (我们的正则, 同一个语言给 xgrammar 的写法, 给 outlines-core 的写法；None = 与我们的相同)
# xgrammar 的 . 包括换行（Python 与 outlines-core 的不包括），给它写成 [^\n]。outlines-core 的 \d \w \s 是 Unicode 的
# （允许 "٣"、"é"、U+00A0），xgrammar 的 \s 也是；我们的与 re.ASCII 相同，给它们写成 ASCII 字符类
REGEXES = [
    (r"[0-9]{3}-[0-9]{4}", None, None),
    (r"(?:Paris|Beijing|Lima|北京|Zürich)", None, None),
    (r"[\u4e00-\u9fff]{1,6}(?:，[\u4e00-\u9fff]{1,6}){0,3}。", None, None),
    (r"[a-z]+@[a-z]+\.(?:com|org)", None, None),
    (r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?", None, None),
    (r"\d{2}:\d{2}(?: [AP]M)?\s\w+", *[r"[0-9]{2}:[0-9]{2}(?: [AP]M)?[ \t\n\v\f\r][0-9A-Za-z_]+"] * 2),
    (r"[^\n\"]{0,12}\"", None, None),
    (r"(?:ab|é|😀)*c.{1,3}", r"(?:ab|é|😀)*c[^\n]{1,3}", None),
    (r"[0-9]{1,3}(?:,[0-9]{3})*", None, None),
]


@pytest.mark.parametrize("rx, xgr_rx, outlines_rx", REGEXES, ids=[r for r, _, _ in REGEXES])
def test_regex_masks_match_xgrammar_and_outlines(env, rx, xgr_rx, outlines_rx):
    grammar = env.ours.compile_regex(rx)
    for seed, random_steps in ((0, 0), (1, 6), (2, 40)):
        peers = [XgrammarPeer("xgrammar", env.xgr.compile_regex(xgr_rx or rx), env.vocab_size),
                 OutlinesPeer(outlines_rx or rx, env.outlines_vocab)]
        out = drive(grammar, peers, random_then_finish(seed, random_steps), env.vocab_size)
        assert re.fullmatch(rx, out.decode("utf-8"), re.ASCII), out


# (schema, 能否也用 xgrammar 的 compile_json_schema(any_whitespace=False) 比较：两边的语言相同时才能)
SCHEMAS = [
    ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                       "city": {"enum": ["Paris", "Beijing", "Lima"]}},
      "required": ["name", "age", "city"]}, True),
    ({"type": "object", "properties": {
        "id": {"type": "integer"},
        "user": {"type": "object", "properties": {"name": {"type": "string"},
                                                  "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}},
                 "required": ["name"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "score": {"type": "number"}, "active": {"type": "boolean"},
        "parent": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
      "required": ["id", "user", "active"]}, True),
    ({"type": "object", "properties": {"名字": {"const": "张三"}, "城市": {"enum": ["北京", "上海", "Zürich"]},
                                       "备注": {"type": "string"}}, "required": ["名字", "城市"]}, True),
    ({"$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                         "required": ["sku", "qty"]}},
      "type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 4}, True),
    # 下面两个 xgrammar 的语言与我们的不同：有长度限制的字符串它允许原始控制字符、不允许转义；
    # 对象写在 enum 里时它用 "," ":" 不带空格。这两处只对照它的 compile_regex（跑我们的正则）
    ({"type": "object", "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 5},
                                       "n": {"type": "number"}}, "required": ["code"]}, False),
    ({"enum": [{"k": [1, 2]}, "x", None, 3.5]}, False),
]


@pytest.mark.parametrize("schema, same_language", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_schema_masks_match_xgrammar_and_outlines(env, schema, same_language):
    rx = schema_to_regex(schema)
    grammar = env.ours.compile_json_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for seed, random_steps in ((0, 0), (1, 8), (2, 30)):
        peers = [XgrammarPeer("xgrammar regex", env.xgr.compile_regex(rx), env.vocab_size),
                 OutlinesPeer(rx, env.outlines_vocab)]
        if same_language:
            peers.append(XgrammarPeer("xgrammar json schema",
                                      env.xgr.compile_json_schema(json.dumps(schema), any_whitespace=False),
                                      env.vocab_size))
        out = drive(grammar, peers, random_then_finish(seed, random_steps), env.vocab_size)
        validator.validate(json.loads(out.decode("utf-8")))


def test_json_object_masks_vs_xgrammar(env):
    """json_object 是深度 ≤ 3 的任意对象，xgrammar 的任意对象不限深度：我们允许的是它的子集，
    多出来的 token 都含有 [ 或 {（只有再开一层容器时两边才不同）。"""
    grammar = env.ours.compile_json_object()
    for seed, random_steps in ((0, 0), (3, 25), (4, 60)):
        peer = XgrammarPeer("xgrammar", env.xgr.compile_json_schema('{"type": "object"}', any_whitespace=False),
                            env.vocab_size)
        choose = random_then_finish(seed, random_steps)
        m = GrammarMatcher(grammar)
        bm = allocate_token_bitmask(1, env.vocab_size)
        out = bytearray()
        for step in range(200):
            m.fill_bitmask(bm)
            ours, theirs = ids_of(bm[0]), peer.allowed()
            assert ours <= theirs, (step, sorted(ours - theirs)[:8])
            assert all(set(env.token_bytes[t]) & set(b"[{") for t in theirs - ours), step
            t = choose(step, m, ours)
            assert m.accept_token(t)
            peer.advance(t)
            if t == EOS:
                break
            out += env.token_bytes[t]
        assert isinstance(json.loads(out.decode("utf-8")), dict)


@torch.inference_mode()
def test_real_model_greedy_path(env, real):
    """真实模型贪心解码（logits 先按掩码屏蔽再 argmax；KV cache 用 step03 的），每一步都与 xgrammar
    （schema 与正则两种编译）、outlines-core 比较，输出满足 schema。"""
    schema = SCHEMAS[0][0]
    rx = schema_to_regex(schema)
    peers = [XgrammarPeer("xgrammar json schema", env.xgr.compile_json_schema(json.dumps(schema), any_whitespace=False),
                          env.vocab_size),
             XgrammarPeer("xgrammar regex", env.xgr.compile_regex(rx), env.vocab_size),
             OutlinesPeer(rx, env.outlines_vocab)]
    ids = real.encode("Describe Ada Lovelace as JSON with her name, age and city.", chat=True)
    max_steps = 40
    cache = PreallocKVCache(real.cfg, len(ids) + max_steps, real.model.device, real.model.dtype)
    logits = [forward(real.model, cache, ids, start=0)]

    def choose(step, matcher, allowed):
        if step > 0:                              # 上一步选的 token 喂回模型
            logits[0] = forward(real.model, cache, [ids[-1]], start=len(ids) - 1)
        mask = torch.zeros(env.vocab_size, dtype=torch.bool)
        mask[sorted(allowed)] = True
        ids.append(int(logits[0].float().masked_fill(~mask, float("-inf")).argmax()))
        return ids[-1]

    out = drive(env.ours.compile_json_schema(schema), peers, choose, env.vocab_size, max_steps=max_steps)
    jsonschema.validate(json.loads(out.decode("utf-8")), schema)


def test_matcher_rollback_and_invalid_tokens(env):
    """不合法的 token 被拒绝、状态不变；rollback(k) 回到 k 个 token 之前：掩码与当时的相同，也与 xgrammar
    同样 rollback 之后的相同；再接受同样的 token 又回到终点。"""
    schema = SCHEMAS[1][0]
    grammar = env.ours.compile_json_schema(schema)
    peer = XgrammarPeer("xgrammar", env.xgr.compile_json_schema(json.dumps(schema), any_whitespace=False),
                        env.vocab_size)
    m = GrammarMatcher(grammar)
    bm = allocate_token_bitmask(1, env.vocab_size)
    choose = random_then_finish(5, 10)
    tokens, history = [], []                      # history[i]：接受 tokens[i] 之前的掩码
    while not tokens or tokens[-1] != EOS:
        m.fill_bitmask(bm)
        history.append(bm[0].clone())
        allowed = ids_of(bm[0])
        bad = next(i for i in range(env.vocab_size) if i not in allowed)
        state = m.state
        assert not m.accept_token(bad) and m.state == state
        tokens.append(choose(len(tokens), m, allowed))
        assert m.accept_token(tokens[-1])
        peer.advance(tokens[-1])
    n = len(tokens)
    assert m.is_terminated() and n > 10
    for k in (1, 3, n // 2, n):
        m.rollback(k)
        peer.m.rollback(k)
        assert not m.is_terminated() and len(m.states) == n - k + 1
        m.fill_bitmask(bm)
        assert torch.equal(bm[0], history[n - k])
        assert ids_of(bm[0]) == peer.allowed()
        for t in tokens[n - k:]:
            assert m.accept_token(t)
            peer.advance(t)
        assert m.is_terminated()
    with pytest.raises(ValueError, match="cannot roll back"):
        m.rollback(n + 1)


def xgrammar_forced_bytes(xm) -> bytes:
    """xgrammar 的 jump-forward 字节串。它的 Python 包装按 UTF-8 解码成 str，字节串从半个字符开始或结束时
    解码失败——这时原始字节就在异常里。"""
    try:
        return xm.find_jump_forward_string().encode()
    except UnicodeDecodeError as e:
        return e.object


@pytest.mark.parametrize("case", ["schema0", "schema1", "schema2", "schema3", "(?:é|è)x|ab(?:é|è)x|中(?:文|国)",
                                  r"(?:Paris|Beijing|Lima|北京|Zürich)", r"[0-9]{3}-[0-9]{4}"])
def test_forced_bytes_match_xgrammar_jump_forward(env, case):
    """沿路径的每一步，forced_bytes() 与 xgrammar 的 find_jump_forward_string() 字节相同。"""
    if case.startswith("schema"):
        schema = SCHEMAS[int(case[6:])][0]
        grammar = env.ours.compile_json_schema(schema)
        make = lambda: env.xgr.compile_json_schema(json.dumps(schema), any_whitespace=False)   # noqa: E731
    else:
        grammar = env.ours.compile_regex(case)
        make = lambda: env.xgr.compile_regex(case)                                            # noqa: E731
    bm = allocate_token_bitmask(1, env.vocab_size)
    forced = 0
    for seed, random_steps in ((0, 0), (1, 3), (2, 30)):
        m, xm = GrammarMatcher(grammar), xgr.GrammarMatcher(make())
        choose = random_then_finish(seed, random_steps)
        for step in range(150):
            ours = m.forced_bytes()
            assert ours == xgrammar_forced_bytes(xm), (step, ours)
            forced += bool(ours)
            m.fill_bitmask(bm)
            t = choose(step, m, ids_of(bm[0]))
            assert m.accept_token(t) and xm.accept_token(t)
            if t == EOS:
                assert m.forced_bytes() == b""
                break
    assert forced > 0


@pytest.mark.parametrize("rx, forced", [("ab(?:é|è)x", b"ab\xc3"), ("(?:é|è)x", b"\xc3"), ("中(?:文|国)", "中".encode()),
                                        ("(?:ab|ac)", b"a"), ("a?b", b""), ("ab(?:cd)?", b"ab")])
def test_forced_bytes_can_stop_inside_a_character(env, rx, forced):
    m = GrammarMatcher(env.ours.compile_regex(rx))
    assert m.forced_bytes() == forced == xgrammar_forced_bytes(xgr.GrammarMatcher(env.xgr.compile_regex(rx)))


def test_masks_of_a_finite_language_by_brute_force(env):
    """有限语言的掩码可以直接数出来：已生成 done 之后，token t 允许 ⇔ done + t 是某个词的前缀；EOS 允许 ⇔ done 是一个词。
    正则里有走不通的分支（[^\\s\\S] 是空集）：DFA 不剪枝的话，"x"、"xa" 这些 token 会被放进来。"""
    words = ["bc", "北京", "北海道", "Zürich", "Zürich!", "{\"a\": 1}"]
    rx = r"(?:xa[^\s\S]|bc|北京|北海道|Zürich!?|\{\"a\": 1\}|\{\"a\": 2[^\s\S]\})"
    encoded = [w.encode() for w in words]
    grammar = env.ours.compile_regex(rx)
    bm = allocate_token_bitmask(1, env.vocab_size)
    for word in encoded:
        m, done = GrammarMatcher(grammar), b""
        while True:
            m.fill_bitmask(bm)
            expected = {i for i, b in enumerate(env.token_bytes) if b and any(w.startswith(done + b) for w in encoded)}
            expected |= {EOS} if done in encoded else set()
            assert ids_of(bm[0]) == expected, done
            if done == word:
                assert m.accept_token(EOS)
                break
            t = max((i for i in expected if i != EOS and word.startswith(done + env.token_bytes[i])),
                    key=lambda i: len(env.token_bytes[i]))               # 最长的 token：路径每次不同
            assert m.accept_token(t)
            done += env.token_bytes[t]


@pytest.mark.parametrize("vocab_size", [31, 33, 100, 49152])
def test_apply_bitmask_matches_xgrammar(vocab_size):
    """同一个 int32 位图，我们的 apply_token_bitmask_ 与 xgrammar 的 apply_token_bitmask_inplace 屏蔽同样的 token。"""
    gen = torch.Generator().manual_seed(vocab_size)
    bitmask = torch.randint(-2**31, 2**31, (4, (vocab_size + 31) // 32), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(4, vocab_size, generator=gen)
    ours, theirs = logits.clone(), logits.clone()
    apply_token_bitmask_(ours, bitmask)
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)
    assert torch.isinf(ours).any() and torch.isfinite(ours).any()
