"""step02_sampling：采样器（对照 HF transformers 的 logits 处理器）、种子、抽样分布、停止条件、run.py。"""
import json
import math

import pytest
import torch
from conftest import ROOT, accepted_sampling_params, one_arch, run_py
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import TopPLogitsWarper

from common import cli
from common.compare import MARGIN_TOL, compare
from common.errors import UserError
from common.hf_reference import load_hf_model
from common.prompts import CHAPTER_PROMPTS
from step01_naive.engine import generate as generate_step01
from step02_sampling import run as step02_run
from step02_sampling import worked_example
from step02_sampling.distribution import (binned, empirical_probs, hf_filtered_probs, top_bins, tv_bound,
                                          tv_distance)
from step02_sampling.engine import generate
from step02_sampling.sampler import (TOP_P_FIRST_K, SamplingParams, adjust_logits, apply_min_p,
                                     apply_repetition_penalty, apply_temperature, apply_top_k, apply_top_p, draw,
                                     draw_margin, make_generator, process_logits, sample)

NEG_INF = float("-inf")


# ---------------------------------------------------------------- 参数检查

@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("top_k", -1), ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan),
    ("min_p", -0.01), ("min_p", 1.5), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("seed", -1),
])
def test_validate_rejects(field, value):
    with pytest.raises(UserError):
        SamplingParams(**{field: value}).validate()


# (字段, 边界上的合法值, 紧挨着它的非法值)：把 <= 写成 <（或反过来）的差一错误，两个方向都会被抓住
BOUNDARIES = [
    ("temperature", 0.0, -1e-9), ("top_k", 0, -1), ("top_p", 1.0, 1.0 + 1e-9), ("top_p", 1e-9, 0.0),
    ("min_p", 0.0, -1e-9), ("min_p", 1.0, 1.0 + 1e-9), ("repetition_penalty", 1e-9, 0.0),
    ("seed", 0, -1), ("seed", 2**63 - 1, 2**63),
]


@pytest.mark.parametrize("field, ok, bad", BOUNDARIES, ids=[f"{f}={ok}" for f, ok, _ in BOUNDARIES])
def test_validate_boundary_is_exact(field, ok, bad):
    SamplingParams(**{field: ok}).validate()
    with pytest.raises(UserError, match=field):
        SamplingParams(**{field: bad}).validate()


def test_greedy_property():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=1.5, top_k=1).greedy
    assert not SamplingParams(temperature=0.1).greedy
    assert not SamplingParams(temperature=1.0, top_k=2).greedy


# ---------------------------------------------------------------- 过滤器：对照 HF 的处理器

def random_logits(seed: int, vocab: int = 2000) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * 3   # (V,)：×3 让分布有高有低，过滤器才有事可做


FILTER_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=0.6, top_p=0.95),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=2.0, min_p=0.3),
    SamplingParams(temperature=1.0, min_p=1.0),
    SamplingParams(temperature=1.0, repetition_penalty=1.5),
    SamplingParams(temperature=1.0, repetition_penalty=0.7),
    SamplingParams(temperature=0.8, top_k=100, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
    SamplingParams(temperature=1.7, top_k=30, top_p=0.7, min_p=0.1, repetition_penalty=2.0),
]


@pytest.mark.parametrize("params", FILTER_CASES, ids=repr)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_process_logits_matches_hf_processors(params, seed):
    logits = random_logits(seed)
    history = torch.randint(0, len(logits), (40,), generator=torch.Generator().manual_seed(seed)).tolist()
    ours = process_logits(logits, history, [], params).softmax(-1)
    ref = hf_filtered_probs(logits, history, [], params)
    assert torch.equal(ours > 0, ref > 0), "保留的 token 集合与 HF 不同"
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-7)


def test_top_k_keeps_exactly_k_and_ties():
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, -1.0])
    assert (apply_top_k(logits, 1) > NEG_INF).tolist() == [True, False, False, False, False]
    # 第 2 名与第 3 名并列：两个都保留（同 HF），所以 k=2 保留 3 个
    assert (apply_top_k(logits, 2) > NEG_INF).tolist() == [True, False, True, True, False]
    assert torch.equal(apply_top_k(logits, 0), logits) and torch.equal(apply_top_k(logits, 99), logits)


