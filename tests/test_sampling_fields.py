"""真实客户端发来的采样与停止字段：presence / frequency 惩罚、logit_bias、min_tokens、stop_token_ids、
include_stop_str_in_output。

- step02 的采样器：惩罚逐元素符合 OpenAI 的定义（只数已生成的 token）；整条处理链与参考（HF 的 SequenceBias /
  RepetitionPenalty / MinNewTokensLength 处理器 + 按定义逐个 token 写出的惩罚）一致；带惩罚的抽样的经验分布等于
  解析地算出的惩罚后分布；贪心也做；取值检查指名字段；极端但合法的值结果有限；
- 每一步的引擎（step03–10）与 step02 的逐步生成逐 token 相同；stop_token_ids 与 min_tokens 落在分块 prefill 的边界上
  （step07 起：提示词的最后一块刚算完就采样）、落在投机解码被接受的一串猜测里（step09/10）；
- 停止字符串与 min_tokens（vLLM 的规则：停止串要结束在前 min_tokens 个 token 的文本之后）：每一步的引擎、step02 的
  completes_stop_string、服务器的增量解码器都与只用整段解码写出的定义相同；结束在 min_tokens 之前的不算、之后的算；
- 真实的 openai 客户端经过 step11 服务器（流式与非流式）：每个字段的效果与引擎直接生成的相同；越界的值 400 指名字段。
"""
import math
import random
from collections import Counter

import openai
import pytest
import torch
from conftest import one_arch

from common.cli import open_session
from common.errors import UserError
from step02_sampling.distribution import binned, empirical_probs, hf_filtered_probs, top_bins, tv_bound, tv_distance
from step02_sampling.engine import generate as generate02
from step02_sampling.sampler import (LOGIT_LIMIT, SamplingParams, adjust_logits, apply_penalties, make_generator,
                                     process_logits, sample)
from step02_sampling.stop_strings import completes_stop_string
from step03_kvcache_single.engine import generate as generate03
from step04_static_batching.engine import generate_batch
from step04_static_batching.request import Request
from step05_paged import engine as step05
from step06_prefix_cache import engine as step06
from step07_chunked_prefill import engine as step07
from step08_kv_quant import engine as step08
from step09_speculative import engine as step09
from step09_speculative.proposer import FakeProposer
from step10_tensor_parallel import engine as step10
from step11_serving.detokenizer import IncrementalDetokenizer
from step15_structured_output import engine as step15
from test_step05_paged import CharTokenizer
from test_step11_serving import tok  # noqa: F401（夹具：真实分词器）


