"""step05 的章节模式（run.py 不带 --prompt 时调用）：检查 + 基准。

同一负载跑两次（默认池子；逼出抢占的小池子，贪心与带种子的采样混跑），逐请求与 step03 单独生成比较；
再在同一负载上与 step04 静态批处理（它自己的引擎、自己的记账）比吞吐、TTFT/TPOT、KV 浪费、同样 KV 预算下的并发数；
量一次 decode 前向：同样的批大小和上下文，step05 的两种读法（gather：先拷成连续的；paged：按块表直接读池子）
比 step04 多花 / 少花的时间花在哪；最后是上下文长度与批大小的扫描（--plot 存图）和"前缀已在池子里、再算一块"的前向。
"""
import statistics
import time

import torch

from common import cli
from common.bench import interleaved_medians, machine, table
from common.compare import MARGIN_TOL, compare
from common.harness import Checks, finish, percentile, pool_is_free, stage
from common.model import Linear
from step02_sampling.sampler import draw_margin
from step03_kvcache_single.engine import generate as generate_single
from step04_static_batching.engine import generate_batch, split_batches
from step05_paged.analysis.decode_bench import KV_IO, PLAN, decode_step_fns, profile_split
from step05_paged.analysis.workload import mixed_workload, preemption_workload
from step05_paged.config import num_blocks_for_budget
from step05_paged.engine import EngineConfig, LLMEngine, blocks_needed
from step05_paged.kv_cache import PagedKVCache
from step05_paged.paged_attention import resolve_impl

STEP = "step05_paged"
MIB = 2**20


class ReadLedger:
    """包住引擎的 kv_cache.plan：每次 decode 前向按块表独立算一遍"读 KV 该拷多少"，与缓存自己的计数器对账。
    只是观察（原样调用 plan、原样返回），不改变任何结果。"""

    def __init__(self, engine: LLMEngine, kv_bytes: int):
        self.bs, self.kvb = engine.config.block_size, kv_bytes
        self.decode_formula = self.decode_real = self.decode_cat = 0   # 字节，全部 decode 步累计
        self.plan = engine.kv_cache.plan
        engine.kv_cache.plan = self

    def __call__(self, seqs, num_new_tokens):
        if all(seq.num_computed_tokens for seq in seqs):      # decode（prefill 的行都从 0 开始）
            self.count(seqs)
        return self.plan(seqs, num_new_tokens)

    def count(self, seqs) -> None:
        blocks = [len(seq.block_table) for seq in seqs]
        self.decode_formula += len(blocks) * max(blocks) * self.bs * self.kvb   # B × max_blocks × block_size × 每 token 字节
        self.decode_real += sum(blocks) * self.bs * self.kvb                     # 其中真正属于各行的块
        self.decode_cat += sum(seq.num_tokens for seq in seqs) * self.kvb        # torch.cat 缓存每步整段复制 S_i 个位置


