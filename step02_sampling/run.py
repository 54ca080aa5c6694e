"""step02_sampling：采样器 —— 先证明贪心仍与 step01 逐 token 一致、种子可复现、抽样分布正确，再测采样的开销。

    python step02_sampling/run.py [--quick] [--json]                                   # 章节模式：检查 + 基准
    python step02_sampling/run.py --prompt "Once upon a time" --max-new-tokens 32 \\
        --temperature 0.8 --top-p 0.9 --seed 1 [--stop "." ...]                       # 生成模式
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common import cli  # noqa: E402
from common.bench import machine, median_time, table  # noqa: E402
from common.compare import MARGIN_TOL, compare  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.prompts import CHAPTER_PROMPTS  # noqa: E402
from step01_naive.engine import generate as generate_step01  # noqa: E402
from step02_sampling.distribution import (binned, empirical_probs, hf_filtered_probs, top_bins,  # noqa: E402
                                          tv_bound, tv_distance)
from step02_sampling.engine import generate  # noqa: E402
from step02_sampling.sampler import (SamplingParams, add_sampling_args, apply_repetition_penalty, draw,  # noqa: E402
                                     make_generator, params_from_args, process_logits, sample)

STEP = "step02_sampling"
CHECK_NEW_TOKENS = 24    # (a) 与 step01 比较的长度
SEED_NEW_TOKENS = 16     # (b) 种子检查的长度
DRAWS = 4000             # (c) 每种策略在固定分布上抽样的次数
# (c) 要检查的策略：都作用在真实模型对同一个前缀的下一 token 分布上
DIST_CASES = [
    ("temperature", SamplingParams(temperature=0.7)),
    ("top_k", SamplingParams(temperature=1.0, top_k=10)),
    ("top_p", SamplingParams(temperature=0.7, top_p=0.8)),
    ("min_p", SamplingParams(temperature=1.0, min_p=0.1)),
    ("combined", SamplingParams(temperature=0.8, top_k=40, top_p=0.7, min_p=0.05, repetition_penalty=1.3)),
    # OpenAI 的惩罚与偏置：已生成的那个 token（前缀里最可能的下一个）被 presence + frequency 压低 3 个单位，
    # token 0（<|endoftext|>，本来几乎不可能）被偏置抬高到约 2%
    ("penalties", SamplingParams(temperature=0.7, presence_penalty=2.0, frequency_penalty=1.0, logit_bias={0: 10.0})),
]
REPETITION_PENALTY = 1.3


def check_greedy(s: cli.Session, checks: dict, notes: list) -> None:
    """(a) temperature 0 与 top_k 1（温度随便设）都必须与 step01 的贪心输出逐 token 一致。"""
    tol = MARGIN_TOL[s.dtype]
    for name, text, chat in CHAPTER_PROMPTS:
        ids = s.encode(text, chat, CHECK_NEW_TOKENS)
        ref = generate_step01(s.model, ids, CHECK_NEW_TOKENS, s.tok.eos_ids)
        for label, params in (("temperature0", SamplingParams(temperature=0.0)),
                              ("top_k1", SamplingParams(temperature=1.3, top_k=1))):
            got = generate(s.model, ids, CHECK_NEW_TOKENS, params, s.tok.eos_ids)
            c = compare(f"{label}/{name}", ids, ref, got, s.full_logits, tol)
            checks[f"{label}_equals_step01_{name}"] = c.ok
            notes.append(c.describe())
        print(f"[{name}] {s.tok.decode(ref)!r}")


def check_seeds(s: cli.Session, checks: dict) -> None:
    """(b) 高温（1.5）下：同一种子 → 相同 token；不同种子 → 不同 token。"""
    name, text, chat = CHAPTER_PROMPTS[3]
    ids = s.encode(text, chat, SEED_NEW_TOKENS)
    runs = {seed: generate(s.model, ids, SEED_NEW_TOKENS, SamplingParams(temperature=1.5, seed=seed),
                           s.tok.eos_ids, ignore_eos=True) for seed in (1, 2)}
    again = generate(s.model, ids, SEED_NEW_TOKENS, SamplingParams(temperature=1.5, seed=1), s.tok.eos_ids,
                     ignore_eos=True)
    checks["same_seed_same_tokens"] = again == runs[1]
    checks["different_seed_different_tokens"] = runs[2] != runs[1]
    print(f"\n种子（{name}，temperature 1.5，{SEED_NEW_TOKENS} tokens）:")
    for seed, out in runs.items():
        print(f"  seed {seed}: {s.tok.decode(out)!r}")


def distribution_prefix(s: cli.Session) -> tuple[list[int], list[int], torch.Tensor]:
    """(c) 用的固定前缀：(提示词, 已生成 = [它最可能的下一个 token], logits)——假装那个 token 已经生成过一次，
    让重复惩罚与 presence/frequency 惩罚也起作用；logits = 提示词之后的下一 token logits (V,)。"""
    ids = s.encode(CHAPTER_PROMPTS[0][1])
    logits = s.full_logits(ids)[-1]                                  # (V,)
    return ids, [int(logits.argmax())], logits


def check_distributions(s: cli.Session, checks: dict) -> None:
    """(c) 在真实的下一 token 分布上：我们的过滤结果 = HF 处理器的结果；抽 DRAWS 次的经验分布与理论分布的
    TV 在上界之内；top-k / top-p / min-p 从不抽出允许集合以外的 token。"""
    prompt, output, logits = distribution_prefix(s)
    rows = []
    for i, (name, params) in enumerate(DIST_CASES):
        theory = hf_filtered_probs(logits, prompt, output, params)          # (V,)：参考（HF 的处理器）
        ours = process_logits(logits, prompt, output, params).softmax(-1)   # (V,)：sample() 抽样用的就是它
        checks[f"filter_equals_hf_{name}"] = (torch.equal(ours > 0, theory > 0)
                                              and torch.allclose(ours, theory, rtol=1e-4, atol=1e-7))
        g = make_generator(1000 + i, s.device)
        draws = [draw(ours, g) for _ in range(DRAWS)]                # 不做前向：每次只是一次抽样
        bins = top_bins(theory)
        theory_b = binned(theory, bins)
        tv = tv_distance(binned(empirical_probs(draws, len(theory)), bins), theory_b)
        bound = tv_bound(theory_b, DRAWS)
        outside = sum(1 for d in draws if theory[d] == 0)
        checks[f"draws_match_distribution_{name}"] = tv < bound
        if name not in ("temperature", "penalties"):   # 纯温度、惩罚不删 token：允许集合是整个词表
            checks[f"draws_inside_allowed_set_{name}"] = outside == 0
        shown = ", ".join(f"{k}={v}" for k, v in vars(params).items() if v != getattr(SamplingParams(), k))
        rows.append([name, shown, int((theory > 0).sum()), f"{tv:.4f}", f"{bound:.4f}", outside])
    print(f"\n抽样分布（前缀 {CHAPTER_PROMPTS[0][1]!r}，已生成 = 它最可能的下一个 token；每种抽 {DRAWS} 次；"
          f"TV 按理论概率前 50 的 token 各一组 + 其余一组计算）:")
    print(table(["策略", "参数", "保留的 token 数", "TV(经验, 理论)", "TV 上界", "允许集合外"], rows))


def check_repetition_penalty(s: cli.Session, checks: dict) -> None:
    """(d) 重复惩罚逐个元素符合定义：history 里的 token 正 logit 除以 r、负 logit 乘以 r，其余不变。"""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    ids = s.encode(CHAPTER_PROMPTS[2][1])                            # 代码提示词：有很多重复 token
    logits = s.full_logits(ids)[-1]                                  # (V,)
    order = logits.argsort()
    history = ids + order[-3:].tolist() + order[:3].tolist()         # 保证正、负 logit 都出现在 history 里
    got = apply_repetition_penalty(logits, history, REPETITION_PENALTY)
    seen = sorted(set(history))
    by_definition = logits.clone()
    for t in seen:
        v = logits[t]
        by_definition[t] = v / REPETITION_PENALTY if v > 0 else v * REPETITION_PENALTY
    hf = RepetitionPenaltyLogitsProcessor(REPETITION_PENALTY)(torch.tensor([history]), logits[None].clone())[0]
    unseen = torch.ones_like(logits, dtype=torch.bool)
    unseen[seen] = False
    signs = {bool(logits[t] > 0) for t in seen}
    checks["repetition_penalty_exact"] = (torch.equal(got, by_definition) and torch.equal(got, hf)
                                          and torch.equal(got[unseen], logits[unseen]) and signs == {True, False})
    print(f"\n重复惩罚 r={REPETITION_PENALTY}：history 含 {len(seen)} 个不同 token（正 logit "
          f"{sum(1 for t in seen if logits[t] > 0)} 个、负 logit {sum(1 for t in seen if logits[t] < 0)} 个）；"
          f"例: token {seen[0]} 的 logit {float(logits[seen[0]]):.4f} → {float(got[seen[0]]):.4f}")


def benchmark(args, s: cli.Session) -> dict:
    """采样器每个 token 的开销（sample() 在真实 logits 上的耗时中位数）对比一次前向。"""
    ids = s.encode(CHAPTER_PROMPTS[3][1], True)
    x = torch.tensor([ids], device=s.device)                         # (1, T)
    pos = torch.arange(len(ids), device=s.device)[None]              # (1, T)
    with torch.inference_mode():
        logits = s.model(x, pos, last_only=True)[0, -1]              # (V,)
        forward = median_time(lambda: s.model(x, pos, last_only=True), repeats=3 if args.quick else 10,
                              warmup=1, device=s.device)
    cases = [("贪心 (argmax)", SamplingParams()),
             ("temperature 0.8", SamplingParams(temperature=0.8)),
             ("top-k 50", SamplingParams(temperature=0.8, top_k=50)),
             ("top-p 0.9", SamplingParams(temperature=0.8, top_p=0.9)),
             ("min-p 0.05", SamplingParams(temperature=0.8, min_p=0.05)),
             ("全部组合 (+重复惩罚 1.1)", SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05,
                                                  repetition_penalty=1.1))]
    repeats = 30 if args.quick else 200
    times = {}
    for label, params in cases:
        g = make_generator(0, s.device)
        times[label] = median_time(lambda: sample(logits, ids, [], params, g), repeats=repeats, warmup=3,
                                   device=s.device)
    greedy, full = times[cases[0][0]], times[cases[-1][0]]
    rows = [[label, f"{t * 1e3:.3f}", f"{(t - greedy) * 1e3:+.3f}", f"{t / forward * 100:.2f}%"]
            for label, t in times.items()]
    # 对照：教科书式 top-p 要把整个词表排序；apply_top_p 用 topk 避开了它
    full_sort = median_time(lambda: logits.sort(descending=True), repeats=repeats, warmup=3, device=s.device)
    rows.append(["（对照）torch.sort 整个词表", f"{full_sort * 1e3:.3f}", "", f"{full_sort / forward * 100:.2f}%"])
    print(f"\n机器: {machine()}；模型 {s.path.name}，{s.device}/{s.dtype_name}；"
          f"一次前向（{len(ids)} tokens，整段重算）中位数 {forward * 1e3:.1f} ms；sample() 取 {repeats} 次的中位数")
    print(table(["策略", "sample() (ms)", "比贪心多 (ms)", "占一次前向"], rows))
    print(f"全部组合比贪心多 {(full - greedy) * 1e3:.3f} ms/token，是一次前向的 {(full - greedy) / forward:.2%}："
          f"采样只处理一个 (V,) 向量，前向要读一遍全部权重。")
    return {"sampling_overhead_ms": round((full - greedy) * 1e3, 4), "greedy_sample_ms": round(greedy * 1e3, 4),
            "full_sample_ms": round(full * 1e3, 4), "full_sort_ms": round(full_sort * 1e3, 4),
            "forward_ms": round(forward * 1e3, 3)}


def chapter(args, s: cli.Session) -> bool:
    checks, notes = {}, []
    check_greedy(s, checks, notes)              # (a)
    check_seeds(s, checks)                      # (b)
    check_distributions(s, checks)              # (c)
    check_repetition_penalty(s, checks)         # (d)
    figures = benchmark(args, s)
    cli.print_checks(checks, notes)
    if args.json:
        cli.emit_json(cli.chapter_json(STEP, s, checks, figures))
    return all(checks.values())


def main(args) -> bool:
    params = params_from_args(args)             # 先检查参数，再花时间加载模型
    stop_strings = args.stop or []
    if any(not t for t in stop_strings):
        raise UserError("--stop must not be empty")
    s = cli.load_session(args, sliding_window=True)   # 每步整段重算、不用缓存：滑动窗口在模型的掩码里，算得对
    if args.prompt is None:
        return chapter(args, s)
    # 先编码、检查全部提示词，任何一个有错都在开始生成前报告（不丢掉进行中的工作）
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]
    # 每个提示词各自从 params.seed 开始（同 vLLM 的每请求种子）：一个提示词的输出不受它前面有几个提示词影响
    outputs = [generate(s.model, ids, args.max_new_tokens, params, s.tok.eos_ids, args.ignore_eos,
                        stop_strings, s.tok) for ids in prompt_ids]
    cli.print_generations(s, args.prompt, outputs)
    if args.json:
        cli.emit_json(cli.generation_json(s, args.prompt, prompt_ids, outputs))
    return True


def make_parser():
    p = cli.make_parser(__doc__.splitlines()[0])
    add_sampling_args(p)
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="停止字符串（可重复）：新生成的文本里出现它就停（包含补全它的那个 token）")
    return p


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
