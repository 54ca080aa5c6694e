"""step12 的章节模式（run.py 不带 --prompt 时调用）：

[1] 相同（决定退出码）：--kv-policy full 与 step09 的输出和每一次前向都相同；每个策略在预算盖得住整个序列时与 full
    相同；每个策略真实的缓存（压紧、重新旋转、按槽记分）与掩码模拟（reference.py）给出同样的 token 和 logprob；
[2] 长文本（有损，只报数）：一段比训练长度还长的英文文本整段当一个提示词，逐位置的 NLL——full / window / sinks
    （缓存位置与原文位置）/ h2o / snapkv-chunked（snapkv 在 prefill 时留着整个提示词，提示词位置的 NLL 就是 full 的，
    不量）；与 full 的 top-1 一致率与 NLL 差；每个请求持有的块随长度（驱逐之后是平的）；
[3] passkey：藏在无关文字里的数，问题在提示词里与在压缩之后才问（snapkv-chunked：上下文一块、压缩，问题下一块）；
[4] 贪心生成第一次与 full 分歧的位置（与 full 在那里的 top-2 差）；
[5] 内存与速度：固定的池子同时放得下几个长请求；长上下文的 decode 一步；没超预算的请求不变慢（vs step09）；
    h2o 取分数的代价。

--sections（逗号分开的 exactness / streams / passkey / greedy / concurrency / speed）只跑这几节；--settings（逗号分开的
设置名前缀，如 snapkv）让每一节的设置列表只留这些（长文本与 decode 速度再留着当参照的 full）——改了一个策略之后只重量
它的那几行。
"""
import time

import torch

from common import cli
from common.bench import machine, memory_bandwidth, table
from common.compare import MARGIN_TOL, compare
from common.harness import Checks, finish, pool_is_free, stage
from common.prompts import CHAPTER_PROMPTS, LONG_PROMPT
from step02_sampling.sampler import SamplingParams, draw_margin
from step04_static_batching.request import Request
from step07_chunked_prefill.analysis.workload import check_workload, mid_prefill_preemption_workload
from step09_speculative import engine as step09
from step12_kv_eviction import engine as step12
from step12_kv_eviction.analysis import measure
from step12_kv_eviction.analysis.runs import Setting, parse, run_one
from step12_kv_eviction.analysis.texts import long_text_ids, text_source

STEP = "step12_kv_eviction"
FULL = Setting()
# 测量计划：完整模式约 40 分钟（空闲的 2 核），--quick 约 5 分钟。名字就是表格里的行、figures 里的后缀
PLAN = {
    False: dict(text_tokens=16384, stream_new=16, nll_window=2048, plot_width=256,
                streams=["full", "window_512", "sinks4_512_cachepos", "sinks4_512_textpos", "h2o_512",
                         "snapkv-chunked_512"],
                sweep_tokens=4096, sweep=["sinks4_256_cachepos", "sinks4_1024_cachepos", "sinks4_2048_cachepos",
                                          "h2o_256", "h2o_1024", "h2o_2048", "snapkv-chunked_256", "snapkv-chunked_1024",
                                          "snapkv-chunked_2048"],
                passkey_lens=[1024, 2048], passkey_depths=[0.1, 0.5, 0.9],
                passkey_inside=["full", "window_512", "sinks4_512_cachepos", "h2o_512", "snapkv_512", "snapkv_1024"],
                passkey_after=["h2o_512", "snapkv-chunked_512", "snapkv-chunked_1024"],
                passkey_chunked=["snapkv-chunked_512", "snapkv_512"],
                greedy_context=1024, greedy_new=32,
                greedy=["window_512", "sinks4_256_cachepos", "sinks4_512_cachepos", "sinks4_512_textpos", "h2o_512",
                        "snapkv_512", "snapkv-chunked_512"],
                conc_requests=8, conc_prompt=2048, conc_new=16, conc_setting="sinks4_512_cachepos",
                decode_context=8192, decode_new=32, decode_settings=["full", "sinks4_512_cachepos", "h2o_512"],
                under_prompt=256, under_new=64, under_budget=2048, repeats=3),
    True: dict(text_tokens=1536, stream_new=8, nll_window=256, plot_width=64,
               streams=["full", "window_512", "sinks4_512_cachepos", "sinks4_512_textpos", "h2o_512",
                        "snapkv-chunked_512"],
               sweep_tokens=1536, sweep=["sinks4_256_cachepos"],
               passkey_lens=[1024], passkey_depths=[0.1, 0.5, 0.9],
               passkey_inside=["full", "sinks4_512_cachepos", "snapkv_512"], passkey_after=["snapkv-chunked_512"],
               passkey_chunked=["snapkv-chunked_512", "snapkv_512"],
               greedy_context=512, greedy_new=16, greedy=["sinks4_256_cachepos", "h2o_256", "snapkv_256"],
               conc_requests=4, conc_prompt=768, conc_new=8, conc_setting="sinks4_256_cachepos",
               decode_context=1024, decode_new=8, decode_settings=["full", "sinks4_512_cachepos", "h2o_512"],
               under_prompt=128, under_new=16, under_budget=2048, repeats=1),
}
REF_SETTINGS = ["window_48", "sinks4_48_cachepos", "sinks4_48_textpos", "h2o_48", "snapkv_64",   # 对照掩码模拟的短例子
                "snapkv-chunked_64"]
