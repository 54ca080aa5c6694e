"""同样的权重、不同的行数：矩阵乘的时间随行数怎么涨（docs/09 第 1 节的单线程表）。

验证 k 个猜测时，每个权重矩阵要乘 k+1 行而不是 1 行。这里用模型形状的随机权重（90 个 576 × 1536 / 1536 × 576 的矩阵，
共约 318 MB，读不进缓存；外加 576 × 49152 的 lm_head）量 1、2、3、5、9 行各要多久，几轮交替取中位数。
单线程：两个线程在有别的进程抢 CPU 时，每个多线程的矩阵乘都要等另一个线程，量出来的是争用而不是矩阵乘。

    python step09_speculative/analysis/matmul_rows.py [--threads 1] [--repeats 5]
"""
import argparse
import statistics
import time

import torch

ROWS = (1, 2, 3, 5, 9)


def measure(repeats: int) -> dict[int, tuple[float, float]]:
    """行数 → (90 个层内矩阵的总时间, lm_head 的时间)，秒，repeats 轮交替的中位数。"""
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(576, 1536, generator=g) for _ in range(60)] + [torch.randn(1536, 576, generator=g) for _ in range(30)]
    lm_head = torch.randn(576, 49152, generator=g)
    times = {m: ([], []) for m in ROWS}
    for _ in range(repeats):
        for m in ROWS:
            x = {576: torch.randn(m, 576), 1536: torch.randn(m, 1536)}
            t0 = time.perf_counter()
            for w in layers:
                x[w.shape[0]] @ w                       # (m, in) x (in, out) -> (m, out)
            t1 = time.perf_counter()
            x[576] @ lm_head                            # (m, 576) x (576, 49152) -> (m, 49152)
            times[m][0].append(t1 - t0)
            times[m][1].append(time.perf_counter() - t1)
    return {m: (statistics.median(a), statistics.median(b)) for m, (a, b) in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    res = measure(args.repeats)
    base = res[1]
    print("行数  层内矩阵 (ms)  ÷ 1 行  lm_head (ms)  ÷ 1 行  合计 ÷ 1 行")
    for m, (a, b) in res.items():
        print(f"{m:>4}  {a * 1e3:>13.1f}  {a / base[0]:>6.2f}  {b * 1e3:>12.1f}  {b / base[1]:>6.2f}  {(a + b) / sum(base):>10.2f}")


if __name__ == "__main__":
    main()