def test_top_p_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    keep = lambda p: (apply_top_p(logits, p) > NEG_INF).tolist()  # noqa: E731
    assert keep(0.45) == [True, False, False, False]     # 第一个就够 0.45
    assert keep(0.51) == [True, True, False, False]
    assert keep(0.9) == [True, True, True, False]        # 0.5 + 0.3 = 0.8 < 0.9 → 还要第三个
    assert keep(1e-9) == [True, False, False, False]     # 最大的那个永远保留
    assert torch.equal(apply_top_p(logits, 1.0), logits)


def test_top_p_grows_beyond_first_topk():
    """分布很平时核心集合远大于 apply_top_p 先看的前 TOP_P_FIRST_K 名：k 要放大几次，结果仍与 HF（整表排序）相同。"""
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 0.1   # (V,)：几乎均匀
    ours = apply_top_p(logits, 0.9)
    ref = TopPLogitsWarper(0.9)(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]
    assert int((ours > NEG_INF).sum()) > 4 * TOP_P_FIRST_K
    assert torch.equal(ours > NEG_INF, ref > NEG_INF)


def test_min_p_scales_with_top_probability():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert (apply_min_p(logits, 0.2) > NEG_INF).tolist() == [True, True, True, False]   # 门槛 0.1
    assert (apply_min_p(logits, 0.7) > NEG_INF).tolist() == [True, False, False, False]  # 门槛 0.35
    assert torch.equal(apply_min_p(logits, 0.0), logits)


def test_repetition_penalty_definition():
    logits = torch.tensor([2.0, -2.0, 0.0, 4.0, -1.0])
    out = apply_repetition_penalty(logits, [0, 1, 2, 0, 0], 2.0)   # token 0 出现 3 次，也只罚一次
    assert out.tolist() == [1.0, -4.0, 0.0, 4.0, -1.0]
    assert logits.tolist() == [2.0, -2.0, 0.0, 4.0, -1.0]          # 不修改输入
    assert apply_repetition_penalty(logits, [3], 0.5).tolist() == [2.0, -2.0, 0.0, 8.0, -1.0]   # < 1 是奖励


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, -2.0])
    assert apply_temperature(logits, 0.5).tolist() == [2.0, -4.0]


def test_worked_example_tables_are_in_the_chapter():
    """章节里的算例表格必须是 worked_example.py 用 sampler.py 真算出来的（防止文档与代码脱节）。"""
    chapter = (ROOT / "docs" / "02_sampling.md").read_text(encoding="utf-8")
    for t in worked_example.tables():
        assert "\n".join(t) in chapter


# ---------------------------------------------------------------- 抽样：随机性只来自自己的 generator

@pytest.mark.parametrize("params", [p for p in FILTER_CASES if not p.greedy], ids=repr)
def test_sample_is_inverse_cdf_draw_from_hf_distribution(params):
    """sample() 对照不是我们写的参考：分布取 HF 处理器链的结果，用 float64 累加成 cdf；每次 sample() 恰好消耗发生器的
    一个 u ~ U[0, 1)（用同一种子的第二个发生器重放出来），抽到的 token 必须是 u 落在其区间 [cdf[t-1], cdf[t]) 的那个。
    过滤错了、顺序错了、抽样偏了一位、多耗或少耗了随机数，都会在某一次对不上。
    （下面的抽样分布检验直接在 process_logits 的分布上 draw：这个测试保证那就是 sample() 抽样的分布。）"""
    logits, history = random_logits(7), [1, 2, 3, 3]
    ref = hf_filtered_probs(logits, history, [], params).double()     # (V,)
    cdf = ref.cumsum(-1) / ref.sum()                               # (V,)
    g, replay = make_generator(11, "cpu"), make_generator(11, "cpu")
    for _ in range(200):
        tok = sample(logits, history, [], params, g)
        u = float(torch.rand((), generator=replay))
        lo, hi = (float(cdf[tok - 1]) if tok else 0.0), float(cdf[tok])
        assert ref[tok] > 0 and lo - 1e-6 <= u < hi + 1e-6, (tok, u, lo, hi)


def test_greedy_consumes_no_randomness():
    g = make_generator(3, "cpu")
    before = g.get_state()
    logits = random_logits(0)
    assert sample(logits, [5], [], SamplingParams(temperature=0.0, repetition_penalty=1.3), g) == int(
        apply_repetition_penalty(logits, [5], 1.3).argmax())
    assert sample(logits, [], [], SamplingParams(temperature=5.0, top_k=1), g) == int(logits.argmax())
    assert torch.equal(g.get_state(), before)


