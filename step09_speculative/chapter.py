"""step09 的章节模式（run.py 不带 --prompt 时调用）：

[1] 相同：--spec-method none 与 step08 的输出和每一次前向都相同；贪心时 ngram 与草稿模型（没给 --draft-model 就让目标
    自己当草稿）与 step08 逐 token 相同——章节提示词、grounded / chat 负载、小池子里的抢占（重算与换出）；
    自己当草稿时接受率 100%；HF transformers 自己的 prompt lookup（generate(..., prompt_lookup_num_tokens=k)）给出
    同样的贪心 token；
[2] 验证为什么几乎免费：同样的请求、同样的上下文，一次前向算每个请求 1 个 token 与 k+1 个 token 各要多久；
[3] 快了多少：grounded（照抄、改写、总结提示词里给的内容）与 chat 两种负载、批 1 与批 8，step08 vs step09（ngram）；
    接受率、每次验证接受几个、每个 token 几次前向；HF 的 prompt lookup 在同一负载上自己快了多少；
[4] 草稿模型：自己当草稿是接受率的上界（代价是每步 k 次草稿前向）；给了 --draft-model 就量那个模型。
抽样在分布上精确由测试检查（tests/test_step09_*.py：几千次抽样的 TV 检验，规则改坏时同一检查失败）。
"""
import statistics

import torch

from common import cli
from common.bench import interleaved_medians, machine, median_time, table
from common.compare import MARGIN_TOL, compare
from common.harness import Checks, finish, pool_is_free, stage
from common.hf_reference import load_hf_model
from common.prompts import CHAPTER_PROMPTS, LONG_PROMPT
from step02_sampling.sampler import SamplingParams
from step04_static_batching.request import Request
from step07_chunked_prefill.analysis.workload import check_workload, mid_prefill_preemption_workload
from step08_kv_quant import engine as step08
from step09_speculative import engine as step09
from step09_speculative.analysis.workload import CHAT, GROUNDED, requests as workload
from step09_speculative.config import num_blocks_for_budget
from step09_speculative.engine import SpecStats, blocks_needed

STEP = "step09_speculative"


def greedy(reqs: list[Request]) -> list[Request]:
    return [Request(r.prompt_ids, r.max_new_tokens, SamplingParams(), r.ignore_eos) for r in reqs]


@torch.inference_mode()
def hf_prompt_lookup(hf, prompt_ids: list[int], max_new: int, eos_ids, k) -> list[int]:
    """HF 的贪心 generate；k 不是 None 时打开它的 prompt lookup（默认 max_matching_ngram_size = 2）。"""
    x = torch.tensor([prompt_ids], device=hf.device)
    extra = {} if k is None else {"prompt_lookup_num_tokens": k}
    out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                      eos_token_id=list(eos_ids), pad_token_id=list(eos_ids)[0], temperature=None, top_p=None,
                      top_k=None, **extra)
    return out[0, len(prompt_ids):].tolist()


