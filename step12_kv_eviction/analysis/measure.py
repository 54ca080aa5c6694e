"""step12 章节模式的测量 [2]–[5]（有损的部分：只报数，不给 ✅；唯一的检查是机制本身——块有上界、"压缩之后才问"真的发生在压缩之后）。

chapter.py 的 Chapter 给出引擎、计划（PLAN）、checks 与 figures；这里按计划跑、打印表格、填 figures。
"""
import statistics

from common.bench import machine, table
from common.compare import top2_margin
from common.harness import stage

from .plots import plot_blocks, plot_nll
from .runs import FULL_LABEL, Setting, agreement, blocks_for, greedy_request, mean_nll, parse, pool_blocks, run_one, stream_request
from .texts import QUESTION, encode, passkey_set, text_source, windowed_means


def ktok(n: int) -> str:
    """16384 → "16k"，1536 → "1.5k"（figures 名字里的长度）。"""
    return f"{n / 1024:g}k"


class Measure:
    def __init__(self, ch, text: list[int]):
        self.ch, self.s, self.p, self.text = ch, ch.s, ch.plan, text
        self.fig = ch.figures

    def mml(self, tokens: int):
        """比模型训练长度长的请求要 max_model_len（位置超出训练范围：只有完整运行的长文本是有意的）。"""
        return tokens if tokens > self.ch.ctx else None

    def bound(self, st: Setting, tokens: int, new: int = 0) -> int:
        """设计给的每个请求（tokens = 提示词 + new）的块数上界（runs.pool_blocks 的，不多给那 1 块）。"""
        return pool_blocks(st, tokens, self.ch.chunk, self.ch.bs, new) - 1

    # ---------- [2] 长文本 ----------
    def streams(self):
        ch, p = self.ch, self.p
        N, new = len(self.text), p["stream_new"]
        mml = N + new if N + new > ch.ctx else None
        stage(f"\n[2] 长文本：前 {N} 个 token 整段当一个提示词（每次前向 {ch.chunk} 个），逐位置 NLL，之后再 decode {new} 个"
              f"（计时）；{len(p['streams'])} 种设置 ...")
        runs, bound_ok = {}, True
        for st in map(parse, p["streams"]):
            e = ch.engine(st, num_blocks=pool_blocks(st, N + new, ch.chunk, ch.bs, new), prefix=False, max_model_len=mml)
            run = runs[st.label] = run_one(e, stream_request(self.text, new))
            ch.done(e)
            if st.policy != "full":
                bound_ok &= run.peak_blocks <= self.bound(st, N + new, new)
            print(f"  {st.label:<22} {run.wall_s:7.1f} s  峰值 {run.peak_blocks} 块", flush=True)
        # 预算扫描：同一段文本的前 sweep_tokens 个 token（full 的这一段与长文本那次逐位相同：因果、同样的分块）
        M = min(p["sweep_tokens"], N)
        sweep = {}
        for st in map(parse, p["sweep"]):
            e = ch.engine(st, num_blocks=pool_blocks(st, M, ch.chunk, ch.bs), prefix=False,
                          max_model_len=self.mml(M))
            run = sweep[st.label] = run_one(e, stream_request(self.text[:M], 0))
            ch.done(e)
            bound_ok &= run.peak_blocks <= self.bound(st, M)
            print(f"  {st.label:<22} {run.wall_s:7.1f} s  峰值 {run.peak_blocks} 块（前 {M} 个 token）", flush=True)
        ch.checks["kv_blocks_bounded_by_budget"] = bound_ok
        budgets = [parse(x).budget for x in p["streams"] + p["sweep"] if x != FULL_LABEL]
        lo = max(budgets) + ch.chunk                  # 从这里起每个设置都已经驱逐过
        agree_hi = min(M, ch.ctx)                     # 与 full 比只在训练长度之内（之外 full 自己也不是"精确"），各预算同一段
        full = runs[FULL_LABEL]
        # 窗口平均表
        w = p["nll_window"]
        wins = {label: windowed_means(r.nll, 1, w) for label, r in runs.items()}
        heads = [f"{a}–{b}" for a, b, _ in wins[FULL_LABEL]]
        print(f"\n平均 NLL（nat/token），按位置每 {w} 个 token 一段；文本：{text_source()}")
        print(table(["设置"] + heads, [[label] + [f"{m:.3f}" for _, _, m in ws] for label, ws in wins.items()]))
        # 汇总表
        bpt = self.s.cfg.kv_bytes_per_token(self.s.dtype.itemsize)
        past = N > ch.ctx
        rows = []
        for label, r in runs.items():
            nll = mean_nll(r, lo, N)
            name = f"nll_full_{ktok(N)}" if label == FULL_LABEL else f"nll_{label}"
            self.fig[name] = round(nll, 4)
            if past:
                self.fig[f"{name}_past_{ktok(ch.ctx)}" if label != FULL_LABEL else f"nll_full_past_{ktok(ch.ctx)}"] = \
                    round(mean_nll(r, ch.ctx, N), 4)
            a, d = agreement(full, r, lo, agree_hi)
            dec = r.decode_step_s
            ratio = dec / full.decode_step_s
            self.fig[f"kv_blocks_peak_{label}"] = r.peak_blocks
            if label != FULL_LABEL:
                self.fig[f"decode_step_ratio_{label}_vs_full_{ktok(N)}"] = round(ratio, 3)
                self.fig[f"top1_agreement_{label}"] = round(a, 4)
                self.fig[f"nll_delta_{label}"] = round(d, 4)
            rows.append([label, f"{nll:.3f}", f"{mean_nll(r, ch.ctx, N):.3f}" if past else "-",
                         f"{a:.3f}" if label != FULL_LABEL else "-", f"{d:+.4f}" if label != FULL_LABEL else "-",
                         r.peak_blocks, f"{r.peak_blocks * ch.bs * bpt / 2**20:.1f}", f"{r.prefill_s:.1f}",
                         f"{dec * 1e3:.1f}", f"{ratio:.2f}"])
        srows = []
        for label, r in sweep.items():
            a, d = agreement(full, r, lo, agree_hi)
            self.fig[f"top1_agreement_{label}"] = round(a, 4)
            self.fig[f"nll_delta_{label}"] = round(d, 4)
            srows.append([label, f"{mean_nll(r, lo, agree_hi):.3f}", f"{a:.3f}", f"{d:+.4f}", r.peak_blocks,
                          f"{r.prefill_s:.1f}"])
        if srows:
            srows.insert(0, [FULL_LABEL, f"{mean_nll(full, lo, agree_hi):.3f}", "-", "-", "-", "-"])
            print(f"\n预算扫描：前 {M} 个 token，位置 {lo}–{agree_hi} 与 full 比（teacher forcing）")
            print(table(["设置", "平均 NLL", "top-1 一致", "NLL 差", "峰值块", "prefill (s)"], srows))
        print(f"\n位置 {lo}–{N}（每个设置都已驱逐过）的平均 NLL；top-1 一致与 NLL 差：与 full 比，位置 {lo}–{agree_hi}"
              f"（训练长度之内，teacher forcing = 同一段真实文本）；decode：文本之后再生成 {new} 个 token 的每步中位数")
        print(table(["设置", "平均 NLL", f"NLL（{ch.ctx} 之后）", "top-1 一致", "NLL 差", "峰值块", "峰值 MiB",
                     "prefill (s)", "decode 一步 (ms)", "÷ full"], rows))
        sinks = "sinks4_512_cachepos"
        if sinks in runs:
            self.fig["kv_bytes_ratio_sinks_vs_full"] = round(runs[sinks].peak_blocks / full.peak_blocks, 4)
        h2o, base, snap = runs.get("h2o_512"), runs.get("sinks4_512_textpos"), runs.get("snapkv-chunked_512")
        if h2o and base:    # 同样的预算、同样的原文位置：差别只在打分（h2o 每次前向都取概率）与挑选
            self.fig["h2o_score_overhead_prefill"] = round(h2o.prefill_s / base.prefill_s, 3)
            self.fig["h2o_score_overhead_decode"] = round(h2o.decode_step_s / base.decode_step_s, 3)
            if snap:
                self.fig["snapkv_chunked_vote_overhead_prefill"] = round(snap.prefill_s / base.prefill_s, 3)
            print(f"取分数的代价（与 sinks4_512_textpos 比：同样的预算与位置，只差打分）：h2o prefill ×"
                  f"{self.fig['h2o_score_overhead_prefill']:.2f}，decode 一步 ×{self.fig['h2o_score_overhead_decode']:.2f}"
                  + (f"；snapkv-chunked prefill ×{self.fig['snapkv_chunked_vote_overhead_prefill']:.2f}" if snap else ""))
        args = ch.args
        shown = {k: v for k, v in runs.items() if k == FULL_LABEL or k.split("_")[1] == "512"}
        if getattr(args, "plot", None):
            plot_nll(args.plot, shown, p["plot_width"], ch.ctx, ch.chunk, text_source())
            print(f"图已存到 {args.plot}")
        if getattr(args, "plot_blocks", None):
            plot_blocks(args.plot_blocks, shown, ch.bs, bpt)
            print(f"图已存到 {args.plot_blocks}")

    # ---------- [3] passkey ----------
    def passkey(self):
        """一次 prefill（每次前向的预算 = 这个提示词的上下文长度）：整个上下文在一次前向里算完、压缩一次——SnapKV、
        PyramidKV 等论文评测的做法。问题在提示词里时它在这次前向的末尾（观察窗口里）；压缩之后才问时，上下文正好是
        这一次前向，问题是下一次（snapkv 只在整个提示词之后压缩，问题总在它的观察窗口里：这种问法用 snapkv-chunked，
        它在上下文那一块之后就压缩）。另有几行"分块"：每次前向 --max-num-batched-tokens 个——snapkv-chunked 每一块都
        压缩一次；snapkv 仍是整个提示词之后压缩一次，结果应与一次 prefill 相同。"""
        ch, p, s = self.ch, self.p, self.s
        lens = p["passkey_lens"]
        q, new = len(encode(s.tok, QUESTION)), 8
        stage(f"\n[3] passkey：上下文 {lens} token，深度 {p['passkey_depths']}；问题 {q} 个 token；贪心生成 {new} 个，"
              f"第一串数字等于藏的数才算对 ...")
        rows, mech, evicting = [], True, 0
        plan = ([(False, x, False) for x in p["passkey_inside"]] + [(True, x, False) for x in p["passkey_after"]]
                + [(False, x, True) for x in p["passkey_chunked"]])
        for after, label, chunked in plan:
            st = parse(label)
            hits = {n: 0 for n in lens}
            for n in lens:
                chunk = ch.chunk if chunked else n
                e = ch.engine(st, num_blocks=pool_blocks(st, n + q + new, chunk, ch.bs, new), prefix=False, chunk=chunk,
                              max_model_len=self.mml(n + q + new))
                for c in passkey_set(s.tok, [n], p["passkey_depths"], after):
                    run = run_one(e, greedy_request(c.ids, new))
                    hits[n] += c.correct(s.tok.decode(run.output_ids))
                    if after and run.max_evicted > 0:
                        evicting += 1
                        mech &= asked_after_compaction(run.trace, c.context_len, q)
                ch.done(e)
            per = len(p["passkey_depths"])
            acc = sum(hits.values()) / (per * len(lens))
            self.fig[f"passkey_acc_{st.label}" + ("_asked_after" if after else "_chunked" if chunked else "")] = round(acc, 4)
            how = "压缩之后才问" if after else f"问题在提示词里，每块 {ch.chunk}" if chunked else "问题在提示词里"
            rows.append([st.label, how] + [f"{hits[n]}/{per}" for n in lens] + [f"{acc:.0%}"])
        ch.checks["passkey_question_asked_after_compaction"] = mech and evicting > 0
        print(table(["设置", "问法"] + [f"{n} token" for n in lens] + ["准确率"], rows))
        print(f"上下文一次 prefill 完、压缩一次。问题在提示词里：问题在这次前向的末尾，snapkv 的观察窗口里就是它；"
              f"压缩之后才问：上下文恰好是一次前向，压缩之后问题（{q} 个 token，少于块大小 {ch.bs}，不再触发压缩）单独一次前向"
              f"——{evicting} 次有驱逐的运行都从每一步的记录核对了这个顺序。\"每块 {ch.chunk}\"：分块 prefill，snapkv-chunked"
              f"每一块之后都按那一块末尾的观察窗口压缩一次，问题来之前藏的数可能已经被扔了；snapkv 仍在整个提示词之后压缩一次")

    # ---------- [4] 贪心生成的第一次分歧 ----------
    def greedy(self):
        ch, p, s = self.ch, self.p, self.s
        C, new = p["greedy_context"], p["greedy_new"]
        ids = self.text[:C]
        stage(f"\n[4] 贪心生成：长文本的前 {C} 个 token 之后各生成 {new} 个，与 full 第一次不同在哪 ...")
        e = ch.engine(num_blocks=blocks_for(C + new, ch.bs) + 1, max_model_len=self.mml(C + new))
        ref = run_one(e, greedy_request(ids, new)).output_ids
        ch.done(e)
        rows = []
        for st in map(parse, p["greedy"]):
            e = ch.engine(st, num_blocks=pool_blocks(st, C + new, ch.chunk, ch.bs, new), max_model_len=self.mml(C + new))
            got = run_one(e, greedy_request(ids, new)).output_ids
            ch.done(e)
            pos = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
            margin = top2_margin(s.full_logits(ids + ref[:pos])[-1]) if pos is not None else None
            self.fig[f"greedy_same_prefix_{st.label}"] = new if pos is None else pos
            rows.append([st.label, f"{new if pos is None else pos}/{new}", "-" if pos is None else pos,
                         "-" if margin is None else f"{margin:.3g}"])
            ch.checks.note(f"greedy {st.label}: " + (f"first {new} tokens identical to full" if pos is None else
                           f"first differs from full at output position {pos} (full's top-2 margin {margin:.3g})"))
        print(table(["设置", "与 full 相同的前缀", "第一次分歧", "full 在那里的 top-2 差"], rows))

    # ---------- [5] 内存与速度 ----------
    def concurrency(self):
        ch, p = self.ch, self.p
        P, R, new = p["conc_prompt"], p["conc_requests"], p["conc_new"]
        step = (len(self.text) - P) // R
        reqs = [greedy_request(self.text[i * step:i * step + P], new) for i in range(R)]
        nb = 2 * blocks_for(P + new, ch.bs) + 1
        stage(f"\n[5] 固定的池子（{nb} 块 = 两个 {P} token 请求的 full 缓存）：{R} 个长请求（各 {P} + {new} token）一起来 ...")
        rows, res = [], {}
        for st in (Setting(), parse(p["conc_setting"])):
            e = ch.engine(st, num_blocks=nb, max_batch_size=R, prefix=False, max_model_len=self.mml(P + new))
            _, stats = e.generate(reqs)
            ch.done(e)
            res[st.policy] = stats
            rows.append([st.label, stats.peak_running, stats.preemptions, f"{stats.wall_s:.1f}", f"{stats.tokens_per_s:.1f}"])
        self.fig["concurrent_long_requests_full"] = res["full"].peak_running
        self.fig["concurrent_long_requests_sinks"] = res["sinks"].peak_running
        self.fig["fixed_pool_throughput_ratio_sinks_vs_full"] = round(res["sinks"].tokens_per_s / res["full"].tokens_per_s, 3)
        print(f"机器: {machine()}")
        print(table(["设置", "峰值并发", "抢占", "墙钟 (s)", "输出 token/s"], rows))

    def speed(self):
        ch, p = self.ch, self.p
        new = p["decode_new"]
        P = p["decode_context"] - new
        stage(f"\n[5] decode 一步：{P} token 的上下文之后生成 {new} 个（每步中位数）...")
        rows, dec = [], {}
        for st in map(parse, p["decode_settings"]):
            e = ch.engine(st, num_blocks=pool_blocks(st, P + new, ch.chunk, ch.bs, new), prefix=False,
                          max_model_len=self.mml(P + new))
            run = run_one(e, greedy_request(self.text[:P], new))
            ch.done(e)
            dec[st.label] = run.decode_step_s
        for label, t in dec.items():
            ratio = t / dec[FULL_LABEL]
            if label != FULL_LABEL:
                self.fig[f"decode_step_ratio_{label}_vs_full_{ktok(p['decode_context'])}"] = round(ratio, 3)
            rows.append([label, f"{t * 1e3:.1f}", f"{ratio:.2f}"])
        sinks = next((x for x in dec if x.startswith("sinks")), None)
        if sinks:
            self.fig[f"decode_step_ratio_vs_full_{ktok(p['decode_context'])}"] = round(dec[sinks] / dec[FULL_LABEL], 3)
        print(f"机器: {machine()}")
        print(table(["设置", "decode 一步 (ms)", "÷ full"], rows))
        self.under_budget()

    def under_budget(self):
        """从不超出预算的请求：每个策略与 step09 的 decode 一步（交替跑，取中位数）。只量、只印比值，不断言。"""
        ch, p = self.ch, self.p
        P, new, B, reps = p["under_prompt"], p["under_new"], p["under_budget"], p["repeats"]
        stage(f"\n[5] 没超预算的请求（{P} + {new} token，预算 {B}）：decode 一步 vs step09，{reps} 轮交替取中位数 ...")
        from step09_speculative import engine as step09
        nb = blocks_for(P + new, ch.bs) + 1
        engines = {"step09": ch.engine(num_blocks=nb, step=step09), "full": ch.engine(num_blocks=nb)}
        for policy in ("window", "sinks", "h2o", "snapkv"):
            engines[policy] = ch.engine(Setting(policy, B), num_blocks=nb)
        times, evicted = {k: [] for k in engines}, 0
        for _ in range(reps + 1):                      # 第一轮是预热，不算
            for name, e in engines.items():
                run = run_one(e, greedy_request(self.text[:P], new))
                times[name].append(run.decode_step_s)
                evicted += run.max_evicted
        ch.done(*engines.values())
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        rows = []
        for name, t in med.items():
            ratio = t / med["step09"]
            if name != "step09":
                self.fig[f"decode_step_ratio_under_budget_{name}_vs_step09"] = round(ratio, 3)
            rows.append([name, f"{t * 1e3:.2f}", f"{ratio:.3f}"])
        print(f"机器: {machine()}（驱逐了 {evicted} 个 token：应为 0）")
        print(table(["引擎 / 策略", "decode 一步 (ms)", "÷ step09"], rows))


def asked_after_compaction(trace, context_len: int, q: int) -> bool:
    """"压缩之后才问"真的如此：有一次前向恰好算到上下文的末尾，它之后驱逐了；下一次前向只算问题（q 个），之后没有驱逐。"""
    computed = [c for c, _, _ in trace]
    evicted = [v for _, _, v in trace]
    if context_len not in computed:
        return False
    i = computed.index(context_len)
    before = evicted[i - 1] if i else 0
    return (evicted[i] > before and i + 1 < len(trace) and computed[i + 1] == context_len + q
            and evicted[i + 1] == evicted[i])