def random_logits(seed: int, vocab: int = 300, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale   # (V,)


# ---------------------------------------------------------------- 采样器：定义

def test_presence_frequency_penalty_definition():
    """OpenAI：logit[t] -= c[t] × frequency + (c[t] > 0) × presence；c 只数已生成的，提示词里的不算。"""
    z = torch.tensor([0.5, 1.0, 2.0, 3.0, -1.0, 4.0])
    prompt, output = [0, 0, 5], [1, 2, 2, 3, 3, 3]
    out = adjust_logits(z, prompt, output, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    assert out.tolist() == [0.5, 1.0 - 0.75, 2.0 - 1.0, 3.0 - 1.25, -1.0, 4.0]
    assert z.tolist() == [0.5, 1.0, 2.0, 3.0, -1.0, 4.0]                       # 不修改输入
    # 负的是奖励；全是默认值时原样返回
    assert apply_penalties(z, output, -2.0, 0.0).tolist() == [0.5, 3.0, 4.0, 5.0, -1.0, 4.0]
    assert adjust_logits(z, prompt, output, SamplingParams()) is z


def test_logit_bias_and_min_tokens_definition():
    z = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert adjust_logits(z, [], [], SamplingParams(logit_bias={0: 100.0, 3: -2.5})).tolist() == [100.0, 1.0, 2.0, 0.5]
    p = SamplingParams(min_tokens=2, stop_token_ids=(1,))
    assert adjust_logits(z, [], [7], p, eos_ids=(3,)).tolist() == [0.0, -math.inf, 2.0, -math.inf]   # 1 < 2：屏蔽
    assert adjust_logits(z, [], [7, 7], p, eos_ids=(3,)).tolist() == z.tolist()                     # 到了：不屏蔽
    assert adjust_logits(z, [9, 9, 9], [], p, eos_ids=(3,))[3] == -math.inf                          # 提示词不算
    # 结束 token 覆盖了整个词表：不屏蔽（否则没有 token 可选）
    every = SamplingParams(min_tokens=5, stop_token_ids=(0, 1, 2))
    assert adjust_logits(z, [], [], every, eos_ids=(3,)).tolist() == z.tolist()


PARAM_CASES = [
    SamplingParams(temperature=1.0, presence_penalty=1.5),
    SamplingParams(temperature=0.7, frequency_penalty=0.8),
    SamplingParams(temperature=1.0, presence_penalty=-1.0, frequency_penalty=-0.5, top_k=50),
    SamplingParams(temperature=0.9, logit_bias={3: 100.0, 7: -100.0, 11: 5.5}),
    SamplingParams(temperature=1.2, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3,
                   logit_bias={4: 2.0}, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.0, min_tokens=31, stop_token_ids=(8, 9)),     # 已生成 30 个 < 31：屏蔽 EOS 与 8、9
    SamplingParams(temperature=1.0, min_tokens=30, stop_token_ids=(8, 9)),     # 正好 30 个：不屏蔽
    SamplingParams(temperature=0.8, top_k=40, frequency_penalty=2.0, min_tokens=40, logit_bias={5: 50.0}),
]
EOS = (5,)


@pytest.mark.parametrize("params", PARAM_CASES, ids=repr)
@pytest.mark.parametrize("seed", [0, 1])
def test_process_logits_matches_reference_chain(params, seed):
    """参考不是我们写的采样器：HF 的 SequenceBias / RepetitionPenalty / MinNewTokensLength 与各个 warper，
    中间是按 OpenAI 文档逐个 token 写的惩罚（distribution.openai_penalties）。已生成的 token 取自一个小范围，次数有多有少。"""
    g = torch.Generator().manual_seed(seed)
    logits = random_logits(seed)
    prompt = torch.randint(0, 300, (20,), generator=g).tolist()
    output = torch.randint(0, 12, (30,), generator=g).tolist()
    ours = process_logits(logits, prompt, output, params, EOS).softmax(-1)
    ref = hf_filtered_probs(logits, prompt, output, params, EOS)
    assert torch.equal(ours > 0, ref > 0), "保留的 token 集合与参考不同"
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)
    masked = params.min_tokens > len(output)
    adjusted = adjust_logits(logits, prompt, output, params, EOS)
    for t in (*EOS, *params.stop_token_ids):
        assert (adjusted[t] == -math.inf) == masked


def analytic(logits: torch.Tensor, output: list[int], params: SamplingParams) -> torch.Tensor:
    """解析地写出惩罚、偏置、温度之后的分布（float64）：不经过采样器的任何函数。"""
    z = logits.double().clone()
    for t, b in params.logit_bias.items():
        z[t] += b
    for t, c in Counter(output).items():
        z[t] -= c * params.frequency_penalty + params.presence_penalty
    return (z / params.temperature).softmax(-1)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, presence_penalty=1.0, frequency_penalty=0.7, logit_bias={2: 1.5}, seed=7),
    SamplingParams(temperature=1.3, presence_penalty=-1.5, frequency_penalty=2.0, seed=8),
], ids=["penalise", "reward_presence"])
def test_penalised_sampling_equals_the_analytic_distribution(params):
    """sample() 抽 4000 次（它自己的发生器、整条处理链），经验分布与解析地惩罚后的分布的 TV 在上界之内；
    忘了惩罚的分布离得远（同一个上界抓得住错误的实现）。"""
    logits = random_logits(3, vocab=40, scale=1.5)
    top = logits.topk(4).indices.tolist()                     # 已生成的是最可能的几个：惩罚挪动很多概率
    prompt, output = [1, 2, 3, 3], [top[0]] * 3 + [top[1]] * 2 + top[2:]
    theory = analytic(logits, output, params)
    g = make_generator(params.seed, "cpu")
    n = 4000
    draws = [sample(logits, prompt, output, params, g) for _ in range(n)]
    bins = top_bins(theory)
    tv = tv_distance(binned(empirical_probs(draws, len(theory)), bins), binned(theory, bins))
    bound = tv_bound(binned(theory, bins), n)
    assert tv < bound, (tv, bound)
    forgot = analytic(logits, [], params)                     # 没有数已生成的 token
    assert tv_distance(binned(forgot, bins), binned(theory, bins)) > 2 * bound