def test_generator_seed_reproducible_and_independent_of_global_rng():
    logits, params = random_logits(1), SamplingParams(temperature=1.0)
    a = [sample(logits, [], [], params, g) for g in [make_generator(42, "cpu")] for _ in range(30)]
    torch.manual_seed(123)
    torch.rand(10)                                            # 动一下全局随机数：不应影响结果
    b = [sample(logits, [], [], params, g) for g in [make_generator(42, "cpu")] for _ in range(30)]
    c = [sample(logits, [], [], params, g) for g in [make_generator(43, "cpu")] for _ in range(30)]
    assert a == b and a != c


def test_draw_never_picks_zero_probability_tokens():
    probs = torch.zeros(1000)
    probs[[3, 500, 999]] = torch.tensor([0.2, 0.5, 0.3])
    g = make_generator(0, "cpu")
    assert {draw(probs, g) for _ in range(3000)} == {3, 500, 999}


# ---------------------------------------------------------------- 抽样分布：真实模型的下一 token 分布

@pytest.fixture(scope="module")
def prefix_logits(real):
    return step02_run.distribution_prefix(real)   # (提示词, 已生成, logits (V,))：与 run.py 的检查 (c) 相同


def binned_tv(p, theory):
    bins = top_bins(theory)
    return tv_distance(binned(p, bins), binned(theory, bins)), tv_bound(binned(theory, bins), step02_run.DRAWS)


@pytest.mark.parametrize("name, params", step02_run.DIST_CASES, ids=[n for n, _ in step02_run.DIST_CASES])
def test_draws_match_theoretical_distribution(prefix_logits, name, params):
    prompt, output, logits = prefix_logits
    theory = hf_filtered_probs(logits, prompt, output, params)
    probs = process_logits(logits, prompt, output, params).softmax(-1)
    g = make_generator(2024, "cpu")
    draws = [draw(probs, g) for _ in range(step02_run.DRAWS)]
    tv, bound = binned_tv(empirical_probs(draws, len(theory)), theory)
    assert tv < bound, f"{name}: TV {tv:.4f} >= bound {bound:.4f}"
    assert all(theory[d] > 0 for d in draws), f"{name}: drew a token outside the allowed set"


# 同样的上界能抓住错误的实现吗？对每种策略构造一个典型的错误实现，算它的分布与理论分布的（分组）TV。
# 在 SmolLM2-135M-Instruct、前缀 "The three primary colors are" 上（本机算出；上界约 0.06–0.08）：
#   temperature 0.7 → 忘了除以温度             TV ≈ 0.34
#   top-k 10        → 忘了截断                 TV ≈ 0.54
#   top-p 0.8       → 先 top-p 再温度（顺序错）TV ≈ 0.18
#   min-p 0.1       → 用绝对门槛 p ≥ 0.1       TV ≈ 0.61
#   combined        → 忘了重复惩罚             TV ≈ 0.51
#   penalties       → 忘了 presence/frequency  TV ≈ 0.40（只忘了偏置 ≈ 0.02：抽样看不出，逐元素对照抓住它）
# 这些都远大于上界：抽样检验会失败。组合里的顺序错误（先 top-p 再 top-k、温度放到最后……）只有上界的 1.2–2.6 倍，
# 更细的错误（比如 top-p 多留一个边界 token）抽样根本看不出：它们由逐元素对照 HF 的测试抓住。
WRONG = {
    "temperature": lambda z, p, o: apply_temperature(z, 1.0),
    "top_k": lambda z, p, o: apply_temperature(z, 1.0),
    "top_p": lambda z, p, o: apply_temperature(apply_top_p(z, 0.8), 0.7),
    "min_p": lambda z, p, o: z.masked_fill(z.softmax(-1) < 0.1, NEG_INF),
    "combined": lambda z, p, o: process_logits(z, p, o, SamplingParams(temperature=0.8, top_k=40, top_p=0.7, min_p=0.05)),
    "penalties": lambda z, p, o: process_logits(z, p, o, SamplingParams(temperature=0.7, logit_bias={0: 10.0})),
}


