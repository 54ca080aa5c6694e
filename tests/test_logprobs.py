"""logprobs：step09 / step10 的引擎（随机小模型）与 step11 的服务器（真实的 openai 客户端）。

引擎：
- 采样出的 token 的 logprob 与 top-k == HF transformers 对整段序列一次前向（teacher forcing）在它那个位置的
  log_softmax（贪心、带惩罚的抽样都一样：原始分布）；top-k 从大到小、就是那一行最大的 k 个；
- 投机解码：每个接受的猜测和奖励 token 的 logprob 用它自己那一行 verify 的 logits，与不猜时逐 token 相同；
- prompt logprobs == step01 那样整段重算一次前向（teacher forcing）的 log_softmax，提示词被分块 prefill 切成几块、
  同一批里还有别的请求在 decode；要 prompt logprobs 的请求不读前缀缓存（要的正是那些位置的 logits）；
  max_new_tokens 0 只 prefill；step10 广播的计划带着要 logits 的提示词位置，TP = 2 的引擎与一个进程的相同。
服务器：completions 的旧格式（流式与非流式、echo + max_tokens 0）、chat 的 content logprobs（流式与非流式）、
--max-logprobs 的上限与不算 logprobs 的引擎都是 400 指名字段。
"""
import datetime
import multiprocessing

import httpx
import openai
import pytest
import torch
import torch.distributed as dist

from common.errors import UserError
from common.hf_reference import hf_logits, load_hf_model
from conftest import make_tiny_model_dir, one_arch
from common.weights import load_model
from step02_sampling.sampler import SamplingParams
from step04_static_batching.request import Request
from step09_speculative import engine as step09
from step10_tensor_parallel import engine as step10
from test_step11_fake_engine import FakeEngine
from test_step11_serving import MODEL, Served, real_engine, tiny_session, tok  # noqa: F401（夹具）

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=5)
TOL = 1e-4          # 引擎（分页、展平的一行、分块）与整段重算的 float32 logits 之差远小于它


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in (5, 23, 37)]


def make(step, model, **cfg):
    return step.LLMEngine(model, step.EngineConfig(**{**dict(num_blocks=64, block_size=4), **cfg}))


def capture_rows(eng):
    """包住 _postprocess：记下每一步交给它的 logits 与各请求的行（request_id → 这一步的 (logits 行, 提示词的行)）。"""
    steps, original = [], eng._postprocess

    def spy(batch, logits, logits_rows, prompt_rows):
        steps.append({seq.request_id: (logits[r.start:r.stop].clone(), logits[p.start:p.stop].clone())
                      for seq, r, p in zip(batch.seqs, logits_rows, prompt_rows)})
        return original(batch, logits, logits_rows, prompt_rows)
    eng._postprocess = spy
    return steps


def run(eng, reqs):
    """一步一步跑完，返回每个请求的全部 RequestOutput（按步）。"""
    ids = [eng.add_request(r) for r in reqs]
    outs = {rid: [] for rid in ids}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id].append(o)
    return [outs[rid] for rid in ids]


def check_entry(entry, token, lp: torch.Tensor, k: int):
    """entry 是 token 在参照分布 lp (V,)（log_softmax）上的 Logprob：数对得上，top-k 从大到小、正是最大的 k 个。"""
    assert entry.token_id == token
    assert abs(entry.logprob - float(lp[token])) <= TOL
    ids, vals = [i for i, _ in entry.top], [v for _, v in entry.top]
    assert len(ids) == k and vals == sorted(vals, reverse=True)
    assert all(abs(v - float(lp[i])) <= TOL for i, v in entry.top)
    assert ids == lp.topk(k).indices.tolist()                       # 没有漏掉更大的


# ---------------- 引擎 ----------------

@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    """同一个随机小模型的两份：我们的（引擎用）与 HF transformers 的（参照：不是我们写的前向）。"""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("lp"), "llama")
    return load_model(path, "cpu", torch.float32), load_hf_model(path, "cpu", torch.float32)