def test_greedy_applies_penalties_bias_and_min_tokens():
    z = torch.tensor([0.0, 3.0, 2.9, 1.0, -1.0])
    g = make_generator(0, "cpu")
    before = g.get_state()
    assert sample(z, [], [], SamplingParams(), g) == 1
    assert sample(z, [], [1], SamplingParams(presence_penalty=0.2), g) == 2      # 已生成的 1 被压低
    assert sample(z, [1], [], SamplingParams(presence_penalty=0.2), g) == 1      # 提示词里的不算
    assert sample(z, [1], [], SamplingParams(repetition_penalty=1.2), g) == 2    # 重复惩罚看提示词
    assert sample(z, [], [], SamplingParams(logit_bias={4: 4.5}), g) == 4
    assert sample(z, [], [], SamplingParams(min_tokens=1), g, eos_ids=(1,)) == 2
    assert sample(z, [], [0], SamplingParams(min_tokens=1), g, eos_ids=(1,)) == 1
    assert sample(z, [], [], SamplingParams(min_tokens=1, stop_token_ids=(1, 2)), g) == 3
    assert torch.equal(g.get_state(), before)                                     # 贪心不消耗随机数


# ---------------------------------------------------------------- 取值检查与极端值

@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.01), ("presence_penalty", -2.01), ("presence_penalty", math.nan),
    ("frequency_penalty", 3.0), ("frequency_penalty", math.inf), ("logit_bias", {0: 100.01}),
    ("logit_bias", {0: math.nan}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}), ("logit_bias", {0: "1"}),
    ("logit_bias", [1, 2]), ("min_tokens", -1), ("min_tokens", 1.5), ("min_tokens", True),
    ("stop_token_ids", (-1,)), ("stop_token_ids", ("a",)),
    # True 是 int 的子类（True == 1）：不查类型就被当成 1 接受；字符串不查类型就在比较里抛 TypeError
    ("top_k", True), ("seed", True), ("seed", False), ("presence_penalty", True), ("frequency_penalty", False),
    ("repetition_penalty", True), ("temperature", True), ("top_p", True), ("min_p", False), ("temperature", "0.5"),
    ("top_p", "0.5"),
])
def test_validate_rejects_by_name(field, value):
    with pytest.raises(UserError, match=field):
        SamplingParams(**{field: value}).validate()


def test_validate_boundaries_and_vocabulary():
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, logit_bias={0: -100.0, 299: 100}, min_tokens=0,
                   stop_token_ids=(0, 299)).validate(300)
    for bad in (SamplingParams(logit_bias={300: 1.0}), SamplingParams(stop_token_ids=(300,))):
        bad.validate()                                               # 不知道词表：只查 >= 0
        with pytest.raises(UserError, match="logit_bias|stop_token_ids"):
            bad.validate(300)
    with pytest.raises(UserError, match="min_tokens"):
        Request([1, 2], 4, SamplingParams(min_tokens=5)).validate(512)
    Request([1, 2], 4, SamplingParams(min_tokens=4)).validate(512)


def test_extreme_but_valid_values_stay_finite():
    logits = random_logits(5)
    # 每个 token 都 -100：整体平移，分布不变
    everything = SamplingParams(temperature=1.0, logit_bias={t: -100.0 for t in range(300)})
    probs = process_logits(logits, [], [], everything).softmax(-1)
    torch.testing.assert_close(probs, logits.softmax(-1), rtol=1e-4, atol=1e-7)
    # 出现十万次的 token、最大的惩罚与奖励，叠上极端的重复惩罚和最小的非贪心温度：仍然有限，token 在词表里
    output = [7] * 100_000 + [8]
    for params in (SamplingParams(temperature=1e-5, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=1e-40),
                   SamplingParams(temperature=1e-5, frequency_penalty=-2.0, presence_penalty=-2.0, repetition_penalty=1e-40,
                                  logit_bias={7: 100.0}),
                   SamplingParams(frequency_penalty=-2.0, repetition_penalty=1e-40)):
        z = adjust_logits(logits, [7], output, params)
        assert torch.isfinite(z).all() and z.abs().max() <= LOGIT_LIMIT
        p = process_logits(logits, [7], output, params).softmax(-1)
        assert torch.isfinite(p).all() and abs(float(p.sum()) - 1) < 1e-5
        assert 0 <= sample(logits, [7], output, params, make_generator(0, "cpu")) < 300


# ---------------------------------------------------------------- 每一步的引擎：与 step02 的逐步生成逐 token 相同

