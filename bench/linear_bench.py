"""小 M 的矩阵乘：几种线性层实现读权重的速度，与同一次运行实测的内存读带宽并排；以及"为什么"的探针。

    python bench/linear_bench.py [--quick] [--threads 2] [--rounds 7] [--json]

第 1 部分（表）：模型里每种投影的形状（默认 SmolLM2-135M 的 config.json）× M = 1, 2, 4, 8, 16（decode 的行数），
完整模式另加 M = 128、512（prefill 的块）× 每种实现，单位 GB/s = 权重字节 ÷ 每次调用的时间：
  plain x@W        我们的 Linear 在 --linear plain 时：权重 (in, out)，x @ W（MKL 的 sgemm）
  F.linear         nn.Linear 的存法：权重 (out, in)，F.linear（也是 MKL 的 sgemm）
  oneDNN packed    --linear packed（common/linear.py）：_reorder_linear_weight 加载时打包一次 + _linear_pointwise
  MKL packed       torch.ops.mkl._mkl_reorder_linear_weight（按 M 打包一次）+ _mkl_linear（MKL 的 packed GEMM）
  oneDNN dense     _linear_pointwise 直接吃普通的 (out, in) 权重、不打包：把"换内核"与"换布局"分开
每种形状复制多份、总量 ≥ 96 MiB（--quick 48 MiB），放不进 L3，和真实 decode 一样从内存读；各实现轮流跑、取中位数。
第 3 部分（端到端）：同一份真实模型 plain 与 packed 各加载一次，step03 的贪心 decode（tokens/s，token 是否相同）与一次前向
M = 1、8、16 行（与批 M 的一步 decode 同样形状的矩阵乘）的毫秒数，两种轮流跑。
第 2 部分（原因）：打包一次要多久（每种形状一个矩阵，和整个模型加载时的那一步）；每次调用 plain 比 packed 多花的时间折合多少字节；每次调用里到底调用了什么
（子进程里开 MKL_VERBOSE=1 / ONEDNN_VERBOSE=1 数行，torch.profiler 列算子）。
只测量，不断言。机器有别的负载时（表头印出 load avg）数字不可信。
"""
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import cli  # noqa: E402
from common.bench import machine, memory_bandwidth, table  # noqa: E402
from common.config import ModelConfig  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.linear import linears, pack_weight, packed_matmul, packed_problem, use_linear_  # noqa: E402
from common.prepare import resolve_model  # noqa: E402
from common.weights import load_model  # noqa: E402
from step02_sampling.sampler import SamplingParams  # noqa: E402
from step03_kvcache_single.engine import generate  # noqa: E402

DECODE_M = (1, 2, 4, 8, 16)
PREFILL_M = (128, 512)
IMPLS = ("plain x@W", "F.linear", "oneDNN packed", "MKL packed", "oneDNN dense")


def model_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """投影名 → (in, out)，与 common/model.py 建的 Linear 相同（k、v 同形，gate、up 同形，各列一次）。"""
    E, D = cfg.hidden_size, cfg.head_dim
    return {"q_proj": (E, cfg.num_heads * D), "k_proj/v_proj": (E, cfg.num_kv_heads * D),
            "o_proj": (cfg.num_heads * D, E), "gate/up_proj": (E, cfg.intermediate_size),
            "down_proj": (cfg.intermediate_size, E), "lm_head": (E, cfg.vocab_size)}


def mkl_packed_available() -> bool:
    return hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight") and torch.backends.mkl.is_available()


def end_to_end(path, rounds: int, new_tokens: int) -> dict:
    """plain 与 packed 各一份模型：step03 贪心 decode new_tokens 个 token 的 tokens/s（两种轮流跑、取中位数）与
    一次前向 M 行的毫秒数；返回数字和两种生成的 token 是否相同。"""
    models = {k: load_model(path, "cpu", torch.float32, k) for k in ("plain", "packed")}
    prompt = list(range(100, 132))                                     # 32 个 token 的提示词；只比速度与 token 是否相同
    tokens, secs = {}, {k: [] for k in models}
    for _ in range(rounds):
        for k, m in models.items():
            t0 = time.perf_counter()
            with torch.inference_mode():
                tokens[k] = generate(m, prompt, new_tokens, SamplingParams(), ignore_eos=True)
            secs[k].append(time.perf_counter() - t0)
    out = {"decode_tok_s": {k: new_tokens / statistics.median(v) for k, v in secs.items()},
           "same_tokens": tokens["plain"] == tokens["packed"], "forward_ms": {}}
    for M in (1, 8, 16):
        ids, pos = torch.tensor([prompt[:M]]), torch.arange(M)[None]        # (1, M)：M ≤ 32，提示词的前 M 个
        fns = {k: (lambda m=m: m(ids, pos)) for k, m in models.items()}
        with torch.inference_mode():
            t = time_calls(fns, rounds * 2 + 1)
        out["forward_ms"][M] = {k: v * 1e3 for k, v in t.items()}
    return out