@pytest.mark.parametrize("name, params", step02_run.DIST_CASES, ids=[n for n, _ in step02_run.DIST_CASES])
def test_tv_bound_catches_wrong_filter(prefix_logits, name, params):
    prompt, output, logits = prefix_logits
    theory = hf_filtered_probs(logits, prompt, output, params)
    wrong = WRONG[name](logits, prompt, output).softmax(-1)
    tv, bound = binned_tv(wrong, theory)
    assert tv > 2 * bound, f"{name}: a wrong filter gives TV {tv:.4f}, too close to bound {bound:.4f}"


def test_processing_order_matches_hf_generate(real):
    """顺序的参考是 HF generate 本身：output_scores 给出它处理后的分数，output_logits 给出原始 logits。
    把我们的 process_logits 作用在同一份原始 logits 上，结果必须与 HF 处理后的一致。"""
    hf = load_hf_model(real.path, "cpu", torch.float32)
    ids = real.encode(CHAPTER_PROMPTS[0][1])
    for params in (SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
                   SamplingParams(temperature=1.5, top_k=200, top_p=0.6, min_p=0.02, repetition_penalty=1.2)):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              do_sample=True, max_new_tokens=1, temperature=params.temperature, top_k=params.top_k,
                              top_p=params.top_p, min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                              output_scores=True, output_logits=True, return_dict_in_generate=True,
                              pad_token_id=real.tok.eos_ids[0])
        raw, processed = out.logits[0][0], out.scores[0][0]           # (V,) 各一份
        ours = process_logits(raw, ids, [], params)
        assert torch.equal(ours > NEG_INF, processed > NEG_INF)
        torch.testing.assert_close(ours.softmax(-1), processed.softmax(-1), rtol=1e-5, atol=1e-7)


def test_chapter_checks_c_d_b(real, monkeypatch):
    """run.py 章节模式的 (b)(c)(d) 检查在真实模型上全部通过（(a) 由下面的逐 token 测试覆盖）。
    (b) 只生成 8 个 token（章节模式 16 个）：同一个检查，step02 每步整段重算，token 少一半就快一半。"""
    monkeypatch.setattr(step02_run, "SEED_NEW_TOKENS", 8)
    checks = {}
    step02_run.check_distributions(real, checks)
    step02_run.check_repetition_penalty(real, checks)
    step02_run.check_seeds(real, checks)
    assert checks and all(checks.values()), checks


# ---------------------------------------------------------------- 引擎：贪心 = step01；种子；停止条件

@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=2.0, top_k=1, seed=5)], ids=repr)
@one_arch
def test_greedy_equals_step01_tiny(tiny, params):
    prompt = [0, 17, 42, 99, 3]
    assert generate(tiny.model, prompt, 24, params) == generate_step01(tiny.model, prompt, 24)


@one_arch
def test_seeded_generation_tiny(tiny):
    prompt, params = [0, 5, 6], SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    a = generate(tiny.model, prompt, 16, params)
    assert a == generate(tiny.model, prompt, 16, params)
    assert a != generate(tiny.model, prompt, 16, SamplingParams(temperature=1.0, top_p=0.95, seed=12))


@one_arch
def test_eos_stops_and_is_kept_tiny(tiny):
    prompt = [0, 9, 8, 7]
    full = generate(tiny.model, prompt, 12, SamplingParams())
    eos = full[4]
    first = full.index(eos)                                            # EOS 第一次出现的位置
    assert generate(tiny.model, prompt, 12, SamplingParams(), eos_ids=[eos]) == full[:first + 1]
    assert generate(tiny.model, prompt, 12, SamplingParams(), eos_ids=[eos], ignore_eos=True) == full


def test_stop_strings_real(real):
    ids = real.encode("The days of the week are Monday,")
    full = generate(real.model, ids, 10, SamplingParams(), ignore_eos=True)   # 停止串取自前 8 个：10 个够了
    # 停止字符串取前 8 个 token 解码结果的末尾 6 个字符（通常跨 token）；它第一次完整出现在第 n 个 token
    stop = real.tok.decode(full[:8])[-6:]
    n = next(i for i in range(1, len(full) + 1) if stop in real.tok.decode(full[:i]))
    got = generate(real.model, ids, 10, SamplingParams(), stop_strings=["@@@", stop], tokenizer=real.tok)
    assert got == full[:n]                                             # 停在补全它的 token，并且保留这个 token
    assert stop in real.tok.decode(got) and stop not in real.tok.decode(got[:-1])
    # 只在新生成的文本里找：只出现在提示词里的串不会让生成停下
    assert "week are" not in real.tok.decode(full)
    assert generate(real.model, ids, 10, SamplingParams(), ignore_eos=True, stop_strings=["week are"],
                    tokenizer=real.tok) == full
    with pytest.raises(ValueError):
        generate(real.model, ids, 4, SamplingParams(), stop_strings=["x"])