def prompts16(n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(2, 256, (16,), generator=g).tolist() for _ in range(n)]   # 16 = 两块 8 个 token 的 prefill


def field_requests(model, eos: int) -> list[Request]:
    """四个请求，各用几个新字段。停止 token 取自不带它时的贪心输出，min_tokens 让它在前几个位置被屏蔽。"""
    ps = prompts16()
    plain = generate02(model, ps[2], 12, SamplingParams(), ignore_eos=True)
    stop = next(t for j, t in enumerate(plain) if j >= 3 and t not in plain[:j])   # 第一次出现在第 4 个或更后
    return [
        Request(ps[0], 12, SamplingParams(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={7: 3.0})),
        Request(ps[1], 12, SamplingParams(temperature=0.9, seed=3, frequency_penalty=1.0, presence_penalty=-0.5,
                                          repetition_penalty=1.1)),
        Request(ps[2], 12, SamplingParams(stop_token_ids=(stop,))),                       # 生成了它就停
        Request(ps[3], 12, SamplingParams(temperature=1.1, seed=4, min_tokens=6, stop_token_ids=(stop, eos),
                                          logit_bias={stop: 4.0, eos: 4.0})),             # 偏置让它们很想早停
    ]


def step02_reference(model, reqs, eos_ids, tokenizer=None):
    return [generate02(model, r.prompt_ids, r.max_new_tokens, r.params, eos_ids, r.ignore_eos, r.stop, tokenizer)
            for r in reqs]


def paged(step, **cfg):
    def run(model, reqs, eos_ids, tokenizer=None):
        return step.LLMEngine(model, step.EngineConfig(**{"num_blocks": 64, "block_size": 4, **cfg}),
                              tokenizer=tokenizer, eos_ids=eos_ids).generate(reqs).outputs
    return run


ENGINES = {   # (模型, 请求, EOS, 分词器：有请求带停止字符串时要) → 每个请求的输出
    "step03": lambda m, reqs, eos, tokenizer=None: [
        generate03(m, r.prompt_ids, r.max_new_tokens, r.params, eos, r.ignore_eos, stop_strings=r.stop,
                   tokenizer=tokenizer) for r in reqs],
    "step04": lambda m, reqs, eos, tokenizer=None: generate_batch(m, reqs, 3, eos, tokenizer).outputs,
    "step05": paged(step05),
    "step06": paged(step06),
    # 预算 8：16 个 token 的提示词分两块，第二块刚算完就采样第一个 token（屏蔽、停止都落在块的边界上）
    "step07": paged(step07, max_num_batched_tokens=8),
    "step08": paged(step08, max_num_batched_tokens=8),
    "step09": paged(step09, max_num_batched_tokens=8),
    "step10": paged(step10, max_num_batched_tokens=8),
    "step15": paged(step15, max_num_batched_tokens=8),
}


@one_arch
@pytest.mark.parametrize("name", list(ENGINES))
def test_every_engine_equals_step02_with_the_new_fields(tiny, name):
    eos = 1
    reqs = field_requests(tiny.model, eos)
    ref = step02_reference(tiny.model, reqs, [eos])
    # 这些字段确实起了作用：停止 token 让它提前停下（包含它）；min_tokens 之前没有停止 token 与 EOS
    assert 4 <= len(ref[2]) < 12 and ref[2][-1] in reqs[2].params.stop_token_ids
    assert not set(ref[3][:6]) & {eos, *reqs[3].params.stop_token_ids}
    assert ENGINES[name](tiny.model, reqs, [eos]) == ref


@one_arch
@pytest.mark.parametrize("step", [step07, step08, step09, step10], ids=lambda m: m.__name__.split(".")[0])
def test_stop_token_and_min_tokens_at_a_prefill_chunk_boundary(tiny, step):
    """提示词 16 个 token、预算 8：最后一块算完的那一步采样第一个 token。停止 token = 它本来的第一个 token：
    不带 min_tokens 时一个 token 就停（finish_reason "stop"，这个 token 在输出里）；min_tokens 1 时它在那一步被屏蔽。"""
    prompt = prompts16(1)[0]
    first = generate02(tiny.model, prompt, 1, SamplingParams())[0]
    for min_tokens in (0, 1, 3):
        params = SamplingParams(min_tokens=min_tokens, stop_token_ids=(first,))
        ref = generate02(tiny.model, prompt, 8, params)
        eng = step.LLMEngine(tiny.model, step.EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8))
        eng.add_request(Request(prompt, 8, params))
        got, reasons, steps = [], [], 0
        while eng.has_unfinished_requests():
            steps += 1
            for o in eng.step():
                got += o.new_token_ids
                reasons.append(o.finish_reason)
        assert got == ref and steps >= 2                                     # 至少两块 prefill
        if min_tokens == 0:
            assert got == [first] and reasons[-1] == "stop"
        else:
            assert got[0] != first and first not in got[:min_tokens]


