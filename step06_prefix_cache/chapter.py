"""step06 的章节模式（run.py 不带 --prompt 时调用）：三种负载，每种都在同一次运行里先跑 step05、再跑 step06，
逐请求比较 token：(a) 共享系统提示词；(b) 多轮对话（每轮重发整段历史）；(c) 逼出回收与抢占的小池子（含并行采样）。
另外量 TTFT 随共享前缀长度的变化（--plot 存图），并在 (b) 上把基数树的 token 粒度匹配与整块匹配对照。
"""
import statistics
import time

import torch

from common import cli
from common.bench import machine, table
from common.compare import MARGIN_TOL, compare
from common.harness import Checks, finish, percentile, pool_is_free, stage
from common.prompts import LONG_PROMPT
from step02_sampling.sampler import draw_margin
from step03_kvcache_single.cache import PreallocKVCache
from step03_kvcache_single.engine import forward as forward_single
from step04_static_batching.request import Request
from step05_paged import engine as step05
from step06_prefix_cache.analysis.workload import (SYSTEM_PROMPT, conversations, first_turn, next_turn,
                                                   shared_prefix_workload, small_pool_workload)
from step06_prefix_cache.config import num_blocks_for_budget
from step06_prefix_cache.engine import EngineConfig, LLMEngine, blocks_needed
from step06_prefix_cache.radix_tree import RadixTree
from step06_prefix_cache.sequence import Sequence

STEP = "step06_prefix_cache"
KV_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}   # 命中块的 K/V 与重新 prefill 的相对差


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def block_aligned(n: int, length: int, bs: int) -> int:
    """块缓存能用上的 token 数：整块，且至少留最后一个 token 去算（它的 logits 给出第一个新 token）。"""
    return min(n, length - 1) // bs * bs


def run(engine, reqs):
    """engine.generate(reqs)，另外返回这次运行里回收了几块（块管理器的计数跟着引擎活，取差）。step05 的引擎没有回收。"""
    ev0 = getattr(engine.block_manager, "num_evictions", 0)
    outs, st = engine.generate(reqs)
    return outs, st, getattr(engine.block_manager, "num_evictions", 0) - ev0


def row(name, st, hit_rate, evictions="-"):
    tpot = [x for x in st.tpot_s() if x is not None]
    return [name, st.prefill_tokens, hit_rate, st.num_forwards, f"{st.wall_s:.1f}", f"{st.tokens_per_s:.1f}",
            f"{percentile(st.first_token_s, .5):.2f}", f"{percentile(st.first_token_s, .9):.2f}",
            f"{percentile(tpot, .5) * 1e3:.0f}" if tpot else "-", f"{st.kv_waste:.1%}",
            st.preemptions, evictions]


HEADERS = ["引擎", "prefill 算的 token", "命中率", "前向次数", "总时间 (s)", "吞吐 (token/s)", "TTFT p50 (s)",
           "TTFT p90 (s)", "TPOT p50 (ms)", "KV 浪费", "抢占", "回收"]


