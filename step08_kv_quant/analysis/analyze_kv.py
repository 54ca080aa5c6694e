"""KV 量化的实验：真实模型的 K/V 长什么样（离群通道），各种量化粒度让模型差了多少，换出 vs 重算。

    python step08_kv_quant/analysis/analyze_kv.py [--quick] [--plot docs/images/08_kv_channel_magnitude.png] [--json]
        [--skip-quality] [--skip-swap] [--model DIR] [--device ...] [--dtype ...]

1. 手算的例子：一个 3 × 4 的小矩阵，按 token / 按通道的 int8、以及 fp8 e4m3，各自的 scale、码、读回值和误差。
2. 通道幅度：章节提示词 + 长提示词 prefill 进 step03 的预分配缓存，取出每层每个通道的 max |K|（缓存里存的、RoPE
   之后的 K；另用钩子记下 RoPE 之前的 K）与 max |V|，印出离群程度并画图（--plot）。
3. 真实 K/V 的量化往返误差（相对误差），各粒度 × int8 / fp8。
4. 质量（慢）：每种方案用量化缓存（dense_cache.QuantKVCache）做 teacher forcing 与贪心生成，与精确缓存比：
   top-1 一致率、|Δ logit|、NLL 变化、贪心第一次分歧的位置与精确模型在那里的 top-2 差。
5. 换出 vs 重算（swap_cost.py）：不同上下文长度下两者的时间与交叉点。
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from common import cli  # noqa: E402
from common.bench import machine, table  # noqa: E402
from common.prompts import CHAPTER_PROMPTS, LONG_PROMPT  # noqa: E402
from step02_sampling.sampler import SamplingParams  # noqa: E402
from step03_kvcache_single.cache import PreallocKVCache  # noqa: E402
from step03_kvcache_single.engine import forward, generate  # noqa: E402
from step08_kv_quant.analysis.dense_cache import QuantKVCache  # noqa: E402
from step08_kv_quant.analysis.quality import first_divergence, forced_logits, pool, teacher_forced_quality  # noqa: E402
from step08_kv_quant.quant import (QuantScheme, compute_scale, dequantize, fake_quantize,  # noqa: E402
                                   kv_bytes_per_token, quantize)
from step08_kv_quant.analysis.swap_cost import crossover, measure_swap_vs_recompute  # noqa: E402

BLOCK_SIZE = 16
NEW_TOKENS = 32          # 质量比较里每段文本生成的 token 数（--quick: QUICK_NEW_TOKENS）
QUICK_NEW_TOKENS = 8

I8, F8 = "int8", "fp8"
# (名字, K 的方案, V 的方案)；None = 那一半不量化（用来分开看 K 和 V 各自的影响）
SCHEMES = [
    ("int8 token / token", QuantScheme(I8, "token"), QuantScheme(I8, "token")),
    ("int8 block / block", QuantScheme(I8, "block"), QuantScheme(I8, "block")),
    ("int8 channel / token", QuantScheme(I8, "channel"), QuantScheme(I8, "token")),
    ("int8 channel / channel", QuantScheme(I8, "channel"), QuantScheme(I8, "channel")),
    ("int8 token / 不量化", QuantScheme(I8, "token"), None),
    ("不量化 / int8 token", None, QuantScheme(I8, "token")),
    ("fp8 token / token", QuantScheme(F8, "token"), QuantScheme(F8, "token")),
    ("fp8 block / block", QuantScheme(F8, "block"), QuantScheme(F8, "block")),
    ("fp8 channel / token", QuantScheme(F8, "channel"), QuantScheme(F8, "token")),
    ("fp8 scale=1 / scale=1", QuantScheme(F8, "tensor", 1.0), QuantScheme(F8, "tensor", 1.0)),
]
QUICK_SCHEMES = [0, 2, 6]


def texts(quick: bool) -> list[tuple[str, str, bool]]:
    """章节提示词 + 长提示词（--quick 只取前两个章节提示词：CI 冒烟用，数字没有意义）。"""
    return CHAPTER_PROMPTS[:2] if quick else CHAPTER_PROMPTS + [("long", LONG_PROMPT, False)]


# ---------- 1. 手算的例子 ----------

def e4m3_bits(code: torch.Tensor) -> str:
    b = int(code.view(torch.uint8))
    return f"{b >> 7} {(b >> 3) & 0xF:04b} {b & 0x7:03b}"


def worked_example() -> None:
    x = torch.tensor([[0.8, -0.3, 0.05, 12.0],
                      [-0.5, 0.6, -0.02, 11.0],
                      [0.1, -0.9, 0.07, 13.0]])                   # 3 个 token × 4 个通道，第 3 通道是离群通道
    print("\n== 1. 手算的例子：3 个 token × 4 个通道的 K（第 3 个通道是离群通道）==")
    print(table(["token", "c0", "c1", "c2", "c3"], [[i, *[f"{v:g}" for v in row.tolist()]] for i, row in enumerate(x)]))
    group = x[None, None]                                          # (1, 1, T, D)：一块、一个头
    for label, scheme in (("int8 按 token（每行一个 scale）", QuantScheme(I8, "token")),
                          ("int8 按通道（每列一个 scale）", QuantScheme(I8, "channel")),
                          ("fp8 e4m3 按 token", QuantScheme(F8, "token"))):
        scale = compute_scale(group, scheme)
        codes = quantize(group, scale, scheme)
        back = dequantize(codes, scale, torch.float32)[0, 0]
        s = scale[0, 0]
        print(f"\n{label}: scale = max|x| / {scheme.qmax:g} = "
              + ", ".join(f"{v:.6g}" for v in s.flatten().tolist()))
        rows = []
        for i in range(x.shape[0]):
            if scheme.dtype == I8:
                code_txt = " ".join(f"{int(c):4d}" for c in codes[0, 0, i])
            else:
                code_txt = " | ".join(e4m3_bits(c) for c in codes[0, 0, i])
            rows.append([i, code_txt, " ".join(f"{v:.4g}" for v in back[i].tolist()),
                         " ".join(f"{v:.2g}" for v in (back[i] - x[i]).abs().tolist())])
        print(table(["token", "码" if scheme.dtype == I8 else "码（符号 指数 尾数）", "读回 x̂", "|x̂ − x|"], rows))


# ---------- 2. 通道幅度 ----------

@torch.inference_mode()
def collect_kv(s: cli.Session, quick: bool) -> dict[str, torch.Tensor]:
    """每段文本 prefill 进预分配缓存；返回 {"k": (layers, H_kv, T, D), "k_pre": 同形, "v": 同形}，T = 全部文本的 token 拼起来。"""
    pre, ks, vs = [], [], []
    seen: list[torch.Tensor] = []

    def hook(module, inp, out):
        seen.append(out.detach())                                  # k_proj（qwen3 为 k_norm）的输出：RoPE 之前

    handles = []
    for layer in s.model.layers:
        attn = layer.self_attn
        handles.append((attn.k_norm if attn.qk_norm else attn.k_proj).register_forward_hook(hook))
    try:
        for name, text, chat in texts(quick):
            ids = s.encode(text, chat)
            cache = PreallocKVCache(s.cfg, len(ids), s.device, s.dtype)
            seen.clear()
            forward(s.model, cache, ids, 0)
            ks.append(cache.kv[:, 0, 0].float())                   # (layers, H_kv, T, D)
            vs.append(cache.kv[:, 1, 0].float())
            H_kv, D = s.cfg.num_kv_heads, s.cfg.head_dim
            pre.append(torch.stack([t[0].reshape(-1, H_kv, D).transpose(0, 1) for t in seen]).float())  # (layers, H_kv, T, D)
    finally:
        for h in handles:
            h.remove()
    return {"k": torch.cat(ks, 2), "k_pre": torch.cat(pre, 2), "v": torch.cat(vs, 2)}


def channel_max(x: torch.Tensor) -> torch.Tensor:
    """(layers, H_kv, T, D) → 每层每个通道（H_kv·D 个）在全部 token 上的 max |x|：(layers, H_kv·D)。"""
    return x.abs().amax(dim=2).flatten(1)


def outlier_ratio(m: torch.Tensor) -> torch.Tensor:
    """(layers, C) → 每层 最大通道 / 通道中位数。"""
    return m.amax(1) / m.median(1).values


def report_magnitudes(kv: dict, figures: dict) -> dict:
    mags = {k: channel_max(v) for k, v in kv.items()}
    ratios = {k: outlier_ratio(m) for k, m in mags.items()}
    L = mags["k"].shape[0]
    T = kv["k"].shape[2]
    print(f"\n== 2. 每层每个通道的 max |·|（{T} 个 token；离群程度 = 最大通道 / 通道中位数）==")
    rows = []
    for layer in range(L):
        top = mags["k"][layer].topk(3).indices.tolist()
        rows.append([layer, f"{float(mags['k'][layer].max()):.1f}", f"{float(mags['k'][layer].median()):.2f}",
                     f"{float(ratios['k'][layer]):.1f}", f"{float(ratios['k_pre'][layer]):.1f}",
                     f"{float(mags['v'][layer].max()):.2f}", f"{float(mags['v'][layer].median()):.2f}",
                     f"{float(ratios['v'][layer]):.1f}", " ".join(map(str, top))])
    print(table(["层", "K 最大", "K 中位", "K 离群(RoPE 后)", "K 离群(RoPE 前)", "V 最大", "V 中位", "V 离群",
                 "K 最大的 3 个通道"], rows))
    med = {k: float(r.median()) for k, r in ratios.items()}
    print(f"离群程度的各层中位数：K（RoPE 后）{med['k']:.1f}，K（RoPE 前）{med['k_pre']:.1f}，V {med['v']:.1f}")
    tiny = {k: float((kv[k].abs() < 2**-6).float().mean()) for k in ("k", "v")}
    print(f"|值| < 2⁻⁶（fp8 固定 scale = 1 时落进次正规数区间）的比例：K {tiny['k'] * 100:.1f}%，V {tiny['v'] * 100:.1f}%"
          f"（第 0 层的 V {float((kv['v'][0].abs() < 2**-6).float().mean()) * 100:.0f}%）")
    figures |= {"k_outlier_ratio_median": med["k"], "k_pre_rope_outlier_ratio_median": med["k_pre"],
                "v_outlier_ratio_median": med["v"], "k_outlier_ratio_max": float(ratios["k"].max()),
                "v_outlier_ratio_max": float(ratios["v"].max())}
    return mags


def plot_magnitudes(mags: dict, cfg, model_name: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    from common.plotting import use_chinese_font

    use_chinese_font()
    layer = int(outlier_ratio(mags["k"]).argmax())
    D, H_kv = cfg.head_dim, cfg.num_kv_heads
    fig = plt.figure(figsize=(12, 9), layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.2])
    ax = fig.add_subplot(grid[0, :])
    x = range(H_kv * D)
    ax.plot(x, mags["k"][layer], label="K（RoPE 之后，缓存里存的）", lw=1.2)
    ax.plot(x, mags["k_pre"][layer], label="K（RoPE 之前）", lw=1, ls="--")
    ax.plot(x, mags["v"][layer], label="V", lw=1.2)
    for h in range(1, H_kv):
        ax.axvline(h * D, color="gray", lw=0.5)
    ax.set_yscale("log")
    ax.set_xlabel(f"通道（{H_kv} 个 KV 头 × {D}，灰线分隔各头）")
    ax.set_ylabel("该通道在全部 token 上的 max |值|")
    ax.set_title(f"第 {layer} 层（K 离群最明显的一层）：K 有少数特别大的通道，V 没有")
    ax.legend(loc="upper left", fontsize=9)
    vmin = float(torch.stack([mags["k"], mags["v"]]).clamp_min(1e-3).min())
    vmax = float(torch.stack([mags["k"], mags["v"]]).max())
    for i, (key, title) in enumerate((("k", "K（RoPE 之后）"), ("v", "V"))):
        ax = fig.add_subplot(grid[1, i])
        im = ax.imshow(mags[key].clamp_min(1e-3), aspect="auto", norm=LogNorm(vmin, vmax), cmap="viridis",
                       interpolation="nearest")
        ax.set_title(f"{title}：每层每个通道的 max |值|")
        ax.set_xlabel("通道")
        ax.set_ylabel("层")
    fig.colorbar(im, ax=fig.axes[1:], label="max |值|（对数色标）")
    fig.suptitle(f"{model_name} 的 K/V 通道幅度（章节提示词 + 长提示词）")
    fig.savefig(path, dpi=110)
    print(f"图已保存：{path}")


# ---------- 3. 真实 K/V 的往返误差 ----------

def round_trip_errors(kv: dict, figures: dict) -> None:
    """相对误差 ‖x̂ − x‖ / ‖x‖（全部层一起）。只取整块：block / channel 粒度在流式缓存里只量化写满的块。"""
    T = kv["k"].shape[2] // BLOCK_SIZE * BLOCK_SIZE
    rows = []
    for scheme in [QuantScheme(I8, g) for g in ("token", "block", "channel")] + \
                  [QuantScheme(F8, g) for g in ("token", "block", "channel")] + [QuantScheme(F8, "tensor", 1.0)]:
        row = [scheme.name]
        for key in ("k", "v"):
            x = kv[key][:, :, :T]                                              # (layers, H_kv, T, D)
            L, H_kv, _, D = x.shape
            blocks = x.reshape(L, H_kv, T // BLOCK_SIZE, BLOCK_SIZE, D).transpose(1, 2)   # (layers, 块数, H_kv, bs, D)
            err = (fake_quantize(blocks, scheme) - blocks).norm() / blocks.norm()
            row.append(f"{float(err) * 100:.3f}%")
            figures[f"rel_error_{key}_{scheme.dtype}_{scheme.granularity}"] = float(err)
        rows.append(row)
    print(f"\n== 3. 真实 K/V 量化再读回的相对误差 ‖x̂ − x‖ / ‖x‖（{T} 个 token，块大小 {BLOCK_SIZE}）==")
    print(table(["方案", "K", "V"], rows))


# ---------- 4. 质量 ----------

def quality(s: cli.Session, quick: bool, figures: dict) -> None:
    chosen = [SCHEMES[i] for i in QUICK_SCHEMES] if quick else SCHEMES
    n_new = QUICK_NEW_TOKENS if quick else NEW_TOKENS
    refs = []
    for name, text, chat in texts(quick):
        ids = s.encode(text, chat, n_new)
        out = generate(s.model, ids, n_new, SamplingParams(), s.tok.eos_ids, ignore_eos=True)
        seq = ids + out
        exact = forced_logits(s.model, PreallocKVCache(s.cfg, len(seq), s.device, s.dtype), seq, len(ids))
        refs.append((name, ids, out, seq, exact))
    base = s.cfg.kv_bytes_per_token(s.dtype.itemsize)
    rows, notes = [], []
    for label, k, v in chosen:
        qs, divs = [], []
        for name, ids, out, seq, exact in refs:
            def cache(n):
                return QuantKVCache(s.cfg, n, s.device, s.dtype, k, v, BLOCK_SIZE)
            got = forced_logits(s.model, cache(len(seq)), seq, len(ids))
            qs.append(teacher_forced_quality(exact, got, torch.tensor(seq[1:], device=exact.device)))
            greedy = generate(s.model, ids, n_new, SamplingParams(), s.tok.eos_ids, ignore_eos=True,
                              cache=cache(len(ids) + n_new - 1))
            d = first_divergence(ids, out, greedy, s.full_logits)
            divs.append((name, d))
            notes.append(d.describe(f"{label} / {name}"))
        q = pool(qs)
        print(f"  [{label}] top-1 {q.top1_agreement:.4f}", file=sys.stderr, flush=True)   # 进度（慢）
        ratio = kv_bytes_per_token(s.cfg, k, v, BLOCK_SIZE, s.dtype) / base
        div_txt = " ".join("—" if d.position is None else f"{d.position}({d.margin:.2f})" for _, d in divs)
        rows.append([label, f"{ratio:.3f}", f"{q.top1_agreement:.4f}", f"{q.mean_abs_dlogit:.4f}",
                     f"{q.max_abs_dlogit:.3f}", f"{q.nll_delta_fraction * 100:+.3f}%", div_txt])
        key = label.replace(" / ", "_").replace(" ", "_").replace("=", "").replace("不量化", "none")
        figures |= {f"top1_{key}": q.top1_agreement, f"nll_delta_fraction_{key}": q.nll_delta_fraction,
                    f"max_abs_dlogit_{key}": q.max_abs_dlogit, f"bytes_ratio_{key}": ratio}
    positions = sum(len(seq) - 1 for _, _, _, seq, _ in refs)
    print(f"\n== 4. 质量：与精确缓存（{s.dtype_name}）比，{len(refs)} 段文本（{', '.join(r[0] for r in refs)}）"
          f"共 {positions} 个位置 ==")
    print(f"teacher forcing：提示词 + 精确模式贪心生成的 {n_new} 个 token（ignore_eos），提示词 prefill、其余逐个 decode；"
          f"块大小 {BLOCK_SIZE}；字节比含 scale，以 {s.dtype_name} 为 1")
    print(table(["方案（K / V）", "字节比", "top-1 一致", "平均 |Δlogit|", "最大 |Δlogit|", "NLL 变化",
                 f"贪心第一次分歧：位置(精确 top-2 差)，— = {n_new} 个全同"], rows))
    for n in notes:
        print(f"  · {n}")


# ---------- 5. 换出 vs 重算 ----------

def swap_vs_recompute(s: cli.Session, quick: bool, figures: dict) -> None:
    lengths = [16, 64] if quick else [16, 64, 256, 1024, 2048]
    print(f"\n== 5. 换出 vs 重算（块大小 {BLOCK_SIZE}；换出 = 换出 + 换入两次拷贝，重算 = prefill 这么多 token）==")
    for label, scheme in ((s.dtype_name, None), ("int8 token", (QuantScheme(I8, "token"),) * 2)):
        rows_ = measure_swap_vs_recompute(s.model, lengths, BLOCK_SIZE, repeats=3, scheme=scheme)
        rows = [[r.tokens, f"{r.swap_bytes / 2**20:.2f}", f"{r.swap_out_s * 1e3:.2f}", f"{r.swap_in_s * 1e3:.2f}",
                 f"{r.recompute_s * 1e3:.1f}", f"{r.swap_over_recompute:.4f}", f"{r.copy_bandwidth / 1e9:.1f}",
                 f"{r.break_even_bandwidth / 1e9:.3f}"] for r in rows_]
        print(f"\nKV 存成 {label}：")
        print(table(["上下文 token 数", "单程 MiB", "换出 ms", "换入 ms", "重算 ms", "换出/重算", "实测拷贝 GB/s",
                     "换出更快所需带宽 GB/s"], rows))
        x = crossover(rows_)
        print("交叉点：" + (f"约 {x:.0f} 个 token" if x is not None else
                         f"测量范围内没有——{'换出' if rows_[0].swap_s < rows_[0].recompute_s else '重算'}在每个长度上都更便宜"))
        key = "float" if scheme is None else "int8"
        figures |= {f"swap_vs_recompute_time_ratio_{key}_{r.tokens}": r.swap_over_recompute for r in rows_}
        figures[f"break_even_bandwidth_gbs_{key}_{lengths[-1]}"] = rows_[-1].break_even_bandwidth / 1e9
        if x is not None:
            figures[f"swap_recompute_crossover_tokens_{key}"] = x


def main(args) -> bool:
    s = cli.load_session(args)
    figures: dict = {}
    print(f"机器: {machine()}；模型 {s.path.name}，{s.device}/{s.dtype_name}")
    worked_example()
    kv = collect_kv(s, args.quick)
    mags = report_magnitudes(kv, figures)
    if args.plot:
        plot_magnitudes(mags, s.cfg, s.path.name, args.plot)
    round_trip_errors(kv, figures)
    if not args.skip_quality:
        quality(s, args.quick, figures)
    if not args.skip_swap:
        swap_vs_recompute(s, args.quick, figures)
    if args.json:
        cli.emit_json({"script": "step08_kv_quant/analyze_kv.py", "model_path": str(s.path), "device": s.device,
                       "dtype": s.dtype_name, "machine": machine(), "figures": figures})
    return True


def parser() -> cli.Parser:
    p = cli.Parser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="更少的文本与方案")
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, help="把通道幅度图存到这个路径（png）")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-swap", action="store_true")
    p.set_defaults(prompt=None)
    return p


if __name__ == "__main__":
    cli.run_main(parser(), main)