def continuation(truth: dict, k: int) -> FakeProposer:
    """按参照输出猜接下来的 k 个（全对）。"""
    def script(token_ids):
        for prompt, out in truth.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                return list(out[done:done + k])
        raise AssertionError("unknown request")
    return FakeProposer(script)


def run_steps(eng, reqs):
    ids = [eng.add_request(r) for r in reqs]
    got, last, sizes = {rid: [] for rid in ids}, {}, {rid: [] for rid in ids}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
            sizes[o.request_id].append(len(o.new_token_ids))
            last[o.request_id] = o
    return [got[i] for i in ids], [last[i] for i in ids], [sizes[i] for i in ids]


@one_arch
@pytest.mark.parametrize("step", [step09, step10], ids=["step09", "step10"])
def test_stop_token_inside_an_accepted_speculative_run(tiny, step, monkeypatch):
    """猜测 = 不带停止 token 时的输出（全对）。停止 token 是被接受的一串猜测里中间的一个：输出停在它（包含它），
    同一步里它后面被接受的猜测和奖励 token 都扔掉，与 step02 逐步生成相同。"""
    monkeypatch.setattr(f"{step.__name__}.SPEC_MIN_ACCEPTANCE", 0.0)
    prompt = prompts16(1)[0]
    plain = generate02(tiny.model, prompt, 16, SamplingParams())
    j = next(j for j in (8, 9, 7, 13, 12, 14) if plain[j] not in plain[:j])   # 不是一串的第一个（每步 1 + 4 个）
    params = SamplingParams(stop_token_ids=(plain[j],))
    ref = generate02(tiny.model, prompt, 16, params)
    assert ref == plain[:j + 1]
    eng = step.LLMEngine(tiny.model, step.EngineConfig(num_blocks=64, block_size=4),
                         proposer=continuation({tuple(prompt): plain}, 4))
    (got,), (last,), (sizes,) = run_steps(eng, [Request(prompt, 16, params)])
    assert got == ref and last.finish_reason == "stop" and last.new_token_ids[-1] == plain[j]
    assert len(last.new_token_ids) > 1          # 停止 token 前面同一步还有被接受的猜测
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@one_arch
@pytest.mark.parametrize("step", [step09, step10], ids=["step09", "step10"])
def test_min_tokens_and_penalties_inside_accepted_speculative_runs(tiny, step, monkeypatch):
    """min_tokens：猜测里有 EOS（不带 min_tokens 时的输出），它在 min_tokens 之前被目标屏蔽，只能被拒绝；
    惩罚：猜测是带惩罚的逐步输出本身（全对），验证第 i 个位置时的次数必须包含前 i 个被接受的猜测——数错了就会拒绝、
    更正成别的 token。两种都与 step02 逐步生成逐 token 相同。"""
    monkeypatch.setattr(f"{step.__name__}.SPEC_MIN_ACCEPTANCE", 0.0)
    prompt = prompts16(2)[1]
    plain = generate02(tiny.model, prompt, 16, SamplingParams(), ignore_eos=True)
    eos = next(t for t in plain[3:8] if t not in plain[:3])              # 不带 min_tokens 时第 4–8 个里的一个当 EOS
    params = SamplingParams(min_tokens=10)
    ref = generate02(tiny.model, prompt, 16, params, [eos])
    assert eos not in ref[:10] and ref != plain[:len(ref)]
    eng = step.LLMEngine(tiny.model, step.EngineConfig(num_blocks=64, block_size=4), eos_ids=[eos],
                         proposer=continuation({tuple(prompt): plain}, 4))
    (got,), _, _ = run_steps(eng, [Request(prompt, 16, params)])
    assert got == ref

    penal = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2)
    ref = generate02(tiny.model, prompt, 16, penal, ignore_eos=True)
    eng = step.LLMEngine(tiny.model, step.EngineConfig(num_blocks=64, block_size=4),
                         proposer=continuation({tuple(prompt): ref}, 4))
    (got,), _, (sizes,) = run_steps(eng, [Request(prompt, 16, penal, ignore_eos=True)])
    assert got == ref
    assert max(sizes) == 5 and eng.spec_stats.accepted == eng.spec_stats.proposed > 0   # 每个猜测都被接受