def test_greedy_equals_step01_real_prompts(real):
    """--temperature 0 与 --top-k 1 对任意提示词都等于 step01（这里两个章节外的提示词）。"""
    for text, chat in (("Water boils at", False), ("Name three fruits.", True)):
        ids = real.encode(text, chat, 8)
        ref = generate_step01(real.model, ids, 8, real.tok.eos_ids)
        assert generate(real.model, ids, 8, SamplingParams(), real.tok.eos_ids) == ref
        assert generate(real.model, ids, 8, SamplingParams(temperature=0.7, top_k=1), real.tok.eos_ids) == ref


# ---------------------------------------------------------------- run.py

def gen_json(*args, subprocess_: bool = False) -> dict:
    r = run_py("step02_sampling", *args, "--json", subprocess_=subprocess_)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_run_py_greedy_equals_step01(real):
    prompt = "My favourite food is"
    out = gen_json("--prompt", prompt, "--max-new-tokens", "8", "--temperature", "0", "--ignore-eos")
    res = out["results"][0]
    assert res["prompt_ids"] == real.encode(prompt)
    assert res["output_ids"] == generate_step01(real.model, res["prompt_ids"], 8, ignore_eos=True)
    assert res["text"] == real.tok.decode(res["output_ids"])


def test_run_py_seed_reproducible_across_processes(real):
    """另一个进程与本进程、同一个种子 → 相同的 output_ids，也等于本进程里直接调用引擎的结果。"""
    args = ("--prompt", "Once upon a time", "--max-new-tokens", "8", "--ignore-eos",
            "--temperature", "1.2", "--top-p", "0.95", "--seed", "7")
    a, b = gen_json(*args, subprocess_=True), gen_json(*args)
    assert a["results"][0]["output_ids"] == b["results"][0]["output_ids"]
    ids = a["results"][0]["prompt_ids"]
    here = generate(real.model, ids, 8, SamplingParams(temperature=1.2, top_p=0.95, seed=7), ignore_eos=True)
    assert a["results"][0]["output_ids"] == here


BAD_ARGS = [
    ["--temperature", "-1"], ["--temperature", "nan"], ["--top-p", "0"], ["--top-p", "1.5"], ["--top-k", "-1"],
    ["--min-p", "-0.1"], ["--min-p", "2"], ["--repetition-penalty", "0"], ["--temperature", "abc"],
    ["--stop", ""], ["--seed", "-3"],
    # 合法范围的另一侧（极端但合法的取值在 test_prepare_and_errors 的 test_run_py_extreme_sampling_values）
    ["--temperature", "inf"], ["--repetition-penalty", "inf"], ["--repetition-penalty", "nan"],
    ["--repetition-penalty", "-1e-40"], ["--top-p", "nan"], ["--top-p", "-1e-30"], ["--min-p", "nan"],
    ["--presence-penalty", "2.5"], ["--frequency-penalty", "nan"], ["--frequency-penalty", "-inf"], ["--min-tokens", "-1"],
    ["--stop-token-id", "-3"], ["--min-tokens", "1.5"],
]


@pytest.mark.parametrize("bad", BAD_ARGS, ids=" ".join)
def test_bad_values_error_exit_2(bad, capsys):
    """在进程内跑 run.py 的 main：取值检查发生在加载模型之前，所以很快。"""
    with pytest.raises(SystemExit) as e:
        cli.run_main(step02_run.make_parser(), step02_run.main, ["--prompt", "hi", *bad])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- 带种子采样的"近乎打平"（common.compare 用）