def time_calls(fns: dict, rounds: int) -> dict[str, float]:
    """每个函数先预热一次，再轮流各跑 rounds 次，返回各自耗时的中位数（秒）。"""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def measure_shape(i: int, o: int, ms: tuple[int, ...], total_mib: int, rounds: int) -> tuple[dict, dict]:
    """一种形状：n 份不同的权重（总量 ≥ total_mib），每个 M 各实现每次调用的秒数（n 个矩阵各乘一次 ÷ n）。
    另返回打包与拷贝的耗时（每个矩阵，秒）。"""
    n = max(1, -(-total_mib * 2**20 // (i * o * 4)))
    w_io = [torch.randn(i, o) for _ in range(n)]
    w_oi = [w.t().contiguous() for w in w_io]
    t0 = time.perf_counter()
    packed = [pack_weight(w) for w in w_io]
    cost = {"pack_oneDNN_s": (time.perf_counter() - t0) / n}
    t0 = time.perf_counter()
    for w in w_io:
        w.clone()
    cost["copy_s"] = (time.perf_counter() - t0) / n                  # 读一遍 + 写一遍权重
    out = {}
    for M in ms:
        x = torch.randn(M, i)
        fns = {"plain x@W": lambda: [x @ w for w in w_io],
               "F.linear": lambda: [F.linear(x, w) for w in w_oi],
               "oneDNN packed": lambda: [packed_matmul(x, p) for p in packed],
               "oneDNN dense": lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in w_oi]}
        if mkl_packed_available():
            t0 = time.perf_counter()
            mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, M) for w in w_oi]   # MKL 的打包与 M 绑定
            cost[f"pack_MKL_M{M}_s"] = (time.perf_counter() - t0) / n
            fns["MKL packed"] = lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, M) for p, w in zip(mkl, w_oi)]
        out[M] = {k: v / n for k, v in time_calls(fns, rounds).items()}
        mkl = None
    return out, cost


def verbose_counts() -> dict[str, dict[str, int]]:
    """在子进程里各跑 3 次调用，开着 MKL_VERBOSE / ONEDNN_VERBOSE，数每种库调用出现几行：
    plain 每次调用是不是一次新的 SGEMM、packed 每次调用有没有再重排（reorder）权重。"""
    code = r"""
import sys, torch, torch.nn.functional as F
sys.path.insert(0, %r)
from common.linear import pack_weight, packed_matmul
torch.set_num_threads(1)
w = torch.randn(576, 3072); x = torch.randn(1, 576)
what = sys.argv[1]
if what == "plain":
    for _ in range(3): x @ w
elif what == "packed":
    print("PACK", flush=True); p = pack_weight(w); print("CALLS", flush=True)
    for _ in range(3): packed_matmul(x, p)
""" % str(Path(__file__).resolve().parent.parent)
    out = {}
    for what, env in (("plain", "MKL_VERBOSE"), ("packed", "ONEDNN_VERBOSE")):
        r = subprocess.run([sys.executable, "-c", code, what], capture_output=True, text=True, timeout=300,
                           env={**os.environ, env: "1", "OMP_NUM_THREADS": "1"})
        lines = (r.stdout + r.stderr).splitlines()
        after = lines[lines.index("CALLS") + 1:] if "CALLS" in lines else lines
        before = lines[:lines.index("CALLS")] if "CALLS" in lines else []
        out[what] = {
            "calls": 3,
            "mkl_sgemm": sum(1 for ln in lines if ln.startswith("MKL_VERBOSE SGEMM(")),
            "onednn_reorder_at_pack": sum(1 for ln in before if ",exec," in ln and ",reorder," in ln),
            "onednn_reorder_per_calls": sum(1 for ln in after if ",exec," in ln and ",reorder," in ln),
            "onednn_inner_product": sum(1 for ln in after if ",exec," in ln and ",inner_product," in ln),
            "weight_format": next((f.split("::")[1].split(":")[-1] for ln in after if ",inner_product," in ln
                                   for f in ln.split() if f.startswith("wei:")), ""),
        }
    return out


