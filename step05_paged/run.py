"""step05_paged：分页 KV cache + 连续批处理 + 抢占 —— 每个请求与 step03 逐 token 一致，再与 step04 比吞吐与内存。

章节模式：同一负载跑两次（默认池子；逼出抢占的小池子，贪心与带种子的采样混跑），逐请求与 step03 单独生成比较；
再在同一负载上与 step04 静态批处理比吞吐、TTFT/TPOT、KV 浪费，以及同样 KV 预算下的并发数。

    python step05_paged/run.py [--quick] [--json]                                   # 章节模式：检查 + 基准
    python step05_paged/run.py --prompt A --prompt B --num-blocks 8 --max-new-tokens 64 --ignore-eos   # 生成模式
"""
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import cli  # noqa: E402
from common.bench import machine, table  # noqa: E402
from common.compare import MARGIN_TOL, compare  # noqa: E402
from step02_sampling.sampler import add_sampling_args, draw_margin, params_from_args  # noqa: E402
from step03_kvcache_single.engine import generate as generate_single  # noqa: E402
from step04_static_batching.engine import generate_batch  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402
from step05_paged.engine import DEFAULT_KV_MIB, PagedEngine, blocks_needed, num_blocks_for_budget  # noqa: E402
from step05_paged.paged_cache import PagedKVCache  # noqa: E402
from step05_paged.static_baseline import (ForwardClock, static_kv_waste, static_peak_concurrency,  # noqa: E402
                                          static_timings)
from step05_paged.workload import mixed_workload, preemption_workload  # noqa: E402

STEP = "step05_paged"


def make_parser():
    p = cli.make_parser(__doc__.splitlines()[0])
    add_sampling_args(p)
    g = p.add_argument_group("分页与调度")
    g.add_argument("--block-size", type=cli.positive_int, default=16, help="每块多少个 token（默认 16，同 vLLM）")
    g.add_argument("--num-blocks", type=cli.positive_int, default=None,
                   help=f"池子的块数；默认按 {DEFAULT_KV_MIB} MiB 的 KV 预算换算（SmolLM2 float32、块大小 16 时为 364 块）")
    g.add_argument("--max-batch-size", type=cli.positive_int, default=8, help="运行集合最多几个请求（默认 8）")
    return p


def percentile(xs: list[float], q: float) -> float:
    """最近秩法：至少 q 比例的样本 ≤ 返回值。"""
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def pool_is_empty(engine: PagedEngine) -> bool:
    a = engine.allocator
    return a.num_free == a.num_blocks and not any(a.ref_counts)


def stage(msg: str) -> float:
    print(msg, flush=True)
    return time.perf_counter()