def test_draw_margin_is_distance_of_replayed_draw_to_interval_edge():
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    g = make_generator(params.seed, "cpu")
    tokens = [sample(logits, [], [], params, g) for _ in range(5)]      # 同一分布连抽 5 次
    assert draw_margin(SamplingParams()) is None                    # 贪心：用默认的 top-2 logit 差
    margin = draw_margin(params)
    cdf = logits.softmax(-1).cumsum(-1)
    g = make_generator(params.seed, "cpu")
    for pos, tok in enumerate(tokens):
        u = float(torch.rand((), generator=g) * cdf[-1])
        lo, hi = (float(cdf[tok - 1]) if tok else 0.0), float(cdf[tok])
        assert lo <= u < hi                                          # 重放出的 u 正好落在抽到的 token 的区间里
        assert margin(logits, [], pos, tok) == pytest.approx(min(u - lo, hi - u))


def _two_token_logits_with_edge_at(edge: float) -> torch.Tensor:
    """两个 token 的分布，累计分布的边界在 edge：token 0 的概率 = edge。"""
    return torch.tensor([edge, 1 - edge]).log()


@pytest.mark.parametrize("offset, accepted", [(1e-7, True), (-1e-7, True), (0.05, False), (-0.05, False)])
def test_compare_accepts_sampled_divergence_only_at_an_interval_edge(offset, accepted):
    """参考在位置 2 抽到的随机数 u 离区间边界 |offset|：只有贴着边界（< 1e-3）时，抽到另一个 token 才被接受。"""
    params = SamplingParams(temperature=1.0, seed=3)
    g = make_generator(params.seed, "cpu")
    u = [float(torch.rand((), generator=g)) for _ in range(3)][2]
    logits = _two_token_logits_with_edge_at(u + offset)             # offset > 0：u 在 token 0 的区间里
    ref_tok = 0 if offset > 0 else 1
    ref, got = [5, 6, ref_tok, 7], [5, 6, 1 - ref_tok, 8]
    c = compare("edge", [1, 2], ref, got, lambda ids: logits.expand(len(ids), 2), MARGIN_TOL[torch.float32],
                draw_margin(params))
    assert c.position == 2 and c.ok == accepted and "draw margin" in c.describe()
    assert c.margin == pytest.approx(abs(offset), abs=1e-6)


# ---------------------------------------------------------------- 极端但合法的参数：结果有定义、有限，token 永远在词表里

SAMPLING_EPS = 1e-5   # 与 sampler.SAMPLING_EPS 相同（测试里写死：常量被改了，这里会提醒文档与 vLLM 的对照也要改）


def extreme_logits(seed: int, scale: float, vocab: int) -> torch.Tensor:
    """随机 logits (V,)：scale 0 时全部并列；取整让并列也常见。"""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, generator=g) * scale).round()


@settings(max_examples=80, deadline=None)
@given(params=accepted_sampling_params(), seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([0.0, 1.0, 3.0, 30.0, 1e4]),
       vocab=st.sampled_from([1, 2, 7, 300]))
def test_any_accepted_params_give_a_valid_token(params, seed, scale, vocab):
    """validate 接受的任何参数：sample 不抛错、token 在 [0, V)；process_logits 的分布有限、和为 1、抽到的 token 概率 > 0；
    温度低于 SAMPLING_EPS（或 top_k 1）就是贪心：等于偏置、惩罚、屏蔽之后的 argmax，不消耗随机数，分布是 argmax 上的 one-hot。"""
    params.validate()
    logits = extreme_logits(seed, scale, vocab)
    history = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
    prompt, output, eos = history[:3], history[3:], (vocab - 1,)   # 后 3 个算已生成的：惩罚与 min_tokens 都起作用
    g = make_generator(params.seed, "cpu")
    before = g.get_state()
    tok = sample(logits, prompt, output, params, g, eos)
    assert 0 <= tok < vocab
    probs = process_logits(logits, prompt, output, params, eos).softmax(-1)   # (V,)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5
    assert probs[tok] > 0
    greedy = params.temperature < SAMPLING_EPS or params.top_k == 1
    assert params.greedy == greedy
    if greedy:
        argmax = int(adjust_logits(logits, prompt, output, params, eos).argmax())
        assert tok == argmax and torch.equal(g.get_state(), before)
        assert probs[argmax] == 1
        assert draw_margin(params) is None
    else:
        margin = draw_margin(params, eos)(logits, history, 3, tok)   # history 的后 3 个是已生成的；重放第 3 次抽样
        assert math.isfinite(margin) and margin >= 0