@pytest.mark.parametrize("step", [step09, step10], ids=["step09", "step10"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_sampled_token_logprob_equals_a_teacher_forced_hf_forward(hf_tiny, step, params):
    """三个请求一起跑（预算 16：长提示词分块 prefill，同一步里别人在 decode）。第 j 个新 token 的 logprob 与 top-k
    的参照是 HF 对"提示词 + 全部输出"整段一次前向的第 len(提示词) − 1 + j 行的 log_softmax（原始分布，与惩罚、温度无关）：
    引擎取错一行（差一个位置、别的请求的行）就对不上。"""
    model, hf = hf_tiny
    reqs = [Request(p, 6, params, ignore_eos=True, logprobs=4) for p in prompts()]
    outs = run(make(step, model, max_num_batched_tokens=16), reqs)
    for r, per in zip(reqs, outs):
        produced = [o for o in per if o.new_token_ids]
        assert len(produced) == 6 and all(len(o.logprobs) == len(o.new_token_ids) == 1 for o in produced)
        assert all(o.prompt_logprobs is None for o in per)
        gen = [o.new_token_ids[0] for o in produced]
        ref = torch.log_softmax(hf_logits(hf, r.prompt_ids + gen), -1)             # (T, V)
        for j, o in enumerate(produced):
            check_entry(o.logprobs[0], gen[j], ref[len(r.prompt_ids) - 1 + j], 4)
    # 没要 logprobs 的请求不带
    plain = run(make(step, model), [Request(prompts()[0], 3, params, ignore_eos=True)])[0]
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in plain)


@one_arch
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculative_tokens_get_the_logprobs_of_plain_decoding(tiny, method):
    """贪心：自己当草稿（全部接受，每步 k+1 个 token）和 prompt lookup 的每个 token 的 logprob 与 top-k，
    等于不猜时一个一个 decode 的（同一个位置的 logits，只是由 verify 的哪一行算出）。"""
    ps = prompts()[:2] + [[5, 6, 7, 8] * 4]             # 最后一个自己重复：prompt lookup 猜得中
    reqs = [Request(p, 12, GREEDY, ignore_eos=True, logprobs=3) for p in ps]
    ref = run(make(step09, tiny.model), reqs)
    spec = step09.LLMEngine(tiny.model, step09.EngineConfig(64, 4, spec_method=method, num_spec_tokens=3),
                            draft_model=tiny.model if method == "draft" else None)
    got = run(spec, reqs)
    assert spec.spec_stats.accepted > 0 and any(len(o.new_token_ids) > 1 for per in got for o in per)
    for a, b in zip(ref, got):
        ea = [e for o in a for e in o.logprobs]
        eb = [e for o in b for e in o.logprobs]
        assert [e.token_id for e in ea] == [e.token_id for e in eb] and len(ea) == 12
        for x, y in zip(ea, eb):
            assert abs(x.logprob - y.logprob) <= TOL
            assert [i for i, _ in x.top] == [i for i, _ in y.top]
            assert max(abs(u - v) for (_, u), (_, v) in zip(x.top, y.top)) <= TOL


def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    """step01 的做法：整段序列一次前向（不用任何缓存），(T, V) 的 log_softmax。"""
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    return torch.log_softmax(logits.float(), -1)


def check_prompt_logprobs(entries, prompt: list[int], ref: torch.Tensor, k: int):
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        e = entries[p]
        assert e.token_id == prompt[p] and abs(e.logprob - float(ref[p - 1, prompt[p]])) <= TOL
        assert len(e.top) == k
        assert all(abs(v - float(ref[p - 1, i])) <= TOL for i, v in e.top)
        if k:
            top = ref[p - 1].topk(k)
            assert abs(e.top[0][1] - float(top.values[0])) <= TOL and abs(e.top[-1][1] - float(top.values[-1])) <= TOL


@one_arch
@pytest.mark.parametrize("step", [step09, step10], ids=["step09", "step10"])
@pytest.mark.parametrize("attention", ["paged", "gather"])
def test_prompt_logprobs_equal_a_teacher_forced_forward(tiny, step, attention):
    """37 个 token 的提示词在预算 8 下分 5 块 prefill，同一批里另一个请求在 decode；同样的提示词先被别的请求算过
    （块登记在前缀缓存里），要 prompt logprobs 的请求仍然不读缓存，从位置 0 算起。"""
    p0, p1, p2 = prompts()
    eng = make(step, tiny.model, max_num_batched_tokens=8, attention=attention)
    warm = run(eng, [Request(p2, 2, GREEDY, ignore_eos=True)])[0]              # 把 p2 的满块登记进前缀缓存
    assert warm[-1].finished
    eng2_hit = run(eng, [Request(p2, 2, GREEDY, ignore_eos=True)])[0]
    assert eng2_hit[0].num_cached_tokens > 0                                     # 缓存里真有它
    steps = capture_rows(eng)
    outs = run(eng, [Request(p1, 10, GREEDY, ignore_eos=True),
                     Request(p2, 3, SEEDED, ignore_eos=True, prompt_logprobs=5, logprobs=2)])
    mine = outs[1]
    assert mine[0].num_cached_tokens == 0                                        # 没读前缀缓存
    assert sum(1 for s in steps if any(len(v[1]) for v in s.values())) >= 5      # 提示词的行分在好几步里
    delivered = [o.prompt_logprobs for o in mine if o.prompt_logprobs is not None]
    assert len(delivered) == 1 and mine[0].prompt_logprobs is not None          # 第一个输出带着，只一次
    check_prompt_logprobs(delivered[0], p2, teacher_forced(tiny.model, p2), 5)
    # 生成的 token 也对得上整段重算（原始分布，与 SEEDED 的惩罚、温度无关）
    gen = [t for o in mine for t in o.new_token_ids]
    ref = teacher_forced(tiny.model, p2 + gen)
    for j, e in enumerate(e for o in mine for e in o.logprobs):
        assert abs(e.logprob - float(ref[len(p2) - 1 + j, gen[j]])) <= TOL
    # max_new_tokens 0：只 prefill，不采样，结束原因 length
    only = run(eng, [Request(p0, 0, GREEDY, prompt_logprobs=0)])[0]
    assert len(only) == 1 and only[0].finished and only[0].finish_reason == "length" and only[0].new_token_ids == []
    check_prompt_logprobs(only[0].prompt_logprobs, p0, teacher_forced(tiny.model, p0), 0)
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@one_arch
def test_prompt_logprobs_survive_preemption(tiny):
    """12 块的池子：短提示词的请求 decode 到要第 3 块时，37 个 token 的提示词还在分块 prefill（已经攒了几个位置的
    logprobs），它被抢占（重算）；重新 prefill 时已经攒好的位置不再算，提示词的 logprobs 只交一次、仍然对。"""
    p0, _, p2 = prompts()
    reqs = [Request(p0, 40, GREEDY, ignore_eos=True, prompt_logprobs=1),
            Request(p2, 4, GREEDY, ignore_eos=True, prompt_logprobs=1)]
    eng = make(step09, tiny.model, num_blocks=12, max_num_batched_tokens=8)
    preempted, original = [], eng.scheduler._preempt
    eng.scheduler._preempt = lambda seq: (preempted.append((len(seq.prompt_logprobs), seq.in_prefill)), original(seq))
    outs = run(eng, reqs)
    assert any(0 < n < len(p2) - 1 and in_prefill for n, in_prefill in preempted), preempted   # 攒到一半时被抢占
    for r, per in zip(reqs, outs):
        delivered = [o.prompt_logprobs for o in per if o.prompt_logprobs is not None]
        assert len(delivered) == 1
        check_prompt_logprobs(delivered[0], r.prompt_ids, teacher_forced(tiny.model, r.prompt_ids), 1)
        assert sum(len(o.new_token_ids) for o in per) == r.max_new_tokens


def test_request_checks_logprob_fields():
    Request([1, 2], 0, prompt_logprobs=0).validate(64)              # 只 prefill
    for bad in (dict(max_new_tokens=0), dict(logprobs=-1), dict(prompt_logprobs=True), dict(logprobs=1.5)):
        with pytest.raises(UserError):
            Request(**{"prompt_ids": [1, 2], "max_new_tokens": 4, **bad}).validate(64)


def test_step10_plan_message_carries_the_prompt_logit_positions():
    from step10_tensor_parallel.sequence import Sequence
    from step10_tensor_parallel.step_message import decode_plan, encode_plan
    s = Sequence(0, Request(list(range(2, 12)), 3, prompt_logprobs=2), torch.Generator(), 0.0)
    s.block_table = [0, 1, 2]
    s.num_computed_tokens = 4
    s.prompt_logprobs = [None] * 3                                  # 已攒了 3 个：还要位置 3..8
    plan = decode_plan(encode_plan([s], [4], [], 200))
    assert plan.prompt_logits == [range(3, 9)] and plan.num_new_tokens == [4]


def test_step10_tp2_prompt_logprobs_equal_one_process(tmp_path_factory):
    """TP = 2：每个 rank 按广播的计划为同样的提示词位置算 logits（lm_head 的 all-gather 行数一致），
    rank 0 交出的 prompt logprobs 与一个进程的引擎相同（容差内：all-reduce 改变了求和顺序）。"""
    from step10_tensor_parallel.launch import launch
    from step10_tensor_parallel.model_runner import serve_worker
    from step10_tensor_parallel.parallel_layers import load_shard
    path = make_tiny_model_dir(tmp_path_factory.mktemp("tp"), "llama")
    full = load_model(path, "cpu", torch.float32)
    reqs = [Request(p, 4, GREEDY, ignore_eos=True, prompt_logprobs=3, logprobs=3) for p in prompts()]
    cfg = step10.EngineConfig(32, 4, 4, 8)
    ref = run(step10.LLMEngine(full, cfg), reqs)
    with launch(2, 1, serve_worker, (path, "cpu", torch.float32), threads=1,
                timeout=datetime.timedelta(seconds=60)) as par:
        eng = step10.LLMEngine(load_shard(path, par, "cpu", torch.float32), cfg, parallel=par)
        got = run(eng, reqs)
        eng.close()
    assert not dist.is_initialized() and not multiprocessing.active_children()
    for a, b in zip(ref, got):
        pa = next(o.prompt_logprobs for o in a if o.prompt_logprobs)
        pb = next(o.prompt_logprobs for o in b if o.prompt_logprobs)
        assert [e and e.token_id for e in pa] == [e and e.token_id for e in pb]
        assert all(abs(x.logprob - y.logprob) <= 1e-3 for x, y in zip(pa[1:], pb[1:]))
        assert [t for o in a for t in o.new_token_ids] == [t for o in b for t in o.new_token_ids]


# ---------------- 服务器：真实的 openai 客户端 ----------------

@pytest.fixture(scope="module")
def lp_server(tiny_session):
    s = Served(real_engine("step10", tiny_session), tiny_session.tok, max_logprobs=20)
    yield s
    s.stop()


def ref_logprobs(session, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(session.full_logits(ids).float(), -1)


def test_completions_legacy_logprobs_streamed_and_not(lp_server, tiny_session):
    s, client = tiny_session, lp_server.client()
    kw = dict(model=MODEL, prompt="长城是", max_tokens=8, temperature=0, logprobs=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    full = client.completions.create(**kw)
    c = full.choices[0]
    ids, out = c.prompt_token_ids, c.token_ids
    lp = c.logprobs
    assert lp.tokens == [s.tok.hf.decode([t], skip_special_tokens=False) for t in out] and len(out) == 8
    ref = ref_logprobs(s, ids + out)
    for j, t in enumerate(out):
        assert abs(lp.token_logprobs[j] - float(ref[len(ids) - 1 + j, t])) <= TOL
        top = lp.top_logprobs[j]
        assert len(top) <= 4 and lp.tokens[j] in top                         # 最可能的 3 个 + 采样出的（字符串可能重复）
        assert abs(max(top.values()) - lp.token_logprobs[j]) <= 1e-6           # 贪心：采样出的就是最可能的
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    special = set(s.tok.hf.all_special_ids)
    clean = [j for j, t in enumerate(out) if t not in special and "\ufffd" not in lp.tokens[j]
             and (j == 0 or (out[j - 1] not in special and "\ufffd" not in lp.tokens[j - 1]))]
    assert all(c.text[lp.text_offset[j]:].startswith(lp.tokens[j]) for j in clean)
    # 流式：每个 chunk 带它那几个 token 的，拼起来与非流式相同
    got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for ch in client.completions.create(stream=True, **kw):
        text += ch.choices[0].text
        if ch.choices[0].logprobs is not None:
            for key in got:
                got[key] += getattr(ch.choices[0].logprobs, key)
    assert text == c.text
    assert got == {key: getattr(lp, key) for key in got}


def test_completions_echo_with_max_tokens_0_gives_prompt_logprobs(lp_server, tiny_session):
    """lm-eval 的 loglikelihood 这样问：echo + logprobs，不生成（或生成 1 个再丢掉）。"""
    s, client = tiny_session, lp_server.client()
    prompt = "The Great Wall of China is very long"
    ids = s.tok.encode(prompt)
    ref = ref_logprobs(s, ids)
    for stream in (False, True):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            text = "".join(ch.choices[0].text for ch in chunks)
            lp = next(ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs is not None)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(**kw)
            text, lp, reason = r.choices[0].text, r.choices[0].logprobs, r.choices[0].finish_reason
            assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
        assert text == prompt and reason == "length"
        assert lp.tokens == [s.tok.hf.decode([t], skip_special_tokens=False) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        for p in range(1, len(ids)):
            assert abs(lp.token_logprobs[p] - float(ref[p - 1, ids[p]])) <= TOL
            assert 2 <= len(lp.top_logprobs[p]) <= 3
        assert all(text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens))
    # echo + 生成：提示词的在前，生成的 text_offset 接着提示词的文本往后数
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt) and len(lp.tokens) == len(ids) + 3
    assert lp.text_offset[len(ids)] == len(prompt)


def test_chat_logprobs_streamed_and_not(lp_server, tiny_session):
    s, client = tiny_session, lp_server.client()
    msgs = [{"role": "user", "content": "讲个笑话"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    content, ids, out = c.logprobs.content, c.prompt_token_ids, c.token_ids
    assert len(content) == len(out) == 10
    ref = ref_logprobs(s, ids + out)
    for j, (e, t) in enumerate(zip(content, out)):
        assert abs(e.logprob - float(ref[len(ids) - 1 + j, t])) <= TOL
        assert e.token == s.tok.hf.decode([t], skip_special_tokens=False)
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert abs(e.top_logprobs[0].logprob - e.logprob) <= 1e-6                 # 贪心
    # bytes 是 token 真正的字节：接起来就是整段文本（一个汉字切成几个 token 也一样）
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace") == s.tok.hf.decode(
        out, skip_special_tokens=False)
    streamed = []
    for ch in client.chat.completions.create(stream=True, **kw):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.content
    assert [(e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, e.bytes, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content]


def test_logprob_bounds_and_engines_without_logprobs_are_400(lp_server, tok):
    C, K = "/v1/chat/completions", "/v1/completions"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    comp = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    cases = [(K, {**comp, "logprobs": 21}, "logprobs"), (K, {**comp, "logprobs": -1}, "logprobs"),
             (K, {**comp, "logprobs": True}, "logprobs"), (K, {**comp, "max_tokens": 0}, "max_tokens"),
             (C, {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             (C, {**chat, "top_logprobs": 2}, "top_logprobs"), (C, {**chat, "logprobs": 1}, "logprobs")]
    for path, body, param in cases:
        r = httpx.post(lp_server.url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    ok = httpx.post(lp_server.url + K, json={**comp, "logprobs": 20})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["token_logprobs"]) == 2
    with pytest.raises(openai.BadRequestError, match="max-logprobs"):
        lp_server.client().completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=21)
    # 不算 logprobs 的引擎（这里是假引擎；step05–08 同样）：要了就 400 指名字段，echo 本身照常
    fake = Served(FakeEngine(tok), tok)
    try:
        for path, body, param in [(K, {**comp, "logprobs": 0}, "logprobs"), (K, {**comp, "echo": True, "max_tokens": 0},
                                                                              "max_tokens"),
                                  (C, {**chat, "logprobs": True}, "logprobs")]:
            r = httpx.post(fake.url + path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        r = fake.client().completions.create(model=MODEL, prompt="hi", max_tokens=2, echo=True, temperature=0)
        assert r.choices[0].text.startswith("hi") and r.usage.completion_tokens == 2
    finally:
        fake.stop()