# ---------------------------------------------------------------- 停止字符串与 min_tokens（vLLM 的规则）

def stop_by_definition(tokenizer, ids: list[int], stops, min_tokens: int) -> tuple[int | None, int | None]:
    """定义，只用整段解码：前 n 个 token 带来的文本 = 前 n' 个的整段解码，n' ≤ n 是解码不以半个字（U+FFFD）结尾的
    最大的那个。停止串要结束在前 min_tokens 个 token 带来的文本之后才算。第一个带来了这样一个停止串的结尾的 token 是
    第 n 个：输出停在它（含它），文本截在这些停止串里开头最早的那个之前。返回 (n, 截断处)；没有时 (None, None)。"""
    done = [0]                                           # 前 n 个 token 带来的字符数
    for n in range(1, len(ids) + 1):
        t = tokenizer.decode(ids[:n])
        done.append(done[-1] if t.endswith("\ufffd") else len(t))
    text = tokenizer.decode(ids)
    for n in range(min_tokens + 1, len(ids) + 1):
        starts = [i for s in stops for i in range(len(text))
                  if text.startswith(s, i) and done[n - 1] < i + len(s) <= done[n]]
        if starts:
            return n, min(starts)
    return None, None


def letter_stop_requests(model) -> tuple[list[int], list[Request]]:
    """字母分词器（token i → 第 i % 26 个字母）下的贪心输出里，字母 c 出现在第 p 个和第 q 个 token（p + 1 < q）。
    请求：min_tokens = p − 1（c 结束在之后：停在 p）、p（正好结束在第 min_tokens 个 token：不算）、q − 1（结束在前
    min_tokens 个里：不算），后两个都接着停在 q；再加一个跨过边界的两字母停止串（开头在前、结尾在后：算）。"""
    letters = CharTokenizer()
    for prompt in prompts16(8):
        plain = generate02(model, prompt, 16, SamplingParams(), ignore_eos=True)
        text = letters.decode(plain)
        for p in range(2, 15):
            q = text.find(text[p - 1], p) + 1          # 第 p 个之后 c 下一次出现在第几个 token（没有：0）
            if q > p + 1:
                c = text[p - 1]
                cases = [((c,), p - 1), ((c,), p), ((c,), q - 1), ((text[p - 1:p + 1],), p)]
                return plain, [Request(prompt, 16, SamplingParams(min_tokens=m), ignore_eos=True, stop=s)
                               for s, m in cases]
    raise AssertionError("no greedy output repeats a letter")


@one_arch
@pytest.mark.parametrize("name", ["step02", *ENGINES])
def test_stop_strings_that_end_before_min_tokens_do_not_count(tiny, name):
    """每一步的引擎与定义相同；前 min_tokens 个 token 里结束的停止串（包括正好结束在第 min_tokens 个的）不停，
    输出越过 min_tokens、停在后面那次（旧的做法在 min_tokens 处把整段输出重新解码、找到前面那次，恰好停在 min_tokens）。"""
    letters = CharTokenizer()
    plain, reqs = letter_stop_requests(tiny.model)
    expect = []
    for r in reqs:
        n, _ = stop_by_definition(letters, plain, r.stop, r.params.min_tokens)
        expect.append(plain[:n] if n else plain)
    p, q = reqs[1].params.min_tokens, reqs[2].params.min_tokens + 1
    assert [len(e) for e in expect] == [p, q, q, p + 1]
    run = step02_reference if name == "step02" else ENGINES[name]
    assert run(tiny.model, reqs, [], letters) == expect


TEXTS = ["长城是中国古代的军事防御工程，全长两万多公里。Emoji 😀🎉 也是多字节。",
         "The cat sat on the mat, then the cat sat on the hat.\n\n猫坐在垫子上，猫又坐在帽子上。"]