@pytest.mark.parametrize("penalty", [1e-40, 5e-324, 1e6, 1e300])
def test_extreme_repetition_penalty_stays_finite(penalty):
    """除以 1e-40 会溢出成 inf（几个 inf 进 softmax 得 NaN）：结果夹在有限范围里，正负号不变、大小顺序不反转（夹住的可以并列）。"""
    logits = torch.tensor([2.0, -2.0, 0.0, 4.0, -1.0, 3.0])
    out = apply_repetition_penalty(logits, [0, 1, 2, 3], penalty)
    assert torch.isfinite(out).all()
    assert out[4] == -1.0 and out[5] == 3.0                         # 没出现过的不变
    if penalty < 1:                                                  # 奖励：出现过的正 logit 变得极大，负的趋向 0
        assert out[0] > 1e20 and out[3] >= out[0] and -1e-30 < out[1] <= 0 and out[2] == 0
    else:                                                            # 惩罚：正的趋向 0，负的变得极小
        assert 0 <= out[0] < 1e-5 and out[1] < -1e5 and out[2] == 0


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 9.99e-6])
def test_temperature_below_eps_is_greedy(temperature):
    params = SamplingParams(temperature=temperature, top_p=0.9, seed=1)
    assert params.greedy and draw_margin(params) is None
    logits = random_logits(3)
    assert sample(logits, [], [], params, make_generator(1, "cpu")) == int(logits.argmax())
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy      # 正好等于 SAMPLING_EPS 仍然抽样


@pytest.mark.parametrize("p", [1e-30, 5e-324])   # 5e-324 在 float32 里是 0：mass_before < p 一个也不成立
def test_top_p_tiny_keeps_the_top_token(p):
    logits = random_logits(4)
    kept = apply_top_p(logits, p) > NEG_INF
    assert kept.tolist() == (torch.arange(len(logits)) == logits.argmax()).tolist()


def test_huge_temperature_is_nearly_uniform():
    logits = random_logits(5, vocab=50)
    probs = process_logits(logits, [], [], SamplingParams(temperature=1e6)).softmax(-1)
    torch.testing.assert_close(probs, torch.full_like(probs, 1 / 50), rtol=1e-3, atol=0)


@pytest.mark.parametrize("probs", [torch.full((4,), math.nan), torch.zeros(4), torch.tensor([0.5, math.inf, 0, 0]),
                                   torch.tensor([0.5, math.nan, 0.5, 0])], ids=["nan", "zero", "inf", "one_nan"])
def test_draw_rejects_a_non_finite_or_zero_total(probs):
    """总和不是有限正数：是上游的 bug，报一个说清楚的错误，而不是返回 V（下一次前向才在 embedding 里 IndexError）。"""
    with pytest.raises(ValueError, match="draw"):
        draw(probs, make_generator(0, "cpu"))


def test_draw_u_at_the_total_picks_the_last_positive_token(monkeypatch):
    """u = r × 总和 在舍入下可能正好等于总和（r 最大是 1 - 2^-24）：searchsorted 会给出 V。
    这时应当是最后一个概率 > 0 的 token（它的区间的右端就是总和）。用 r = 1 模拟这种舍入。"""
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0))
    assert draw(torch.tensor([0.2, 0.8, 0.0, 0.0]), make_generator(0, "cpu")) == 1
    assert draw(torch.tensor([0.2, 0.3, 0.0, 0.5]), make_generator(0, "cpu")) == 3


@settings(max_examples=15, deadline=None)
@given(params=accepted_sampling_params())
@one_arch
def test_any_accepted_params_generate_valid_tokens_tiny(tiny, params):
    """同样的性质走一遍真实的生成循环（随机小模型）：每个 token 都喂回下一次前向，越界的 id 会在 embedding 里出错。"""
    out = generate(tiny.model, [0, 17, 42, 17], 4, params, ignore_eos=True)
    assert all(0 <= t < tiny.cfg.vocab_size for t in out)
    assert len(out) == 4 or (len(out) >= params.min_tokens and out[-1] in params.stop_token_ids)   # 停止 token 可以提前结束
    plain = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                           seed=params.seed)
    if params.greedy and params == plain:   # 没有偏置、惩罚、停止 token：就是 step01 的贪心
        assert out == generate_step01(tiny.model, [0, 17, 42, 17], 4, ignore_eos=True)
