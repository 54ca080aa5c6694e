"""step07 的章节模式（run.py 不带 --prompt 时调用）：

[1] 正确性（0 时刻到达的短负载，调度与计时无关）：--no-chunked-prefill（step06 的引擎）与 step06 的输出和每一次
    前向都相同；几种预算（含 1、奇数、质数）与一个逼出抢占（包括 prefill 到一半被抢占）的小池子，输出都与 step06 相同；
[2] 请求陆续到达的负载（泊松到达，短请求里夹着长提示词）：同一次运行里 step06 与 step07 交替各跑几轮，逐请求比较
    token（贪心与带种子的采样），比 TTFT / TPOT / 最长停顿 / 吞吐 / prefill 填充（--plot-timeline 存时间线图）；
[3] 扫一遍预算：TTFT 与 TPOT 的取舍（--plot 存图）；
[4] 一次混合前向的四种做法：展平 + 一次内核调用（paged）、展平 + 按段注意力（gather）、左填充 + 掩码、
    展平 + 块对角掩码（analysis/varlen_bench.py）。
"""
import statistics

import torch

from common import cli
from common.bench import machine, median_time, table
from common.clock import WallClock
from common.compare import MARGIN_TOL, compare
from common.harness import Checks, finish, percentile, pool_is_free, replay, stage
from step02_sampling.sampler import draw_margin
from step04_static_batching.request import Request
from step06_prefix_cache import engine as step06
from step07_chunked_prefill.analysis.varlen_bench import (DENSE, FLAT, PADDED, PAGED, compare as compare_varlen,
                                                          print_comparison)
from step07_chunked_prefill.analysis.workload import (arrival_workload, check_workload, is_long,
                                                      mid_prefill_preemption_workload)
from step07_chunked_prefill.config import num_blocks_for_budget
from step07_chunked_prefill.sequence import SequenceStatus

STEP = "step07_chunked_prefill"
LOGITS_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}   # 三种混合前向的 logits 相对差：矩阵形状不同，求和顺序不同


class ChunkLedger:
    """包住引擎的 kv_cache.plan（只是观察：原样调用、原样返回）：每个请求的 prefill 分成了几块；
    prefill 到一半（提示词还没算完）时被抢占了几次。"""

    def __init__(self, engine):
        self.engine, self.plan = engine, engine.kv_cache.plan
        engine.kv_cache.plan = self
        self.chunks: dict[int, int] = {}
        self.partial = []                 # 上一步之后还在 prefill 提示词的运行中请求
        self.preempted_mid_prefill = 0

    def __call__(self, seqs, num_new_tokens):
        # 上一步之后还在 prefill 的请求，现在回到了等待队列：这一步开头被抢占了
        self.preempted_mid_prefill += sum(seq.status is SequenceStatus.WAITING for seq in self.partial)
        for seq in seqs:
            if not seq.output_ids:                           # 还没有首 token：这是提示词的一块
                self.chunks[seq.request_id] = self.chunks.get(seq.request_id, 0) + 1
        out = self.plan(seqs, num_new_tokens)
        self.partial = [seq for seq, n in zip(seqs, num_new_tokens)
                        if seq.num_computed_tokens + n < len(seq.request.prompt_ids)]
        return out


