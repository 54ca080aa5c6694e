"""step08_kv_quant：KV cache 存成 int8 / fp8（外加每个 token、每个头一个 scale），以及换出式抢占。

章节模式：
[1] 精确模式（--kv-dtype 等于模型 dtype，默认）与 step07 的输出和每一次前向都相同；
    换出式抢占（--preempt swap）在逼出抢占的小池子上与 step03（单请求、没有抢占）逐 token 相同；
[2] 量化的数学在真实的 K/V 上：int8 读回与原值最多差半个台阶；字节公式等于池子张量的实际大小；
[3] 质量（有损，量出来，不声称相等）：章节提示词 + 长提示词，teacher forcing 下 top-1 一致率、|Δ logit|、NLL 变化，
    贪心生成第一次分歧的位置与精确模型在那里的 top-2 差；
[4] 内存与速度：每 token 字节、同样 MiB 预算下池子放得下的 token 数与峰值并发、吞吐（含反量化的代价）；
[5] 换出 vs 重算：同一组抢占的字节与时间，以及随上下文长度的交叉点。

    python step08_kv_quant/run.py [--quick] [--json]                                     # 章节模式
    python step08_kv_quant/run.py --prompt "..." --kv-dtype int8 --preempt swap          # 生成模式
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common import cli  # noqa: E402
from common.bench import machine, median_time, table  # noqa: E402
from common.compare import MARGIN_TOL, compare  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.prompts import CHAPTER_PROMPTS, LONG_PROMPT  # noqa: E402
from step02_sampling.sampler import SamplingParams, draw_margin, params_from_args  # noqa: E402
from step03_kvcache_single.cache import PreallocKVCache  # noqa: E402
from step03_kvcache_single.engine import forward, generate as generate03  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402
from step05_paged.engine import DEFAULT_KV_MIB, blocks_needed  # noqa: E402
from step05_paged.run import stage  # noqa: E402
from step06_prefix_cache.run import pool_is_idle  # noqa: E402
from step06_prefix_cache.workload import parallel_samples  # noqa: E402
from step07_chunked_prefill.engine import ChunkedPrefillEngine  # noqa: E402
from step07_chunked_prefill.run import check_budget, forward_shapes, make_parser as chunked_parser  # noqa: E402
from step07_chunked_prefill.workload import check_workload, mid_prefill_preemption_workload  # noqa: E402
from step08_kv_quant.engine import PREEMPT_CHOICES, KVQuantEngine, num_blocks_for_mib, pool_bytes_per_token  # noqa: E402
from step08_kv_quant.paged_quant import KV_DTYPE_CHOICES, QuantPagedKVCache, kv_format  # noqa: E402
from step08_kv_quant.quality import first_divergence, pool as pool_quality, teacher_forced_quality  # noqa: E402
from step08_kv_quant.swap_cost import crossover, measure_swap_vs_recompute  # noqa: E402

STEP = "step08_kv_quant"
LOSSY = ("int8", "fp8")


def make_parser():
    p = chunked_parser()                                 # step07 的全部参数
    p.description = __doc__.splitlines()[0]
    for a in p._actions:                                 # step07 的两个画图参数在这一步没有用
        if a.dest in ("plot", "plot_timeline"):
            a.help = "（step07 的章节图；本步不画）"
    g = p.add_argument_group("KV 量化与换出")
    g.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default=None,
                   help="KV 池子的存法（默认：模型的 dtype，精确，与 step07 相同）；int8 / fp8 每个 (token, 头) 一个 scale")
    g.add_argument("--preempt", choices=PREEMPT_CHOICES, default="recompute",
                   help="池子满了怎么让出块：recompute（扔掉 KV、之后重算，step05 起的做法）或 swap（换出到 CPU 内存、之后换回）")
    return p


class Chapter:
    def __init__(self, args, s: cli.Session):
        self.args, self.s, self.quick = args, s, args.quick
        self.tol, self.eos, self.bs, self.B = MARGIN_TOL[s.dtype], s.tok.eos_ids, args.block_size, args.max_batch_size
        self.budget = args.max_num_batched_tokens
        self.num_blocks = args.num_blocks or num_blocks_for_mib(s.cfg, self.bs, s.dtype, None, DEFAULT_KV_MIB)
        self.checks, self.notes, self.figures = {}, [], {}
        self.engines = []

    def engine(self, cls=KVQuantEngine, num_blocks=None, budget=None, max_batch_size=None, **kw):
        e = cls(self.s.model, num_blocks or self.num_blocks, self.bs, max_batch_size or self.B, budget or self.budget, **kw)
        self.engines.append(e)
        return e

    def compare_all(self, name, reqs, refs, outs) -> bool:
        res = [compare(f"{name}#{i}", r.prompt_ids, ref, got, self.s.full_logits, self.tol, draw_margin(r.params))
               for i, (r, ref, got) in enumerate(zip(reqs, refs, outs))]
        self.notes.extend(c.describe() for c in res if not c.equal)
        return all(c.ok for c in res)

    # ---------- [1] 精确模式 = step07；换出 = step03 ----------
    @torch.inference_mode()
    def exactness(self):
        s = self.s
        # 正确性的负载在完整模式下也用 step07 的 --quick 那一份：检查的是"相同"，不需要更大的负载
        reqs = [Request(r.prompt_ids, r.max_new_tokens, r.params, ignore_eos=True) for r in check_workload(s.tok, True)]
        pre_reqs, small, budget = mid_prefill_preemption_workload(s.tok)
        stage(f"[1] 精确模式 vs step07（{len(reqs)} 个请求 + 小池子 {small} 块的抢占负载）；换出式抢占 vs step03 ...")
        ok = True
        rows = []
        for label, kw in ((f"--kv-dtype {s.dtype_name}", {"kv_dtype": s.dtype_name}), ("默认（模型 dtype）", {})):
            for wl, rq, nb, bud in (("短负载", reqs, None, None), ("小池子", pre_reqs, small, budget))[:2 if kw else 1]:
                ref, st7 = self.engine(ChunkedPrefillEngine, nb, bud).generate(rq, self.eos)
                out, st8 = self.engine(num_blocks=nb, budget=bud, **kw).generate(rq, self.eos)
                same = out == ref and forward_shapes(st8) == forward_shapes(st7)
                ok &= same
                rows.append([label, wl, st8.num_forwards, st8.preemptions, "输出与每一次前向都相同" if same else "不同"])
        self.checks["exact_mode_equals_step07"] = ok
        # 换出：与 step03（每个请求单独跑、从不被抢占）逐 token 比较；两个负载都要真的发生换出
        ok, swaps = True, 0
        dec = self.decode_workload()
        for wl, rq, nb, bud in (("小池子", pre_reqs, small, budget), ("decode 负载 + 紧池子", dec, self.tight_blocks(dec), None)):
            refs = [generate03(s.model, r.prompt_ids, r.max_new_tokens, r.params, self.eos, r.ignore_eos) for r in rq]
            e = self.engine(num_blocks=nb, budget=bud, preempt="swap")
            out, st = e.generate(rq, self.eos)
            same = self.compare_all(f"swap_{wl}", rq, refs, out)
            ok &= same
            swaps += e.last_swap.swap_outs
            rows.append(["--preempt swap", wl, st.num_forwards, f"{st.preemptions}（换出 {e.last_swap.swap_outs}）",
                         "与 step03 相同" if same else "不同"])
        self.checks["swap_equals_step03_with_preemptions"] = ok and swaps > 0
        print(table(["模式", "负载", "前向次数", "抢占", "结果"], rows))

    def tight_blocks(self, reqs) -> int:
        """比最大的一个请求多 1 块的池子：几个请求一起 decode、各自要新块时一定会抢占。"""
        return max(blocks_needed(r, self.bs) for r in reqs) + 1

    def decode_workload(self) -> list[Request]:
        """换出用的第二个负载：4 个短提示词各生成几十个 token（贪心与带种子采样各半）——被抢占的是正在 decode 的请求。"""
        text = self.s.tok.encode(LONG_PROMPT)
        n_new = 24 if self.quick else 40
        return [Request(text[11 * i:11 * i + n], n_new, SamplingParams(temperature=0.8, top_p=0.95, seed=6000 + i)
                        if i % 2 else SamplingParams(), ignore_eos=True) for i, n in enumerate([20, 14, 30, 9])]

    # ---------- [2] 量化的数学在真实 K/V 上；字节公式 ----------
    @torch.inference_mode()
    def round_trip_and_bytes(self):
        s, cfg = self.s, self.s.cfg
        stage("\n[2] 真实 K/V 的量化往返误差；每 token 字节公式 vs 张量大小 ...")
        ids = s.tok.encode(LONG_PROMPT)[:64 if self.quick else 512]
        cache = PreallocKVCache(cfg, len(ids), s.device, s.dtype)
        forward(s.model, cache, ids, 0)                                   # 精确的 K/V：cache.kv (layers, 2, 1, H_kv, T, D)
        rows, ok_int8 = [], True
        for name in LOSSY:
            fmt = kv_format(name, s.dtype)
            nb = -(-len(ids) // self.bs)
            pool = QuantPagedKVCache(cfg, nb, self.bs, s.device, s.dtype, fmt)
            table_ = list(range(nb))
            worst, rel_k, rel_v = 0.0, [], []
            for layer in range(cfg.num_layers):
                for kv in range(2):
                    x = cache.kv[layer, kv, 0, :, :len(ids)]                      # (H_kv, T, D)
                    # 按槽写进池子（与引擎同一个写函数：encode + 按块号 / 块内偏移写）
                    pos = torch.arange(len(ids), device=s.device)
                    c, sc = fmt.encode(x.transpose(0, 1))                        # (T, H_kv, D), (T, H_kv, 1)
                    pool.pool[layer, kv, pos // self.bs, :, pos % self.bs] = c
                    pool.scales[layer, kv, pos // self.bs, :, pos % self.bs] = sc
                for kv, (back, scale) in enumerate(pool.read_tokens(layer, table_, len(ids))):
                    x = cache.kv[layer, kv, 0, :, :len(ids)].float()                   # (H_kv, T, D)
                    err = (back.float() - x).abs()
                    if name == "int8":
                        worst = max(worst, float((err / (scale / 2)).max()))           # 以半个台阶为单位
                    (rel_k if kv == 0 else rel_v).append(float(err.norm() / x.norm()))
            if name == "int8":
                ok_int8 = worst <= 1 + 1e-5
            rows.append([name, f"{statistics.mean(rel_k):.3%}", f"{statistics.mean(rel_v):.3%}",
                         f"{worst:.4f}" if name == "int8" else "-"])
        self.checks["int8_round_trip_within_half_a_scale_step"] = ok_int8
        print(f"{len(ids)} 个 token 的长提示词，每层的 K、V 写进量化池子再读回（每个 (token, 头) 一个 scale）：")
        print(table(["格式", "K 相对误差（各层平均）", "V 相对误差", "最大误差 ÷ 半个台阶（int8，≤ 1）"], rows))
        # 字节：公式 × 槽数 = 池子张量的实际字节数
        brows, ok = [], True
        f32 = cfg.kv_bytes_per_token(4)
        for name in [s.dtype_name] + [n for n in KV_DTYPE_CHOICES if n != s.dtype_name]:
            e = self.engine(num_blocks=8, kv_dtype=name)
            per_token = e.bytes_per_token()
            expect = (8 + 1) * self.bs * per_token                           # 池子多一块空块
            ok &= e.pool_nbytes == expect
            brows.append([name + ("（精确）" if e.fmt is None else ""), f"{per_token:.0f}", f"{per_token / f32:.3f}",
                          e.pool_nbytes, "相等" if e.pool_nbytes == expect else "不等"])
            if name == "int8":
                self.figures["kv_bytes_per_token_ratio"] = round(per_token / f32, 4)
                self.figures["int8_bytes_per_token"] = per_token
            if name == "fp8":
                self.figures["fp8_kv_bytes_per_token_ratio"] = round(per_token / f32, 4)
        self.figures["float32_bytes_per_token"] = f32
        self.checks["bytes_formula_equals_tensor_sizes"] = ok
        print(table(["--kv-dtype", "每 token 字节（含 scale）", "÷ float32", "8 块的池子实际字节", "公式 × 槽数"], brows))

    # ---------- [3] 质量 ----------
    @torch.inference_mode()
    def quality(self):
        s = self.s
        n_new = 8 if self.quick else 32
        texts = CHAPTER_PROMPTS[:2] if self.quick else CHAPTER_PROMPTS + [("long", LONG_PROMPT, False)]
        prompts = [s.encode(t, chat) for _, t, chat in texts]
        reqs = [Request(ids, n_new, SamplingParams(), ignore_eos=True) for ids in prompts]
        stage(f"\n[3] 质量：{len(texts)} 段文本（{', '.join(n for n, _, _ in texts)}），各生成 {n_new} 个 token ...")
        exact, _ = self.engine().generate(reqs, self.eos)
        rows = []
        for name in LOSSY:
            fmt = kv_format(name, s.dtype)
            qs, divs = [], []
            got, _ = self.engine(kv_dtype=name).generate(reqs, self.eos)
            for (label, _, _), ids, ref, out in zip(texts, prompts, exact, got):
                seq = ids + ref                                              # teacher forcing：喂精确模式的贪心输出
                ref_logits = s.full_logits(seq)[:-1]                         # (T-1, V)：第 t 行预测 seq[t+1]
                got_logits = self.paged_logits(fmt, seq)[:-1]
                qs.append(teacher_forced_quality(ref_logits, got_logits, torch.tensor(seq[1:], device=s.device)))
                d = first_divergence(ids, ref, out, s.full_logits)
                divs.append(d)
                self.notes.append(d.describe(f"{name} {label}"))
            q = pool_quality(qs)
            first = [d.position for d in divs if d.position is not None]
            rows.append([name, q.positions, f"{q.top1_agreement:.4f}", f"{q.mean_abs_dlogit:.4f}", f"{q.max_abs_dlogit:.3f}",
                         f"{q.nll_delta_fraction:+.4%}", f"{q.ppl_ref:.3f} → {q.ppl_got:.3f}",
                         f"{len(divs) - len(first)} / {len(divs)}", min(first) if first else "-"])
            prefix = "" if name == "int8" else "fp8_"
            self.figures.update({f"{prefix}top1_agreement": round(q.top1_agreement, 5),
                                 f"{prefix}nll_delta_fraction": round(q.nll_delta_fraction, 6),
                                 f"{prefix}mean_abs_dlogit": round(q.mean_abs_dlogit, 5),
                                 f"{prefix}max_abs_dlogit": round(q.max_abs_dlogit, 4),
                                 f"{prefix}greedy_identical_texts": len(divs) - len(first)})
        print(f"teacher forcing：每段文本 = 提示词 + 精确模式的 {n_new} 个贪心 token，量化池子整段 prefill（token 粒度的码与写入先后无关）"
              f"与精确模型逐位置比；贪心：两边各自生成 {n_new} 个 token")
        print(table(["--kv-dtype", "位置数", "top-1 一致率", "平均 |Δlogit|", "最大 |Δlogit|", "NLL 变化", "困惑度",
                     "贪心完全相同", "最早分歧位置"], rows))

    @torch.inference_mode()
    def paged_logits(self, fmt, ids: list[int]) -> torch.Tensor:
        """ids 整段 prefill 进量化的分页池子，返回每个位置的 logits (T, V)。"""
        from step05_paged.sequence import Sequence
        nb = -(-len(ids) // self.bs)
        cache = QuantPagedKVCache(self.s.cfg, nb, self.bs, self.s.device, self.s.dtype, fmt)
        seq = Sequence(Request(ids, 1), None, block_table=list(range(nb)))
        fwd = cache.plan([seq])
        return self.s.model(fwd.input_ids, fwd.positions, fwd)[0]

    # ---------- [4] 容量、并发、吞吐 ----------
    @torch.inference_mode()
    def capacity(self):
        s, cfg = self.s, self.s.cfg
        n, prompt_len, n_new = (8, 40, 16) if self.quick else (12, 96, 32)
        text = s.tok.encode(LONG_PROMPT)
        reqs = [Request(text[7 * i:7 * i + prompt_len], n_new, SamplingParams(), ignore_eos=True) for i in range(n)]
        f32 = cfg.kv_bytes_per_token(4)
        mib = 3 * (prompt_len + n_new) * f32 / 2**20                    # float32 的池子正好放下约 3 个请求
        B = n
        stage(f"\n[4] 同样 {mib:.2f} MiB 的 KV 预算：{n} 个请求（提示词 {prompt_len}、各生成 {n_new} 个 token），"
              f"批上限 {B} ...")
        repeats = 1 if self.quick else 3
        names = (["float32"] if s.dtype == torch.float32 else ["float32", s.dtype_name]) + list(LOSSY)
        results = {}
        for k in range(repeats):                                        # 交替跑，取中位数
            for name in names:
                fmt = kv_format(name, s.dtype)
                nb = num_blocks_for_mib(cfg, self.bs, s.dtype, fmt, mib)
                e = self.engine(num_blocks=nb, max_batch_size=B, kv_dtype=name)
                _, st = e.generate(reqs, self.eos)
                results.setdefault(name, []).append((nb, st))
        rows = []
        for name in names:
            nb, _ = results[name][0]
            sts = [st for _, st in results[name]]
            tps = statistics.median(st.tokens_per_s for st in sts)
            results[name] = (nb, sts[0], tps)
        base_nb, _, base_tps = results["float32"]
        for name in names:
            nb, st, tps = results[name]
            rows.append([name, f"{pool_bytes_per_token(cfg, self.bs, s.dtype, kv_format(name, s.dtype)):.0f}", nb * self.bs,
                         f"{nb / base_nb:.2f}", st.peak_running, st.preemptions, f"{tps:.1f}", f"{tps / base_tps:.2f}"])
        self.figures.update({
            "capacity_ratio_vs_float32": round(results["int8"][0] / base_nb, 3),
            "throughput_ratio_vs_float32": round(results["int8"][2] / base_tps, 3),
            "peak_running_int8": results["int8"][1].peak_running, "peak_running_float32": results["float32"][1].peak_running,
            "fp8_capacity_ratio_vs_float32": round(results["fp8"][0] / base_nb, 3),
            "fp8_throughput_ratio_vs_float32": round(results["fp8"][2] / base_tps, 3),
        })
        print(f"机器: {machine()}")
        print(table(["--kv-dtype", "每 token 字节", "池子容量（token）", "容量 ÷ float32", "峰值并发", "抢占",
                     f"吞吐 token/s（{repeats} 轮中位数）", "吞吐 ÷ float32"], rows))
        # 反量化的代价：同样多的块（都放得下全部请求），只比读路径
        roomy = sum(-(-(prompt_len + n_new) // self.bs) for _ in reqs)
        drows = []
        times = {}
        for k in range(repeats):
            for name in ["float32", "int8"]:
                e = self.engine(num_blocks=roomy, max_batch_size=B, kv_dtype=name)
                _, st = e.generate(reqs, self.eos)
                dec = [x.seconds for x in st.steps if not x.prefill]
                times.setdefault(name, []).append((statistics.median(dec), st.tokens_per_s,
                                                   sum(x.gather_bytes for x in st.steps)))
        for name in ["float32", "int8"]:
            ms = statistics.median(t[0] for t in times[name]) * 1e3
            drows.append([name, f"{ms:.1f}", f"{statistics.median(t[1] for t in times[name]):.1f}", times[name][0][2]])
        ratio = statistics.median(t[0] for t in times["int8"]) / statistics.median(t[0] for t in times["float32"])
        self.figures["decode_step_ms_ratio_int8_vs_float32_same_blocks"] = round(ratio, 3)
        print(f"同样 {roomy} 块（不抢占、同样的批）：只比读路径——int8 读 1/4 的字节，但每层多一次反量化（码 × scale → 新张量）")
        print(table(["--kv-dtype", "decode 一步 (ms，中位数)", "吞吐 token/s", "读池子的字节（全部前向）"], drows))

    # ---------- [5] 换出 vs 重算 ----------
    @torch.inference_mode()
    def swap_vs_recompute(self):
        s = self.s
        reqs, small, budget = mid_prefill_preemption_workload(s.tok)
        more = self.decode_workload()
        stage("\n[5] 换出 vs 重算：同样的抢占，换出搬了多少、花了多久；重算同样多的 token 要多久 ...")
        rows, swap_s, recompute_s, swap_bytes = [], 0.0, 0.0, 0
        for wl, rq, nb, bud in (("小池子", reqs, small, budget), ("decode 负载 + 紧池子", more, self.tight_blocks(more), None)):
            e = self.engine(num_blocks=nb, budget=bud, preempt="swap")
            _, st = e.generate(rq, self.eos)
            c = e.last_swap
            _, st_r = self.engine(num_blocks=nb, budget=bud).generate(rq, self.eos)      # 同一负载，重算式抢占
            redo = sum(self.prefill_seconds(n) for n in c.tokens)                        # 重算这些 token 的 prefill 时间
            rows.append([wl, f"{c.swap_outs}（{sum(c.tokens)} token）", c.bytes_out + c.bytes_in,
                         f"{(c.seconds_out + c.seconds_in) * 1e3:.2f}", f"{redo * 1e3:.1f}",
                         f"{st_r.preemptions}（多算 {st_r.prefill_tokens - st.prefill_tokens} token）"])
            swap_s += c.seconds_out + c.seconds_in
            recompute_s += redo
            swap_bytes += c.bytes_out + c.bytes_in
        print(f"机器: {machine()}")
        print(table(["负载", "换出次数（换出的 token）", "搬运字节（出 + 入）", "换出 + 换入 (ms)",
                     "prefill 同样多 token (ms)", "重算模式：抢占（比换出模式多算的 prefill）"], rows))
        self.figures["swap_vs_recompute_time_ratio"] = round(swap_s / recompute_s, 4)
        self.figures["swap_bytes"] = swap_bytes
        self.figures["swap_seconds"] = round(swap_s, 5)
        self.figures["recompute_seconds"] = round(recompute_s, 4)
        print("重算模式的抢占里，被抢占请求已登记进前缀缓存、还没被驱逐的块会直接命中，实际多算的 token 可能少于换出的 token。")
        # 交叉点：不同上下文长度下，换出 + 换入 ⌈n / 块⌉ 块 vs prefill n 个 token
        lengths = [16, 64] if self.quick else [16, 64, 256, 1024]
        lengths = [n for n in lengths if n <= s.cfg.max_position_embeddings]
        crows = []
        for name in (s.dtype_name, "int8"):
            fmt = kv_format(name, s.dtype)
            res = measure_swap_vs_recompute(s.model, lengths, self.bs, repeats=1 if self.quick else 3,
                                            scheme=None if fmt is None else (fmt.scheme, fmt.scheme))
            for r in res:
                crows.append([name, r.tokens, r.swap_bytes, f"{r.swap_s * 1e3:.2f}", f"{r.recompute_s * 1e3:.1f}",
                              f"{r.swap_over_recompute:.4f}", f"{r.copy_bandwidth / 1e9:.1f}", f"{r.break_even_bandwidth / 1e9:.3f}"])
            x = crossover(res)
            self.notes.append(f"{name}: swap/recompute crossover " + (f"at {x:.0f} tokens" if x is not None else
                              f"not within {lengths[0]}–{lengths[-1]} tokens (one side always cheaper)"))
            if name == "int8":
                self.figures["int8_swap_over_recompute_at_max_len"] = round(res[-1].swap_over_recompute, 5)
            else:
                self.figures["swap_over_recompute_at_max_len"] = round(res[-1].swap_over_recompute, 5)
                if x is not None:
                    self.figures["swap_crossover_tokens"] = round(x, 1)
        print(table(["池子", "上下文 (token)", "单程字节", "换出 + 换入 (ms)", "重算 prefill (ms)", "换出 ÷ 重算",
                     "实测拷贝带宽 (GB/s)", "换出更快所需带宽 (GB/s)"], crows))

    def prefill_seconds(self, n: int) -> float:
        if n not in self._prefill_s:
            cfg, s = self.s.cfg, self.s
            ids = s.tok.encode(LONG_PROMPT)[:1] * n
            self._prefill_s[n] = median_time(lambda: forward(s.model, PreallocKVCache(cfg, n, s.device, s.dtype), ids, 0),
                                             repeats=1 if self.quick else 3, warmup=1, device=s.device)
        return self._prefill_s[n]

    def run(self) -> bool:
        self._prefill_s = {}
        self.exactness()
        self.round_trip_and_bytes()
        self.quality()
        self.capacity()
        self.swap_vs_recompute()
        self.checks["every_tier_empty_at_the_end"] = all(
            pool_is_idle(e) and (getattr(e, "swap", None) is None or e.swap.num_used == 0) for e in self.engines)
        cli.print_checks(self.checks, self.notes)
        if self.args.json:
            cli.emit_json(cli.chapter_json(STEP, self.s, self.checks, self.figures))
        return all(self.checks.values())


def main(args) -> bool:
    params = params_from_args(args)
    stop = tuple(args.stop or ())
    if any(not t for t in stop):
        raise UserError("--stop must not be empty")
    check_budget(args)
    if args.preempt == "swap" and args.no_chunked_prefill:
        raise UserError("--preempt swap works with chunked prefill only (drop --no-chunked-prefill)")
    s = cli.load_session(args)
    if args.prompt is None:
        return Chapter(args, s).run()
    fmt = kv_format(args.kv_dtype, s.dtype)
    num_blocks = args.num_blocks or num_blocks_for_mib(s.cfg, args.block_size, s.dtype, fmt, DEFAULT_KV_MIB)
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]
    requests = [q for ids in prompt_ids
                for q in parallel_samples(Request(ids, args.max_new_tokens, params, args.ignore_eos, stop), args.n)]
    prompts = [p for p in args.prompt for _ in range(args.n)]
    engine = KVQuantEngine(s.model, num_blocks, args.block_size, args.max_batch_size, args.max_num_batched_tokens,
                           chunked_prefill=not args.no_chunked_prefill, prefix_caching=not args.no_prefix_cache,
                           kv_dtype=args.kv_dtype, preempt=args.preempt)
    engine.check_fits(requests)
    outputs, st = engine.generate(requests, s.tok.eos_ids, s.tok)
    cli.print_generations(s, prompts, outputs)
    kv = "精确（模型 dtype）" if fmt is None else f"{fmt.name}（有损）"
    sw = engine.last_swap
    print(f"\nKV 存法 {kv}：每 token {engine.bytes_per_token():.0f} 字节；池子 {num_blocks} 块 × {args.block_size} token；"
          f"{st.num_forwards} 次前向，抢占 {st.preemptions} 次（换出 {sw.swap_outs}，{sw.bytes_out + sw.bytes_in} 字节），"
          f"峰值并发 {st.peak_running}")
    if args.json:
        out = cli.generation_json(s, prompts, [r.prompt_ids for r in requests], outputs)
        for res, cached in zip(out["results"], st.cached_tokens):
            res["cached_tokens"] = cached
        out["stats"] = {"num_blocks": num_blocks, "block_size": args.block_size, "forwards": st.num_forwards,
                        "kv_dtype": fmt.name if fmt else s.dtype_name, "bytes_per_token": engine.bytes_per_token(),
                        "preemptions": st.preemptions, "swap_outs": sw.swap_outs,
                        "swap_bytes": sw.bytes_out + sw.bytes_in, "peak_running": st.peak_running}
        cli.emit_json(out)
    return True


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
