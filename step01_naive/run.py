"""step01_naive：朴素生成 —— 先证明与 HF transformers 的贪心 generate 逐 token 一致，再测 O(n²) 的代价。

    python step01_naive/run.py [--quick] [--json]                        # 章节模式：检查 + 基准
    python step01_naive/run.py --prompt "你好" --max-new-tokens 16        # 生成模式
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import cli  # noqa: E402
from common.bench import machine, median_time, table  # noqa: E402
from common.compare import MARGIN_TOL, compare  # noqa: E402
from common.hf_reference import hf_greedy, hf_logits, load_hf_model  # noqa: E402
from common.prompts import CHAPTER_PROMPTS  # noqa: E402
from step01_naive.engine import generate  # noqa: E402

STEP = "step01_naive"
CHECK_NEW_TOKENS = 32


def chapter(args, s: cli.Session) -> bool:
    # 1) 正确性：与 HF transformers 的贪心 generate 逐 token 比较
    hf = load_hf_model(s.path, s.device, s.dtype)
    tol = MARGIN_TOL[s.dtype]
    checks, notes = {}, []
    for name, text, chat in CHAPTER_PROMPTS:
        ids = s.encode(text, chat, CHECK_NEW_TOKENS)
        ref = hf_greedy(hf, ids, CHECK_NEW_TOKENS, s.tok.eos_ids)
        got = generate(s.model, ids, CHECK_NEW_TOKENS, s.tok.eos_ids)
        c = compare(name, ids, ref, got, lambda t: hf_logits(hf, t), tol)
        checks[f"equals_hf_generate_{name}"] = c.ok
        notes.append(c.describe())
        print(f"[{name}] {s.tok.decode(got)!r}")
    del hf

    # 2) 基准：生成 N 个 token 的总时间随 N 的增长（每步整段重算 → 总时间 ≈ O(N²)）
    lengths = [8, 16, 32, 64] if args.quick else [16, 32, 64, 128, 256]
    repeats = 1 if args.quick else 3
    ids = s.encode(CHAPTER_PROMPTS[0][1], False, max(lengths))
    rows, prev, totals = [], None, {}
    for n in lengths:
        t = median_time(lambda: generate(s.model, ids, n, ignore_eos=True), repeats=repeats, warmup=1, device=s.device)
        totals[n] = t
        rows.append([n, f"{t:.2f}", f"{t / n * 1000:.1f}", f"{t / prev:.2f}×" if prev else "-"])
        prev = t
    print(f"\n机器: {machine()}；模型 {s.path.name}，{s.device}/{s.dtype_name}，提示词 {len(ids)} tokens，"
          f"每个长度取 {repeats} 次的中位数")
    print(table(["新 token 数 N", "总时间 (s)", "平均每 token (ms)", "总时间 / 上一行"], rows))
    print("N 翻倍时总时间远超 2 倍：每一步都在重算越来越长的整段序列。")

    cli.print_checks(checks, notes)
    n = max(lengths)
    figures = {"tok_per_s": round(n / totals[n], 3), "largest_new_tokens": n}
    if args.json:
        cli.emit_json(cli.chapter_json(STEP, s, checks, figures))
    return all(checks.values())


def main(args) -> bool:
    s = cli.load_session(args, sliding_window=True)   # 每步整段重算、不用缓存：滑动窗口在模型的掩码里，算得对
    if args.prompt is None:
        return chapter(args, s)
    # 先编码、检查全部提示词，任何一个有错都在开始生成前报告（不丢掉进行中的工作）
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]
    outputs = [generate(s.model, ids, args.max_new_tokens, s.tok.eos_ids, args.ignore_eos) for ids in prompt_ids]
    cli.print_generations(s, args.prompt, outputs)
    if args.json:
        cli.emit_json(cli.generation_json(s, args.prompt, prompt_ids, outputs))
    return True


if __name__ == "__main__":
    cli.run_main(cli.make_parser(__doc__.splitlines()[0]), main)
