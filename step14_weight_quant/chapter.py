"""step14 的章节模式（run.py 不带 --prompt 时调用）：

[1] 相同：ours-f32（同样的 float32 权重、我们的内核）与 q4_1（GGUF 的块，激活 float32）经 step03 的 generate（批 1）
    和 step09 的引擎（所有提示词一批）生成的贪心 token 与 float32 模型（--linear packed，即 step03 / step09）相同；
    teacher-forced 的 top-1 一致率 100%。
[2] 有损的一级（q4_1 + 8 位激活；q8_0 从 float32 重新量化）：teacher-forced top-1 一致率、平均 NLL 的变化、
    贪心生成第一个分歧的位置与参照在那里的 top-2 差——报告，不打 ✅。
[3] 常驻的权重字节数，与批 1 的 decode 每步耗时（同一次运行实测的内存带宽、机器与负载印在表头）。
q4_1 与有损的 q4_1 + q8 只有默认模型才有（它的 GGUF）；别的模型上这两行跳过，说一声。
"""
import dataclasses

import torch

from common import cli
from common.bench import machine, median_time, memory_bandwidth, table
from common.compare import MARGIN_TOL, compare
from common.harness import Checks, finish, stage
from common.prepare import default_model_dir
from common.prompts import CHAPTER_PROMPTS
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single.cache import PreallocKVCache
from step03_kvcache_single.engine import forward, generate
from step04_static_batching.request import Request
from step14_weight_quant.linear import use_block_weights_, weight_bytes

STEP = "step14_weight_quant"
EXACT = ("f32", "q4_1")                   # use_block_weights_ 的格式：与 float32 模型同样的 token
LOSSY = ("q4_1_q8_1", "q8_0")
LABEL = {"fp32": "float32（packed）", "f32": "ours f32", "q4_1": "ours q4_1", "q4_1_q8_1": "q4_1 + 8 位激活（有损）",
         "q8_0": "q8_0 重新量化（有损）"}