def test_stop_strings_and_min_tokens_by_definition(tok):
    """真实分词器（一个汉字、emoji 切成几个 token）、随机的停止串与 min_tokens：step02 的 completes_stop_string
    （离线的引擎都用它）停在定义给出的 token；服务器的增量解码器发出的文本截在定义给出的地方，
    一个一个 push 与一次 push 几个相同。"""
    rng = random.Random(0)
    earlier = 0
    for _ in range(300):
        ids = tok.hf(rng.choice(TEXTS), add_special_tokens=False).input_ids
        text = tok.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text))
            stops.append(text[i:i + rng.randint(1, 4)])
        m = rng.randrange(len(ids))
        n, cut = stop_by_definition(tok, ids, stops, m)
        earlier += any(s in tok.decode(ids[:m]) for s in stops)   # 有停止串结束在前 min_tokens 个 token 里
        assert next((k for k in range(1, len(ids) + 1) if completes_stop_string(tok, ids[:k], stops, m)), None) == n
        for chunk in (1, 3):
            det, sent = IncrementalDetokenizer(tok, stops, m), ""
            for i in range(0, len(ids), chunk):
                sent += det.push(ids[i:i + chunk])
                if det.stopped:
                    break
            else:
                sent += det.finish()
            assert sent == (text if n is None else text[:cut]), (stops, m, chunk)
    assert earlier > 50


# ---------------------------------------------------------------- 真实的 openai 客户端经过服务器

@pytest.fixture(scope="module")
def served(tiny_tok_dir):
    """step10 的引擎（服务器默认的那个）+ 随机小模型 + 真实分词器；参照是同样建出来的另一个引擎直接生成。"""
    from test_step11_serving import Served, real_engine
    session = open_session(str(tiny_tok_dir), "cpu", "float32")
    s = Served(real_engine("step10", session), session.tok)
    yield s, session, lambda: real_engine("step10", session)
    s.stop()