def profiler_ops() -> dict[str, list[str]]:
    """torch.profiler 看到的每次调用的算子（顶层与子算子）：plain 是 aten::matmul → aten::mm（MKL 在 mm 里面），
    packed 是一个 mkldnn::_linear_pointwise；两者都没有单独的"重排权重"算子——plain 每次调用的额外工作在 MKL 里面。"""
    from torch.profiler import ProfilerActivity, profile
    w = torch.randn(576, 3072)
    p, x = pack_weight(w), torch.randn(1, 576)
    out = {}
    for name, fn in (("plain x@W", lambda: x @ w), ("oneDNN packed", lambda: packed_matmul(x, p))):
        fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        out[name] = [e.name for e in prof.events()]
    return out


def main(args) -> bool:
    problem = packed_problem("cpu", torch.float32)
    if problem:
        raise UserError(f"cannot run the packed path here: {problem}")
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    cfg = ModelConfig.from_dir(path)
    shapes = model_shapes(cfg)
    ms = DECODE_M if args.quick else DECODE_M + PREFILL_M
    total = 48 if args.quick else 96
    bw0 = memory_bandwidth()
    print(f"机器: {machine()}")
    print(f"模型形状来自 {cfg.model_type}（E {cfg.hidden_size}，F {cfg.intermediate_size}，V {cfg.vocab_size}）；"
          f"{args.threads} 个线程，{args.rounds} 轮轮流跑取中位数，每种形状的权重总量 ≥ {total} MiB")
    print(f"同一次运行的内存读带宽（对 512 MiB 求和）开始时 {bw0 / 1e9:.1f} GB/s")
    impls = [k for k in IMPLS if k != "MKL packed" or mkl_packed_available()]
    rows, records, costs = [], [], {}
    for name, (i, o) in shapes.items():
        res, cost = measure_shape(i, o, ms, total, args.rounds)
        costs[name] = cost
        nbytes = i * o * 4
        for M in ms:
            gbs = {k: nbytes / res[M][k] / 1e9 for k in impls}
            rows.append([f"{name} {i}×{o}", M] + [f"{gbs[k]:.1f}" for k in impls]
                        + [f"{res[M]['plain x@W'] / res[M]['oneDNN packed']:.2f}×"])
            records.append({"shape": name, "in": i, "out": o, "M": M, "gbs": {k: round(v, 2) for k, v in gbs.items()},
                            "us_per_call": {k: round(res[M][k] * 1e6, 2) for k in impls}})
    bw1 = memory_bandwidth()
    print(f"\n读权重的速度（GB/s = 权重字节 ÷ 每次调用的时间；同一次运行的读带宽 {bw0 / 1e9:.1f} → {bw1 / 1e9:.1f} GB/s）:")
    print(table(["投影 (in×out)", "M"] + list(impls) + ["packed 对 plain"], rows))
    if not args.quick:
        print(f"M ≥ {PREFILL_M[0]} 是 prefill 的块：这时瓶颈是算力不是读权重，GB/s 只用来和同一行的其他实现比。")

    print("\n原因 1：打包是一次性的（每个矩阵）")
    cost_rows = []
    for name, (i, o) in shapes.items():
        c = costs[name]
        per_call = [r for r in records if r["shape"] == name and r["M"] == 1][0]["us_per_call"]
        extra = per_call["plain x@W"] - per_call["oneDNN packed"]              # 每次调用 plain 多花的 µs
        cost_rows.append([f"{name} {i}×{o}", f"{i * o * 4 / 2**20:.2f}", f"{c['pack_oneDNN_s'] * 1e3:.2f}",
                          f"{c['pack_oneDNN_s'] * 1e6 / per_call['oneDNN packed']:.1f}",
                          f"{c['copy_s'] * 1e3:.2f}", f"{extra:.1f}",
                          f"{extra * 1e-6 * bw0 / (i * o * 4):.2f}"])
    print(table(["投影", "权重 MiB", "oneDNN 打包 ms", "= M=1 调用几次", "拷贝一份 ms", "M=1 时 plain 每次多花 µs",
                 "多花的时间按带宽折合几份权重"], cost_rows))
    print("（最后一列 = (plain − packed) × 本次带宽 ÷ 权重字节：如果 plain 多花的时间全是在多搬字节，它每次调用多搬了"
          "几份权重。拷贝一份 = 读一遍 + 写一遍。）")
    model = load_model(path, "cpu", torch.float32, "plain")
    t0 = time.perf_counter()
    use_linear_(model, "packed")                                       # 加载时做的就是这一步（common/weights.py）
    pack_model_s = time.perf_counter() - t0
    n_lin = len(linears(model))
    print(f"整个模型（{n_lin} 个矩阵，{sum(p.nbytes for m in linears(model) for p in m.parameters()) / 2**20:.0f} MiB）"
          f"加载时打包一次：{pack_model_s:.2f} s")
    del model

    counts = verbose_counts()
    print("\n原因 2：每次调用里调用了什么（子进程，1 线程，576×3072，M = 1，各 3 次调用）")
    pl, pk = counts["plain"], counts["packed"]
    print(f"  plain x@W（MKL_VERBOSE=1）：{pl['mkl_sgemm']} 行 SGEMM —— 每次调用都是一次完整的 sgemm，"
          f"调用之间不复用任何对权重做过的处理")
    print(f"  oneDNN packed（ONEDNN_VERBOSE=1）：打包时 {pk['onednn_reorder_at_pack']} 次 reorder；之后 3 次调用里 "
          f"{pk['onednn_reorder_per_calls']} 次 reorder、{pk['onednn_inner_product']} 次 inner_product，"
          f"权重格式 {pk['weight_format'] or '?'}")
    ops = profiler_ops()
    for name, names in ops.items():
        print(f"  torch.profiler，{name}：{' → '.join(names)}")
    e2e = end_to_end(path, 3, 16 if args.quick else 64)
    print(f"\n第 3 部分，端到端（step03 贪心 decode {16 if args.quick else 64} 个 token、一次前向 M 行；两种轮流跑取中位数）")
    dt = e2e["decode_tok_s"]
    rows3 = [["decode tokens/s（批 1）", f"{dt['plain']:.1f}", f"{dt['packed']:.1f}", f"{dt['packed'] / dt['plain']:.2f}×"]]
    for M, t in e2e["forward_ms"].items():
        rows3.append([f"一次前向 {M} 行 (ms)", f"{t['plain']:.1f}", f"{t['packed']:.1f}", f"{t['plain'] / t['packed']:.2f}×"])
    print(table(["", "plain", "packed", "packed 快几倍"], rows3))
    print(f"两种生成的 token {'相同' if e2e['same_tokens'] else '不同（看第 01 章的规则：只允许在近乎打平处分歧）'}")
    print(f"\n结束时: {machine()}；读带宽 {memory_bandwidth() / 1e9:.1f} GB/s")
    if args.json:
        cli.emit_json({"step": "bench_linear", "machine": machine(), "threads": args.threads,
                       "bandwidth_gbs": [round(bw0 / 1e9, 2), round(bw1 / 1e9, 2)], "table": records,
                       "costs_s": costs, "pack_model_s": round(pack_model_s, 3), "verbose": counts, "profiler": ops,
                       "end_to_end": e2e})
    return True


def make_parser():
    p = cli.Parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="取形状与量整模型打包时间的 HF 目录；默认 SmolLM2-135M-Instruct")
    p.add_argument("--threads", type=cli.positive_int, default=2, help="线程数（默认 2）")
    p.add_argument("--rounds", type=cli.positive_int, default=7, help="轮流计时的轮数，取中位数（默认 7）")
    p.add_argument("--quick", action="store_true", help="只有 decode 的 M、每种形状 48 MiB、3 轮（冒烟用，数字噪声大）")
    p.add_argument("--json", action="store_true", help="stdout 最后一行输出一个 JSON 对象")
    p.set_defaults(prompt=None)                               # cli.run_main 检查的生成模式参数：这里没有
    return p


def run(args) -> bool:
    if args.quick:
        args.rounds = min(args.rounds, 3)
    return main(args)


if __name__ == "__main__":
    cli.run_main(make_parser(), run)
