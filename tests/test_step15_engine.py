"""step15 引擎：结构化输出走完整的引擎（随机小模型 + 真实分词器：掩码要真实词表的字节）。

- 不给约束时与 step09 逐位相同（同样的输出、同样的每一次前向），抽样、投机也一样；
- 约束下的输出满足约束：正则（re.fullmatch）、JSON Schema（jsonschema.validate）、choice；没写完就到 max_new_tokens 的，
  每个 token 都被语法接受（是某个合法输出的前缀）；
- 掩码只去掉不合法的：贪心的输出本来就满足约束时，加上约束 token 一个不变（投机时也是）；
- 编译不了的约束在 add_request 就拒绝（UserError 里有关键字），什么也没分配；min_tokens 与约束不能同时给；
- 只允许空白的陷阱以 "length" 结束；EOS 只在接受状态；匹配器接受 EOS 后以 "stop" 结束；
- 投机：不合法的猜测在第一个处截断（被截的猜测有 q 时记下它）；截断后验证的分布仍然精确（规则改坏时检查失败）；
  脚本化的猜测里夹着不合法的 token，输出与不猜时相同；
- jump-forward：分词与结尾的退回（llguidance 的规则）、强制的 EOS、不超过 max_new_tokens、跨好几块的追加（小块），
  前向次数变少；关掉时每个 token 都采样；
- 分块 prefill、前缀缓存、抢占照常：同样的约束请求在小预算、小池子里输出相同，结束后块全部还回来；
- logprobs 是铺了掩码之后的分布（vLLM 的 raw_logprobs 同样取自铺过掩码的 logits）。
"""
import json
import re

import jsonschema
import pytest
import torch

from common.cli import open_session
from common.compare import MARGIN_TOL
from common.errors import UserError
from step02_sampling.sampler import SamplingParams
from step04_static_batching.request import Request
from step09_speculative import engine as step09
from step15_structured_output import engine as step15
from step15_structured_output import rejection_sampler
from step15_structured_output.chapter import jump_relation
from step15_structured_output.proposer import FakeProposer, Proposal
from step15_structured_output.schema import literal
from step15_structured_output.structured import StructuredOutputsParams as SO
from step15_structured_output.structured import jump_forward_tokens
from step15_structured_output.token_index import unpack_bits

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
SPECIAL = {i: -100.0 for i in range(17)}          # 随机模型也会挑特殊 token：与约束无关的比较里压下去
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"]}


@pytest.fixture(scope="module")
def s(tiny_tok_dir):
    return open_session(str(tiny_tok_dir), "cpu", "float32")


def engine(s, step=step15, proposer=None, **cfg):
    config = step.EngineConfig(**{**dict(num_blocks=128, block_size=16, max_batch_size=4), **cfg})
    return step.LLMEngine(s.model, config, s.tok, s.tok.eos_ids, proposer=proposer)


def reqs(s, params=GREEDY, n=24, texts=("Give me JSON:", "The answer is", "hello hello hello hello"), **kw):
    return [Request(s.tok.encode(t), n, params, **kw) for t in texts]


def assert_all_free(e) -> None:
    bm = e.block_manager
    assert not e.seqs and not e.scheduler.has_unfinished()
    assert all(c == 0 for c in bm.ref_counts) and bm.num_free_blocks == bm.num_blocks


def text(s, ids) -> str:
    return s.tok.hf.decode(ids, skip_special_tokens=True)


def engine_bytes(s, ids) -> bytes:
    """token 的原始字节连起来（不经过 decode 的替换字符）。"""
    from step15_structured_output.token_index import vocab_bytes
    if not hasattr(engine_bytes, "table"):
        engine_bytes.table = vocab_bytes(s.tok.hf)[0]
    return b"".join(engine_bytes.table[t] for t in ids)


def accepted_by(e, so: SO, ids: list[int]) -> bool:
    """每个 token 都被这个约束的语法接受（从头走一遍一个新的匹配器）。"""
    m = e.grammars.matcher(so)
    return all(m.accept_token(t) for t in ids)


