"""step08 的章节模式（run.py 不带 --prompt 时调用）：

[1] 精确模式（--kv-dtype 等于模型 dtype，默认）与 step07 的输出和每一次前向都相同；
    换出式抢占（--preempt swap）在逼出抢占的小池子上与 step03（单请求、没有抢占）逐 token 相同；
[2] 量化的数学在真实的 K/V 上：int8 读回与原值最多差半个台阶；字节公式等于池子张量的实际大小；
[3] 质量（有损，量出来，不声称相等）：章节提示词 + 长提示词，teacher forcing 下 top-1 一致率、|Δ logit|、NLL 变化，
    贪心生成第一次分歧的位置与精确模型在那里的 top-2 差；
[4] 内存与速度：每 token 字节、同样 MiB 预算下池子放得下的 token 数与峰值并发、吞吐（含反量化的代价）；
[5] 换出 vs 重算：同一组抢占的字节与时间，以及随上下文长度的交叉点。
"""
import statistics

import torch

from common import cli
from common.bench import machine, median_time, table
from common.compare import MARGIN_TOL, compare
from common.harness import Checks, finish, pool_is_free, stage
from common.prompts import CHAPTER_PROMPTS, LONG_PROMPT
from step02_sampling.sampler import SamplingParams, draw_margin
from step03_kvcache_single.cache import PreallocKVCache
from step03_kvcache_single.engine import forward, generate as generate03
from step04_static_batching.request import Request
from step07_chunked_prefill import engine as step07
from step07_chunked_prefill.analysis.workload import check_workload, mid_prefill_preemption_workload
from step08_kv_quant import engine as step08
from step08_kv_quant.analysis.quality import first_divergence, pool as pool_quality, teacher_forced_quality
from step08_kv_quant.analysis.swap_cost import crossover, measure_swap_vs_recompute
from step08_kv_quant.config import num_blocks_for_budget
from step08_kv_quant.engine import blocks_needed
from step08_kv_quant.gather import plan_segment
from step08_kv_quant.kv_cache import PagedKVCache
from step08_kv_quant.quant import KV_DTYPE_CHOICES, kv_format
from step08_kv_quant.sequence import Sequence

STEP = "step08_kv_quant"
LOSSY = ("int8", "fp8")


def read_tokens(cache: PagedKVCache, layer: int, block_table: list[int], length: int):
    """一个请求前 length 个位置反量化后的 K、V，以及 scale（各 (H_kv, length, ·)）：直接读池子，不经过引擎的读路径。"""
    blocks = torch.tensor(block_table, device=cache.pool.device)
    out = []
    for kv in range(2):
        c = cache.pool[layer, kv, blocks]                                          # (n, H_kv, bs, D)
        s = cache.scales[layer, kv, blocks] if cache.scales is not None else None  # (n, H_kv, bs, 1)
        flat = lambda t: t.transpose(0, 1).flatten(1, 2)[:, :length]               # noqa: E731  (n, H_kv, bs, ·) -> (H_kv, length, ·)
        out.append((cache.fmt.decode(flat(c), flat(s) if s is not None else None, cache.dtype),
                    flat(s) if s is not None else None))
    return out