def chapter(args, s: cli.Session) -> bool:
    print(f"机器: {machine()}；模型 {s.path.name}，{s.device}/{s.dtype_name}", flush=True)
    tol, eos, bs, B = MARGIN_TOL[s.dtype], s.tok.eos_ids, args.block_size, args.max_batch_size
    kvb = s.cfg.kv_bytes_per_token(s.dtype.itemsize)
    requests = mixed_workload(s.tok, args.quick)          # 全部贪心：正确性 + 与 step04 比吞吐
    preempt_reqs = preemption_workload(requests)          # 小池子那次用：奇数号带种子采样，全部 ignore_eos
    default_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, bs, s.dtype)
    small_blocks = 2 * max(blocks_needed(r, bs) for r in requests)   # 只够最大的请求放两份：一定会抢占
    prompts, max_new = [r.prompt_ids for r in requests], [r.max_new_tokens for r in requests]
    workload = (f"{'--quick 负载' if args.quick else '完整负载'}：{len(requests)} 个请求，提示词 {min(map(len, prompts))}–"
                f"{max(map(len, prompts))} token，max_new_tokens {min(max_new)}–{max(max_new)}")
    print(f"{workload}；块大小 {bs}，每块 {PagedKVCache.bytes_per_block(s.cfg, bs, s.dtype) / 2**10:.0f} KiB")

    # 1) 参考：step03 一个一个单独生成。小池子那次的贪心请求若在参考里没有提前遇到 EOS，
    #    ignore_eos 不改变它的输出，直接复用；其余（带种子的、提前结束的）按 ignore_eos 单独再生成一次
    t = stage("[1/5] step03 逐个单独生成参考输出 ...")
    ref = [generate_single(s.model, r.prompt_ids, r.max_new_tokens, r.params, eos) for r in requests]
    sequential_s = time.perf_counter() - t
    ref_preempt = [ref[i] if r.params.seed is None and len(ref[i]) == r.max_new_tokens
                   else generate_single(s.model, r.prompt_ids, r.max_new_tokens, r.params, eos, ignore_eos=True)
                   for i, r in enumerate(preempt_reqs)]

    checks, runs = Checks(), []

    def engine(num_blocks, max_batch_size=B, attention=args.attention):
        return LLMEngine(s.model, EngineConfig(num_blocks, bs, max_batch_size, attention=attention), s.tok, eos)

    def run_and_check(name, eng, reqs, refs):
        outs, st = eng.generate(reqs)
        results = [compare(f"{name}#{i}", r.prompt_ids, rf, got, s.full_logits, tol, draw_margin(r.params))
                   for i, (r, rf, got) in enumerate(zip(reqs, refs, outs))]
        for c in results:
            if not c.equal:
                checks.note(c.describe())
        runs.append([name, eng.config.num_blocks, eng.config.max_batch_size, st.num_forwards, st.preemptions,
                     st.peak_running, f"{sum(c.equal for c in results)}/{len(results)}"])
        return results, st, pool_is_free(eng), outs

    # 2) 正确性：小池子（批大小不设限，逼出抢占；贪心与带种子的采样混跑）
    stage(f"[2/5] step05：小池子 {small_blocks} 块，批大小不设限 ...")
    res, st_small, free_small, _ = run_and_check("small_pool", engine(small_blocks, len(preempt_reqs)), preempt_reqs,
                                              ref_preempt)
    seeded_rows = [r.params.seed is not None for r in preempt_reqs]
    checks["greedy_small_pool_equals_step03"] = all(c.ok for c, sd in zip(res, seeded_rows) if not sd)
    checks["seeded_small_pool_equals_step03"] = all(c.ok for c, sd in zip(res, seeded_rows) if sd)
    checks["small_pool_preempted"] = st_small.preemptions > 0
    hit = [sd for n, sd in zip(st_small.preempted, seeded_rows) if n]   # 被抢占过的请求是不是带种子的
    checks.note(f"小池子共抢占 {st_small.preemptions} 次，被抢占过的请求：贪心 {hit.count(False)} 个、"
                 f"带种子采样 {hit.count(True)} 个")

    # 3) 默认池子、全部贪心：既是正确性检查，也是 step05 的计时。同一负载再用 gather 读法跑一次：
    #    ReadLedger 按块表独立算 gather 该拷多少，与缓存自己的计数器对账；两种读法的 token 逐个相同
    impl = resolve_impl("auto", s.device, s.dtype)
    stage(f"[3/5] step05：默认池子 {default_blocks} 块，批上限 {B}；--attention {args.attention}"
          f"（paged 在这台机器上的实现：{impl}），再用 gather 读法跑一次 ...")
    res, st_paged, free_default, out_paged = run_and_check("default_pool", engine(default_blocks), requests, ref)
    gather_engine = engine(default_blocks, attention="gather")
    ledger = ReadLedger(gather_engine, kvb)
    out_gather, st_gather = gather_engine.generate(requests)
    checks["greedy_default_pool_equals_step03"] = all(c.ok for c in res)
    checks["gather_equals_paged"] = out_gather == out_paged   # 上面默认池子那次运行就是 --attention 读法的输出
    checks["all_blocks_free_after_each_run"] = free_small and free_default and pool_is_free(gather_engine)
    checks["workload_has_eos_endings"] = any(o[-1] in eos for o in ref)
    decode_gather = sum(st.gather_bytes for st in st_gather.steps if not st.prefill)
    checks["prefill_gathers_nothing"] = all(st.gather_bytes == 0 for st in st_gather.steps if st.prefill)
    checks["decode_gather_bytes_match_formula"] = decode_gather == ledger.decode_formula
    # paged 读法在拷贝发生的地方计数（AttentionMetadata.gather_bytes）；编不出内核、退回 gather 时拷贝发生在
    # paged_attention_gather 里，按块表公式照实报
    paged_copied = (sum(st.gather_bytes for st in st_paged.steps if not st.prefill) if impl == "cpp"
                    else ledger.decode_formula)
    print(table(["运行", "块数", "批上限", "前向次数", "抢占次数", "峰值并发", "与 step03 完全相同"], runs))

    # 4) 基准：同一负载、同样的批上限，step04 静态批处理（它自己的引擎和记账）vs step05（上面默认池子那次
    #    运行就是 step05 的第一轮）。完整模式再交替各跑两轮，每个引擎取总时间居中的一轮（TTFT/TPOT 也取自这一轮）
    repeats = 1 if args.quick else 3
    stage(f"[4/5] step04 静态批处理，批上限 {B}" + ("" if repeats == 1 else f"；再交替各跑 {repeats - 1} 轮") + " ...")
    static_runs, paged_runs, gather_runs = [generate_batch(s.model, requests, B, eos).stats], [st_paged], [st_gather]
    for _ in range(repeats - 1):
        paged_runs.append(engine(default_blocks).generate(requests).stats)
        static_runs.append(generate_batch(s.model, requests, B, eos).stats)
        gather_runs.append(engine(default_blocks, attention="gather").generate(requests).stats)
    st_paged, st_static, st_gather = (sorted(r, key=lambda st: st.wall_s)[len(r) // 2]
                                      for r in (paged_runs, static_runs, gather_runs))
    tokens = st_static.generated_tokens   # 三个引擎的输出逐 token 相同，生成的 token 数也相同

    def row(name, st, peak):
        tpot, bare = st.tpot_s(), st.tpot_s(without_stall=True)
        return [name, f"{st.wall_s:.1f}", f"{st.tokens_per_s:.1f}", f"{percentile(st.first_token_s, .5):.2f}",
                f"{percentile(st.first_token_s, .9):.2f}", f"{percentile(tpot, .5) * 1e3:.0f}",
                f"{percentile(tpot, .9) * 1e3:.0f}", f"{percentile(bare, .5) * 1e3:.0f}", f"{st.kv_waste:.1%}", peak]

    print(f"\n机器（基准结束时）: {machine()}")
    print(f"{workload}；批上限 {B}，step05 池子 {default_blocks} 块（{default_blocks * bs} 个槽）；"
          f"{'每个引擎只跑一次' if repeats == 1 else f'每个引擎跑 {repeats} 轮、取总时间居中的一轮'}")
    print(table(["引擎", "总时间 (s)", "吞吐 (token/s)", "TTFT p50 (s)", "TTFT p90 (s)", "TPOT p50 (ms)",
                 "TPOT p90 (ms)", "TPOT p50 去掉干等 (ms)", "KV 浪费", "峰值并发"], [
        ["step03 逐个单独", f"{sequential_s:.1f}", f"{tokens / sequential_s:.1f}", "-", "-", "-", "-", "-", "-", 1],
        row("step04 静态批", st_static, B),
        row(f"step05 分页+连续批（{args.attention}）", st_paged, st_paged.peak_running),
        row("step05 分页+连续批（gather）", st_gather, st_gather.peak_running)]))
    print("KV 浪费 = 1 − Σ 存着真实 token 的槽 ÷ Σ 持有的槽（每次前向之后各采样一次，两个引擎同一段代码算）；"
          "干等 = 已经在 decode 的请求等别人 prefill 的时间。")

    # decode 前向的耗时与干等：各自引擎记下的每一步
    def decode_row(name, st):
        dec = [x for x in st.steps if not x.prefill]
        pre = [x for x in st.steps if x.prefill]
        decode_span = sum(f - t for t, f, n in zip(st.first_token_s, st.finish_s, st.num_outputs) if n > 1)
        return [name, len(dec), f"{statistics.mean(x.rows - x.idle_rows for x in dec):.1f} / "
                f"{statistics.mean(x.rows for x in dec):.1f}", f"{statistics.median(x.seconds for x in dec) * 1e3:.0f}",
                len(pre), f"{statistics.median(x.seconds for x in pre) * 1e3:.0f}", f"{sum(st.stall_s):.1f}",
                f"{sum(st.stall_s) / decode_span:.0%}"]

    print(f"\n每一步（同上面那一轮；decode 步的耗时包括采样）：")
    print(table(["引擎", "decode 步数", "每步在生成的行 / 算的行", "decode 步 p50 (ms)", "prefill 步数",
                 "prefill 步 p50 (ms)", "干等合计 (请求·s)", "干等占 decode 时间"],
                [decode_row("step04 静态批", st_static), decode_row(f"step05（{args.attention}）", st_paged),
                 decode_row("step05（gather）", st_gather)]))

    # 读 KV 时拷贝的字节：step03 的两种缓存（公式）与 step05 的 gather（缓存里的计数器，ReadLedger 按块表对账）
    n_dec = st_gather.decode_steps
    weights = sum(m.in_features * m.out_features * s.dtype.itemsize for m in s.model.modules() if isinstance(m, Linear))
    print(f"\n读 KV 时每个 decode 步拷贝的字节（上面 step05 默认池子那次运行，{n_dec} 个 decode 步的平均；"
          f"每 token 的 K/V {kvb} 字节，全部 {s.cfg.num_layers} 层的 K 和 V）：")
    print(table(["缓存", "每个 decode 步拷贝 (MiB)", "公式（每步）"], [
        ["step03 torch.cat（每个请求各一个）", f"{ledger.decode_cat / n_dec / MIB:.1f}", f"Σ_行 S_i × {kvb}：整段复制到新内存"],
        ["step03/04 预分配", "0", "读的是切片视图，不拷贝"],
        ["step05 按块表 gather（计数器）", f"{decode_gather / n_dec / MIB:.1f}", f"B × max_blocks × {bs} × {kvb}"],
        ["  其中补齐到最长块表的空块", f"{(ledger.decode_formula - ledger.decode_real) / n_dec / MIB:.1f}",
         f"Σ_行 (max_blocks − 块数_i) × {bs} × {kvb}"],
        [f"step05 paged（{impl}）", f"{paged_copied / n_dec / MIB:.1f}",
         "注意力直接按块表读池子" if impl == "cpp" else "编不出内核：退回 gather"],
        ["对照：每步读一遍线性层权重", f"{weights / MIB:.0f}", ""]]))
    print(f"全部 decode 步的 gather 共拷贝 {decode_gather / 2**30:.2f} GiB；prefill 步拷贝 0（全新的 prefill 只看自己的 K/V）。")

    # 5) 同样的批大小和上下文，一次 decode 前向：step04（读视图）vs step05（gather / paged）；再扫上下文和批大小
    stage("\n[5/5] 一次 decode 前向：step04 vs step05 的两种读法，同样的批大小和上下文 ...")
    contexts = [len(r.prompt_ids) + r.max_new_tokens // 2 for r in requests[:B]]
    figures_step = decode_step_comparison(args, s, contexts, bs)
    figures_step |= scaling(args, s, bs)

    # 同样的 KV 预算（小池子的槽数）下最多几个请求同时在跑：step04 按同一个预算切批 vs 分页实测
    budget = small_blocks * bs
    peak4 = max(map(len, split_batches(requests, len(requests), max_kv_slots=budget)))
    print(f"\n同样 {budget} 个 KV 槽（{budget * kvb / MIB:.1f} MiB）下的峰值并发（{workload}）：")
    print(table(["方式", "峰值并发"], [["step04 连续预留（split_batches：每批 B × (最长提示词 + 最大 max_new − 1) ≤ 预算）",
                                       peak4], ["step05 分页（小池子那次运行实测）", st_small.peak_running]]))

    figures = {
        "kv_waste": round(st_paged.kv_waste, 4),
        "throughput_ratio_vs_static": round(st_paged.tokens_per_s / st_static.tokens_per_s, 3),
        "preemptions": st_small.preemptions,
        "peak_concurrency_ratio_vs_static": round(st_small.peak_running / peak4, 3),
        "decode_gather_bytes_per_step": round(decode_gather / n_dec),
        "paged_decode_gather_bytes_per_step": round(paged_copied / n_dec),
        "gather_tok_per_s": round(st_gather.tokens_per_s, 3),
        "paged_throughput_ratio_vs_gather": round(st_paged.tokens_per_s / st_gather.tokens_per_s, 3),
        **figures_step,
        "static_kv_waste": round(st_static.kv_waste, 4),
        "tok_per_s": round(st_paged.tokens_per_s, 3),
        "static_tok_per_s": round(st_static.tokens_per_s, 3),
        "sequential_tok_per_s": round(tokens / sequential_s, 3),
        "ttft_p50_s": round(percentile(st_paged.first_token_s, .5), 4),
        "ttft_p90_s": round(percentile(st_paged.first_token_s, .9), 4),
        "tpot_p50_s": round(percentile(st_paged.tpot_s(), .5), 4),
        "tpot_p90_s": round(percentile(st_paged.tpot_s(), .9), 4),
        "tpot_p50_without_stall_s": round(percentile(st_paged.tpot_s(without_stall=True), .5), 4),
        "stall_s_total": round(sum(st_paged.stall_s), 3),
        "static_ttft_p50_s": round(percentile(st_static.first_token_s, .5), 4),
        "static_ttft_p90_s": round(percentile(st_static.first_token_s, .9), 4),
        "static_tpot_p50_s": round(percentile(st_static.tpot_s(), .5), 4),
        "static_tpot_p90_s": round(percentile(st_static.tpot_s(), .9), 4),
        "decode_cat_bytes_per_step": round(ledger.decode_cat / n_dec),
        "peak_concurrency": st_small.peak_running,
        "static_peak_concurrency": peak4,
        "num_blocks": default_blocks,
        "small_pool_blocks": small_blocks,
        "block_size": bs,
        "max_batch_size": B,
        "num_requests": len(requests),
    }
    return finish(STEP, s, checks, figures, args.json)


@torch.inference_mode()
def decode_step_comparison(args, s: cli.Session, contexts: list[int], bs: int) -> dict:
    """B 行、各自上下文 contexts 的一次 decode 前向：step04（PreallocKVCache + 左填充掩码，读视图）与 step05 的
    gather（plan + 按块表拷贝）、paged（plan + 按块表直接读）。交替计时取中位数；再各用 torch.profiler 剖析几步，
    按类别分开（analysis/decode_bench.py）。"""
    repeats, profiled = (5, 2) if args.quick else (15, 4)
    steps = repeats + profiled + 2
    step04, gather = decode_step_fns(s, contexts, bs, steps, "gather")
    paged = decode_step_fns(s, contexts, bs, steps, "paged")[1]
    fns = {"step04": step04, "gather": gather, "paged": paged}
    med, cpu = interleaved_medians(fns, repeats, s.device, cpu=True)
    prof = {name: profile_split(fn, profiled) for name, fn in fns.items()}
    max_blocks = max(-(-c // bs) for c in contexts)
    print(f"B = {len(contexts)}，上下文 {contexts}（负载前 {len(contexts)} 个请求的 提示词 + max_new_tokens/2；"
          f"step04 左填充到 {max(contexts)}，step05 补齐到 {max_blocks} 块）；交替各跑 {repeats} 次取中位数：")
    print(table(["", "一次 decode 前向 (ms)", "÷ step04", "进程 CPU 时间 (ms)", "÷ step04"],
                [[name, f"{med[name] * 1e3:.1f}", f"{med[name] / med['step04']:.2f}", f"{cpu[name] * 1e3:.1f}",
                  f"{cpu[name] / cpu['step04']:.2f}"] for name in fns]))
    print(f"torch.profiler 剖析（各 {profiled} 步的平均，ms；剖析器本身让每个算子慢一点，看差值和比例）：")
    print(table(["类别", "step04", "gather", "paged", "gather − step04", "paged − step04"],
                [[k] + [f"{prof[n][k] * 1e3:.1f}" for n in fns] +
                 [f"{(prof[n][k] - prof['step04'][k]) * 1e3:+.1f}" for n in ("gather", "paged")] for k in prof["step04"]]))
    copy_ms = prof["gather"][KV_IO] - prof["step04"][KV_IO]
    copied = len(contexts) * max_blocks * bs * s.cfg.kv_bytes_per_token(s.dtype.itemsize)
    print(f"gather 每步拷贝 {copied / MIB:.1f} MiB（B × max_blocks × {bs} × 每 token 字节）；KV 读写一类多出的 "
          f"{copy_ms * 1e3:.1f} ms 主要是这次拷贝和 V 清零；paged 不拷贝，注意力在内核里按块表读池子。")
    return {"decode_step_ms_ratio_vs_static": round(med["gather"] / med["step04"], 3),
            "paged_decode_step_ms_ratio_vs_static": round(med["paged"] / med["step04"], 3),
            "paged_decode_step_ms_ratio_vs_gather": round(med["paged"] / med["gather"], 3),
            "decode_step_ms": round(med["gather"] * 1e3, 2), "paged_decode_step_ms": round(med["paged"] * 1e3, 2),
            "static_decode_step_ms": round(med["step04"] * 1e3, 2), "decode_step_gather_ms": round(copy_ms * 1e3, 2),
            "decode_step_plan_ms": round(prof["gather"][PLAN] * 1e3, 2),
            "paged_decode_step_plan_ms": round(prof["paged"][PLAN] * 1e3, 2)}


@torch.inference_mode()
def scaling(args, s: cli.Session, bs: int) -> dict:
    """一次前向随上下文长度和批大小怎么变：step04（连续缓存，读视图）、gather、paged，同样的批、同样的上下文；
    再量"前缀已在池子里、这一步算一块"（step06 的前缀命中、step07 的分块 prefill 都是它）的前向。"""
    contexts = [256, 1024] if args.quick else [256, 512, 1024, 2048, 4096]
    batches = [1, 8] if args.quick else [1, 4, 8]
    chunks = [(1024, 256)] if args.quick else [(1024, 64), (1024, 256), (2048, 256)]
    repeats = 2 if args.quick else 5
    rows, points = [], {}
    print(f"\n一次前向随上下文与批大小（每行上下文相同；交替各跑 {repeats} 次取中位数）：")
    for B in batches:
        for ctx in contexts:
            ctxs = [ctx] * B
            step04, gather = decode_step_fns(s, ctxs, bs, repeats + 2, "gather")
            paged = decode_step_fns(s, ctxs, bs, repeats + 2, "paged")[1]
            med = interleaved_medians({"step04": step04, "gather": gather, "paged": paged}, repeats, s.device)
            points[(B, ctx)] = med
            rows.append([B, ctx, f"{med['step04'] * 1e3:.1f}", f"{med['gather'] * 1e3:.1f}", f"{med['paged'] * 1e3:.1f}",
                         f"{med['gather'] / med['step04']:.2f}", f"{med['paged'] / med['step04']:.2f}"])
            del step04, gather, paged
    print(table(["批", "上下文", "step04 (ms)", "gather (ms)", "paged (ms)", "gather ÷ step04", "paged ÷ step04"], rows))
    crow = []
    for ctx, L in chunks:                      # 一个请求：前 ctx − L 个 token 已在池子里，这一步算 L 个
        step04, gather = decode_step_fns(s, [ctx], bs, repeats + 2, "gather", query_len=L)
        paged = decode_step_fns(s, [ctx], bs, repeats + 2, "paged", query_len=L)[1]
        med = interleaved_medians({"step04": step04, "gather": gather, "paged": paged}, repeats, s.device)
        crow.append([ctx, L, f"{med['step04'] * 1e3:.1f}", f"{med['gather'] * 1e3:.1f}", f"{med['paged'] * 1e3:.1f}",
                     f"{med['paged'] / med['gather']:.2f}"])
    print("前缀已在池子里、这一步算一块（1 个请求；上下文 = 前缀 + 这一块）：")
    print(table(["上下文", "这一块 (token)", "step04 (ms)", "gather (ms)", "paged (ms)", "paged ÷ gather"], crow))
    if args.plot:
        plot_scaling(args.plot, points, batches, contexts)
        print(f"图已存到 {args.plot}")
    longest = points[(max(batches), max(contexts))]
    return {"paged_decode_step_ms_ratio_vs_static_longest": round(longest["paged"] / longest["step04"], 3),
            "gather_decode_step_ms_ratio_vs_static_longest": round(longest["gather"] / longest["step04"], 3),
            "paged_chunk_step_ms_ratio_vs_gather": round(med["paged"] / med["gather"], 3)}   # 最后一种块


def plot_scaling(path, points: dict, batches: list[int], contexts: list[int]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.plotting import use_chinese_font
    use_chinese_font()
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.6), sharey=False)
    for ax, B in zip(axes, batches):
        for name, label, style in (("step04", "step04：连续缓存（读视图）", "s--"),
                                   ("gather", "step05 gather：先按块表拷成连续的", "o-"),
                                   ("paged", "step05 paged：按块表直接读池子", "^-")):
            ax.plot(contexts, [points[(B, c)][name] * 1e3 for c in contexts], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"批大小 {B}")
        ax.set_xlabel("上下文长度（token）")
        ax.set_ylabel("一次 decode 前向（毫秒）")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("decode 一步随上下文长度：gather 的拷贝随上下文线性增长，paged 不拷贝", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