class Chapter:
    def __init__(self, args, s: cli.Session, engine_for):
        """engine_for：run.py 按命令行选引擎的那个函数（--no-prefix-cache → step05 的），(c) 检查它选对了。"""
        self.args, self.s, self.engine_for = args, s, engine_for
        self.tol, self.eos, self.bs = MARGIN_TOL[s.dtype], s.tok.eos_ids, args.block_size
        self.default_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, self.bs, s.dtype)
        self.checks, self.figures = Checks(), {}
        self.engines = []                                # 用过的引擎：最后检查引用计数都回到 0

    def step05(self, num_blocks, max_batch_size) -> step05.LLMEngine:
        config = step05.EngineConfig(num_blocks, self.bs, max_batch_size, attention=self.args.attention)
        e = step05.LLMEngine(self.s.model, config, self.s.tok, self.eos)
        self.engines.append(e)
        return e

    def step06(self, num_blocks, max_batch_size) -> LLMEngine:
        config = EngineConfig(num_blocks, self.bs, max_batch_size, attention=self.args.attention)
        e = LLMEngine(self.s.model, config, self.s.tok, self.eos)
        self.engines.append(e)
        return e

    def compare(self, name, reqs, refs, outs):
        """每个请求与 step05 的输出逐 token 比较（near-tie 规则见 common/compare.py）；返回 (贪心都对, 采样都对)。"""
        res = [compare(f"{name}#{i}", r.prompt_ids, ref, got, self.s.full_logits, self.tol, draw_margin(r.params))
               for i, (r, ref, got) in enumerate(zip(reqs, refs, outs))]
        for c in res:
            if not c.equal:
                self.checks.note(c.describe())
        seeded = [r.params.seed is not None for r in reqs]
        return (all(c.ok for c, sd in zip(res, seeded) if not sd), all(c.ok for c, sd in zip(res, seeded) if sd))

    # ---------- (a) 共享系统提示词 ----------
    def shared_prompt(self):
        s, bs, B = self.s, self.bs, self.args.max_batch_size
        reqs = shared_prefix_workload(s.tok, self.args.quick)
        lens = [len(r.prompt_ids) for r in reqs]
        stage(f"[a] 共享系统提示词：{len(reqs)} 个请求，提示词 {min(lens)}–{max(lens)} token（共同前缀 "
              f"{min(lcp(reqs[0].prompt_ids, r.prompt_ids) for r in reqs[1:])}），max_new_tokens "
              f"{reqs[0].max_new_tokens}；池子 {self.default_blocks} 块，批上限 {B}")
        o5, st5 = self.step05(self.default_blocks, B).generate(reqs)
        e6 = self.step06(self.default_blocks, B)
        o6, st6, ev6 = run(e6, reqs)
        self.checks["a_equals_step05"] = all(self.compare("a", reqs, o5, o6))
        # 设计好的负载：提示词互不为前缀、不回收，所以第 j 个请求命中的 = 与前面提示词的最长公共前缀，按块取整
        expected = [block_aligned(max((lcp(r.prompt_ids, q.prompt_ids) for q in reqs[:j]), default=0), len(r.prompt_ids), bs)
                    for j, r in enumerate(reqs)]
        self.checks["a_cached_tokens_equal_block_aligned_lcp"] = st6.cached_tokens == expected and ev6 == 0
        self.kv_of_hit_blocks(e6, reqs[-1].prompt_ids)

        repeats = 1 if self.args.quick else 3          # 完整模式：交替再各跑两轮，各取总时间居中的一轮
        runs5, runs6 = [st5], [st6]
        for _ in range(repeats - 1):
            runs5.append(self.step05(self.default_blocks, B).generate(reqs).stats)
            runs6.append(self.step06(self.default_blocks, B).generate(reqs).stats)
        st5 = sorted(runs5, key=lambda st: st.wall_s)[len(runs5) // 2]
        st6 = sorted(runs6, key=lambda st: st.wall_s)[len(runs6) // 2]
        print(f"\n(a) 共享系统提示词 —— 机器: {machine()}；{s.device}/{s.dtype_name}；"
              f"{'每个引擎只跑一次' if repeats == 1 else f'每个引擎跑 {repeats} 轮、取总时间居中的一轮'}")
        print(table(HEADERS, [row("step05", st5, "-"), row("step06", st6, f"{st6.hit_rate:.1%}", evictions=ev6)]))
        self.figures.update({
            "prefill_tokens_saved_fraction": round(1 - st6.prefill_tokens / st5.prefill_tokens, 4),
            "ttft_p50_ratio_vs_step05": round(percentile(st5.first_token_s, .5) / percentile(st6.first_token_s, .5), 3),
            "throughput_ratio_vs_step05": round(st6.tokens_per_s / st5.tokens_per_s, 3),
            "a_hit_rate": round(st6.hit_rate, 4),
            "a_prefill_tokens_step05": st5.prefill_tokens, "a_prefill_tokens_step06": st6.prefill_tokens,
            "a_tok_per_s_step05": round(st5.tokens_per_s, 3), "a_tok_per_s_step06": round(st6.tokens_per_s, 3),
            "a_ttft_p50_s_step05": round(percentile(st5.first_token_s, .5), 4),
            "a_ttft_p50_s_step06": round(percentile(st6.first_token_s, .5), 4),
            "a_num_requests": len(reqs), "block_size": bs, "max_batch_size": B, "num_blocks": self.default_blocks,
        })

    @torch.inference_mode()
    def kv_of_hit_blocks(self, engine, prompt_ids):
        """命中块里存的 K/V 与把这个提示词从头单独 prefill（step03 的连续缓存）写出的 K/V 比较。
        两次前向的矩阵形状不同（写块的是别的请求、别的长度），浮点末位可能不同，所以按相对误差比。"""
        s, bs = self.s, self.bs
        probe = Sequence(-1, Request(prompt_ids, 1), torch.Generator(), 0.0)
        blocks = engine.block_manager.match_prefix(probe).blocks
        dense = PreallocKVCache(s.cfg, len(prompt_ids), s.device, s.dtype)
        forward_single(s.model, dense, prompt_ids, start=0)
        pool = engine.kv_cache.pool                        # (layers, 2, num_blocks + 1, H_kv, block_size, D)
        cached = pool[:, :, blocks]                     # (layers, 2, n, H_kv, block_size, D)
        fresh = dense.kv[:, :, 0, :, :len(blocks) * bs].unflatten(3, (len(blocks), bs)).transpose(2, 3)
        # dense.kv[:, :, 0]: (layers, 2, H_kv, S, D) -> (layers, 2, H_kv, n, block_size, D) -> (layers, 2, n, H_kv, block_size, D)
        rel = float((cached.float() - fresh.float()).abs().max() / fresh.float().abs().max()) if blocks else float("nan")
        self.checks["hit_block_kv_equals_fresh_prefill"] = bool(blocks) and rel <= KV_TOL[s.dtype]
        self.checks.note(f"(a) 最后一个请求命中 {len(blocks)} 块：其中的 K/V 与单独 prefill 写出的相比，"
                          f"最大相对差 {rel:.1e}（容差 {KV_TOL[s.dtype]:.0e}）")

    # ---------- (b) 多轮对话 ----------
    def multi_turn(self):
        s, bs = self.s, self.bs
        convs = conversations(self.args.quick)
        n_turns, max_new = len(convs[0].questions), 16 if self.args.quick else 48
        B = max(self.args.max_batch_size, len(convs))
        stage(f"[b] 多轮对话：{len(convs)} 段 × {n_turns} 轮，每轮 max_new_tokens {max_new}；step06 的池子在各轮之间保留")
        e6 = self.step06(self.default_blocks, B)
        prompts = [first_turn(s.tok, c) for c in convs]
        computed: list[list[int]] = []                   # 已经算过 K/V 的 token 序列（暴力求最长公共前缀用）
        tree = RadixTree(self.default_blocks * bs)       # 同样容量、token 粒度的 SGLang 式索引（只模拟，不存 K/V）
        per_turn, all_reqs, all_cached, expected, radix, radix_exact = [], [], [], [], [], True
        retok_diff, retok_hit, ids_hit, first_diff = 0, 0, 0, None
        greedy_ok, tot5, tot6, evictions = True, [], [], 0
        for t in range(n_turns):
            reqs = [Request(ids, max_new) for ids in prompts]
            o5, st5 = self.step05(self.default_blocks, B).generate(reqs)
            o6, st6, ev6 = run(e6, reqs)
            greedy_ok &= self.compare(f"b.turn{t}", reqs, o5, o6)[0]
            for r in reqs:                               # 与 step06 的接纳顺序相同：先查，再把这个提示词记为已算
                ids = r.prompt_ids
                best = max((lcp(ids, c) for c in computed), default=0)
                expected.append(block_aligned(best, len(ids), bs))
                m = tree.match_prefix(ids).length
                radix_exact &= m == best
                radix.append(min(m, len(ids) - 1))
                computed.append(ids)
                tree.insert(ids)
            for r, out in zip(reqs, o6):                 # 这一轮结束：提示词 + 除最后一个以外的输出都有 K/V 了
                computed.append(r.prompt_ids + out[:-1])
                tree.insert(r.prompt_ids + out[:-1])
            all_reqs += reqs
            all_cached += st6.cached_tokens
            tot5.append(st5)
            tot6.append(st6)
            evictions += ev6
            per_turn.append([t + 1, round(statistics.mean(len(r.prompt_ids) for r in reqs)), st5.prefill_tokens,
                             st6.prefill_tokens, f"{st6.hit_rate:.1%}", f"{percentile(st5.first_token_s, .5):.2f}",
                             f"{percentile(st6.first_token_s, .5):.2f}"])
            if t + 1 < n_turns:                          # 下一轮：历史用 step05 的回复（与 step06 逐 token 相同）
                turns = [next_turn(s.tok, c, out) for c, out in zip(convs, o5)]
                for (ids, retok), c in zip(turns, computed[-len(convs):]):
                    retok_diff += ids != retok
                    ids_hit += block_aligned(lcp(ids, c), len(ids), bs)
                    retok_hit += block_aligned(lcp(retok, c), len(retok), bs)
                    if ids != retok and first_diff is None:
                        p = lcp(ids, retok)
                        first_diff = (p, s.tok.hf.convert_ids_to_tokens(ids[p:p + 3]),
                                      s.tok.hf.convert_ids_to_tokens(retok[p:p + 3]))
                prompts = [ids for ids, _ in turns]

        prompt_tokens = sum(len(r.prompt_ids) for r in all_reqs)
        hit_rate = sum(all_cached) / prompt_tokens
        pre5, pre6 = sum(st.prefill_tokens for st in tot5), sum(st.prefill_tokens for st in tot6)
        self.checks["b_equals_step05"] = greedy_ok
        self.checks["b_cached_tokens_equal_block_aligned_lcp"] = all_cached == expected and evictions == 0
        self.checks["radix_match_equals_brute_force_lcp"] = radix_exact and tree.num_evicted_tokens == 0
        print(f"\n(b) 多轮对话（{len(convs)} 段 × {n_turns} 轮）：每一轮的 TTFT 与 prefill 量")
        print(table(["轮", "提示词平均长度", "step05 prefill token", "step06 prefill token", "step06 命中率",
                     "step05 TTFT p50 (s)", "step06 TTFT p50 (s)"], per_turn))
        print(f"合计：提示词 {prompt_tokens} token，step05 prefill {pre5}，step06 prefill {pre6}（省 {1 - pre6 / pre5:.1%}），"
              f"命中率 {hit_rate:.1%}，回收 {evictions}")

        # 基数树 vs 整块：同样的请求序列、同样的容量
        block_total, radix_total = sum(all_cached), sum(radix)
        probes = [Sequence(-1, r, torch.Generator(), 0.0) for r in all_reqs]
        t0 = time.perf_counter()
        for probe in probes:
            e6.block_manager.match_prefix(probe)
        t_block = (time.perf_counter() - t0) / len(all_reqs)
        t0 = time.perf_counter()
        for r in all_reqs:
            tree.match_prefix(r.prompt_ids)
        t_radix = (time.perf_counter() - t0) / len(all_reqs)
        print("\n(b) token 粒度（基数树）vs 整块（块哈希链）：同样的请求、同样的容量")
        print(table(["索引", "匹配到的 token", "占提示词", "每次查找 (µs)", "索引条目"], [
            ["整块（step06 实测）", block_total, f"{block_total / prompt_tokens:.1%}", f"{t_block * 1e6:.0f}",
             f"{len(e6.block_manager.cached)} 块（每块一个 key、一个块号）"],
            ["基数树（模拟）", radix_total, f"{radix_total / prompt_tokens:.1%}", f"{t_radix * 1e6:.0f}",
             f"{tree.num_nodes()} 个节点、{tree.size} 个 token（每 token 一个槽号）"]]))
        print(f"基数树多找到 {radix_total - block_total} token（{radix_total / block_total:.3f} 倍），"
              f"即全部提示词的 {(radix_total - block_total) / prompt_tokens:.1%}")
        n_next = len(convs) * (n_turns - 1)
        print(f"\n重新编码的陷阱：把回复解码成文本、整段历史重新套模板编码，{n_next} 轮里有 {retok_diff} 轮得到的 token id "
              f"与真正发过的不同；按文本重发，这些轮能命中 {retok_hit} token，按 token id 重发能命中 {ids_hit} token")
        if first_diff:
            p, a, b = first_diff
            print(f"  例：第一处不同在位置 {p}：原来的 {a}，重新编码成 {b}")
        self.figures.update({
            "multi_turn_hit_rate": round(hit_rate, 4),
            "multi_turn_prefill_tokens_saved_fraction": round(1 - pre6 / pre5, 4),
            "radix_vs_block_matched_tokens_ratio": round(radix_total / block_total, 4),
            "retokenization_mismatch_turns": retok_diff, "multi_turn_next_turns": n_next,
            "retokenized_hit_tokens": retok_hit, "token_id_hit_tokens": ids_hit,
        })

    # ---------- (c) 小池子：回收、抢占、并行采样 ----------
    def small_pool(self):
        s, bs = self.s, self.bs
        reqs = small_pool_workload(s.tok, self.args.quick)
        blocks = max(blocks_needed(r, bs) for r in reqs) * 3 // 2   # 只够最大的请求放一份半
        B = len(reqs)
        n_seeded = sum(r.params.seed is not None for r in reqs)
        stage(f"[c] 小池子 {blocks} 块：{len(reqs)} 个请求（{n_seeded} 个是并行采样的样本），批大小不设限 ...")
        o5, st5 = self.step05(blocks, B).generate(reqs)
        e6 = self.step06(blocks, B)
        o6, st6, ev6 = run(e6, reqs)
        greedy_ok, seeded_ok = self.compare("c", reqs, o5, o6)
        self.checks["c_greedy_equals_step05"] = greedy_ok
        self.checks["c_seeded_equals_step05"] = seeded_ok
        self.checks["c_evicted_and_preempted"] = ev6 > 0 and st6.preemptions > 0
        # 并行采样：第 2 个样本紧跟第 1 个被接纳，提示词的整块全部命中
        pairs = [j for j in range(1, len(reqs)) if reqs[j].params.seed is not None
                 and reqs[j].prompt_ids == reqs[j - 1].prompt_ids]
        self.checks["parallel_samples_share_prompt_blocks"] = bool(pairs) and all(
            st6.cached_tokens[j] == block_aligned(len(reqs[j].prompt_ids), len(reqs[j].prompt_ids), bs) for j in pairs)
        # --no-prefix-cache：run.py 按这个参数选引擎（应当是 step05 的）；它若选错了，命中的 token 和前向次数都会不同
        no_cache = self.engine_for(cli.override(self.args, no_prefix_cache=True), s, blocks, B)
        self.engines.append(no_cache)
        on, stn = no_cache.generate(reqs)
        self.checks["no_prefix_cache_equals_step05"] = on == o5 and stn.num_forwards == st5.num_forwards and not any(stn.cached_tokens)
        print(f"\n(c) 小池子 {blocks} 块（{blocks * bs} 个槽）")
        print(table(HEADERS, [row("step05", st5, "-"), row("step06", st6, f"{st6.hit_rate:.1%}", evictions=ev6),
                              row("step06 --no-prefix-cache", stn, "-")]))
        self.figures.update({"evictions": ev6, "c_preemptions_step05": st5.preemptions,
                             "c_preemptions_step06": st6.preemptions, "c_small_pool_blocks": blocks})

    # ---------- TTFT 随共享前缀长度 ----------
    def ttft_sweep(self):
        """一个请求 = 长度 L 的共享前缀 + 一个短问题，单独到达。step05 每次都从头 prefill；step06 先用另一个问题把
        前缀放进缓存，再量新问题的 TTFT（前缀 L 取块大小的整数倍，整段命中）。"""
        s, bs = self.s, self.bs
        base = s.tok.encode(SYSTEM_PROMPT + LONG_PROMPT)
        lengths = [64, 512] if self.args.quick else [16, 128, 256, 512, 1024]
        lengths = [L // bs * bs for L in lengths if L <= len(base)]
        reps = 1 if self.args.quick else 3
        question = [s.tok.hf(f"\nQuestion {k}: what is this text about?", add_special_tokens=False).input_ids
                    for k in range(1, reps + 2)]          # 个位数：每个问题一样长
        stage(f"[TTFT] 共享前缀长度 {lengths}，每点取 {reps} 次的中位数 ...")
        rows, xs, y5, y6 = [], [], [], []
        for L in lengths:
            prefix = base[:L]
            t5 = statistics.median(self.step05(self.default_blocks, 1).generate(
                [Request(prefix + question[k + 1], 1)]).stats.first_token_s[0] for k in range(reps))
            e6 = self.step06(self.default_blocks, 1)
            e6.generate([Request(prefix + question[0], 1)])
            t6 = statistics.median(e6.generate([Request(prefix + question[k + 1], 1)]).stats.first_token_s[0] for k in range(reps))
            rows.append([L, f"{t5 * 1e3:.0f}", f"{t6 * 1e3:.0f}", f"{t5 / t6:.1f}"])
            xs.append(L)
            y5.append(t5 * 1e3)
            y6.append(t6 * 1e3)
        print(f"\nTTFT 随共享前缀长度（单个请求；问题约 {len(question[0])} token）—— 机器: {machine()}")
        print(table(["共享前缀 (token)", "step05 TTFT (ms)", "step06 TTFT (ms)", "step05 ÷ step06"], rows))
        if self.args.plot:
            plot(self.args.plot, xs, y5, y6)
            print(f"图已存到 {self.args.plot}")
        self.figures["ttft_ratio_at_longest_prefix"] = round(y5[-1] / y6[-1], 3)

    def run(self) -> bool:
        self.shared_prompt()
        self.multi_turn()
        self.small_pool()
        self.ttft_sweep()
        self.checks["all_ref_counts_zero_at_end"] = all(pool_is_free(e) for e in self.engines)
        return finish(STEP, self.s, self.checks, self.figures, self.args.json)


def plot(path, xs, y5, y6) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.plotting import use_chinese_font
    use_chinese_font()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(xs, y5, "o-", label="step05：每次从头 prefill")
    ax.plot(xs, y6, "s-", label="step06：前缀已在缓存里")
    ax.set_xlabel("共享前缀长度（token）")
    ax.set_ylabel("TTFT（毫秒）")
    ax.set_title("首 token 延迟随共享前缀长度的变化")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
