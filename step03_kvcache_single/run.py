"""step03_kvcache_single：KV cache —— 先证明与 step02 逐 token 一致、每步 logits 等于整段重算，再测 O(n²) → O(n)。

    python step03_kvcache_single/run.py [--quick] [--json] [--plot latency.png] [--profile]   # 章节模式
    python step03_kvcache_single/run.py --prompt "你好" --max-new-tokens 32 [--cache cat] \\
        [--temperature 0.8 --top-p 0.9 --seed 1] [--stop "。"]                               # 生成模式
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common import cli  # noqa: E402
from perf import llamacpp  # noqa: E402
from common.bench import (Roofline, machine, median_time, memory_bandwidth, profile_steps, stamps_of, table,  # noqa: E402
                          weight_bytes_per_step)
from common.compare import MARGIN_TOL, compare  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.hf_reference import hf_greedy, hf_logits, load_hf_model  # noqa: E402
from common.prepare import default_model_dir  # noqa: E402
from common.prompts import CHAPTER_PROMPTS, LONG_PROMPT  # noqa: E402
from step02_sampling.engine import generate as generate_step02  # noqa: E402
from step02_sampling.sampler import SamplingParams, add_sampling_args, draw_margin, params_from_args  # noqa: E402
from step03_kvcache_single.cache import CACHES, PreallocKVCache  # noqa: E402
from step03_kvcache_single.engine import forward, generate  # noqa: E402

STEP = "step03_kvcache_single"
CHECK_NEW_TOKENS = 32                        # 与 step01/02 的检查同样长
SEEDED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1)
# 整段重算 vs decode 的 logits 最大绝对差的容差：两条路的矩阵形状不同（L×E 对 1×E），浮点求和顺序不同，
# 末位会不一样；float32 下实测最大约 1e-4（检查结果下面的 note 会打印），logits 本身是 10 左右的量级
LOGITS_TOL = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}


def check_prompts(args) -> list[tuple[str, str, bool, int, bool]]:
    """(名字, 文本, 是否对话模板, 检查生成的 token 数, ignore_eos)：4 个章节提示词 + 几百 token 的长提示词。
    step02 每步整段重算，长提示词上每步都要算几百个位置，所以长提示词少生成一些；
    它的第一个贪心 token 就是 EOS，所以按 --ignore-eos 的语义生成满 N 个，才有 N 个 token 可比。"""
    long_new = 8 if args.quick else CHECK_NEW_TOKENS
    return ([(n, t, c, CHECK_NEW_TOKENS, False) for n, t, c in CHAPTER_PROMPTS]
            + [("long", LONG_PROMPT, False, long_new, True)])


def record_logits(model, fn):
    """运行 fn()，用前向钩子记下每次前向最后一个位置的 logits：返回 (fn 的结果, [(V,), ...])。"""
    seen = []
    handle = model.register_forward_hook(lambda m, inp, out: seen.append(out[0, -1].clone()))
    try:
        return fn(), seen
    finally:
        handle.remove()


def check_tokens(args, s: cli.Session, hf, checks: dict, notes: list) -> None:
    """(a) 贪心：两种缓存都与 step02 逐 token 一致（长提示词再加一项：与 HF generate 一致）；
    (b) 带种子采样：与 step02 同种子的输出逐 token 相同（只接受抽样点贴着区间边界处的分歧）；(c) 每个 decode 步的 logits = 整段重算的 logits。"""
    tol = MARGIN_TOL[s.dtype]
    worst = 0.0
    for name, text, chat, n, ignore_eos in check_prompts(args):
        ids = s.encode(text, chat, n)
        ref = generate_step02(s.model, ids, n, SamplingParams(), s.tok.eos_ids, ignore_eos)
        got, step_logits = record_logits(s.model, lambda: generate(s.model, ids, n, SamplingParams(), s.tok.eos_ids,
                                                                   ignore_eos))
        cat = generate(s.model, ids, n, SamplingParams(), s.tok.eos_ids, ignore_eos, cache="cat")
        for label, out in (("prealloc", got), ("cat", cat)):
            c = compare(f"{label}/{name}", ids, ref, out, s.full_logits, tol)
            checks[f"{label}_equals_step02_{name}"] = c.ok
            notes.append(c.describe())
        # (c) 第 i 次前向（0 = prefill）给出第 i 个新 token 的分布；整段重算时它是位置 len(ids)-1+i 的输出
        full = s.full_logits(ids + got[:-1])[len(ids) - 1:]                    # (len(got), V)
        diff = float((torch.stack(step_logits) - full).abs().max())
        worst = max(worst, diff)
        checks[f"decode_logits_match_recompute_{name}"] = diff < LOGITS_TOL[s.dtype]
        if name == "long":
            c = compare(f"hf/{name}", ids, hf_greedy(hf, ids, n, s.tok.eos_ids, ignore_eos), got,
                        lambda t: hf_logits(hf, t), tol)
            checks["prealloc_equals_hf_generate_long"] = c.ok
            notes.append(c.describe())
        print(f"[{name}, {len(ids)} tokens] {s.tok.decode(got)!r}")
    notes.append(f"decode logits vs full recompute: max |diff| {worst:.2e} (tol {LOGITS_TOL[s.dtype]:g})")

    print(f"\n带种子采样（temperature {SEEDED.temperature}, top_k {SEEDED.top_k}, top_p {SEEDED.top_p}, "
          f"seed {SEEDED.seed}）:")
    for name, text, chat, n, _ in check_prompts(args)[3:]:                     # chat 与 long
        ids = s.encode(text, chat, n)
        ref = generate_step02(s.model, ids, n, SEEDED, s.tok.eos_ids, ignore_eos=True)
        for cache in CACHES:
            # 同样的随机数；logits 只差浮点末位，所以只有抽样点恰好贴着区间边界时才可能抽到相邻的 token（draw_margin）
            got = generate(s.model, ids, n, SEEDED, s.tok.eos_ids, ignore_eos=True, cache=cache)
            c = compare(f"seeded_{cache}/{name}", ids, ref, got, s.full_logits, tol, draw_margin(SEEDED))
            checks[f"seeded_{cache}_equals_step02_{name}"] = c.ok
            notes.append(c.describe())
        print(f"  [{name}] {s.tok.decode(ref)!r}")


def check_memory(s: cli.Session, checks: dict) -> dict:
    """KV 大小公式对上真实张量的字节数；两种缓存复制的字节数对上公式（只数 K/V 缓存自己的写入）。"""
    ids = s.encode(CHAPTER_PROMPTS[0][1])
    P, N = len(ids), 16
    kvb = s.cfg.kv_bytes_per_token(torch.empty((), dtype=s.dtype).element_size())
    max_len = P + N - 1
    caches = {name: cls(s.cfg, max_len, s.device, s.dtype) for name, cls in CACHES.items()}
    for cache in caches.values():
        generate(s.model, ids, N, SamplingParams(), ignore_eos=True, cache=cache)
    checks["kv_bytes_per_token_matches_tensors"] = (caches["prealloc"].nbytes() == max_len * kvb
                                                    and caches["cat"].nbytes() == caches["cat"].length * kvb)
    # 预分配：每个位置只写一次。cat：每次前向把当时的全部 S 个位置写一遍；prefill S = P，第 j 步 decode S = P + j
    cat_positions = P + sum(P + j for j in range(1, N))
    checks["copy_bytes_match_formula"] = (caches["prealloc"].bytes_copied == max_len * kvb
                                          and caches["cat"].bytes_copied == cat_positions * kvb)
    return {"kv_bytes_per_token": kvb}


def benchmark(args, s: cli.Session, hf, kvb: int, checks: dict, notes: list) -> tuple[dict, dict]:
    """同一提示词、几种生成长度：step02（朴素）/ cat / 预分配 的总时间、TTFT、TPOT、复制量；再比 HF、llama.cpp（装了的话）与 roofline。"""
    lengths = [16, 32] if args.quick else [32, 64, 128, 256]
    repeats = 3 if args.quick else 5
    bandwidth = memory_bandwidth(s.device)                                     # 先测带宽：roofline 的分母
    ids = s.encode(CHAPTER_PROMPTS[0][1], False, max(lengths))
    P = len(ids)
    greedy = SamplingParams()

    def run(engine, n):
        if engine == "step02":
            return generate_step02(s.model, ids, n, greedy, ignore_eos=True)
        return generate(s.model, ids, n, greedy, ignore_eos=True, cache=engine)

    latencies = {}

    def timed(engine, n):
        # step02 很慢：只跑 1 次、不预热（模型在检查阶段早已预热），顺便记下每个 token 的延迟（画图用）；
        # 带缓存的引擎跑 repeats 次取中位数，画图用的延迟另跑一次
        if engine == "step02":
            latencies[engine] = stamps_of(s.model, s.device, lambda: run(engine, n))
            return sum(latencies[engine])
        return median_time(lambda: run(engine, n), repeats=repeats, warmup=1, device=s.device)

    engines = ["step02", "cat", "prealloc"]
    ttft = {e: timed(e, 1) for e in engines}                                   # 只生成 1 个 token = prefill + 采样
    total = {(e, n): timed(e, n) for n in lengths for e in engines}            # 最后留下的是最大 N 的 step02 延迟
    tpot = {k: (t - ttft[k[0]]) / (k[1] - 1) for k, t in total.items()}        # 其余 N-1 个 token 的平均间隔

    print(f"\n机器: {machine()}；模型 {s.path.name}，{s.device}/{s.dtype_name}；提示词 {P} tokens；"
          f"带缓存的引擎取 {repeats} 次中位数，step02 跑 1 次")
    rows = [[n, f"{total['step02', n]:.2f}", f"{total['cat', n]:.2f}", f"{total['prealloc', n]:.2f}",
             f"{total['step02', n] / total['prealloc', n]:.1f}×",
             f"{tpot['step02', n] * 1e3:.1f}", f"{tpot['cat', n] * 1e3:.1f}", f"{tpot['prealloc', n] * 1e3:.1f}"]
            for n in lengths]
    print(table(["新 token 数 N", "step02 总时间 (s)", "cat (s)", "预分配 (s)", "预分配比 step02 快",
                 "TPOT step02 (ms)", "TPOT cat (ms)", "TPOT 预分配 (ms)"], rows))
    print(f"TTFT（只生成 1 个 token）：step02 {ttft['step02'] * 1e3:.1f} ms，cat {ttft['cat'] * 1e3:.1f} ms，"
          f"预分配 {ttft['prealloc'] * 1e3:.1f} ms —— 三者都是一次整段 prefill，缓存不改变 TTFT。")
    print("TPOT = (生成 N 个的总时间 − TTFT) / (N − 1)：step02 随 N 变长而变大（每步整段重算），带缓存的几乎不变。")

    # 复制量：按公式算（check_memory 已经用缓存自己的计数器核对过公式）
    rows = []
    for n in lengths:
        cat_bytes = (P + sum(P + j for j in range(1, n))) * kvb
        pre_bytes = (P + n - 1) * kvb
        rows.append([n, f"{cat_bytes / 2**20:.1f}", f"{pre_bytes / 2**20:.2f}", f"{cat_bytes / pre_bytes:.0f}×",
                     f"{(P + n - 1) * kvb / 2**10:.0f}", f"{kvb / 2**10:.1f}"])
    print(f"\nKV 写入量（每 token {kvb} 字节 = 2 × {s.cfg.num_layers} 层 × {s.cfg.num_kv_heads} 个 KV 头 × "
          f"{s.cfg.head_dim} × {kvb // (2 * s.cfg.num_layers * s.cfg.num_kv_heads * s.cfg.head_dim)} 字节）:")
    print(table(["N", "cat 累计复制 (MiB)", "预分配累计写入 (MiB)", "cat / 预分配", "cat 最后一步复制 (KiB)",
                 "预分配每步写入 (KiB)"], rows))

    # 与 HF transformers 的 generate（默认的 DynamicCache）比 decode 速度：同一模型、dtype、线程数、提示词、长度
    n = max(lengths)
    hf_t1 = median_time(lambda: hf_greedy(hf, ids, 1, [], ignore_eos=True), repeats=repeats, warmup=1,
                        device=s.device)
    hf_tn = median_time(lambda: hf_greedy(hf, ids, n, [], ignore_eos=True), repeats=repeats, warmup=1,
                        device=s.device)
    ours = (n - 1) / (total["prealloc", n] - ttft["prealloc"])                 # decode tokens/s
    theirs = (n - 1) / (hf_tn - hf_t1)
    # roofline：每个 decode 步至少要把权重读一遍，再读当时缓存里的全部 K/V（第 j 步有 P + j 个位置）
    roof = Roofline(bandwidth)
    weights = weight_bytes_per_step(s.model)
    step_bytes = sum(weights + (P + j) * kvb for j in range(1, n)) / (n - 1)         # 平均每步
    frac = roof.fraction(step_bytes, 1 / ours)
    rows = [["HF generate", f"{theirs:.1f}", "1.00×", "-"],
            ["step03 预分配", f"{ours:.1f}", f"{ours / theirs:.2f}×", f"{frac:.0%}"]]
    # llama.cpp（可选依赖，默认模型才有）：同一份权重写成的 F32 GGUF，同样的线程数、提示词、长度、贪心。
    # --quick 不做：第一次要写 540 MB 的 GGUF，每次要加载它（CI 的章节模式要快）
    is_default = s.path.resolve() == default_model_dir().resolve()
    llama = None if args.quick else llamacpp.f32_decode_tok_s(s.path, ids, n, torch.get_num_threads(), repeats)
    if llama is not None:
        llama_tok_s, llama_tokens = llama
        ref = generate(s.model, ids, n, greedy, ignore_eos=True)
        c = compare("llama.cpp F32 vs step03", ids, ref, llama_tokens, s.full_logits, MARGIN_TOL[s.dtype])
        checks["llamacpp_f32_equals_step03"] = c.ok        # token 一致，计时的比较才有意义
        notes.append(c.describe())
        llama_bytes = sum(weights + (P + j) * kvb / 2 for j in range(1, n)) / (n - 1)  # 它的 KV cache 是 f16
        rows.append(["llama.cpp F32（同一份权重）", f"{llama_tok_s:.1f}", f"{llama_tok_s / theirs:.2f}×",
                     f"{roof.fraction(llama_bytes, 1 / llama_tok_s):.0%}"])
    rows.append(["roofline（带宽上限）", f"{1 / roof.seconds(step_bytes):.1f}",
                 f"{1 / roof.seconds(step_bytes) / theirs:.2f}×", "100%"])
    print(f"\n单请求 decode 速度（N = {n}，decode tokens/s = (N − 1) / (总时间 − TTFT)；"
          f"roofline 用本次实测的内存读带宽 {bandwidth / 1e9:.1f} GB/s，每步读权重 {weights / 2**20:.0f} MiB + "
          f"KV 平均 {(step_bytes - weights) / 2**20:.2f} MiB）:")
    print(table(["引擎", "decode tokens/s", "对 HF", f"占 roofline（@ {bandwidth / 1e9:.1f} GB/s）"], rows))
    if llama is None and is_default and args.quick:
        print("（--quick：跳过与 llama.cpp 的对照——要加载 540 MB 的 F32 GGUF；完整模式或 bench/decode_speed.py 会做）")
    elif llama is None and is_default:
        print(f"（要同时和 llama.cpp 比，安装可选依赖：{llamacpp.INSTALL}；逐级提速与对照见 bench/decode_speed.py）")

    latencies |= {e: stamps_of(s.model, s.device, lambda: run(e, n)) for e in CACHES}
    figures = {"speedup_vs_prev": round(total["step02", n] / total["prealloc", n], 3), "largest_new_tokens": n,
               "decode_tok_s": round(ours, 3), "hf_decode_tok_s": round(theirs, 3),
               "ratio_vs_hf": round(ours / theirs, 3), "roofline_fraction": round(frac, 4),
               "ttft_ms": round(ttft["prealloc"] * 1e3, 2), "tpot_ms": round(1e3 / ours, 2),
               "bandwidth_gb_s": round(bandwidth / 1e9, 2)}
    if llama is not None:
        figures |= {"llamacpp_f32_decode_tok_s": round(llama_tok_s, 3), "ratio_vs_llamacpp_f32": round(ours / llama_tok_s, 3)}
    return figures, {"prompt_len": P, "latencies": latencies}


def long_context(args, s: cli.Session, bandwidth: float) -> dict:
    """长提示词上一直 decode 下去：缓存越长，每步要读的 K/V 越多（预分配）、要复制的越多（cat）。
    TTFT（一次几百 token 的 prefill）预热后跑 repeats 次取中位数；decode 每步的延迟来自预热之后的一次完整生成，
    "开头 / 最后 16 步"取这 16 步的中位数（单步偶尔被别的进程打断，中位数不受影响）。"""
    n = 128 if args.quick else 1024
    repeats = 3 if args.quick else 5
    ids = s.encode(LONG_PROMPT, False, n)

    def run(cache, k):
        return generate(s.model, ids, k, SamplingParams(), ignore_eos=True, cache=cache)

    ttft = {e: median_time(lambda: run(e, 1), repeats=repeats, warmup=1, device=s.device) for e in CACHES}
    lat = {e: stamps_of(s.model, s.device, lambda: run(e, n)) for e in CACHES}
    first = {e: statistics.median(xs[1:17]) for e, xs in lat.items()}        # 前 16 个 decode 步
    last = {e: statistics.median(xs[-16:]) for e, xs in lat.items()}         # 最后 16 个 decode 步
    rows = [[e, f"{ttft[e] * 1e3:.0f}", f"{first[e] * 1e3:.1f}", f"{last[e] * 1e3:.1f}"] for e in CACHES]
    print(f"\n长上下文（提示词 {len(ids)} tokens，decode {n - 1} 步，新 token 的位置 {len(ids) + 1} → "
          f"{len(ids) + n - 1}）每 token 延迟（TTFT 预热后取 {repeats} 次中位数，decode 取 16 步的中位数）:")
    print(table(["缓存", "TTFT = prefill (ms)", "开头 16 步 (ms)", "最后 16 步 (ms)"], rows))
    # prefill 与 decode 用硬件的方式完全不同：同样读一遍权重，一个做几百个 token 的计算，一个只做 1 个
    t_prefill, tpot = ttft["prealloc"], first["prealloc"]
    flops, weights = prefill_flops(s.model, len(ids)), weight_bytes_per_step(s.model)
    print(f"prefill：{len(ids)} tokens 约 {flops / 1e9:.0f} GFLOP，{t_prefill * 1e3:.0f} ms → "
          f"{flops / t_prefill / 1e9:.1f} GFLOP/s，每读 1 字节权重做 {flops / weights:.0f} 次运算")
    print(f"decode ：1 token 约 {prefill_flops(s.model, 1) / 1e9:.2f} GFLOP，{tpot * 1e3:.1f} ms → "
          f"{prefill_flops(s.model, 1) / tpot / 1e9:.1f} GFLOP/s，每读 1 字节权重做 "
          f"{prefill_flops(s.model, 1) / weights:.1f} 次运算；读权重 {weights / tpot / 1e9:.1f} GB/s"
          f"（同一次运行实测的内存读带宽 {bandwidth / 1e9:.1f} GB/s）")
    return {"prompt_len": len(ids), "latencies": lat, "prefill_gflop_s": flops / t_prefill / 1e9}


def prefill_flops(model, T: int) -> float:
    """一次处理 T 个 token 的前向的浮点运算数：每层矩阵乘 2·参数·T，注意力 QKᵀ 与 PV 各 2·H·D·T²
    （我们的实现把被掩码遮住的一半也算了），LM head 只算最后一个位置。"""
    cfg = model.cfg
    layer_params = sum(p.numel() for name, p in model.layers.named_parameters() if name.endswith(("proj.weight", "proj.packed")))
    attention = cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * T * T
    return 2 * layer_params * T + attention + 2 * cfg.hidden_size * cfg.vocab_size


def profile_decode(args, s: cli.Session, bandwidth: float) -> dict:
    """用 torch.profiler 看一次 decode 步的时间花在哪：矩阵乘（读权重）还是其余几百个小算子与 Python。"""
    ids = s.encode(CHAPTER_PROMPTS[0][1])
    steps = 8
    cache = PreallocKVCache(s.cfg, len(ids) + 2 * steps, s.device, s.dtype)
    with torch.inference_mode():
        forward(s.model, cache, ids, 0)
        tok = ids[-1]                        # 喂什么 token 不影响耗时
        wall = median_time(lambda: forward(s.model, cache, [tok], cache.length), repeats=steps, warmup=0,
                           device=s.device)  # 不开剖析器时一步的真实耗时
        prof = profile_steps(lambda: forward(s.model, cache, [tok], cache.length), steps)
    # 矩阵乘的计时可信；其余小算子各自被剖析器拖慢，所以用"真实一步 − 矩阵乘"算它们
    mm, calls = prof.matmul_s, prof.ops
    weights = weight_bytes_per_step(s.model)
    print(f"\n一次 decode 步的剖析（torch.profiler，{steps} 步平均）：一步 {wall * 1e3:.1f} ms，其中")
    print(f"  矩阵乘 (aten::mm / bmm) {mm * 1e3:.1f} ms（{mm / wall:.0%}），折合读权重 {weights / mm / 1e9:.1f} GB/s"
          f"（本次实测内存读带宽 {bandwidth / 1e9:.1f} GB/s）；")
    print(f"  其余 {(wall - mm) * 1e3:.1f} ms（{1 - mm / wall:.0%}）花在每步 {calls:.0f} 次从 Python 发出的小算子"
          f"（RMSNorm、RoPE、掩码、softmax、加法……）与 Python 本身上，平均每次 {(wall - mm) / calls * 1e6:.1f} µs")
    if args.profile:
        print(prof.table)
    return {"decode_step_ms": round(wall * 1e3, 2), "matmul_ms_per_step": round(mm * 1e3, 2),
            "matmul_share": round(mm / wall, 3), "ops_per_step": round(calls)}


def rolling_median(xs: list[float], window: int) -> list[float]:
    """滑动中位数（窗口居中，两端各少 window // 2 个点）：压掉单步的抖动，留下随位置变化的趋势。"""
    return torch.tensor(xs).unfold(0, window, 1).median(-1).values.tolist()