class Chapter:
    def __init__(self, args, s: cli.Session):
        self.args, self.s, self.quick = args, s, args.quick
        self.tol, self.eos, self.bs, self.B = MARGIN_TOL[s.dtype], s.tok.eos_ids, args.block_size, args.max_batch_size
        self.budget = args.max_num_batched_tokens
        self.num_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, self.bs, s.dtype)
        self.checks, self.figures = Checks(), {}
        self.engines = []

    def engine(self, step=step08, num_blocks=None, budget=None, max_batch_size=None, **kw):
        """step08 的引擎（kw：kv_dtype、preempt），或 step=step07 的引擎（参考）。"""
        config = step.EngineConfig(num_blocks or self.num_blocks, self.bs, max_batch_size or self.B,
                                   budget or self.budget, attention=self.args.attention, **kw)
        e = step.LLMEngine(self.s.model, config, self.s.tok, self.eos)
        self.engines.append(e)
        return e

    def bytes_per_token(self, name) -> float:
        """--kv-dtype name 时池子里每个 token 的字节（含 scale）。"""
        fmt = kv_format(name, self.s.dtype)
        return PagedKVCache.bytes_per_block(self.s.cfg, self.bs, self.s.dtype, fmt) / self.bs

    def compare_all(self, name, reqs, refs, outs) -> bool:
        res = [compare(f"{name}#{i}", r.prompt_ids, ref, got, self.s.full_logits, self.tol, draw_margin(r.params))
               for i, (r, ref, got) in enumerate(zip(reqs, refs, outs))]
        for c in res:
            if not c.equal:
                self.checks.note(c.describe())
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
        rows, refs = [], {}                          # step07 的参照每个负载只跑一次：两种写法比的是同一份
        for label, kw in ((f"--kv-dtype {s.dtype_name}", {"kv_dtype": s.dtype_name}), ("默认（模型 dtype）", {})):
            for wl, rq, nb, bud in (("短负载", reqs, None, None), ("小池子", pre_reqs, small, budget))[:2 if kw else 1]:
                if wl not in refs:
                    refs[wl] = self.engine(step07, nb, bud).generate(rq)
                ref, st7 = refs[wl]
                out, st8 = self.engine(num_blocks=nb, budget=bud, **kw).generate(rq)
                same = out == ref and st8.forward_shapes == st7.forward_shapes
                ok &= same
                rows.append([label, wl, st8.num_forwards, st8.preemptions, "输出与每一次前向都相同" if same else "不同"])
        self.checks["exact_mode_equals_step07"] = ok
        # 换出：与 step03（每个请求单独跑、从不被抢占）逐 token 比较；两个负载都要真的发生换出
        ok, swaps = True, 0
        dec = self.decode_workload()
        for wl, rq, nb, bud in (("小池子", pre_reqs, small, budget), ("decode 负载 + 紧池子", dec, self.tight_blocks(dec), None)):
            refs = [generate03(s.model, r.prompt_ids, r.max_new_tokens, r.params, self.eos, r.ignore_eos) for r in rq]
            e = self.engine(num_blocks=nb, budget=bud, preempt="swap")
            out, st = e.generate(rq)
            same = self.compare_all(f"swap_{wl}", rq, refs, out)
            ok &= same
            swaps += e.swap.num_swap_out
            rows.append(["--preempt swap", wl, st.num_forwards, f"{st.preemptions}（换出 {e.swap.num_swap_out}）",
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
            pool = PagedKVCache(cfg, nb, self.bs, s.device, s.dtype, fmt=fmt)
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
                for kv, (back, scale) in enumerate(read_tokens(pool, layer, table_, len(ids))):
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
            per_token = self.bytes_per_token(name)
            expect = (8 + 1) * self.bs * per_token                           # 池子多一块空块
            nbytes = e.kv_cache.nbytes
            ok &= nbytes == expect
            brows.append([name + ("（精确）" if e.kv_cache.fmt is None else ""), f"{per_token:.0f}", f"{per_token / f32:.3f}",
                          nbytes, "相等" if nbytes == expect else "不等"])
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
        exact, _ = self.engine().generate(reqs)
        rows = []
        for name in LOSSY:
            fmt = kv_format(name, s.dtype)
            qs, divs = [], []
            got, _ = self.engine(kv_dtype=name).generate(reqs)
            for (label, _, _), ids, ref, out in zip(texts, prompts, exact, got):
                seq = ids + ref                                              # teacher forcing：喂精确模式的贪心输出
                ref_logits = s.full_logits(seq)[:-1]                         # (T-1, V)：第 t 行预测 seq[t+1]
                got_logits = self.paged_logits(fmt, seq)[:-1]
                qs.append(teacher_forced_quality(ref_logits, got_logits, torch.tensor(seq[1:], device=s.device)))
                d = first_divergence(ids, ref, out, s.full_logits)
                divs.append(d)
                self.checks.note(d.describe(f"{name} {label}"))
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
        nb = -(-len(ids) // self.bs)
        cache = PagedKVCache(self.s.cfg, nb, self.bs, self.s.device, self.s.dtype, fmt=fmt)
        seq = Sequence(0, Request(ids, 1), torch.Generator(), 0.0, block_table=list(range(nb)))
        fwd = plan_segment(cache, [seq], [len(ids)])                 # 一段整段 prefill（gather.py）：每个位置都要 logits
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
                nb = num_blocks_for_budget(cfg, self.bs, s.dtype, mib, kv_dtype=name)
                e = self.engine(num_blocks=nb, max_batch_size=B, kv_dtype=name)
                _, st = e.generate(reqs)
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
            rows.append([name, f"{self.bytes_per_token(name):.0f}", nb * self.bs,
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
                _, st = e.generate(reqs)
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
            _, st = e.generate(rq)
            c = e.swap                                                                   # 这个引擎的换出账（它只跑了这一次）
            _, st_r = self.engine(num_blocks=nb, budget=bud).generate(rq)                # 同一负载，重算式抢占
            redo = sum(self.prefill_seconds(n) for n in c.tokens_out)                    # 重算这些 token 的 prefill 时间
            rows.append([wl, f"{c.num_swap_out}（{sum(c.tokens_out)} token）", c.bytes_out + c.bytes_in,
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
        print("重算模式的抢占里，被抢占请求已登记进前缀缓存、还没被回收的块会直接命中，实际多算的 token 可能少于换出的 token。")
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
            self.checks.note(f"{name}: swap/recompute crossover " + (f"at {x:.0f} tokens" if x is not None else
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
            pool_is_free(e) and (getattr(e, "swap", None) is None or e.swap.num_used == 0) for e in self.engines)
        return finish(STEP, self.s, self.checks, self.figures, self.args.json)