def chapter(args, s: cli.Session) -> bool:
    tol, eos, bs, B = MARGIN_TOL[s.dtype], s.tok.eos_ids, args.block_size, args.max_batch_size
    requests = mixed_workload(s.tok, args.quick)          # 全部贪心：正确性 + 与 step04 比吞吐
    preempt_reqs = preemption_workload(requests)          # 小池子那次用：奇数号带种子采样，全部 ignore_eos
    default_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, bs, s.dtype)
    small_blocks = 2 * max(blocks_needed(r, bs) for r in requests)   # 只够最大的请求放两份：一定会抢占
    prompts, max_new = [r.prompt_ids for r in requests], [r.max_new_tokens for r in requests]
    print(f"负载: {len(requests)} 个请求，提示词 {min(map(len, prompts))}–{max(map(len, prompts))} token，"
          f"max_new_tokens {min(max_new)}–{max(max_new)}；块大小 {bs}，"
          f"每块 {PagedKVCache.bytes_per_block(s.cfg, bs, s.dtype) / 2**10:.0f} KiB")

    # 1) 参考：step03 一个一个单独生成。小池子那次的贪心请求若在参考里没有提前遇到 EOS，
    #    ignore_eos 不改变它的输出，直接复用；其余（带种子的、提前结束的）按 ignore_eos 单独再生成一次
    t = stage("[1/4] step03 逐个单独生成参考输出 ...")
    ref = [generate_single(s.model, r.prompt_ids, r.max_new_tokens, r.params, eos) for r in requests]
    sequential_s = time.perf_counter() - t
    ref_preempt = [ref[i] if r.params.seed is None and len(ref[i]) == r.max_new_tokens
                 else generate_single(s.model, r.prompt_ids, r.max_new_tokens, r.params, eos, ignore_eos=True)
                 for i, r in enumerate(preempt_reqs)]

    checks, notes, runs = {}, [], []

    def run_and_check(name, engine, reqs, refs):
        outs, st = engine.generate(reqs, eos)
        results = [compare(f"{name}#{i}", r.prompt_ids, rf, got, s.full_logits, tol, draw_margin(r.params))
                   for i, (r, rf, got) in enumerate(zip(reqs, refs, outs))]
        notes.extend(c.describe() for c in results if not c.equal)
        runs.append([name, engine.allocator.num_blocks, engine.max_batch_size, st.steps, st.preemptions,
                     st.peak_running, f"{sum(c.equal for c in results)}/{len(results)}"])
        return results, st, pool_is_empty(engine)

    # 2) 正确性：小池子（批大小不设限，逼出抢占；贪心与带种子的采样混跑）
    stage(f"[2/4] step05：小池子 {small_blocks} 块，批大小不设限 ...")
    small = PagedEngine(s.model, small_blocks, bs, max_batch_size=len(preempt_reqs))
    res, st_small, free_small = run_and_check("small_pool", small, preempt_reqs, ref_preempt)
    seeded_rows = [r.params.seed is not None for r in preempt_reqs]
    checks["greedy_small_pool_equals_step03"] = all(c.ok for c, sd in zip(res, seeded_rows) if not sd)
    checks["seeded_small_pool_equals_step03"] = all(c.ok for c, sd in zip(res, seeded_rows) if sd)
    checks["small_pool_preempted"] = st_small.preemptions > 0
    hit = [sd for n, sd in zip(st_small.preempted, seeded_rows) if n]   # 被抢占过的请求是不是带种子的
    notes.append(f"小池子共抢占 {st_small.preemptions} 次，被抢占过的请求：贪心 {hit.count(False)} 个、"
                 f"带种子采样 {hit.count(True)} 个")

    # 3) 默认池子、全部贪心：既是正确性检查，也是 step05 的计时；紧接着跑 step04，两次计时挨在一起
    stage(f"[3/4] step05：默认池子 {default_blocks} 块，批上限 {B} ...")
    res, st_paged, free_default = run_and_check("default_pool", PagedEngine(s.model, default_blocks, bs, B),
                                                requests, ref)
    checks["greedy_default_pool_equals_step03"] = all(c.ok for c in res)
    checks["all_blocks_free_after_each_run"] = free_small and free_default
    checks["workload_has_eos_endings"] = any(o[-1] in eos for o in ref)
    print(table(["运行", "块数", "批上限", "前向次数", "抢占次数", "峰值并发", "与 step03 完全相同"], runs))

    # 4) 基准：同一负载、同样的批上限，step04 静态批处理 vs step05（上面默认池子那次运行就是 step05 的第一轮）。
    #    完整模式再交替各跑两轮，每个引擎取总时间居中的那一轮（它的 TTFT/TPOT 也取自这一轮）
    def run_static():
        clock = ForwardClock(s.model)
        clock.start()
        out, st = generate_batch(clock, requests, B, eos)
        return out, st, time.perf_counter() - clock.t0, *static_timings(out, B, clock.times)

    repeats = 1 if args.quick else 3
    stage(f"[4/4] step04 静态批处理，批上限 {B}" + ("" if repeats == 1 else f"；再交替各跑 {repeats - 1} 轮") + " ...")
    static_runs, paged_runs = [run_static()], [st_paged]
    for _ in range(repeats - 1):
        paged_runs.append(PagedEngine(s.model, default_blocks, bs, B).generate(requests, eos).stats)
        static_runs.append(run_static())
    st_paged = sorted(paged_runs, key=lambda st: st.wall_s)[len(paged_runs) // 2]
    static_out, static_stats, static_s, ttft4, tpot4 = sorted(static_runs, key=lambda r: r[2])[len(static_runs) // 2]
    waste4 = static_kv_waste(prompts, max_new, static_out, B)
    tokens = static_stats.generated_tokens   # 三个引擎的输出逐 token 相同，生成的 token 数也相同
    rows = [["step03 逐个单独", f"{sequential_s:.1f}", f"{tokens / sequential_s:.1f}", "-", "-", "-", "-", "-", 1],
            ["step04 静态批", f"{static_s:.1f}", f"{tokens / static_s:.1f}", f"{percentile(ttft4, .5):.2f}",
             f"{percentile(ttft4, .9):.2f}", f"{percentile(tpot4, .5) * 1e3:.0f}", f"{percentile(tpot4, .9) * 1e3:.0f}",
             f"{waste4:.1%}", B],
            ["step05 分页+连续批", f"{st_paged.wall_s:.1f}", f"{st_paged.tokens_per_s:.1f}",
             f"{percentile(st_paged.ttft_s, .5):.2f}", f"{percentile(st_paged.ttft_s, .9):.2f}",
             f"{percentile(st_paged.tpot_s, .5) * 1e3:.0f}", f"{percentile(st_paged.tpot_s, .9) * 1e3:.0f}",
             f"{st_paged.kv_waste:.1%}", st_paged.peak_running]]
    print(f"\n机器: {machine()}；模型 {s.path.name}，{s.device}/{s.dtype_name}；批上限 {B}，"
          f"step05 池子 {default_blocks} 块（{default_blocks * bs} 个槽）；"
          f"{'每个引擎只跑一次' if repeats == 1 else f'每个引擎跑 {repeats} 轮、取总时间居中的一轮'}")
    print(table(["引擎", "总时间 (s)", "吞吐 (token/s)", "TTFT p50 (s)", "TTFT p90 (s)", "TPOT p50 (ms)",
                 "TPOT p90 (ms)", "KV 浪费", "峰值并发"], rows))

    # 5) 同样的 KV 预算（小池子的槽数）下最多几个请求同时在跑：step04 式连续预留 vs 分页
    budget = small_blocks * bs
    peak4 = static_peak_concurrency(prompts, max_new, budget)
    print(f"\n同样 {budget} 个 KV 槽（{budget * s.cfg.kv_bytes_per_token(s.dtype.itemsize) / 2**20:.1f} MiB）下的峰值并发：")
    print(table(["方式", "峰值并发"], [["step04 连续预留（每批 B × (最长提示词 + 最大 max_new - 1)）", peak4],
                                     ["step05 分页（小池子那次运行实测）", st_small.peak_running]]))

    cli.print_checks(checks, notes)
    figures = {
        "kv_waste": round(st_paged.kv_waste, 4),
        "throughput_ratio_vs_static": round(st_paged.tokens_per_s * static_s / tokens, 3),
        "preemptions": st_small.preemptions,
        "peak_concurrency_ratio_vs_static": round(st_small.peak_running / peak4, 3),
        "static_kv_waste": round(waste4, 4),
        "tok_per_s": round(st_paged.tokens_per_s, 3),
        "static_tok_per_s": round(tokens / static_s, 3),
        "sequential_tok_per_s": round(tokens / sequential_s, 3),
        "ttft_p50_s": round(percentile(st_paged.ttft_s, .5), 4),
        "ttft_p90_s": round(percentile(st_paged.ttft_s, .9), 4),
        "tpot_p50_s": round(percentile(st_paged.tpot_s, .5), 4),
        "tpot_p90_s": round(percentile(st_paged.tpot_s, .9), 4),
        "static_ttft_p50_s": round(percentile(ttft4, .5), 4),
        "static_ttft_p90_s": round(percentile(ttft4, .9), 4),
        "static_tpot_p50_s": round(percentile(tpot4, .5), 4),
        "static_tpot_p90_s": round(percentile(tpot4, .9), 4),
        "peak_concurrency": st_small.peak_running,
        "static_peak_concurrency": peak4,
        "num_blocks": default_blocks,
        "small_pool_blocks": small_blocks,
        "block_size": bs,
        "max_batch_size": B,
        "num_requests": len(requests),
    }
    if args.json:
        cli.emit_json(cli.chapter_json(STEP, s, checks, figures))
    return all(checks.values())


def main(args) -> bool:
    s = cli.load_session(args)
    if args.prompt is None:
        return chapter(args, s)
    params = params_from_args(args)
    num_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, args.block_size, s.dtype)
    # 先编码、检查全部提示词（包括"池子放不放得下"），任何一个有错都在开始生成前报告
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]
    requests = [Request(ids, args.max_new_tokens, params, args.ignore_eos) for ids in prompt_ids]
    engine = PagedEngine(s.model, num_blocks, args.block_size, args.max_batch_size)
    engine.check_fits(requests)
    outputs, st = engine.generate(requests, s.tok.eos_ids)
    cli.print_generations(s, args.prompt, outputs)
    print(f"\n池子 {num_blocks} 块 × {args.block_size} token；{st.steps} 次前向（prefill {st.prefill_steps}，"
          f"decode {st.decode_steps}），抢占 {st.preemptions} 次，峰值并发 {st.peak_running}，KV 浪费 {st.kv_waste:.1%}")
    if args.json:
        out = cli.generation_json(s, args.prompt, prompt_ids, outputs)
        out["stats"] = {"num_blocks": num_blocks, "block_size": args.block_size, "preemptions": st.preemptions,
                        "peak_running": st.peak_running, "kv_waste": round(st.kv_waste, 4)}
        cli.emit_json(out)
    return True


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