def ask(server, ids, stream: bool, **kw):
    """completions（token id 的提示词）→ (文本, token id, finish_reason)；流式时把 chunk 拼起来。"""
    from test_step11_serving import MODEL
    client = server.client()
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    r = client.completions.create(model=MODEL, prompt=ids, stream=stream, extra_body=extra, **kw)
    if not stream:
        c = r.choices[0]
        return c.text, c.token_ids, c.finish_reason
    text, tokens, reason = "", [], None
    for chunk in r:
        for c in chunk.choices:
            text += c.text
            tokens += getattr(c, "token_ids", None) or []
            reason = c.finish_reason or reason
    return text, tokens, reason


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_openai_client_penalties_and_logit_bias(served, stream):
    server, s, engine = served
    ids = s.tok.encode("The capital of France is")
    plain = engine().generate([Request(ids, 10, SamplingParams(), ignore_eos=True)]).outputs[0]
    for kw, params in [
        (dict(presence_penalty=1.5, frequency_penalty=0.5), SamplingParams(presence_penalty=1.5, frequency_penalty=0.5)),
        (dict(logit_bias={str(plain[2]): -100, "42": 30}), SamplingParams(logit_bias={plain[2]: -100.0, 42: 30.0})),
        (dict(temperature=0.9, seed=4, frequency_penalty=-1.0, extra_body={"repetition_penalty": 1.2}),
         SamplingParams(temperature=0.9, seed=4, frequency_penalty=-1.0, repetition_penalty=1.2)),
    ]:
        ref = engine().generate([Request(ids, 10, params, ignore_eos=True)]).outputs[0]
        extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
        temperature = kw.pop("temperature", 0)
        text, tokens, reason = ask(server, ids, stream, max_tokens=10, temperature=temperature, extra_body=extra, **kw)
        assert tokens == ref and text == s.tok.decode(ref) and reason == "length", kw
    assert ref != plain


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_openai_client_stop_token_ids_min_tokens_include_stop_str(served, stream):
    server, s, engine = served
    ids = s.tok.encode("Once upon a time")
    plain = engine().generate([Request(ids, 12, SamplingParams(), ignore_eos=True)]).outputs[0]
    j = next(j for j in range(2, 8) if plain[j] not in plain[:j] and s.tok.decode(plain[:j + 1]) != s.tok.decode(plain[:j]))
    stop = plain[j]
    base = dict(max_tokens=12, temperature=0)
    # stop_token_ids：停在它，id 在 token_ids 里，文本不在；include_stop_str_in_output 时文本也在
    text, tokens, reason = ask(server, ids, stream, **base, extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert tokens == plain[:j + 1] and reason == "stop" and text == s.tok.decode(plain[:j])
    text, tokens, reason = ask(server, ids, stream, **base, extra_body={
        "ignore_eos": True, "stop_token_ids": [stop], "include_stop_str_in_output": True})
    assert tokens == plain[:j + 1] and reason == "stop" and text == s.tok.decode(plain[:j + 1])
    # min_tokens：停止 token 在前 j + 2 个位置被屏蔽，与引擎直接生成的相同
    params = SamplingParams(min_tokens=j + 2, stop_token_ids=(stop,))
    ref = engine().generate([Request(ids, 12, params, ignore_eos=True)]).outputs[0]
    text, tokens, reason = ask(server, ids, stream, **base, extra_body={
        "ignore_eos": True, "stop_token_ids": [stop], "min_tokens": j + 2})
    assert tokens == ref and stop not in ref[:j + 2] and ref != plain[:len(ref)]
    shown = ref[:-1] if reason == "stop" else ref
    assert text == s.tok.decode(shown) and reason == ("stop" if ref[-1] == stop else "length")
    # 停止字符串：include_stop_str_in_output 时文本到它的末尾为止；min_tokens 之前它不算
    full_text = s.tok.decode(plain)
    # 停止串：文本中段的 3 个字符（不含替换符、不全是空白）；cut = 它第一次出现的位置
    at = next(i for i in range(len(full_text) // 3, len(full_text) - 3)
              if "\ufffd" not in full_text[i:i + 3] and full_text[i:i + 3].strip())
    stop_str = full_text[at:at + 3]
    cut = full_text.index(stop_str)
    text, _, reason = ask(server, ids, stream, **base, stop=[stop_str], extra_body={"ignore_eos": True})
    assert text == full_text[:cut] and reason == "stop"
    text, _, reason = ask(server, ids, stream, **base, stop=[stop_str],
                          extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert text == full_text[:cut + len(stop_str)] and reason == "stop"
    # 停止串与 min_tokens：字符 c 第一次出现在第 p 个 token 的文本里。min_tokens p − 1 时停在它；p（正好结束在
    # 第 min_tokens 个 token）与 q − 1（结束在前 min_tokens 个里）时不算，接着停在第 q 个 token 里的 c。
    # token 与离线引擎自己判断停止串时相同，文本与定义相同
    def token_of(i: int) -> int:   # 第 i 个字符由第几个 token 带来（定义同 stop_by_definition）
        return next(n for n in range(1, len(plain) + 1)
                    if not s.tok.decode(plain[:n]).endswith("\ufffd") and len(s.tok.decode(plain[:n])) > i)
    c, p, q = next((c, token_of(i), token_of(j)) for i, c in enumerate(full_text) if c != "\ufffd"
                   for j in [full_text.find(c, i + 1)] if j > 0 and token_of(j) > token_of(i) + 1)
    for m in (p - 1, p, q - 1):
        n, cut = stop_by_definition(s.tok, plain, [c], m)
        assert n == (p if m < p else q)
        ref = engine().generate([Request(ids, 12, SamplingParams(min_tokens=m), ignore_eos=True, stop=(c,))]).outputs[0]
        text, tokens, reason = ask(server, ids, stream, **base, stop=[c], extra_body={"ignore_eos": True, "min_tokens": m})
        assert tokens == ref == plain[:n] and text == full_text[:cut] and reason == "stop", m


def test_openai_client_bad_values_are_400_naming_the_field(served):
    server, s, _ = served
    from test_step11_serving import MODEL
    client = server.client()
    kw = dict(model=MODEL, prompt="hi", max_tokens=4)
    for extra, field in [
        (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(logit_bias={"5": 101}), "logit_bias"), (dict(logit_bias={"999999": 1}), "logit_bias"),
        (dict(extra_body={"stop_token_ids": [10**7]}), "stop_token_ids"), (dict(extra_body={"min_tokens": -1}), "min_tokens"),
        (dict(extra_body={"min_tokens": 5}), "min_tokens"),                      # 大于 max_tokens
        (dict(extra_body={"include_stop_str_in_output": 1}), "include_stop_str_in_output"),
    ]:
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(**kw, **extra)
    server.wait_idle()
    assert server.pool_is_free()


def test_a_huge_temperature_keeps_masked_tokens_masked():
    """T = 1e300 在 float32 里是 inf，被 min_tokens 屏蔽的 -inf 除以它是 NaN（hypothesis 找到的）：
    截到 float32 的最大有限值以后，屏蔽的仍是 -inf，其余趋于均匀。"""
    p = SamplingParams(temperature=1e300, min_tokens=3, stop_token_ids=(0,))
    out = process_logits(torch.tensor([0.0, 6.0, 1.0]), [1], [1, 1], p)
    assert out[0] == -math.inf and torch.isfinite(out[1:]).all()