class Chapter:
    def __init__(self, args, s: cli.Session, engine_for):
        """engine_for：run.py 按命令行选引擎的那个函数（--no-chunked-prefill → step06 的），self.engine 用它。"""
        self.args, self.s, self.engine_for = args, s, engine_for
        self.tol, self.eos, self.bs, self.B = MARGIN_TOL[s.dtype], s.tok.eos_ids, args.block_size, args.max_batch_size
        self.budget = args.max_num_batched_tokens
        self.num_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, self.bs, s.dtype)
        self.checks, self.figures = Checks(), {}
        self.engines = []                                # 用过的引擎：最后检查引用计数都回到 0

    def engine(self, budget=None, num_blocks=None, max_batch_size=None, clock=None, no_chunked_prefill=False):
        """run.py 的 engine_for：no_chunked_prefill=True 时是 --no-chunked-prefill 选的引擎（应当是 step06 的）。"""
        args = cli.override(self.args, no_chunked_prefill=no_chunked_prefill)
        e = self.engine_for(args, self.s, num_blocks or self.num_blocks, max_batch_size or self.B, budget or self.budget,
                            clock)
        self.engines.append(e)
        return e

    def step06(self, clock=None) -> step06.LLMEngine:
        config = step06.EngineConfig(self.num_blocks, self.bs, self.B, attention=self.args.attention)
        e = step06.LLMEngine(self.s.model, config, self.s.tok, self.eos, clock)
        self.engines.append(e)
        return e

    def replay(self, engine_fn, arrivals):
        clock = WallClock()
        return replay(engine_fn(clock=clock), arrivals, clock)

    def compare(self, name, reqs, refs, outs) -> tuple[bool, bool]:
        """每个请求与 step06 的输出逐 token 比较（near-tie 规则见 common/compare.py）；返回 (贪心都对, 采样都对)。"""
        res = [compare(f"{name}#{i}", r.prompt_ids, ref, got, self.s.full_logits, self.tol, draw_margin(r.params))
               for i, (r, ref, got) in enumerate(zip(reqs, refs, outs))]
        for c in res:
            if not c.equal:
                self.checks.note(c.describe())
        seeded = [r.params.seed is not None for r in reqs]
        return (all(c.ok for c, sd in zip(res, seeded) if not sd), all(c.ok for c, sd in zip(res, seeded) if sd))

    # ---------- [1] 正确性：0 时刻到达的短负载 ----------
    def correctness(self):
        s, B = self.s, self.B
        reqs = [Request(r.prompt_ids, r.max_new_tokens, r.params, ignore_eos=True) for r in check_workload(s.tok, self.args.quick)]
        lens = [len(r.prompt_ids) for r in reqs]
        stage(f"[1] 正确性：{len(reqs)} 个请求（提示词 {min(lens)}–{max(lens)} token，贪心与带种子采样各半，ignore_eos），"
              f"都在 0 时刻到达")
        ref, st6 = self.step06().generate(reqs)
        out, stn = self.engine(no_chunked_prefill=True).generate(reqs)
        self.checks["no_chunked_prefill_equals_step06"] = out == ref and stn.forward_shapes == st6.forward_shapes
        rows = [["step06", "-", st6.num_forwards, "-", "-", f"{st6.prefill_padding_waste:.1%}", "(参考)"],
                ["step07 --no-chunked-prefill", "-", stn.num_forwards, "-", "-", f"{stn.prefill_padding_waste:.1%}",
                 "输出与每一次前向都相同" if self.checks["no_chunked_prefill_equals_step06"] else "不同"]]
        self.figures["step06_simultaneous_prefill_padding_waste"] = round(st6.prefill_padding_waste, 4)
        # 几种预算：1（每次前向只算 1 个 token，批大小也只能是 1）、B+1、奇数、质数
        budgets = [1, B + 1, 13, 31] + ([] if self.args.quick else [97])
        ok_all = True
        for budget in budgets:
            e = self.engine(budget, max_batch_size=min(B, budget))
            ledger = ChunkLedger(e)
            out, st = e.generate(reqs)
            greedy_ok, seeded_ok = self.compare(f"budget{budget}", reqs, ref, out)
            ok_all &= greedy_ok and seeded_ok and st.prefill_padding_slots == 0
            rows.append([f"step07 预算 {budget}", min(B, budget), st.num_forwards, max(ledger.chunks.values()),
                         st.preemptions, f"{st.prefill_padding_waste:.1%}", "相同" if greedy_ok and seeded_ok else "不同"])
        self.checks["every_budget_equals_step06"] = ok_all
        print(table(["引擎", "批上限", "前向次数", "最多分几块", "抢占", "prefill 填充", "与 step06"], rows))
        # 小池子：长提示词分块 prefill 到一半被抢占，之后重新接纳、命中自己已经登记的块
        reqs, small, budget = mid_prefill_preemption_workload(s.tok)
        ref, _ = self.step06().generate(reqs)
        e = self.engine(budget, num_blocks=small)
        ledger, ev0 = ChunkLedger(e), e.block_manager.num_evictions
        out, st = e.generate(reqs)
        greedy_ok, seeded_ok = self.compare("mid_prefill", reqs, ref, out)
        self.checks["preempted_mid_prefill_equals_step06"] = greedy_ok and seeded_ok and ledger.preempted_mid_prefill > 0
        prompt = sum(len(r.prompt_ids) for r in reqs)
        print(f"小池子 {small} 块、预算 {budget}：提示词 {[len(r.prompt_ids) for r in reqs]} token，抢占 {st.preemptions} 次"
              f"（其中 prefill 到一半的 {ledger.preempted_mid_prefill} 次），回收 {e.block_manager.num_evictions - ev0} 块；prefill 共算 "
              f"{st.prefill_tokens} 个 token（提示词 {prompt} + 重算 {st.prefill_tokens - prompt}），输出与 step06 "
              f"{'相同' if greedy_ok and seeded_ok else '不同'}")

    # ---------- [2] 请求陆续到达 ----------
    def calibrate(self) -> float:
        """一次 decode 前向的秒数（B 个请求各 1 个 token），到达间隔以它为单位。"""
        x = torch.zeros(self.B, 1, dtype=torch.long, device=self.s.device)     # token 0、位置 0：耗时与数值无关
        return median_time(lambda: self.s.model(x, x, last_only=True), repeats=5, warmup=2, device=self.s.device)

    def arrivals(self):
        s = self.s
        step_s = self.calibrate()
        arrivals = arrival_workload(s.tok, self.args.quick, step_s)
        self.arrivals_, reqs = arrivals, [a.request for a in arrivals]
        self.long = [is_long(i) for i in range(len(reqs))]
        lens = [len(r.prompt_ids) for r in reqs]
        span = arrivals[-1].time
        self.workload = (f"{'--quick ' if self.args.quick else '完整'}负载：{len(reqs)} 个请求在 "
                         f"{span:.1f} s 内陆续到达（平均间隔 {span / (len(reqs) - 1) * 1e3:.0f} ms"
                         f" ≈ {span / (len(reqs) - 1) / step_s:.0f} 个 decode 步，本机一步 {step_s * 1e3:.0f} ms），"
                         f"提示词 {min(lens)}–{max(lens)} token（其中 {sum(self.long)} 个长提示词）")
        repeats = 1 if self.args.quick else 3
        stage(f"[2] {self.workload}；step06 与 step07（预算 {self.budget}）交替各跑 {repeats} 轮 ...")
        runs6, runs7, ledgers = [], [], []
        for k in range(repeats):
            o6, st6 = self.replay(self.step06, arrivals)
            clock = WallClock()
            e7 = self.engine(clock=clock)
            ledger = ChunkLedger(e7)
            o7, st7 = replay(e7, arrivals, clock)
            runs6.append(st6)
            runs7.append(st7)
            ledgers.append(ledger)
            if k == 0:
                greedy_ok, seeded_ok = self.compare("arrivals", reqs, o6, o7)
                self.checks["greedy_equals_step06"] = greedy_ok
                self.checks["seeded_equals_step06"] = seeded_ok
        self.checks["prompts_prefilled_in_chunks"] = all(max(lg.chunks.values()) >= 2 for lg in ledgers)
        self.checks["every_forward_carries_every_running_decode"] = all(x.stalled == 0 for st in runs7 for x in st.steps)
        self.checks["prefill_padding_is_zero"] = all(st.prefill_padding_slots == 0 for st in runs7)
        st6 = sorted(runs6, key=lambda st: st.wall_s)[len(runs6) // 2]
        st7 = sorted(runs7, key=lambda st: st.wall_s)[len(runs7) // 2]
        self.st6, self.st7 = st6, st7
        print(f"\n机器: {machine()}；模型 {s.path.name}，{s.device}/{s.dtype_name}")
        print(f"{self.workload}；批上限 {self.B}，池子 {self.num_blocks} 块；"
              f"{'每个引擎只跑一次' if repeats == 1 else f'每个引擎跑 {repeats} 轮、取忙碌时间居中的一轮'}")
        print(table(LATENCY_HEADERS, [latency_row("step06（一次 prefill 整段）", st6, self.long),
                                      latency_row(f"step07（预算 {self.budget}）", st7, self.long)]))
        print("TTFT 从请求到达算起；TPOT = (最后一个 token − 首 token) ÷ (输出数 − 1)，每个请求一个数；"
              "最长停顿 = 一个请求相邻两个 token 之间最长的间隔；吞吐 = 生成的 token ÷ 忙碌时间（没有请求可做的空闲不算）；"
              "prefill 填充 = 有 prefill 的前向里，填充的位置 ÷ 算的全部位置。")
        tpot6, tpot7 = st6.tpot_s(), st7.tpot_s()
        gap6, gap7 = max(g for g in st6.max_gap_s() if g), max(g for g in st7.max_gap_s() if g)
        self.figures.update({
            "tpot_p90_ratio_vs_step06": round(percentile(tpot6, .9) / percentile(tpot7, .9), 3),
            "max_stall_ratio_vs_step06": round(gap6 / gap7, 3),
            "throughput_ratio_vs_step06": round(st7.tokens_per_s / st6.tokens_per_s, 3),
            "ttft_p50_ratio_vs_step06": round(percentile(st6.ttft_s(), .5) / percentile(st7.ttft_s(), .5), 3),
            "prefill_padding_waste": round(st7.prefill_padding_waste, 4),
            "step06_prefill_padding_waste": round(st6.prefill_padding_waste, 4),
            "ttft_p90_ratio_vs_step06": round(percentile(st6.ttft_s(), .9) / percentile(st7.ttft_s(), .9), 3),
            "tpot_p50_ratio_vs_step06": round(percentile(tpot6, .5) / percentile(tpot7, .5), 3),
            "max_stall_s": round(gap7, 4), "step06_max_stall_s": round(gap6, 4),
            "tpot_p90_s": round(percentile(tpot7, .9), 4), "step06_tpot_p90_s": round(percentile(tpot6, .9), 4),
            "ttft_p50_s": round(percentile(st7.ttft_s(), .5), 4), "step06_ttft_p50_s": round(percentile(st6.ttft_s(), .5), 4),
            "tok_per_s": round(st7.tokens_per_s, 3), "step06_tok_per_s": round(st6.tokens_per_s, 3),
            "max_num_batched_tokens": self.budget, "decode_step_s": round(step_s, 4), "num_requests": len(reqs),
            "max_batch_size": self.B, "block_size": self.bs, "num_blocks": self.num_blocks,
        })
        if self.args.plot_timeline:
            plot_timeline(self.args.plot_timeline, arrivals, self.long, st6, st7, self.budget, self.workload)
            print(f"时间线图已存到 {self.args.plot_timeline}")

    # ---------- [3] 预算扫描 ----------
    def sweep(self):
        budgets = [b for b in (sorted({16, 64, self.budget}) if self.args.quick else [16, 32, 64, 128, 256, 512, 1024]) if b >= self.B]
        stage(f"\n[3] 预算扫描 {budgets}：同一负载，每个预算跑一次 ...")
        rows, points = [latency_row("step06", self.st6, self.long)], []
        for b in budgets:
            st = self.st7 if b == self.budget else self.replay(lambda clock: self.engine(b, clock=clock), self.arrivals_).stats
            rows.append(latency_row(f"step07 预算 {b}", st, self.long))
            points.append((b, st))
        print(f"机器: {machine()}")
        print(table(LATENCY_HEADERS, rows))
        if self.args.plot:
            plot_sweep(self.args.plot, points, self.st6, self.workload)
            print(f"图已存到 {self.args.plot}")

    # ---------- [4] 一次混合前向的三种做法 ----------
    def varlen(self):
        contexts, chunk = [280, 310, 295, 330, 270, 305, 320, 290], (200, 56)
        stage("\n[4] 一次混合前向：展平 + 一次内核调用 vs 展平 + 按段注意力 vs 左填充 + 掩码 vs 展平 + 块对角掩码 ...")
        res = compare_varlen(self.s, contexts, chunk, self.bs, repeats=3 if self.args.quick else 9)
        print(f"机器: {machine()}")
        print_comparison(res, contexts, chunk)
        self.checks["varlen_logits_equal_padded_and_dense"] = all(r["max_rel_diff"] <= LOGITS_TOL[self.s.dtype]
                                                                  and r["same_argmax"] for r in res.values())
        self.figures.update({
            "varlen_step_ms": round(res[FLAT]["ms"], 2),
            "paged_varlen_step_ms": round(res[PAGED]["ms"], 2),
            "paged_varlen_step_ms_ratio_vs_gather": round(res[PAGED]["ms"] / res[FLAT]["ms"], 3),
            "padded_step_ms_ratio_vs_varlen": round(res[PADDED]["ms"] / res[FLAT]["ms"], 3),
            "dense_step_ms_ratio_vs_varlen": round(res[DENSE]["ms"] / res[FLAT]["ms"], 3),
            "padded_token_slots_ratio": round(res[PADDED]["token_slots"] / res[FLAT]["token_slots"], 3),
            "dense_scores_ratio": round(res[DENSE]["scores"] / res[FLAT]["scores"], 3),
        })

    def run(self) -> bool:
        self.correctness()
        self.arrivals()
        self.sweep()
        self.varlen()
        self.checks["all_blocks_free_after_each_run"] = all(pool_is_free(e) for e in self.engines)
        return finish(STEP, self.s, self.checks, self.figures, self.args.json)


LATENCY_HEADERS = ["引擎", "前向次数", "忙碌 (s)", "吞吐 (token/s)", "TTFT p50 (s)", "TTFT p90 (s)", "长提示词 TTFT p50 (s)",
                   "TPOT p50 (ms)", "TPOT p90 (ms)", "TPOT max (ms)", "最长停顿 (ms)", "prefill 填充"]


def latency_row(name, st, long) -> list:
    tpot = st.tpot_s()
    ttft = st.ttft_s()
    long_ttft = [t for t, lg in zip(ttft, long) if lg]
    return [name, st.num_forwards, f"{st.wall_s:.1f}", f"{st.tokens_per_s:.1f}", f"{percentile(ttft, .5):.2f}",
            f"{percentile(ttft, .9):.2f}", f"{statistics.median(long_ttft):.2f}" if long_ttft else "-",
            f"{percentile(tpot, .5) * 1e3:.0f}", f"{percentile(tpot, .9) * 1e3:.0f}",
            f"{max(x for x in tpot if x is not None) * 1e3:.0f}",
            f"{max(g for g in st.max_gap_s() if g is not None) * 1e3:.0f}", f"{st.prefill_padding_waste:.1%}"]


def plot_timeline(path, arrivals, long, st6, st7, budget, workload) -> None:
    """每个请求一行：到达（空心圆）、每个输出 token（竖线），长提示词用另一种颜色。上下两幅：step06、step07。"""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.plotting import use_chinese_font
    use_chinese_font()
    fig, axes = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for ax, st, title in ((axes[0], st6, "step06：长提示词一次 prefill 完，正在 decode 的请求全部停下"),
                          (axes[1], st7, f"step07：每次前向最多 {budget} 个 token，decode 每步都前进")):
        for i, (t0, ts) in enumerate(zip(st.arrival_s, st.token_s)):
            color = "tab:red" if long[i] else "tab:blue"
            ax.plot([t0, ts[-1]], [i, i], color=color, lw=0.6, alpha=0.4)
            ax.plot(ts, [i] * len(ts), "|", color=color, ms=5)
            ax.plot([t0], [i], "o", mfc="none", color=color, ms=4)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("请求（按到达顺序）")
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    axes[1].set_xlabel("时间（秒）；○ 到达，| 产出一个 token；红色 = 长提示词")
    fig.suptitle(workload, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(path, points, st6, workload) -> None:
    """左：TTFT p50 / p90 随预算；右：TPOT p90 与最长停顿随预算；虚线是 step06。"""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.plotting import use_chinese_font
    use_chinese_font()
    xs = [b for b, _ in points]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for q, style in ((.5, "o-"), (.9, "s-")):
        line, = a.plot(xs, [percentile(st.ttft_s(), q) for _, st in points], style, label=f"step07 TTFT p{int(q * 100)}")
        a.axhline(percentile(st6.ttft_s(), q), ls="--", color=line.get_color(), label=f"step06 TTFT p{int(q * 100)}")
    a.set_ylabel("TTFT（秒，从到达算起）")
    line, = b.plot(xs, [percentile(st.tpot_s(), .9) * 1e3 for _, st in points], "o-", label="step07 TPOT p90")
    b.axhline(percentile(st6.tpot_s(), .9) * 1e3, ls="--", color=line.get_color(), label="step06 TPOT p90")
    line, = b.plot(xs, [max(g for g in st.max_gap_s() if g) * 1e3 for _, st in points], "s-", label="step07 最长停顿")
    b.axhline(max(g for g in st6.max_gap_s() if g) * 1e3, ls="--", color=line.get_color(), label="step06 最长停顿")
    b.set_ylabel("毫秒")
    b.set_yscale("log")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("每次前向的 token 预算（max_num_batched_tokens）")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"token 预算的取舍：首 token 延迟（左）与 decode 的间隔（右）\n{workload}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
