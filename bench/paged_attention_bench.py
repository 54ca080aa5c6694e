"""一层注意力的微基准：step05 现在的 gather + 注意力、就地读池子的 PagedAttention（C++ 内核、flex_attention）、
以及连续 K/V 上的注意力（step04 的对照），在 SmolLM2 的形状上（H = 9，H_kv = 3，D = 64，块大小 16）。

    python bench/paged_attention_bench.py [--quick] [--threads N] [--repeats R] [--json] [--plot PATH]

decode：上下文 256 … 4096 × 批大小 1 / 4 / 8，每个请求 1 个 query；分块 prefill：几个 query_len > 1 的情况。
每个请求的块在池子里随机打散（和真实运行一样不连续）；池子按最大的情况一次分好，各情况从中取块。
计时方式：每种写法先预热，然后轮流各跑 R 次取中位数；每次计时前读一遍 2 × L3 大小的缓冲，把 K/V 挤出缓存——
真实的前向里，两次读同一层的 K/V 之间隔着其余 29 层和全部权重，K/V 总是从内存里读的。
"gather + 注意力"只计每层都要做的部分（index_select 到复用的缓冲、清零尾巴的 V、注意力），
与 step05 的 AttentionMetadata.update（gather 读法）相同；块表换算成行号、掩码这些每次前向算一次的东西不计（plan 里做）。
flex 的 BlockMask 同理每次前向造一次、各层共用，不计；它的编译时间单独列出。
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.bench import machine, table  # noqa: E402
from common.model import attention  # noqa: E402
from step05_paged import paged_attention as pa  # noqa: E402

H, H_KV, D, BLOCK = 9, 3, 64, 16                    # SmolLM2-135M 的注意力形状
LAYERS = 30                                         # 它的层数：一个 decode 步 = 30 次这样的注意力
MIB = 2**20
CONTEXTS, BATCHES = (256, 512, 1024, 2048, 4096), (1, 4, 8)
QUICK_CONTEXTS, QUICK_BATCHES = (256, 1024, 4096), (1, 8)
CHUNKS = ((1, 64, 512), (1, 256, 1024), (1, 512, 512), (4, 64, 1024))   # (B, query_len, 上下文)：分块 / 前缀命中后的 prefill
IMPLS = {"gather": "gather + 注意力（step05 现在）", "cpp": "分页 C++ 内核", "flex": "分页 flex_attention",
         "dense": "连续 K/V（step04 同款注意力）", "sdpa": "连续 K/V + F.sdpa"}


class Case:
    """一种 (B, query_len, 上下文)：池子里随机散开的块表、q、以及同样内容的连续 K/V。"""

    def __init__(self, pool, B: int, L: int, ctx: int, gen: torch.Generator):
        self.B, self.L, self.ctx = B, L, ctx
        self.rows_view = pool.view(-1, BLOCK * D)      # (2·(num_blocks+1)·H_kv, bs·D)：一行 = (K/V, 物理块, 头) 的一段
        num_pool_blocks = pool.shape[1]                                        # num_blocks + 1（最后一块是空块）
        self.k_cache, self.v_cache = pool[0], pool[1]                          # 各 (num_blocks + 1, H_kv, bs, D)
        n = -(-ctx // BLOCK)
        picked = torch.randperm(num_pool_blocks - 1, generator=gen)[:B * n]
        self.block_tables = picked.view(B, n).to(torch.int32)                  # (B, n)：每行 n 个随机的物理块
        self.seq_lens = torch.full((B,), ctx, dtype=torch.int32)
        self.query_lens = torch.full((B,), L, dtype=torch.int32)
        self.q = torch.randn(B * L, H, D, generator=gen)                       # (T, H, D)
        # 连续的 K/V：与池子里这些块同样的数，(B, H_kv, S, D)，S 多留一点容量（step04 的预分配缓存读的是前 S 列的视图）
        k, v, _ = pa.gather_kv(self.k_cache, self.v_cache, self.block_tables.long())
        cap = ctx + BLOCK
        self.k_dense = torch.zeros(B, H_KV, cap, D)
        self.v_dense = torch.zeros(B, H_KV, cap, D)
        self.k_dense[:, :, :ctx] = k[:, :, :ctx]
        self.v_dense[:, :, :ctx] = v[:, :, :ctx]
        # step05 的读法：池子一层看成 (2·(num_blocks+1)·H_kv, bs·D) 行，一次 index_select 把 K 和 V 一起拷到复用的缓冲
        heads = torch.arange(H_KV)[None, None, :, None]
        kv = torch.arange(2)[:, None, None, None]
        self.read_rows = ((kv * num_pool_blocks + self.block_tables.long()[None, :, None, :]) * H_KV + heads).flatten()
        self.read_buf = torch.empty(2 * B * H_KV * n, BLOCK * D)
        S = n * BLOCK
        own = torch.arange(S)
        self.v_tail_rows = ((own[None, :] >= ctx)[:, None, :].expand(B, H_KV, S)).flatten().nonzero().squeeze(1)
        q_pos = ctx - L + torch.arange(L)                                       # (L,)
        self.mask = (own[None, :] <= q_pos[:, None])[None, None, None].expand(B, 1, 1, L, S)   # (B, 1, 1, L, S)
        self.q4 = self.q.view(B, L, H, D).transpose(1, 2)                      # (B, H, L, D)
        self.block_mask = None

    @property
    def gather_bytes(self) -> int:
        return self.read_buf.nbytes

    def fns(self) -> dict:
        B, L, ctx = self.B, self.L, self.ctx

        def gather():
            torch.index_select(self.rows_view, 0, self.read_rows, out=self.read_buf)      # 拷贝：K 和 V 一次拷出
            k_all, v_all = self.read_buf.view(2, B, H_KV, -1, D)                 # 各 (B, H_kv, S, D)
            v_all.view(-1, D).index_fill_(0, self.v_tail_rows, 0)
            return attention(self.q4, k_all, v_all, self.mask)

        def cpp():
            return pa.paged_attention_cpp(self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                                          self.query_lens)

        def flex():
            if self.block_mask is None:                                         # 每次前向造一次，各层共用
                self.block_mask = pa.flex_block_mask(self.k_cache, self.block_tables, self.seq_lens, self.query_lens, H)
            return pa.paged_attention_flex(self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                                           self.query_lens, block_mask=self.block_mask)

        dense_mask = None if L > 1 else torch.ones(B, 1, 1, 1, ctx, dtype=torch.bool)   # step04 decode 的掩码（左填充，这里没有填充）

        def dense():
            return attention(self.q4, self.k_dense[:, :, :ctx], self.v_dense[:, :, :ctx], dense_mask)

        sdpa_mask = None if L == 1 else self.mask[:, 0, :, :, :ctx]            # (B, 1, L, ctx)

        def sdpa():
            return F.scaled_dot_product_attention(self.q4, self.k_dense[:, :, :ctx], self.v_dense[:, :, :ctx],
                                                  attn_mask=sdpa_mask, enable_gqa=True)

        return {"gather": gather, "cpp": cpp, "flex": flex, "dense": dense, "sdpa": sdpa}


def measure(fns: dict, repeats: int, flush: torch.Tensor) -> dict:
    """轮流计时（每轮换一次顺序），每次之前读一遍 flush 把 K/V 挤出缓存；返回各自的中位数（毫秒）。"""
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            flush.sum()
            t = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def check_same(fns: dict, T: int) -> float:
    """各写法的输出与 gather 的最大差（同一个数学，应在 float32 舍入以内）。"""
    def as_rows(o):
        return o if o.dim() == 3 else o.transpose(1, 2).reshape(T, H, D)       # (B, H, L, D) -> (T, H, D)
    ref = as_rows(fns["gather"]())
    return max(float((as_rows(fn()) - ref).abs().max()) for fn in fns.values())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="少几种上下文和批大小、少几次重复")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=None, help="每种写法计时几次（默认 15，--quick 5）")
    p.add_argument("--no-flex", action="store_true", help="不测 flex_attention（省掉它的编译）")
    p.add_argument("--json", action="store_true", help="stdout 最后一行输出一个 JSON 对象")
    p.add_argument("--plot", default=None, help="把 decode 的表画成图，存到这个路径（PNG）")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (5 if args.quick else 15)
    contexts, batches = (QUICK_CONTEXTS, QUICK_BATCHES) if args.quick else (CONTEXTS, BATCHES)
    impls = [i for i in IMPLS if not (args.no_flex and i == "flex")]

    print(f"机器: {machine()}")
    if not pa.kernel_available():
        print(f"C++ 内核编不出来：{pa.kernel_build_error()}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:                 # 量一次现场编译要多久（不碰真正的缓存）
        t = time.perf_counter()
        pa.build_kernel(Path(tmp))
        build_s = time.perf_counter() - t
    print(f"C++ 内核：现场编译一次 {build_s:.1f} s（之后从缓存加载：{pa.kernel_dir()}）")
    gen = torch.Generator().manual_seed(0)
    need = max(max(batches) * -(-max(contexts) // BLOCK), max(b * -(-c // BLOCK) for b, _, c in CHUNKS))
    pool = torch.randn(2, need + 1, H_KV, BLOCK, D, generator=gen)              # 一层的池子：(2, num_blocks + 1, H_kv, bs, D)
    flush = torch.empty(64 * MIB // 4).uniform_()                               # 2 × L3（这台机器 32 MiB）
    print(f"池子 {need} 块（一层 {pool.nbytes / MIB:.0f} MiB）；每种写法轮流各跑 {repeats} 次取中位数，"
          f"每次之前读 {flush.nbytes // MIB} MiB 挤掉缓存；{args.threads} 个线程")

    compile_s = {}
    rows, records = [], []

    def run_case(B, L, ctx, kind):
        case = Case(pool, B, L, ctx, gen)
        fns = {name: fn for name, fn in case.fns().items() if name in impls}
        if "flex" in fns:
            t = time.perf_counter()
            fns["flex"]()                                   # 第一次：可能要编译（B、L 变了就重新编译）
            compile_s[f"B={B},L={L},ctx={ctx}"] = time.perf_counter() - t
        diff = check_same(fns, B * L)
        ms = measure(fns, repeats, flush)
        rec = {"kind": kind, "B": B, "query_len": L, "context": ctx, "ms_per_layer": ms, "max_abs_diff": diff,
               "gather_bytes_per_layer": case.gather_bytes}
        records.append(rec)
        return rec

    print("\ndecode（每个请求 1 个 query）：一层注意力的时间（ms，中位数）")
    for ctx in contexts:
        for B in batches:
            rec = run_case(B, 1, ctx, "decode")
            ms = rec["ms_per_layer"]
            rows.append([ctx, B] + [ms[i] for i in impls] + [ms["cpp"] / ms["dense"], ms["cpp"] / ms["gather"],
                                                              rec["gather_bytes_per_layer"] / MIB,
                                                              LAYERS * rec["gather_bytes_per_layer"] / MIB])
    headers = ["上下文", "B"] + [IMPLS[i] for i in impls] + ["C++ ÷ step04", "C++ ÷ gather", "gather 每层拷贝 (MiB)",
                                                              "每个 decode 步 (30 层, MiB)"]
    print(table(headers, rows))

    print("\n分块 prefill / 前缀命中（每个请求 query_len 个 query，位于上下文的最后 query_len 个位置，因果）：")
    chunk_rows = []
    for B, L, ctx in CHUNKS:
        rec = run_case(B, L, ctx, "chunk")
        ms = rec["ms_per_layer"]
        chunk_rows.append([B, L, ctx] + [ms[i] for i in impls] + [ms["cpp"] / ms["dense"],
                                                                   rec["gather_bytes_per_layer"] / MIB])
    print(table(["B", "query_len", "上下文"] + [IMPLS[i] for i in impls] + ["C++ ÷ 连续", "gather 每层拷贝 (MiB)"],
                chunk_rows))
    print("连续 K/V 一列在 query_len > 1 时是同样的因果注意力直接读连续的 K/V（step04 没有这种前向，只作对照）。")
    worst = max(r["max_abs_diff"] for r in records)
    print(f"\n各写法与 gather 的最大差 {worst:.1e}（float32）")
    if compile_s:
        slow = {k: v for k, v in compile_s.items() if v >= 0.5}
        print("flex_attention 第一次调用要编译的形状（torch.compile）: "
              + ", ".join(f"{k} {v:.1f} s" for k, v in slow.items())
              + f"；其余 {len(compile_s) - len(slow)} 种形状直接复用编好的内核（第一次调用 < 0.5 s）")

    if args.plot:
        plot(records, impls, batches, args.plot)
        print(f"图: {args.plot}")
    if args.json:
        print(json.dumps({"machine": machine(), "threads": args.threads, "repeats": repeats, "build_s": build_s,
                          "records": records,
                          "flex_first_call_s": compile_s, "max_abs_diff": worst}))
    return 0


def plot(records, impls, batches, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.plotting import use_chinese_font
    use_chinese_font()
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4.2), sharey=True)
    for ax, B in zip(axes, batches):
        recs = [r for r in records if r["kind"] == "decode" and r["B"] == B]
        ctx = [r["context"] for r in recs]
        for name in impls:
            ax.plot(ctx, [r["ms_per_layer"][name] for r in recs], marker="o", label=IMPLS[name])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ctx, [str(c) for c in ctx])
        ax.set_title(f"批大小 B = {B}")
        ax.set_xlabel("上下文长度（token）")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("一层注意力的时间（ms，对数坐标）")
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"decode 一层注意力：gather vs 就地读池子 vs 连续 K/V（H=9, H_kv=3, D=64, 块 16；{machine()}）",
                 fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    with torch.inference_mode():                               # 和引擎一样（index_select(out=) 在这里也能用）
        sys.exit(main())