SECTIONS = ("exactness", "streams", "passkey", "greedy", "concurrency", "speed")


class Chapter:
    def __init__(self, args, s: cli.Session):
        self.args, self.s, self.quick, self.plan = args, s, args.quick, PLAN[bool(args.quick)]
        if getattr(args, "settings", None):   # 只留名字以这些前缀开头的设置（长文本与 decode 速度里 full 是参照，留着）
            keep = tuple(args.settings.split(","))
            self.plan = {k: [x for x in v if x.startswith(keep) or (x == "full" and k in ("streams", "decode_settings"))]
                         if isinstance(v, list) and all(isinstance(x, str) for x in v) else v
                         for k, v in self.plan.items()}
        self.tol, self.eos, self.bs, self.chunk = MARGIN_TOL[s.dtype], s.tok.eos_ids, args.block_size, args.max_num_batched_tokens
        self.ctx = s.cfg.max_position_embeddings
        self.checks, self.figures, self.pools_free = Checks(), {}, []

    def engine(self, setting: Setting = FULL, num_blocks: int = 64, max_batch_size: int = 1, prefix: bool = True,
               max_model_len=None, chunk=None, step=step12):
        """一个新引擎（step=step09 时是上一步的，参照）。max_model_len 只给 step12：比模型训练长度长的文本要它。"""
        kw = dict(num_blocks=num_blocks, block_size=self.bs, max_batch_size=max_batch_size,
                  max_num_batched_tokens=chunk or self.chunk, enable_prefix_caching=prefix, attention=self.args.attention)
        if step is step12:
            kw.update(setting.config(), max_model_len=max_model_len)
        return step.LLMEngine(self.s.model, step.EngineConfig(**kw), self.s.tok, self.eos)

    def done(self, *engines) -> None:
        """用完的引擎：记下池子是否全还回来了，不留引用（长文本的池子有几百 MiB）。"""
        self.pools_free += [pool_is_free(e) for e in engines]

    def compare_all(self, name, reqs, refs, outs, logits_fn=None) -> bool:
        res = [compare(f"{name}#{i}", r.prompt_ids, ref, got, logits_fn or self.s.full_logits, self.tol,
                       draw_margin(r.params))
               for i, (r, ref, got) in enumerate(zip(reqs, refs, outs))]
        for c in res:
            if not c.equal:
                self.checks.note(c.describe())
        return all(c.ok for c in res)

    # ---------- [1] 相同 ----------
    @torch.inference_mode()
    def exactness(self):
        s = self.s
        stage("[1] full vs step09；预算盖得住整个序列的每个策略 vs full；每个策略的真实缓存 vs 掩码模拟 ...")
        rows = []
        reqs = check_workload(s.tok, True)
        pre, small, budget = mid_prefill_preemption_workload(s.tok)
        chap = [Request(s.encode(t, chat), 16 if self.quick else 48, SamplingParams()) for _, t, chat in CHAPTER_PROMPTS]
        ok, full_out = True, {}
        for wl, rq, nb, bud in (("短负载", reqs, 128, None), ("小池子", pre, small, budget), ("章节提示词", chap, 128, None)):
            e9 = self.engine(num_blocks=nb, max_batch_size=8, chunk=bud, step=step09)
            e12 = self.engine(num_blocks=nb, max_batch_size=8, chunk=bud)
            (ref, st9), (out, st12) = e9.generate(rq), e12.generate(rq)
            same = self.compare_all(f"full_{wl}", rq, ref, out) and st12.forward_shapes == st9.forward_shapes
            ok &= same
            full_out[wl] = (rq, out, st12)
            rows.append(["full", wl, st12.num_forwards, st9.num_forwards, "与 step09 相同（每一次前向也同）" if same else "不同"])
            self.done(e9, e12)
        self.checks["full_equals_step09"] = ok
        # 预算盖得住整个序列：一次也不压紧，输出与前向都同 full。h2o / snapkv 不查前缀缓存（engine.py 说为什么），
        # 它们的参照是不查前缀缓存的 full：短负载里有共享前缀的请求，查不查缓存前向的形状不同
        rq, ref, st_full = full_out["短负载"]
        e = self.engine(num_blocks=128, max_batch_size=8, prefix=False)
        ref_nocache = e.generate(rq)
        self.done(e)
        cover = -(-max(len(r.prompt_ids) + r.max_new_tokens for r in rq) // self.bs) * self.bs + 64
        ok = True
        for st in (Setting("window", cover), Setting("sinks", cover, "cache"), Setting("sinks", cover, "text"),
                   Setting("h2o", cover), Setting("snapkv", cover), Setting("snapkv-chunked", cover)):
            e = self.engine(st, num_blocks=128, max_batch_size=8)
            out, st12 = e.generate(rq)
            want, st_want = ref_nocache if st.policy not in ("window", "sinks") else (ref, st_full)
            same = (self.compare_all(f"cover_{st.label}", rq, want, out) and st12.forward_shapes == st_want.forward_shapes
                    and e.num_compactions == 0)
            ok &= same
            rows.append([st.label, "短负载", st12.num_forwards, st_want.num_forwards, "与 full 相同" if same else "不同"])
            self.done(e)
        self.checks["budget_covering_sequence_equals_full"] = ok
        print(table(["设置", "负载", "前向次数", "参照的前向次数", "结果"], rows))
        self.reference_check()

    def reference_check(self):
        """每个策略的真实缓存 vs reference.py 的掩码模拟：一个短提示词，分块 prefill 中就驱逐，再 decode 时也驱逐。"""
        from step12_kv_eviction.reference import simulate
        s = self.s
        ids, chunk, new = s.tok.encode(LONG_PROMPT)[:160], 48, 24
        rows, ok = [], True
        for label in REF_SETTINGS:
            st = parse(label)
            e = self.engine(st, num_blocks=32, chunk=chunk)
            run = run_one(e, Request(ids, new, SamplingParams(), ignore_eos=True, prompt_logprobs=0))
            self.done(e)
            sim = simulate(s.model, ids, policy=st.policy, budget=st.budget, block_size=self.bs, chunk=chunk,
                           num_sinks=st.num_sinks if st.policy == "sinks" else None, positions=st.positions,
                           max_new_tokens=new)
            dlp = float((torch.tensor([lp.logprob for lp in run.prompt_logprobs[1:]], dtype=torch.float64)
                         - sim.prompt_logprobs(ids)).abs().max())
            same = self.compare_all(f"reference_{label}", [Request(ids, new)], [sim.output_ids], [run.output_ids],
                                    lambda h: sim.logits[:len(h)]) and dlp <= self.tol
            ok &= same and sim.num_compactions > 0
            rows.append([label, sim.num_compactions, f"{dlp:.1e}", f"{sim.selection_margin:.1e}",
                         "与掩码模拟相同" if same else "不同"])
        self.checks["policy_cache_equals_mask_simulation"] = ok
        print(f"真实缓存 vs 掩码模拟（reference.py）：{len(ids)} token 的提示词，每次前向 {chunk} 个，再生成 {new} 个（贪心）")
        print(table(["设置", "驱逐次数", "提示词 logprob 最大差", "挑选余量（h2o/snapkv）", "结果"], rows))

    # ---------- [2]–[5] ----------
    def run(self) -> bool:
        s, p = self.s, self.plan
        print(f"机器: {machine()}；读带宽 {memory_bandwidth(s.device) / 1e9:.1f} GB/s（本次运行测）", flush=True)
        print(f"模型 {s.path.name}，{s.device}/{s.dtype_name}，训练长度 {self.ctx}；块 {self.bs} token，"
              f"每次前向至多 {self.chunk} 个 token（--max-num-batched-tokens）；长文本：{text_source()}")
        m = measure.Measure(self, long_text_ids(s.tok, p["text_tokens"]))
        wanted = self.args.sections.split(",") if getattr(self.args, "sections", None) else SECTIONS
        parts = dict(zip(SECTIONS, (self.exactness, m.streams, m.passkey, m.greedy, m.concurrency, m.speed)))
        for part in (parts[name] for name in SECTIONS if name in wanted):
            t = time.perf_counter()
            part()
            print(f"（这一节用时 {time.perf_counter() - t:.0f} s）", flush=True)
        self.checks["every_pool_empty_at_the_end"] = all(self.pools_free)
        print(f"\n机器（结束时）: {machine()}；读带宽 {memory_bandwidth(s.device) / 1e9:.1f} GB/s")
        return finish(STEP, self.s, self.checks, self.figures, self.args.json)


if __name__ == "__main__":
    raise SystemExit("run step12_kv_eviction/run.py (without --prompt) for the chapter mode")