class Chapter:
    def __init__(self, args, s: cli.Session):
        self.args, self.s, self.quick = args, s, args.quick
        self.tol, self.eos, self.bs, self.B = MARGIN_TOL[s.dtype], s.tok.eos_ids, args.block_size, args.max_batch_size
        self.budget, self.k = args.max_num_batched_tokens, args.num_spec_tokens
        self.num_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, self.bs, s.dtype)
        self.draft = cli.open_session(args.draft_model, s.device, s.dtype_name, args.linear).model if args.draft_model else s.model
        self.draft_name = "--draft-model " + args.draft_model if args.draft_model else "目标自己当草稿"
        self.checks, self.figures, self.engines = Checks(), {}, []

    def engine(self, step=step09, num_blocks=None, max_batch_size=None, budget=None, **kw):
        """step09 的引擎（kw：spec_method、preempt、enable_prefix_caching……），或 step=step08 的引擎（参照）。"""
        spec = {name: kw.pop(name) for name in ("spec_method", "num_spec_tokens", "ngram_min", "ngram_max") if name in kw}
        if step is step09:
            spec = {"num_spec_tokens": self.k, "ngram_min": self.args.ngram_min, "ngram_max": self.args.ngram_max, **spec}
        config = step.EngineConfig(num_blocks or self.num_blocks, self.bs, max_batch_size or self.B,
                                   budget or self.budget, **{"attention": self.args.attention, **kw}, **spec)
        extra = {"draft_model": self.draft} if spec.get("spec_method") == "draft" else {}
        e = step.LLMEngine(self.s.model, config, self.s.tok, self.eos, **extra)
        self.engines.append(e)
        return e

    def compare_all(self, name, reqs, refs, outs) -> bool:
        """贪心输出按 run.py 的"相等"规则比较：第一个不同的位置，参照的 top-2 logit 差必须小于容差。"""
        res = [compare(f"{name}#{i}", r.prompt_ids, ref, got, self.s.full_logits, self.tol)
               for i, (r, ref, got) in enumerate(zip(reqs, refs, outs))]
        for c in res:
            if not c.equal:
                self.checks.note(c.describe())
        return all(c.ok for c in res)

    def blocks_for(self, reqs) -> int:
        return sum(blocks_needed(r, self.bs) for r in reqs) + 8

    # ---------- [1] 相同 ----------
    @torch.inference_mode()
    def exactness(self):
        s = self.s
        stage("[1] spec none vs step08；贪心 ngram / 草稿模型 vs step08；HF prompt lookup ...")
        rows = []
        # none：同样的输出、同样的每一次前向（带种子的采样也一样：没有猜测时验证就是那一次 sample()）
        reqs = check_workload(s.tok, True)
        pre, small, budget = mid_prefill_preemption_workload(s.tok)
        ok = True
        for wl, rq, nb, bud in (("短负载", reqs, None, None), ("小池子", pre, small, budget)):
            ref, st8 = self.engine(step08, nb, budget=bud).generate(rq)
            out, st9 = self.engine(num_blocks=nb, budget=bud, spec_method="none").generate(rq)
            same = out == ref and st9.forward_shapes == st8.forward_shapes
            ok &= same
            rows.append(["none", wl, st9.num_forwards, st8.num_forwards, "-", "输出与每一次前向都相同" if same else "不同"])
        self.checks["spec_none_equals_step08"] = ok
        # 贪心的 ngram 与草稿：章节提示词 + 一个 grounded 提示词；小池子里抢占（重算、换出）
        n_new = 16 if self.quick else 48
        texts = [s.encode(t, chat) for _, t, chat in CHAPTER_PROMPTS] + [s.encode(GROUNDED[0], True)]
        chap = [Request(ids, n_new, SamplingParams()) for ids in texts]
        tight = self.tight_workload()
        refs = {}                                    # step08 的参照每个负载只跑一次：ngram 与草稿比的是同一份
        for method in ("ngram", "draft"):
            ok, acc = True, SpecStats()
            for wl, rq, nb, kw in (("章节提示词", chap, None, {}),
                                   ("紧池子·重算", tight, self.tight_blocks(tight), {}),
                                   ("紧池子·换出", tight, self.tight_blocks(tight), {"preempt": "swap"})):
                if wl not in refs:
                    refs[wl] = self.engine(step08, nb, **kw).generate(rq)
                ref, st8 = refs[wl]
                e = self.engine(num_blocks=nb, spec_method=method, **kw)
                out, st9 = e.generate(rq)
                same = self.compare_all(f"{method}_{wl}", rq, ref, out)
                ok &= same and (nb is None or st9.preemptions > 0)
                for f in ("proposed", "accepted", "verifications"):
                    setattr(acc, f, getattr(acc, f) + getattr(e.spec_stats, f))
                rows.append([method, wl, st9.num_forwards, st8.num_forwards,
                             f"{e.spec_stats.accepted}/{e.spec_stats.proposed}（抢占 {st9.preemptions}）",
                             "与 step08 相同" if same else "不同"])
            self.checks[f"greedy_{method}_equals_step08"] = ok
            if method == "draft" and not self.args.draft_model:
                self.checks["self_draft_accepts_every_proposal"] = acc.proposed > 0 and acc.accepted == acc.proposed
                self.figures["self_draft_acceptance_rate"] = round(acc.accepted / acc.proposed, 4)
        print(table(["--spec-method", "负载", "前向次数", "step08 前向次数", "接受 / 验证的猜测", "结果"], rows))
        # 同行：HF transformers 的 prompt lookup（贪心）给出同样的 token
        hf = load_hf_model(s.path, s.device, s.dtype)
        g = workload(s.tok, GROUNDED[:2 if self.quick else 4], n_new)
        ours = self.engine(spec_method="ngram", max_batch_size=1).generate(g).outputs
        theirs = [hf_prompt_lookup(hf, r.prompt_ids, n_new, self.eos, self.k) for r in g]
        self.checks["hf_prompt_lookup_equals_ours"] = self.compare_all("hf_prompt_lookup", g, theirs, ours)
        self.hf = hf

    def tight_workload(self) -> list[Request]:
        """紧池子用：4 个提示词各生成几十个 token（贪心）——几个请求一起 decode、各自要新块时一定抢占。"""
        text = self.s.tok.encode(LONG_PROMPT)
        n_new = 24 if self.quick else 40
        return [Request(text[11 * i:11 * i + n], n_new, SamplingParams(), ignore_eos=True)
                for i, n in enumerate([20, 14, 30, 9])]

    def tight_blocks(self, reqs) -> int:
        return max(blocks_needed(r, self.bs) for r in reqs) + 1

    # ---------- [2] 验证 k 个猜测的前向 vs decode 1 个 token ----------
    @torch.inference_mode()
    def verify_cost(self):
        s = self.s
        ks = [0, 1, 2, 4, 8] if not self.quick else [0, 4]
        context = 128 if self.quick else 512
        repeats = 3 if self.quick else 10
        stage(f"\n[2] 一次前向：每个请求算 1 个 token（decode）vs 1 + k 个（验证 k 个猜测）；上下文 {context} token ...")
        ids = s.tok.encode(LONG_PROMPT)
        rows = []
        for batch in (1, 8):
            e = self.engine(num_blocks=batch * (context // self.bs + 4), max_batch_size=batch, spec_method="none",
                            budget=max(self.budget, batch * context))
            rids = [e.add_request(Request((ids * 4)[i:i + context], 64, SamplingParams(), ignore_eos=True))
                    for i in range(batch)]
            e.step()                                                     # prefill：之后每个请求都在 decode
            seqs = [e.seqs[r] for r in rids]
            base = None
            for k in ks:
                for seq in seqs:                                         # 猜测内容不影响时间；块表补到能写 k 个
                    seq.spec_token_ids = seq.token_ids[-k:] if k else []
                    need = e.block_manager.blocks_for(seq.num_tokens_with_spec) - len(seq.block_table)
                    seq.block_table += e.block_manager.allocate(max(0, need))

                def forward():
                    fwd = e.kv_cache.plan(seqs, [1 + len(q.spec_token_ids) for q in seqs])
                    return s.model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index)
                t = median_time(forward, repeats=repeats, warmup=1, device=s.device)
                base = base or t
                rows.append([batch, k, batch * (1 + k), f"{t * 1e3:.1f}", f"{t / base:.2f}"])
                self.figures[f"verify_forward_ratio_batch{batch}_k{k}"] = round(t / base, 3)
            for seq in seqs:
                seq.spec_token_ids = []
            for r in rids:
                e.abort(r)
        print(f"机器: {machine()}")
        print(table(["批", "k", "这次前向的 token", "前向 (ms，中位数)", "÷ k = 0"], rows))

    # ---------- [3] 快了多少 ----------
    @torch.inference_mode()
    def speed(self):
        s = self.s
        n_new = 48 if self.quick else 128
        n1 = 2 if self.quick else 4
        repeats = 1 if self.quick else 3
        stage(f"\n[3] step08 vs step09（ngram，k = {self.k}）：grounded / chat，批 1（{n1} 个请求依次）与批 8；"
              f"各生成至多 {n_new} 个 token；{repeats} 轮交替取中位数 ...")
        rows, ok = [], True
        for wl, texts in (("grounded", GROUNDED), ("chat", CHAT)):
            for batch in (1, 8):
                reqs = workload(s.tok, texts[:n1] if batch == 1 else texts[:8], n_new)
                nb = self.blocks_for(reqs)
                engines = {name: self.engine(step08 if name == "step08" else step09, nb, batch,
                                             enable_prefix_caching=False,   # 每一轮都做同样多的 prefill
                                             **({} if name == "step08" else {"spec_method": "ngram"}))
                           for name in ("step08", "step09")}
                last = {}

                def run(name):
                    e = engines[name]
                    if name == "step09":
                        e.spec_stats = SpecStats()
                    last[name] = e.generate(reqs)
                med = interleaved_medians({n: (lambda n=n: run(n)) for n in engines}, repeats, s.device)
                out8, st8 = last["step08"]
                out9, st9 = last["step09"]
                ok &= self.compare_all(f"speed_{wl}_b{batch}", reqs, out8, out9)
                sp = engines["step09"].spec_stats
                speedup = med["step08"] / med["step09"]
                rate = sp.accepted / sp.proposed if sp.proposed else 0.0
                rows.append([wl, batch, st9.generated_tokens, f"{med['step08']:.2f}", f"{med['step09']:.2f}",
                             f"{speedup:.2f}", f"{rate:.1%}", f"{sp.accepted / sp.verifications if sp.verifications else 0:.2f}",
                             f"{st8.num_forwards / st8.generated_tokens:.2f} → {st9.num_forwards / st9.generated_tokens:.2f}"])
                self.figures[f"speedup_vs_step08_batch{batch}_{wl}"] = round(speedup, 3)
                if (wl, batch) == ("grounded", 1):
                    self.figures.update({"acceptance_rate": round(rate, 4),
                                         "mean_accepted_tokens_per_step": round(sp.accepted / max(sp.verifications, 1), 3),
                                         "forwards_per_token": round(st9.num_forwards / st9.generated_tokens, 4),
                                         "step08_forwards_per_token": round(st8.num_forwards / st8.generated_tokens, 4)})
                    self.grounded1 = reqs
        self.checks["benchmark_outputs_equal_step08"] = ok
        print(f"机器: {machine()}")
        print(table(["负载", "批", "产出 token", "step08 (s)", "step09 (s)", "加速", "接受率", "每次验证接受",
                     "每 token 前向次数"], rows))
        # HF 自己的 prompt lookup 在同一负载（grounded、批 1）上快了多少：它是同行，不是我们的代码
        reqs = self.grounded1
        outs = {}

        def hf_run(k):
            outs[k] = [hf_prompt_lookup(self.hf, r.prompt_ids, n_new, self.eos, k) for r in reqs]
        med = interleaved_medians({"plain": lambda: hf_run(None), "lookup": lambda: hf_run(self.k)}, repeats, s.device)
        self.figures["hf_prompt_lookup_speedup_batch1_grounded"] = round(med["plain"] / med["lookup"], 3)
        print(f"HF transformers generate，grounded 批 1：普通贪心 {med['plain']:.2f} s，prompt_lookup_num_tokens={self.k} "
              f"{med['lookup']:.2f} s，加速 {med['plain'] / med['lookup']:.2f}×（它自己的实现，同样的 token："
              f"{'是' if outs[None] == outs[self.k] else '否'}）")

    # ---------- [4] 草稿模型 ----------
    @torch.inference_mode()
    def draft_model(self):
        s = self.s
        reqs = self.grounded1
        repeats = 1 if self.quick else 3
        stage(f"\n[4] 草稿模型（{self.draft_name}）：grounded 批 1 ...")
        nb = self.blocks_for(reqs)
        engines = {"step08": self.engine(step08, nb, 1, enable_prefix_caching=False),
                   "draft": self.engine(num_blocks=nb, max_batch_size=1, enable_prefix_caching=False, spec_method="draft")}
        last = {}

        def run(name):
            if name == "draft":
                engines[name].spec_stats = SpecStats()
            last[name] = engines[name].generate(reqs)
        med = interleaved_medians({n: (lambda n=n: run(n)) for n in engines}, repeats, s.device)
        sp = engines["draft"].spec_stats
        st = last["draft"].stats
        self.checks["draft_benchmark_equals_step08"] = self.compare_all("draft_speed", reqs, last["step08"].outputs,
                                                                        last["draft"].outputs)
        self.figures.update({"draft_acceptance_rate": round(sp.accepted / max(sp.proposed, 1), 4),
                             "draft_forwards_per_token": round(st.num_forwards / st.generated_tokens, 4),
                             "draft_speedup_vs_step08_batch1_grounded": round(med["step08"] / med["draft"], 3)})
        print(table(["", "时间 (s)", "接受率", "目标前向 / token", "每步草稿前向"],
                    [["step08", f"{med['step08']:.2f}", "-", "-", "-"],
                     [self.draft_name, f"{med['draft']:.2f}", f"{sp.accepted / max(sp.proposed, 1):.1%}",
                      f"{st.num_forwards / st.generated_tokens:.2f}", self.k]]))
        if not self.args.draft_model:
            print("目标自己当草稿：每步先跑 k 次与目标一样贵的草稿前向，所以比 step08 慢——它只说明机制与接受率的上界；"
                  "真正的草稿模型要小得多（这台机器上没有第二个 SmolLM2 尺寸，用 --draft-model 给一个）。")

    def run(self) -> bool:
        print(f"机器: {machine()}；模型 {self.s.path.name}，{self.s.device}/{self.s.dtype_name}；k = {self.k}，"
              f"n-gram {self.args.ngram_min}–{self.args.ngram_max}", flush=True)
        self.exactness()
        self.verify_cost()
        self.speed()
        self.draft_model()
        self.checks["every_pool_empty_at_the_end"] = all(pool_is_free(e) for e in self.engines) and all(
            not getattr(getattr(e, "proposer", None), "states", None) for e in self.engines)
        return finish(STEP, self.s, self.checks, self.figures, self.args.json)


if __name__ == "__main__":
    raise SystemExit("run step09_speculative/run.py (without --prompt) for the chapter mode")
