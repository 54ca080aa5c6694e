"""块权重（step14_weight_quant）的两把尺子，各实现轮流跑、与同一次运行实测的内存读带宽并排：

    python bench/block_matmul_bench.py [--quick] [--threads 2] [--rounds 5] [--tokens 48]

第 1 部分（内核）：模型里每种投影的形状 × M = 1, 2, 4, 8, 16，每种实现读权重的速度（GB/s = 权重字节 ÷ 每次调用的时间）
与它占同次带宽的比例：
  plain x@W       --linear plain（MKL 的 sgemm，float32 (in, out)）
  oneDNN packed   项目现在的线性层（common/linear.py 的 packed，float32）
  ours f32        我们的内核，float32 权重按 16 行一组重排（formats.repack_f32）
  ours q8_0       我们的内核，Q8_0 块（--weights q8_0；发布的文件里 lm_head 就是 Q8_0）
  ours q4_1       我们的内核，Q4_1 块（投影；lm_head 在文件里是 Q8_0，那一行没有 q4_1）
  torch int8      aten._weight_int8pack_mm：int8 权重、每个输出通道一个缩放（附录的 int8 一级；有损，表示不了 Q8_0）
  torch int4      aten._weight_int4pack_mm_for_cpu：同一组 Q4_1 的数（scale = d、zero = m + 8d），float32 激活
                  （它的向量化内核只有 bf16；float32 走标量循环，慢：只量 M = 1、2）
另有两列：GFLOP/s 与占 roofline 的比例——roofline 的时间下限 = max(权重字节 ÷ 带宽, 2·M·N·K ÷ 算力)，算力是同一次运行里
oneDNN 大方阵乘法的 FLOP/s；"(memory)" / "(compute)" 说的是哪一项大。表头还有一次调用的固定开销（16 × 32 的矩阵）。
最后一段是目标的汇总：ours f32 在每种形状、每个 M 上占带宽的最低比例（第 14 章的目标是 ≥ 80%）。
每种形状复制多份、总量 ≥ 64 MiB（--quick 32 MiB），放不进 L3，和真实 decode 一样从内存读。数据是随机的块（速度与数值无关）。
第 2 部分（端到端）：真实默认模型的四种加载——float32 packed（默认）、ours f32、ours q4_1、有损的 q4_1 × Q8_1——
step03 的贪心 decode，每步毫秒数（去掉 prefill 的中位数），轮流跑 rounds 轮；并报告贪心 token 是否与 float32 packed
相同（不同时从第几个起）、常驻的权重字节。
第 3 部分（批处理引擎）：同样三种精确的加载（float32 packed、ours f32、ours q4_1）交给 step09 的引擎（引擎不变），
批 1 / 8 / 16（各自的 max_batch_size，不同的提示词、各生成 --tokens 个，ignore_eos）：满批 decode 步的中位耗时、
tokens/s 与对 float32 packed 的倍数，贪心 token 是否与 float32 packed 相同（第 01 章的规则：不同处参照的 top-2 差
在容差内算近乎打平，接受）。
只测量，不断言。表头印出 load avg：机器有别的负载时数字不可信。
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.bench import machine, median_time, memory_bandwidth, stamps_of, table  # noqa: E402
from common.compare import MARGIN_TOL, compare  # noqa: E402
from common.linear import pack_weight, packed_matmul  # noqa: E402
from common.prepare import default_model_dir  # noqa: E402
from common.tokenizer import Tokenizer  # noqa: E402
from common.weights import load_model  # noqa: E402
from step02_sampling.sampler import SamplingParams  # noqa: E402
from step03_kvcache_single.engine import generate  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402
from step09_speculative import engine as step09  # noqa: E402
from step14_weight_quant import formats, kernels  # noqa: E402
from step14_weight_quant.linear import use_block_weights_, weight_bytes  # noqa: E402

SHAPES = {"q/o_proj": (576, 576), "k/v_proj": (192, 576), "gate/up_proj": (1536, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}                                   # (N, K)，SmolLM2-135M
DECODE_M = (1, 2, 4, 8, 16)


def random_blocks(fmt: str, N: int, K: int, rng) -> np.ndarray:
    nb = K // formats.QK
    scales = (rng.standard_normal((N, nb, 2 if fmt == "q4_1" else 1)) * 0.05).astype(np.float16).view(np.uint8)
    qs = rng.integers(0, 256, (N, nb, 16 if fmt == "q4_1" else 32), dtype=np.uint8)
    return np.concatenate([scales.reshape(N, nb, -1), qs], axis=-1)


def copies_for(nbytes: int, total: int) -> int:
    return max(1, -(-total // nbytes))


def int4_operands(blocks: np.ndarray, N: int, K: int):
    """Q4_1 块 → PyTorch int4 内核的操作数（tests/test_step14_kernels.py 里同一组数的那个换算）。"""
    q = torch.from_numpy(formats.q4_1_nibbles(blocks[..., 4:]).reshape(N, K).astype(np.int32))
    d = torch.from_numpy(formats.fp16_fields(blocks, 0)[..., 0])                      # (N, K/32)
    m = torch.from_numpy(formats.fp16_fields(blocks, 2)[..., 0])
    scale_zero = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous()       # (K/32, N, 2)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scale_zero


def compute_peak(n: int = 1024) -> float:
    """这台机器的 float32 算力（FLOP/s）：oneDNN 的 n × n 矩阵乘（算术强度高，接近 FMA 的上限）。不用 MKL 的 sgemm：
    它在 AMD 的 CPU 上不走 AVX-512，只量出一半左右。"""
    a = torch.randn(n, n)
    w = pack_weight(a)
    return 2 * n**3 / median_time(lambda: packed_matmul(a, w), repeats=5, warmup=2)


def fixed_cost_us(lib, rounds: int) -> float:
    """一次调用的固定开销：16 × 32 的 float32 矩阵（一个行组、一块），读的字节可以忽略。"""
    w, x = formats.repack_f32(torch.randn(32, 16)), torch.randn(1, 32)
    calls = [None] * 2000
    best = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in calls:
            kernels.matmul_unchecked(lib, kernels.FMT_CODE["f32"], x, w, 16, 32)
        best.append((time.perf_counter() - t) / len(calls))
    return statistics.median(best) * 1e6


def kernel_table(total_bytes: int, rounds: int) -> tuple[str, list, float]:
    """每种形状 × M × 实现：GB/s、占带宽、占 roofline（max(字节 ÷ 带宽, 2·M·N·K ÷ 算力) ÷ 实测时间）。"""
    rng = np.random.default_rng(0)
    lib = kernels.library()
    bw, peak = memory_bandwidth(), compute_peak()
    fixed = fixed_cost_us(lib, rounds)
    rows, records = [], []
    for name, (N, K) in SHAPES.items():
        W = torch.randn(N, K)
        n_dense = copies_for(W.nbytes, total_bytes)
        plain = [W.T.contiguous() for _ in range(n_dense)]                                  # (in, out)
        dense = [pack_weight(w) for w in plain]
        f32 = [formats.repack_f32(W.T) for _ in range(n_dense)]
        blocks = {f: random_blocks(f, N, K, rng) for f in ("q8_0", "q4_1")}
        qb = {f: formats.repack_blocks(formats.QuantTensor(f, b, N, K)) for f, b in blocks.items()}
        q = {f: [t.clone() for _ in range(copies_for(t.nbytes, total_bytes))] for f, t in qb.items()}
        w8 = torch.randint(-127, 128, (N, K), dtype=torch.int8)
        s8 = torch.rand(N) * 0.01
        i8 = [(w8.clone(), s8) for _ in range(copies_for(w8.nbytes, total_bytes))]
        w4, sz = int4_operands(blocks["q4_1"], N, K)
        i4 = [(w4.clone(), sz) for _ in range(copies_for(w4.nbytes + sz.nbytes, total_bytes))]
        # 与 BlockLinear 同一条调用路径（不查参数的 matmul_unchecked）：量的是模型里那次调用
        ours = lambda x, w, f: kernels.matmul_unchecked(lib, kernels.FMT_CODE[f], x, w, N, K)  # noqa: E731
        for M in DECODE_M:
            x = torch.randn(M, K)
            floor = lambda nbytes: max(nbytes / bw, 2 * M * N * K / peak)          # noqa: E731  roofline 的时间下限
            impls = {"plain x@W": (lambda: [x @ w for w in plain], W.nbytes, len(plain)),
                     "oneDNN packed": (lambda: [packed_matmul(x, w) for w in dense], W.nbytes, len(dense)),
                     "ours f32": (lambda: [ours(x, w, "f32") for w in f32], W.nbytes, len(f32))}
            for f in ("q8_0", "q4_1"):
                impls[f"ours {f}"] = (lambda f=f: [ours(x, w, f) for w in q[f]], qb[f].nbytes, len(q[f]))
            impls["torch int8"] = (lambda: [torch.ops.aten._weight_int8pack_mm(x, w, sc) for w, sc in i8],
                                   w8.nbytes + s8.nbytes, len(i8))
            if M <= 2:
                impls["torch int4"] = (lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, 32, z) for w, z in i4],
                                       w4.nbytes + sz.nbytes, len(i4))
            times = {k: [] for k in impls}
            for fn, _, _ in impls.values():
                fn()
            for _ in range(rounds):
                for k, (fn, _, _) in impls.items():
                    t = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - t)
            for k, (_, nbytes, n) in impls.items():
                s = statistics.median(times[k]) / n                                         # 每次调用
                bound = "memory" if nbytes / bw >= 2 * M * N * K / peak else "compute"
                rows.append([name, M, k, f"{s * 1e6:.1f}", f"{nbytes / s / 1e9:.1f}", f"{nbytes / s / bw:.0%}",
                             f"{2 * M * N * K / s / 1e9:.0f}", f"{floor(nbytes) / s:.0%} ({bound})"])
                records.append({"shape": name, "M": M, "impl": k, "us_per_call": round(s * 1e6, 2),
                                "gb_s": round(nbytes / s / 1e9, 2), "of_bandwidth": round(nbytes / s / bw, 3),
                                "gflop_s": round(2 * M * N * K / s / 1e9, 1), "of_roofline": round(floor(nbytes) / s, 3),
                                "bound": bound})
    head = (f"read bandwidth this run: {bw / 1e9:.1f} GB/s (torch.sum over 512 MiB); compute: {peak / 1e9:.0f} GFLOP/s "
            f"(oneDNN 1024 x 1024 matmul); fixed cost of one call of ours (16 x 32 matrix): {fixed:.1f} µs\n"
            "of roofline = max(bytes / bandwidth, 2·M·N·K / compute) / time; (memory) or (compute): which term is larger\n")
    ours = [r for r in records if r["impl"] == "ours f32"]
    worst = min(ours, key=lambda r: r["of_bandwidth"])
    mem = [r for r in ours if r["bound"] == "memory"]
    worst_mem = min(mem, key=lambda r: r["of_bandwidth"]) if mem else None
    goal = (f"\nours f32, lowest share of bandwidth over every shape and M: {worst['of_bandwidth']:.0%} "
            f"({worst['shape']}, M = {worst['M']}); goal >= 80%: {'met' if worst['of_bandwidth'] >= 0.8 else 'missed'}; "
            f"shapes x M at >= 80%: {sum(r['of_bandwidth'] >= 0.8 for r in ours)} / {len(ours)}"
            + (f"\n  where the bytes are the bound ({len(mem)} of {len(ours)}): lowest {worst_mem['of_bandwidth']:.0%} "
               f"({worst_mem['shape']}, M = {worst_mem['M']}), at >= 80%: {sum(r['of_bandwidth'] >= 0.8 for r in mem)}"
               if mem else "")
            + (f"\n  where compute is the bound: the ceiling is compute / (2·M / 4 bytes) = {peak / 1e9:.0f} / (M / 2) GB/s"
               if len(mem) < len(ours) else ""))
    return head + table(["shape", "M", "impl", "µs/call", "GB/s", "of bandwidth", "GFLOP/s", "of roofline"], rows) + goal, \
        records, bw


def decode_table(rounds: int, tokens: int) -> tuple[str, list]:
    path = default_model_dir()
    tok = Tokenizer(path)
    ids = tok.encode("Write a short story about a robot who learns to paint.")
    models = {"f32 packed": load_model(path, "cpu", torch.float32)}
    models["ours f32"] = use_block_weights_(load_model(path, "cpu", torch.float32, "plain"), "f32")
    models["ours q4_1"] = use_block_weights_(load_model(path, "cpu", torch.float32, "plain"), "q4_1")
    models["q4_1 x Q8_1 (lossy)"] = use_block_weights_(load_model(path, "cpu", torch.float32, "plain"), "q4_1_q8_1")
    steps = {k: [] for k in models}
    outs = {}
    for k, m in models.items():                                        # 预热
        outs[k] = generate(m, ids, tokens, SamplingParams(), ignore_eos=True)
    for _ in range(rounds):
        for k, m in models.items():
            lat = stamps_of(m, "cpu", lambda: generate(m, ids, tokens, SamplingParams(), ignore_eos=True))
            steps[k].append(statistics.median(lat[1:]))              # 第 0 个是 prefill
    base = statistics.median(steps["f32 packed"])
    rows, records = [], []
    for k, m in models.items():
        s = statistics.median(steps[k])
        resident = (sum(weight_bytes(m).values()) if k != "f32 packed"
                    else sum(p.numel() * p.element_size() for p in m.parameters()))
        div = next((i for i, (a, b) in enumerate(zip(outs[k], outs["f32 packed"])) if a != b), None)
        rows.append([k, f"{s * 1e3:.2f}", f"{base / s:.2f}x", f"{resident / 1e6:.1f}",
                     "identical" if div is None else f"differs from token {div}"])
        records.append({"weights": k, "ms_per_step": round(s * 1e3, 3), "resident_bytes": resident,
                        "first_difference": div})
    return (f"step03 greedy decode, prompt {len(ids)} tokens, {tokens} new tokens, median step over {rounds} rounds\n"
            + table(["weights", "ms/step", "speed vs f32 packed", "resident weight MB", "greedy tokens vs f32 packed"], rows),
            records)


ENGINE_BATCHES = (1, 8, 16)


def engine_table(rounds: int, tokens: int) -> tuple[str, list]:
    """step09 的引擎在批 1 / 8 / 16 上：只换线性层（与 step14 的 run.py 相同的模块），引擎一行不改。"""
    path = default_model_dir()
    tok = Tokenizer(path)
    prompts = [tok.encode(f"Write one sentence about the number {i}.") for i in range(max(ENGINE_BATCHES))]
    models = {"f32 packed": load_model(path, "cpu", torch.float32),
              "ours f32": use_block_weights_(load_model(path, "cpu", torch.float32, "plain"), "f32"),
              "ours q4_1": use_block_weights_(load_model(path, "cpu", torch.float32, "plain"), "q4_1")}

    def run(model, B: int):
        blocks = B * (-(-(max(map(len, prompts)) + tokens) // 16) + 1)
        engine = step09.LLMEngine(model, step09.EngineConfig(blocks, 16, B), tok, tok.eos_ids)
        out = engine.generate([Request(ids, tokens, SamplingParams(), ignore_eos=True) for ids in prompts[:B]])
        full = [st.seconds for st in out.stats.steps if not st.prefill and st.decode_tokens == B]   # 满批的纯 decode 步
        return out.outputs, statistics.median(full)

    step_s = {(k, B): [] for k in models for B in ENGINE_BATCHES}
    outs = {(k, B): run(m, B)[0] for k, m in models.items() for B in ENGINE_BATCHES}     # 预热，并留下 token
    for _ in range(rounds):
        for B in ENGINE_BATCHES:
            for k, m in models.items():
                step_s[k, B].append(run(m, B)[1])
    @torch.inference_mode()
    def ref_logits(ids):                                                  # 参照：float32 packed 整段重算
        return models["f32 packed"](torch.tensor([ids]), torch.arange(len(ids))[None])[0]

    def verdict(k: str, B: int) -> tuple[str, bool]:
        res = [compare(f"#{i}", prompts[i], r, g, ref_logits, MARGIN_TOL[torch.float32])
               for i, (r, g) in enumerate(zip(outs["f32 packed", B], outs[k, B]))]
        bad = [r for r in res if not r.equal]
        if not bad:
            return "identical", True
        ok = all(r.ok for r in bad)
        return (f"{len(bad)} of {B} differ, " + ("all near-ties (accepted): " if ok else "MISMATCH: ")
                + "; ".join(f"{r.name} at {r.position}, ref top-2 margin {r.margin:.1e}" for r in bad)), ok

    rows, records = [], []
    for B in ENGINE_BATCHES:
        base = statistics.median(step_s["f32 packed", B])
        for k in models:
            s = statistics.median(step_s[k, B])
            text, ok = verdict(k, B)
            rows.append([B, k, f"{s * 1e3:.2f}", f"{B / s:.0f}", f"{base / s:.2f}x", text])
            records.append({"batch": B, "weights": k, "ms_per_step": round(s * 1e3, 3), "tok_s": round(B / s, 1),
                            "vs_f32_packed": round(base / s, 3), "tokens": text, "tokens_ok": ok})
    return (f"step09 engine, batch = max_batch_size, distinct prompts, {tokens} new tokens each (ignore_eos), "
            f"median full-batch decode step over {rounds} rounds\n"
            + table(["batch", "weights", "ms/step", "tok/s", "vs f32 packed", "greedy tokens vs f32 packed"], rows),
            records)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--part", choices=["all", "kernel", "decode", "engine"], default="all")
    ap.add_argument("--json", action="store_true", help="stdout 最后一行输出一个 JSON 对象")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {"machine_before": machine()}
    print(out["machine_before"])
    if args.part in ("all", "kernel"):
        text, out["kernel"], bw = kernel_table((32 if args.quick else 64) * 2**20, args.rounds)
        out["bandwidth_gb_s"] = round(bw / 1e9, 2)
        print(text)
    if args.part in ("all", "decode"):
        text, out["decode"] = decode_table(args.rounds, args.tokens)
        print(text)
    if args.part in ("all", "engine"):
        text, out["engine"] = engine_table(args.rounds, args.tokens)
        print(text)
    out["machine_after"] = machine()
    print(out["machine_after"])
    if args.json:
        print(json.dumps(out, ensure_ascii=False))


if __name__ == "__main__":
    main()