def save_plot(path: str, bench: dict, long: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.plotting import use_chinese_font
    use_chinese_font()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    P = bench["prompt_len"]
    names = {"step02": "step02 朴素（每步整段重算）", "cat": "KV cache：torch.cat", "prealloc": "KV cache：预分配"}
    colors = {"step02": "tab:red", "cat": "tab:orange", "prealloc": "tab:blue"}
    for e, xs in bench["latencies"].items():   # 第 0 个是 prefill（TTFT），画 decode 步
        a.plot(range(P + 1, P + len(xs)), [x * 1e3 for x in xs[1:]], label=names[e], color=colors[e])
    a.set(title=f"每 token 延迟（提示词 {P} tokens）", xlabel="新 token 的位置", ylabel="延迟 (ms)", ylim=(0, None))
    a.legend()
    P = long["prompt_len"]
    w = max(3, min(63, len(next(iter(long["latencies"].values()))) // 4) | 1)   # 完整模式 63 步，quick 31 步
    for e, xs in long["latencies"].items():
        ms = [x * 1e3 for x in xs[1:]]
        b.plot(range(P + 1, P + len(xs)), ms, color=colors[e], linewidth=0.5, alpha=0.25)
        b.plot(range(P + 1 + w // 2, P + len(xs) - w // 2), rolling_median(ms, w), color=colors[e], linewidth=2,
               label=f"{names[e]}（{w} 步滑动中位数）")
    b.set(title=f"长提示词（{P} tokens）之后带缓存的 decode", xlabel="新 token 的位置",
          ylabel="延迟 (ms)，淡色为每一步", ylim=(0, None))
    b.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    print(f"\n图已保存: {path}")


def chapter(args, s: cli.Session) -> bool:
    checks, notes = {}, []
    hf = load_hf_model(s.path, s.device, s.dtype)
    check_tokens(args, s, hf, checks, notes)
    figures = check_memory(s, checks)
    bench_figures, bench = benchmark(args, s, hf, figures["kv_bytes_per_token"], checks, notes)
    figures |= bench_figures
    del hf
    long = long_context(args, s, figures["bandwidth_gb_s"] * 1e9)
    figures["prefill_gflop_s"] = round(long["prefill_gflop_s"], 1)
    figures |= profile_decode(args, s, figures["bandwidth_gb_s"] * 1e9)
    if args.plot:
        save_plot(args.plot, bench, long)
    cli.print_checks(checks, notes)
    if args.json:
        cli.emit_json(cli.chapter_json(STEP, s, checks, figures))
    return all(checks.values())


def main(args) -> bool:
    params = params_from_args(args)             # 先检查参数，再花时间加载模型
    stop_strings = args.stop or []
    if any(not t for t in stop_strings):
        raise UserError("--stop must not be empty")
    if args.prompt is not None and (args.plot or args.profile):
        raise UserError("--plot and --profile belong to chapter mode (no --prompt)")
    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        raise UserError(f"--plot: directory {Path(args.plot).parent} does not exist")
    s = cli.load_session(args)
    if args.prompt is None:
        return chapter(args, s)
    # 先编码、检查全部提示词，任何一个有错都在开始生成前报告（不丢掉进行中的工作）
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]
    # 每个提示词各自从 params.seed 开始、各自一个缓存（同 step02：一个提示词的输出不受别的提示词影响）
    outputs = [generate(s.model, ids, args.max_new_tokens, params, s.tok.eos_ids, args.ignore_eos, args.cache,
                        stop_strings, s.tok) for ids in prompt_ids]
    cli.print_generations(s, args.prompt, outputs)
    if args.json:
        cli.emit_json(cli.generation_json(s, args.prompt, prompt_ids, outputs))
    return True


def make_parser():
    p = cli.make_parser(__doc__.splitlines()[0])
    add_sampling_args(p)
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="停止字符串（可重复）：新生成的文本里出现它就停（包含补全它的那个 token）")
    p.add_argument("--cache", choices=list(CACHES), default="prealloc", help="KV cache 的存法（默认预分配）")
    p.add_argument("--plot", metavar="PATH", help="章节模式：把每 token 延迟随位置变化的图存成 PNG")
    p.add_argument("--profile", action="store_true", help="章节模式：打印一次 decode 步的完整算子表")
    return p


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
