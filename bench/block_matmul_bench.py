"""块权重（step14_weight_quant）的两把尺子，各实现轮流跑、与同一次运行实测的内存读带宽并排：

    python bench/block_matmul_bench.py [--quick] [--threads 2] [--rounds 5] [--tokens 48]

第 1 部分（内核）：模型里每种投影的形状 × M = 1, 2, 4, 8, 16，每种实现读权重的速度（GB/s = 权重字节 ÷ 每次调用的时间）
与它占同次带宽的比例：
  oneDNN packed   项目现在的线性层（common/linear.py 的 packed，float32）
  ours f32        我们的内核，float32 权重按 16 行一组重排（formats.repack_f32）
  ours q4_1       我们的内核，Q4_1 块（lm_head 那一行是 Q8_0：发布的文件里它就是 Q8_0）
每种形状复制多份、总量 ≥ 64 MiB（--quick 32 MiB），放不进 L3，和真实 decode 一样从内存读。数据是随机的块（速度与数值无关）。
第 2 部分（端到端）：真实默认模型的四种加载——float32 packed（默认）、ours f32、ours q4_1、有损的 q4_1 × Q8_1——
step03 的贪心 decode，每步毫秒数（去掉 prefill 的中位数），轮流跑 rounds 轮；并报告贪心 token 是否与 float32 packed
相同（不同时从第几个起）、常驻的权重字节。
只测量，不断言。表头印出 load avg：机器有别的负载时数字不可信。
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.bench import machine, memory_bandwidth, stamps_of, table  # noqa: E402
from common.linear import pack_weight, packed_matmul  # noqa: E402
from common.prepare import default_model_dir  # noqa: E402
from common.tokenizer import Tokenizer  # noqa: E402
from common.weights import load_model  # noqa: E402
from step02_sampling.sampler import SamplingParams  # noqa: E402
from step03_kvcache_single.engine import generate  # noqa: E402
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


def kernel_table(total_bytes: int, rounds: int) -> str:
    rng = np.random.default_rng(0)
    bw = memory_bandwidth()
    rows = []
    for name, (N, K) in SHAPES.items():
        qfmt = "q8_0" if name == "lm_head" else "q4_1"
        W = torch.randn(N, K)
        dense = [pack_weight(W.T.contiguous()) for _ in range(copies_for(W.nbytes, total_bytes))]
        f32 = [formats.repack_f32(W.T) for _ in range(len(dense))]
        qb = formats.repack_blocks(formats.QuantTensor(qfmt, random_blocks(qfmt, N, K, rng), N, K))
        q = [qb.clone() for _ in range(copies_for(qb.nbytes, total_bytes))]
        for M in DECODE_M:
            x = torch.randn(M, K)
            impls = {"oneDNN packed": (lambda: [packed_matmul(x, w) for w in dense], W.nbytes * len(dense), len(dense)),
                     "ours f32": (lambda: [kernels.matmul("f32", x, w, N) for w in f32], W.nbytes * len(f32), len(f32)),
                     f"ours {qfmt}": (lambda: [kernels.matmul(qfmt, x, w, N) for w in q], qb.nbytes * len(q), len(q))}
            times = {k: [] for k in impls}
            for fn, _, _ in impls.values():
                fn()
            for _ in range(rounds):
                for k, (fn, _, _) in impls.items():
                    t = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - t)
            for k, (_, nbytes, n) in impls.items():
                s = statistics.median(times[k])
                rows.append([name, M, k, f"{s / n * 1e6:.1f}", f"{nbytes / s / 1e9:.1f}", f"{nbytes / s / bw:.0%}"])
    head = f"read bandwidth this run: {bw / 1e9:.1f} GB/s (torch.sum over 512 MiB)\n"
    return head + table(["shape", "M", "impl", "µs/call", "GB/s", "of bandwidth"], rows)


def decode_table(rounds: int, tokens: int) -> str:
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
    rows = []
    for k, m in models.items():
        s = statistics.median(steps[k])
        resident = (sum(weight_bytes(m).values()) if k != "f32 packed"
                    else sum(p.numel() * p.element_size() for p in m.parameters()))
        div = next((i for i, (a, b) in enumerate(zip(outs[k], outs["f32 packed"])) if a != b), None)
        rows.append([k, f"{s * 1e3:.2f}", f"{base / s:.2f}x", f"{resident / 1e6:.1f}",
                     "identical" if div is None else f"differs from token {div}"])
    return (f"step03 greedy decode, prompt {len(ids)} tokens, {tokens} new tokens, median step over {rounds} rounds\n"
            + table(["weights", "ms/step", "speed vs f32 packed", "resident weight MB", "greedy tokens vs f32 packed"], rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--part", choices=["all", "kernel", "decode"], default="all")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine())
    if args.part in ("all", "kernel"):
        print(kernel_table((32 if args.quick else 64) * 2**20, args.rounds))
    if args.part in ("all", "decode"):
        print(decode_table(args.rounds, args.tokens))
    print(machine())


if __name__ == "__main__":
    main()