class Chapter:
    def __init__(self, args, engine_for):
        """engine_for(args, session) → step09 的引擎（run.py 给的：与生成模式同一套参数）。"""
        if args.device not in ("auto", "cpu") or args.dtype not in ("auto", "float32"):
            print(f"step14 的内核只在 CPU float32 上：章节模式在 cpu/float32 上跑（不是 {args.device}/{args.dtype}）")
        self.args = cli.override(args, device="cpu", dtype="float32")
        self.s = cli.load_session(cli.override(self.args, linear="auto" if args.linear == "ours" else args.linear))
        self.engine_for, self.quick = engine_for, args.quick
        self.n = 16 if args.quick else 32
        self.tol = MARGIN_TOL[self.s.dtype]
        self.checks, self.figures = Checks(), {}
        has_gguf = self.s.path.resolve() == default_model_dir().resolve()
        self.formats = [f for f in ("f32", "q4_1", "q4_1_q8_1", "q8_0") if has_gguf or f not in ("q4_1", "q4_1_q8_1")]
        if not has_gguf:
            self.checks.note(f"{self.s.path.name} 没有转换来源的 GGUF：跳过 q4_1 与 q4_1 + 8 位激活")

    def variant(self, fmt: str):
        """新加载一份 float32 模型（plain，不打包）再换成 fmt：返回 (模型, 换之前的 float32 权重字节数)。"""
        m = cli.open_session(self.args.model, "cpu", "float32", "plain").model
        dense = sum(p.nbytes for p in m.parameters())
        return use_block_weights_(m, fmt), dense

    def prompts(self):
        return [self.s.encode(t, chat, self.n) for _, t, chat in CHAPTER_PROMPTS]

    def step03_tokens(self, model, prompts):
        return [generate(model, ids, self.n, SamplingParams(), self.s.tok.eos_ids) for ids in prompts]

    def step09_tokens(self, model, prompts):
        engine = self.engine_for(self.args, dataclasses.replace(self.s, model=model))
        outputs, _ = engine.generate([Request(ids, self.n, SamplingParams()) for ids in prompts])
        return outputs

    @torch.inference_mode()
    def teacher_forced(self, model, prompts, refs) -> tuple[float, float]:
        """参照的贪心序列喂给两个模型：top-1 一致率，与参照 token 的平均 NLL 的相对变化。"""
        agree = total = 0
        nll_ref = nll_got = 0.0
        for ids, ref in zip(prompts, refs):
            seq = ids + ref
            x, pos = torch.tensor([seq]), torch.arange(len(seq))[None]
            a = self.s.model(x, pos)[0, len(ids) - 1:-1]                  # (len(ref), V)：预测每个参照 token 的位置
            b = model(x, pos)[0, len(ids) - 1:-1]
            target = torch.tensor(ref)
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += len(ref)
            nll_ref += float(-torch.log_softmax(a.float(), -1)[torch.arange(len(ref)), target].sum())
            nll_got += float(-torch.log_softmax(b.float(), -1)[torch.arange(len(ref)), target].sum())
        return agree / max(total, 1), (nll_got - nll_ref) / max(nll_ref, 1e-12)

    def step_ms(self, model, ids, repeats: int) -> float:
        """批 1 的 decode：step03 的 forward 一次一个 token（预热之后的中位数）。"""
        cache = PreallocKVCache(self.s.cfg, len(ids) + repeats + 4, "cpu", torch.float32)
        with torch.inference_mode():
            forward(model, cache, ids, 0)
            return median_time(lambda: forward(model, cache, [ids[-1]], cache.length), repeats=repeats, warmup=2) * 1e3

    def run(self) -> bool:
        c, s = self.checks, self.s
        prompts = self.prompts()
        stage(f"[1] float32 模型（{self.args.linear}）：step03 与 step09 的贪心 token，{len(prompts)} 个提示词 × {self.n}")
        ref03, ref09 = self.step03_tokens(s.model, prompts), self.step09_tokens(s.model, prompts)
        for i, (a, b) in enumerate(zip(ref03, ref09)):
            r = compare(f"step09/fp32#{i}", prompts[i], a, b, s.full_logits, self.tol)
            if not r.equal:
                c.note(r.describe())
        models, dense = {}, {}
        for fmt in self.formats:
            models[fmt], dense[fmt] = self.variant(fmt)
        bytes_ = {"fp32": dense[self.formats[0]]} | {f: sum(weight_bytes(m).values()) for f, m in models.items()}

        rows = []
        for fmt, m in models.items():
            got03, got09 = self.step03_tokens(m, prompts), self.step09_tokens(m, prompts)
            top1, dnll = self.teacher_forced(m, prompts, ref03)
            res = [compare(f"{fmt}/step03#{i}", ids, r, g, s.full_logits, self.tol)
                   for i, (ids, r, g) in enumerate(zip(prompts, ref03, got03))]
            res += [compare(f"{fmt}/step09#{i}", ids, r, g, s.full_logits, self.tol)
                    for i, (ids, r, g) in enumerate(zip(prompts, ref03, got09))]
            if fmt in EXACT:
                c[f"{fmt}_step03_equals_fp32"] = all(r.ok for r in res[:len(prompts)])
                c[f"{fmt}_step09_equals_fp32"] = all(r.ok for r in res[len(prompts):])
                c[f"{fmt}_teacher_forced_top1_100"] = top1 == 1.0
                for r in res:
                    if not r.equal:
                        c.note(r.describe())
            else:                                     # 有损：只报告第一个分歧与参照在那里的 top-2 差
                first = [r for r in res[:len(prompts)] if not r.equal]
                div = ", ".join(f"{r.name} 位置 {r.position}（top-2 差 {r.margin:.3f}）" for r in first) or "无"
                c.note(f"{LABEL[fmt]}：贪心生成的第一个分歧 {div}")
                self.figures[f"top1_agreement_{fmt}"] = round(top1, 4)
                self.figures[f"nll_delta_fraction_{fmt}"] = round(dnll, 5)
            rows.append([LABEL[fmt], f"{top1:.2%}", f"{dnll:+.3%}",
                         "相同" if all(r.equal for r in res) else "可接受" if all(r.ok for r in res) else "不同"])
        print(table(["权重", "teacher-forced top-1 一致", "平均 NLL 变化", "贪心 token（step03 / step09）"], rows))

        stage("[2] 常驻的权重字节数与批 1 的 decode 每步耗时")
        bandwidth = memory_bandwidth("cpu", mib=256 if self.quick else 512)
        repeats = 8 if self.quick else 40
        ms = {"fp32": self.step_ms(s.model, prompts[0], repeats)} | \
             {f: self.step_ms(m, prompts[0], repeats) for f, m in models.items()}
        print(f"机器: {machine()}；同一次运行实测的内存读带宽 {bandwidth / 1e9:.1f} GB/s；每行 {repeats} 步的中位数")
        print(table(["权重", "常驻权重 (MiB)", "对 float32", "ms / 步（批 1）", "对 float32 packed"],
                    [[LABEL[f], f"{bytes_[f] / 2**20:.1f}", f"{bytes_[f] / bytes_['fp32']:.2f}×", f"{ms[f]:.2f}",
                      f"{ms['fp32'] / ms[f]:.2f}×"] for f in ms]))
        self.figures |= {"bandwidth_gb_s": round(bandwidth / 1e9, 2), "weight_bytes_fp32": bytes_["fp32"]}
        for f in ms:
            self.figures[f"ms_per_step_{'f32_packed' if f == 'fp32' else 'ours_' + f}"] = round(ms[f], 3)
            self.figures[f"weight_bytes_{f}"] = bytes_[f]
        return finish(STEP, s, c, self.figures, self.args.json)