# ---------------- 不给约束 = step09 ----------------

@pytest.mark.parametrize("spec", ["none", "ngram"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_no_constraint_is_step09_bit_for_bit(s, spec, params):
    rq = reqs(s, params)
    ref = engine(s, step09, spec_method=spec).generate(rq)
    e = engine(s, spec_method=spec)
    out = e.generate(rq)
    assert out.outputs == ref.outputs
    assert out.stats.forward_shapes == ref.stats.forward_shapes
    assert out.finish_reasons == ["length"] * len(rq)
    assert e.grammars._compiler is None               # 没有约束的请求从不建语法索引
    assert_all_free(e)


# ---------------- 输出满足约束 ----------------

CONSTRAINTS = [
    ("regex", SO(regex=r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ("choice", SO(choice=("Paris", "Beijing", "Lima")), lambda t: t in ("Paris", "Beijing", "Lima")),
    ("schema", SO(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ("json_object", SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
]


@pytest.mark.parametrize("jump", [True, False], ids=["jump", "no-jump"])
@pytest.mark.parametrize("spec", ["none", "ngram"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name,so,valid", CONSTRAINTS, ids=[c[0] for c in CONSTRAINTS])
def test_constrained_outputs_are_valid(s, name, so, valid, params, spec, jump):
    e = engine(s, spec_method=spec, jump_forward=jump)
    rq = reqs(s, params, n=40)
    out = e.generate(rq, so)
    for ids, reason in zip(out.outputs, out.finish_reasons):
        assert accepted_by(e, so, ids), (name, text(s, ids))
        if reason == "stop":                           # 语法走完、接受了 EOS
            assert ids[-1] in s.tok.eos_ids and valid(text(s, ids)), text(s, ids)
        else:
            assert reason == "length" and len(ids) == 40
    if name in ("regex", "choice"):                    # 长度有限的语言：40 个 token 之内一定走完
        assert out.finish_reasons == ["stop"] * len(rq)
    assert e.structured_stats.masked_rows > 0
    if not jump:
        assert e.structured_stats.jump_tokens == 0
    elif name != "json_object":   # json_object 的开头只强制 `{`，而 `{"` 是一个 token：退回之后什么也不强制
        assert e.structured_stats.jump_tokens > 0
    assert_all_free(e)


@pytest.mark.parametrize("spec", ["none", "ngram"])
def test_masking_only_removes(s, spec):
    """贪心的输出本来就满足约束时，加上约束一个 token 也不变：约束就是那段输出的文本本身（字面量的正则），每一步
    模型自己选的 token 都在允许集合里。关掉 jump-forward：它会把强制的文本按分词器的切法放进来，不按模型的。
    掩码铺错了行、铺在惩罚之后、位算错了，这里都会变。"""
    params = SamplingParams(logit_bias=SPECIAL, repetition_penalty=1.3)   # 惩罚在掩码之后：-inf 仍是 -inf
    rq = reqs(s, params, n=20, ignore_eos=True)
    free = engine(s, spec_method=spec).generate(rq)
    checked = 0
    for r, ids in zip(rq, free.outputs):
        try:                                           # 正则在码点上：输出的字节得是完整的 UTF-8 才写得成正则
            out_text = engine_bytes(s, ids).decode("utf-8")
        except UnicodeDecodeError:
            continue
        e = engine(s, spec_method=spec, jump_forward=False)
        assert e.generate([r], SO(regex=literal(out_text))).outputs == [ids]
        # 一个不强制任何东西的约束（除了几个控制字符什么都行）：jump-forward 开着也不变
        e = engine(s, spec_method=spec)
        assert e.generate([r], SO(regex="[^\x00-\x08]*")).outputs == [ids]
        checked += 1
    assert checked >= 2


# ---------------- 拒绝 ----------------

@pytest.mark.parametrize("so,words", [
    (SO(regex="[0-9"), "unterminated character set"),
    (SO(json={"type": "integer", "minimum": 3}), "unsupported keyword 'minimum'"),
    (SO(json={"type": "string", "enum": [1, 2]}), "no enum/const value has type string"),
    (SO(json={"properties": {"a": {"$ref": "#/properties/a"}}}), "recursive $ref"),
    (SO(json="{not json"), "not valid JSON"),
    (SO(choice=()), "choice must be a non-empty list"),
    (SO(regex="a", choice=("b",)), "exactly one of"),
])
def test_bad_constraints_are_refused_before_anything_is_allocated(s, so, words):
    e = engine(s)
    free = e.block_manager.num_free_blocks
    with pytest.raises(UserError, match=re.escape(words)):
        e.add_request(reqs(s)[0], so)
    assert not e.seqs and not e.scheduler.has_unfinished() and e.block_manager.num_free_blocks == free
    assert e._next_id == 0


def test_min_tokens_is_refused_with_a_constraint(s):
    e = engine(s)
    with pytest.raises(UserError, match="min_tokens"):
        e.add_request(Request(s.tok.encode("hi"), 8, SamplingParams(min_tokens=2)), SO(choice=("a", "b")))
    assert not e.seqs


def test_a_constraint_needs_the_tokenizer(s):
    e = step15.LLMEngine(s.model, step15.EngineConfig(num_blocks=16, block_size=16))
    with pytest.raises(UserError, match="tokenizer"):
        e.add_request(Request([1, 2, 3], 4), SO(regex="a"))


# ---------------- 结束 ----------------

def test_whitespace_trap_ends_with_length(s):
    """语法允许一直写空格（` *!`），而 `!` 被 logit_bias 压下去：模型永远选空格。请求以 "length" 结束，不会挂住。"""
    e = engine(s)
    so = SO(regex=" *!")
    m = e.grammars.matcher(so)
    index = e.grammars.index
    allowed = m.grammar.masks(m.state).token_ids.tolist()
    bias = {t: -100.0 for t in allowed if b"!" in index.token_bytes[t]}
    assert bias and len(bias) < len(allowed)
    out = e.generate([Request(s.tok.encode("hi"), 30, SamplingParams(logit_bias=bias))], so)
    assert out.finish_reasons == ["length"] and len(out.outputs[0]) == 30
    assert set(text(s, out.outputs[0])) == {" "}


def test_eos_only_in_accepting_states_and_terminated_means_stop(s):
    """\\d{3}：前三步不允许 EOS；第三个数字之后只允许 EOS（jump-forward 直接把它放进去）。ignore_eos 也一样以 "stop"
    结束：语法结束之后什么也不允许了。"""
    for ignore in (False, True):
        for jump in (True, False):
            e = engine(s, jump_forward=jump)
            so = SO(regex=r"[0-9]{3}")
            out = e.generate([Request(s.tok.encode("hi"), 10, GREEDY, ignore_eos=ignore)], so)
            ids = out.outputs[0]
            assert out.finish_reasons == ["stop"] and ids[-1] in s.tok.eos_ids
            assert re.fullmatch(r"[0-9]{3}", text(s, ids))
            assert not set(ids[:-1]) & set(s.tok.eos_ids)
            m = e.grammars.matcher(so)
            assert not unpack_bits(m.grammar.masks(m.state).bitmask, s.cfg.vocab_size)[list(s.tok.eos_ids)].any()
            assert all(m.accept_token(t) for t in ids[:-1]) and m.is_accepting()
            assert_all_free(e)


# ---------------- 投机解码 ----------------

def test_illegal_drafts_are_cut_and_greedy_output_is_unchanged(s):
    """脚本化的猜测：合法的前两个 token 之后跟一个不合法的（语法不允许的字母）。截断后只验证合法的部分，
    输出与不猜时逐 token 相同；被截掉的从不算进 proposed。"""
    so = SO(regex=r"[0-9]{2,12}")
    rq = [Request(s.tok.encode("Numbers:"), 12, GREEDY)]
    ref = engine(s, jump_forward=False).generate(rq, so).outputs
    letter = s.tok.hf("x", add_special_tokens=False).input_ids[0]
    digits = [s.tok.hf(str(d), add_special_tokens=False).input_ids[0] for d in range(10)]
    seen = []

    def script(token_ids):
        seen.append(len(token_ids))
        return [digits[1], digits[2], letter, digits[3]]
    e = engine(s, proposer=FakeProposer(script), jump_forward=False)
    out = e.generate(rq, so)
    assert out.outputs == ref
    assert e.spec_stats.proposed > 0 and e.spec_stats.proposed <= 2 * e.spec_stats.verifications
    assert_all_free(e)


def test_a_cut_draft_keeps_its_q(s):
    """草稿分布 q 抽出的猜测被截掉时，Sequence 记下那个猜测的 q（验证要它）；确定性的猜测不记。"""
    so = SO(regex=r"[0-9]{2,12}")
    V = s.cfg.vocab_size
    letter = s.tok.hf("x", add_special_tokens=False).input_ids[0]
    one = s.tok.hf("1", add_special_tokens=False).input_ids[0]
    q = torch.full((2, V), 1.0 / V)
    for probs, expect in ((q, True), (None, False)):
        e = engine(s, proposer=FakeProposer(lambda ids: Proposal([one, letter], probs)), jump_forward=False)
        rid = e.add_request(Request(s.tok.encode("Numbers:"), 8, SamplingParams(temperature=1.0, seed=0)), so)
        e.step()                                       # prefill
        e._propose()
        seq = e.seqs[rid]
        assert seq.spec_token_ids == [one]
        assert (seq.spec_cut_q is not None) == expect
        if expect:
            assert torch.equal(seq.spec_cut_q, q[1])
        seq.trim_spec(0)
        assert seq.spec_cut_q is None
        e.abort(rid)


def test_verification_after_a_grammar_cut_is_exact_in_distribution():
    """三个 token：c 不合法（掩码后 p = (1/2, 1/2, 0)），草稿分布 q = (1/2, 0, 1/2)。按 q 抽猜测 d；d = c 时引擎把它截掉。
    截断后仍要从 max(p − q, 0) 里抽（cut_q），输出的分布才是 p；若截掉后照常从 p 抽，a 的概率变成 3/4。"""
    logits = torch.tensor([[0.0, 0.0, float("-inf")], [0.0, 0.0, float("-inf")]])   # 已经铺过掩码
    q = torch.tensor([0.5, 0.0, 0.5])
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(3)
    for seed in range(4000):
        g = torch.Generator().manual_seed(seed)
        d = int(torch.multinomial(q, 1, generator=g))
        if d == 2:    # 不合法：截掉，只带着它的 q
            out = rejection_sampler.verify(logits[:1], [5], [], Proposal([], None, q), params, g)
        else:
            out = rejection_sampler.verify(logits, [5], [], Proposal([d], q[None]), params, g)
        counts[out[0]] += 1
    freq = counts / counts.sum()
    assert freq[2] == 0 and abs(freq[0] - 0.5) < 0.03, freq


# ---------------- jump-forward ----------------

def test_jump_forward_backs_off_a_token_that_could_span_the_boundary(s):
    """`{"name": "` 之后是自由的字符串：词表里有 ` ""`、` "_` 这样以 ` "` 开头、跨过边界的 token，所以结尾的 ` "`
    不强制（退回），强制的是 `{"`、`name`、`":`。`, "age": ` 同理退回结尾的空格（` -` 是一个负数的开头，跨过了边界）。
    choice 在 "B" 之后强制 `eijing` 和它后面唯一的 EOS。"""
    e = engine(s)
    hf = s.tok.hf

    def forced(so, prefix):
        m = e.grammars.matcher(so)
        for t in hf(prefix, add_special_tokens=False).input_ids:
            assert m.accept_token(t)
        return jump_forward_tokens(m, e.grammars, 100)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    toks = forced(SO(json=schema), "")
    assert hf.decode(toks) == '{"name":' and len(toks) == 3
    assert hf.decode(forced(SO(json=schema), '{"name": "Ada"')) == ', "age":'
    rest = forced(SO(choice=("Paris", "Beijing")), "B")
    assert rest[-1] in s.tok.eos_ids and hf.decode(rest[:-1]) == "eijing"
    assert forced(SO(regex="[0-9]+"), "") == []        # 没有唯一确定的字节
    assert forced(SO(choice=("é1", "è2")), "") == []   # 只确定了半个字符（共同的首字节 0xC3）：分词器切不了，不跳
    assert hf.decode(forced(SO(choice=("xyzé1", "xyzè2")), "")) in ("xyz", "xy", "x")   # 截到完整的字符为止
    assert jump_forward_tokens(e.grammars.matcher(SO(json=schema)), e.grammars, 2) == toks[:2]   # 至多 cap 个


@pytest.mark.parametrize("spec", ["none", "ngram"])
def test_jump_forward_saves_forwards_and_keeps_the_output_valid(s, spec):
    so = SO(json=SCHEMA)
    rq = reqs(s, GREEDY, n=40)
    on, off = engine(s, spec_method=spec), engine(s, spec_method=spec, jump_forward=False)
    a, b = on.generate(rq, so), off.generate(rq, so)
    assert on.structured_stats.jump_tokens > 0 and off.structured_stats.jump_tokens == 0
    assert a.stats.num_forwards < b.stats.num_forwards
    for ids in a.outputs:
        assert accepted_by(on, so, ids) and text(s, ids).startswith('{"name": "')
    assert sum(map(len, a.outputs)) == a.stats.generated_tokens


def test_jump_forward_never_passes_max_new_tokens(s):
    """强制的 `{"name":` 有 3 个 token：max_new_tokens 2 时开头只强制 1 个（至少留一个采样），之后到 2 个就以 length 结束。"""
    for n in (1, 2, 3, 4):
        e = engine(s)
        out = e.generate([Request(s.tok.encode("hi"), n, GREEDY)], SO(json=SCHEMA))
        assert len(out.outputs[0]) == n and out.finish_reasons == ["length"]
        assert_all_free(e)


def test_jump_forward_over_several_blocks(s):
    """块大小 4、一段很长的强制文本：追加的 token 跨好几块，调度器一块一块地补（step09 的调度器只补一块：前向的
    地址排不出来）。这个正则里自由的只有开头和结尾的一个数字：开头的那个两条路相同（同样的上下文），之间的全部强制。"""
    pattern = r"[0-9] is the number of the beast, said the wise old owl to the young fox in the dark forest\. [0-9]"
    rq = [Request(s.tok.encode("hi"), 60, GREEDY)]
    outs = []
    for jump in (True, False):
        e = engine(s, block_size=4, num_blocks=64, jump_forward=jump)
        out = e.generate(rq, SO(regex=pattern))
        assert out.finish_reasons == ["stop"] and re.fullmatch(pattern, text(s, out.outputs[0]))
        outs.append((text(s, out.outputs[0]), out.stats.num_forwards))
        assert_all_free(e)
    assert outs[0][0][:-1] == outs[1][0][:-1]
    assert outs[0][1] < outs[1][1] / 3


# ---------------- 分块 prefill、前缀缓存、抢占 ----------------

@pytest.mark.parametrize("jump", [True, False], ids=["jump", "no-jump"])
def test_chunked_prefill_prefix_cache_and_preemption_do_not_change_constrained_outputs(s, jump):
    so = SO(json=SCHEMA)
    long = s.tok.encode("Describe a person as JSON. " * 12)
    rq = [Request(long + s.tok.encode(t), 30, GREEDY) for t in ("A", "B", "C", "D")]
    ref = [engine(s, jump_forward=jump, enable_prefix_caching=False).generate([r], so).outputs[0] for r in rq]
    for cfg in (dict(max_num_batched_tokens=32), dict(num_blocks=14, block_size=16), dict(num_blocks=14, preempt="swap")):
        e = engine(s, jump_forward=jump, **cfg)
        out = e.generate(rq, so)
        assert out.outputs == ref, cfg
        assert_all_free(e)
        if "num_blocks" in cfg:
            assert out.stats.preemptions > 0
        else:
            assert sum(out.stats.cached_tokens) > 0


# ---------------- logprobs ----------------

def test_logprobs_are_of_the_masked_distribution(s):
    """choice 的第一步只有几个 token 合法：最可能的 k 个里只有它们（其余是 -inf），它们的概率加起来是 1。要 logprobs 的
    请求不 jump-forward：每个 token 都有自己那一行 logits。"""
    so = SO(choice=("yes", "no", "maybe"))
    e = engine(s)
    rid = e.add_request(Request(s.tok.encode("Answer:"), 8, GREEDY, logprobs=20), so)
    m = e.grammars.matcher(so)
    allowed = set(m.grammar.masks(m.state).token_ids.tolist())
    outs = []
    while e.has_unfinished_requests():
        outs += [o for o in e.step() if o.request_id == rid]
    first = outs[0].logprobs[0]
    finite = [(t, lp) for t, lp in first.top if lp > float("-inf")]
    assert {t for t, _ in finite} == allowed
    assert abs(sum(torch.tensor([lp for _, lp in finite]).exp().tolist()) - 1) < 1e-5
    ids = [t for o in outs for t in o.new_token_ids]
    assert len(ids) == sum(len(o.logprobs) for o in outs) and e.structured_stats.jump_tokens == 0
    assert text(s, ids) in ("yes", "no", "maybe")


# ---------------- jump-forward 与不跳：能保证的关系 ----------------

def relation(e, so, r, jumped, plain, logits_fn, n):
    return jump_relation(e.grammars, so, r.prompt_ids, jumped, plain, n, logits_fn, MARGIN_TOL[torch.float32],
                         e.grammars.index.token_bytes)


def test_jump_forward_is_greedy_with_the_tokenizers_spelling(s):
    """跳的输出 = 强制的几段（重放得出，分词器的切法）+ 其余每个 token 是它自己上文上铺了掩码的 argmax；与不跳的输出
    逐 token 相同，直到第一个强制 token 与模型自己的切法不同的地方。强制的 token 与引擎记的账一样多。"""
    so, n = SO(json=SCHEMA), 40
    rq = reqs(s, GREEDY, n=n)
    on, off = engine(s), engine(s, jump_forward=False)
    a, b = on.generate(rq, so), off.generate(rq, so)
    forced = 0
    for r, x, y in zip(rq, a.outputs, b.outputs):
        rel = relation(on, so, r, x, y, s.full_logits, n)
        assert rel.ok, rel.reason
        forced += sum(rel.forced)
    assert forced == on.structured_stats.jump_tokens > 0


def test_jump_relation_can_fail(s):
    """检查本身会失败：一个采样的位置换成另一个合法的 token（不是 argmax，也不是打平）；一个强制的 token 拆成单字节的
    token（文本相同，切法不是分词器的：重放不出来）；不跳的输出在一个采样的位置与跳的不同（不是打平）。"""
    so, n = SO(json=SCHEMA), 40
    r = reqs(s, GREEDY, n=n)[0]
    on = engine(s)
    x = on.generate([r], so).outputs[0]
    ok = relation(on, so, r, x, x, s.full_logits, n)
    assert ok.ok and ok.divergence is None
    logits = s.full_logits(r.prompt_ids + x)[len(r.prompt_ids) - 1:]
    m = on.grammars.matcher(so)
    for i, t in enumerate(x):                        # 一个采样的位置，铺了掩码后第一与第二差得远（换掉它不是打平）
        allowed = m.grammar.masks(m.state).token_ids
        top = logits[i][allowed].topk(min(2, len(allowed)))
        if not ok.forced[i] and len(allowed) > 1 and top.values[0] - top.values[1] > 0.05:
            other = int(allowed[top.indices[1]])
            break
        m.accept_token(t)
    else:
        pytest.fail("no sampled position with a clear argmax")
    wrong = x[:i] + [other]                          # max_new_tokens = 它的长度：重放到这里就停，只看 teacher forcing
    bad = relation(on, so, r, wrong, wrong, s.full_logits, len(wrong))
    assert not bad.ok and "not the masked argmax" in bad.reason
    plain = x[:i] + [other]
    bad = relation(on, so, r, x, plain, s.full_logits, n)
    assert not bad.ok and f"differ at {i}" in bad.reason
    table = on.grammars.index.token_bytes
    j = next(j for j, f in enumerate(ok.forced) if f and len(table[x[j]]) > 1)
    singles = [table.index(bytes([c])) for c in table[x[j]]]
    respelled = x[:j] + singles + x[j + 1:]
    bad = relation(on, so, r, respelled, respelled, s.full_logits, n + len(singles) - 1)
    assert not bad.ok and "replay" in bad.reason


def test_jump_forward_relation_on_the_real_model(real):
    """固定键的 schema、贪心，真实模型：两个提示词上关系都成立。跳与不跳从第一个 token 起就不同——跳时按分词器的切法放进
    `{"`（一个 token），不跳时模型自己选了 `{`（它在铺了掩码的 logits 里最大）再写 `"`。第一个提示词之后写的内容一样，
    文本相同；第二个（章节模式 [4] 的 "Make up a person…"）的名字不同——这不是错，是 jump-forward 换掉了模型看到的 token。
    前向少于不跳的 0.7 倍。"""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                                               "city": {"type": "string", "maxLength": 40}},
              "required": ["name", "age", "city"]}
    so, n = SO(json=schema), 48
    rq = [Request(real.tok.encode(t, True), n, GREEDY)
          for t in ("Give me a JSON object for a person called Bob who is 42 and lives in Paris.",
                    "Make up a person and describe them in JSON with name, age and city.")]
    outs, engines = {}, {}
    for jump in (True, False):
        engines[jump] = step15.LLMEngine(real.model, step15.EngineConfig(num_blocks=32, block_size=16, jump_forward=jump),
                                         real.tok, real.tok.eos_ids)
        outs[jump] = engines[jump].generate(rq, so)
        assert outs[jump].finish_reasons == ["stop", "stop"]
    a, b = outs[True], outs[False]
    for r, x, y in zip(rq, a.outputs, b.outputs):
        rel = relation(engines[True], so, r, x, y, real.full_logits, n)
        assert rel.ok and rel.divergence == 0 and rel.reason == "forced spelling", rel.reason
        assert real.tok.hf.decode(x[:1]) == '{"' and real.tok.hf.decode(y[:1]) == "{"
        jsonschema.validate(json.loads(real.tok.decode(x)), schema)
    assert real.tok.decode(a.outputs[0]) == real.tok.decode(b.outputs[0])
    assert a.stats.num_forwards < 0.7 * b.stats.num_forwards


# ---------------- run.py ----------------

def run_json(module, argv, capsys) -> dict:
    """在进程内跑某一步的 run.py（与命令行同一条路），退出码 0，返回最后一行的 JSON。"""
    from common import cli
    with pytest.raises(SystemExit) as e:
        cli.run_main(module.make_parser(), module.main, argv)
    out = capsys.readouterr().out
    assert e.value.code == 0, out[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def test_run_py_no_constraint_equals_step09_and_reports_finish_reasons(tiny_tok_dir, capsys):
    import step09_speculative.run as run09
    import step15_structured_output.run as run15
    argv = ["--model", str(tiny_tok_dir), "--prompt", "hello hello hello", "--prompt", "a b c a b c",
            "--max-new-tokens", "12", "--json"]
    outs = {mod: run_json(mod, argv, capsys) for mod in (run09, run15)}
    assert [r["output_ids"] for r in outs[run09]["results"]] == [r["output_ids"] for r in outs[run15]["results"]]
    assert outs[run09]["stats"]["forwards"] == outs[run15]["stats"]["forwards"]
    assert [r["finish_reason"] for r in outs[run15]["results"]] == ["length", "length"]
    res = run_json(run15, argv + ["--choice", "yes,no"], capsys)["results"]
    assert [r["finish_reason"] for r in res] == ["stop", "stop"] and {r["text"] for r in res} <= {"yes", "no"}


@pytest.mark.parametrize("extra,words", [
    (["--regex", "[0-9"], "unterminated character set"),
    (["--json-schema", '{"type": "integer", "minimum": 3}'], "unsupported keyword 'minimum'"),
    (["--json-schema", '{"type": "string", "enum": [1]}'], "no enum/const value"),
    (["--json-schema", "no-such-file.json"], "neither a readable file nor valid JSON"),
    (["--regex", "a", "--choice", "b"], "at most one of"),
    (["--choice", "a,,b"], "non-empty strings"),
    (["--choice", "a", "--no-chunked-prefill", "--spec-method", "none"], "step15's engine"),
    (["--choice", "a", "--min-tokens", "2"], "min_tokens"),
])
def test_run_py_errors(tiny_tok_dir, capsys, extra, words):
    import step15_structured_output.run as run15
    from conftest import cli_error
    line = cli_error(run15, ["--model", str(tiny_tok_dir), "--prompt", "hi", "--max-new-tokens", "4", *extra], capsys)
    assert words in line, line


def test_run_py_reads_a_schema_file(tiny_tok_dir, tmp_path, capsys):
    import step15_structured_output.run as run15
    path = tmp_path / "schema.json"
    path.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    res = run_json(run15, ["--model", str(tiny_tok_dir), "--prompt", "hi", "--max-new-tokens", "16",
                           "--json-schema", str(path), "--json"], capsys)["results"][0]
    assert res["finish_reason"] == "stop" and json.loads(res["text"]) in ({"ok": True}, {"ok": False})


def test_a_grammar_that_cannot_continue_ends_only_its_request(s):
    """某个状态一个 token 也接不上（词表缺字节的分词器才会这样；这里把算掩码换成抛错来模拟）：只有这个请求以
    "error" 结束，同一批别的请求照常写完，块全部还回来。"""
    e = engine(s, jump_forward=False)
    so = SO(regex="[a-z]{2,30}")
    grammar = e.grammars.compile(so)
    grammar.cache.clear()
    real_compute = grammar.compute

    def compute(state):
        if state != 1:                                     # 起点（START = 1）照常，之后的状态都"接不上"
            raise ValueError(f"no token of the vocabulary can continue the grammar from DFA state {state}")
        return real_compute(state)
    grammar.compute = compute
    try:
        bad = e.add_request(Request(s.tok.encode("hi"), 10, GREEDY), so)
        good = e.add_request(Request(s.tok.encode("hello"), 10, GREEDY, ignore_eos=True))
        outs = {}
        while e.has_unfinished_requests():
            for o in e.step():
                outs.setdefault(o.request_id, []).append(o)
    finally:
        grammar.compute = real_compute
        grammar.cache.clear()
    assert outs[bad][-1].finish_reason == "error" and "can continue" in str(outs[bad][-1].error)
    assert outs[good][-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs[good]) == 10
    assert_all_free(e)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-40), SamplingParams(temperature=1e6, seed=1),
    SamplingParams(temperature=0.8, repetition_penalty=1e-40, seed=1),
    SamplingParams(temperature=0.8, repetition_penalty=1e6, seed=1), SamplingParams(temperature=0.8, top_p=1e-30, seed=1),
    SamplingParams(temperature=1e-5, repetition_penalty=1e-40, frequency_penalty=-2, presence_penalty=-2, seed=1,
                   logit_bias={s_: 100.0 for s_ in range(3)}),
], ids=["t1e-40", "t1e6", "rp1e-40", "rp1e6", "topp1e-30", "mixed"])
def test_extreme_sampling_values_stay_inside_the_grammar(s, params):
    """惩罚把 -inf 夹成 -1e30、温度 1e6 把分布压平、logit_bias +100 加在被屏蔽的特殊 token 上：被屏蔽的 token 的概率
    仍然是 0，输出仍然合法。"""
    so = SO(regex=r"[0-9]{2}-(?:yes|no)")
    e = engine(s)
    out = e.generate([Request(s.tok.encode("hi there"), 12, params)], so)
    assert out.finish_reasons == ["stop"] and re.fullmatch(r"[0-9]{2}-(?:yes|no)", text(s, out.outputs[0]))
