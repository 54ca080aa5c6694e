"""画第 06–08 章、第 12–15 章与性能附录里的示意图（不跑模型，只画结构；同样的输入总是画出同样的 PNG）。

    python docs/diagrams.py [--out docs/images]

画出的文件（按章节命名）：
    06_radix_split.png          基数树插入一个分叉的提示词时在边的中间分裂，对照整块匹配
    06_block_lifecycle.png      前缀缓存里一个块的一生：空闲 → 使用中 → 已缓存 → 可回收 → 被回收
    07_varlen_row.png           一步的全部新 token 展平成一行、按段做注意力（cu_seqlens）
    08_quant_pool_layout.png    量化池子的一块：int8 码与每个 (token, 头) 一个 float32 scale 并排
    08_swap_path.png            换出式抢占：块拷到第二层、重新接纳时拷回新块号
    14_q4_1_blocks.png          Q4_1 / Q8_0 一块的字节、半字节的顺序，以及 16 个输出行的同一块重排成一条记录
    14_register_tile.png        块内核的寄存器分块：16 个字节 → 16 行的权重 → 与 MT 行激活乘加进 MT 个累加器
    12_compaction.png           h2o 的一次压紧：旧块表 → 每个头留的槽 → 新块（补转的角度）；同一个槽号、不同的头是不同的 token
    12_cache_positions.png      汇 + 最近的 token：原文位置与缓存位置下 query 与汇的距离
    13_selective_recompute.png  层 × token：reuse 与 blend（检查段、选中的 token 逐层重算）
    15_dfa_tokens.png           字节上的 DFA 与 token 的一步：一个 token 走过好几个状态，一个汉字切在两个 token 里
    appendix_decode_ladder.png  附录阶梯每一级的 ms/步（数字抄自附录那次完整运行的表）
中文字体来自 PyPI 包 mplfonts（common/plotting.py）。
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")   # 不需要显示器
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle  # noqa: E402

from common.plotting import use_chinese_font  # noqa: E402
from step12_kv_eviction.eviction import kept_slots, rotation_deltas  # noqa: E402
from step15_structured_output.automaton import START, compile_regex  # noqa: E402
from step15_structured_output.schema import schema_to_regex  # noqa: E402

DPI = 110
# 颜色：同一种东西在几张图里用同一种颜色
FREE, USED, CACHED, EVICT = "#d9d9d9", "#9ecae1", "#a1d99b", "#fdae6b"
DECODE, PREFILL_A, PREFILL_B, POOL = "#6baed6", "#fd8d3c", "#fdd0a2", "#c7e9c0"

# 附录阶梯表里的数字：`python bench/decode_speed.py --json` 完整模式（2026-12-02，N = 128，3 轮中位数，2 线程，
# 机器空闲，load avg 1.0 → 1.7；第 1 级起是 packed 权重；llama.cpp 一侧是 llama-server，只有 F32 一行）。
# 附录的表换成新一次运行的输出时，这里跟着改，再重画。
# (行名, ms/步, 其中矩阵乘 ms（None = 没有剖析）, 种类)
LADDER = [
    ("0 step03（plain：x @ W）", 85.6, 47.3, "exact"),
    ("0 step03（packed：加载时打包）", 80.9, 50.5, "exact"),
    ("1 + 融合 QKV、gate/up", 72.1, 47.1, "exact"),
    ("2 + SDPA 注意力", 72.6, 52.4, "exact"),
    ("3 + 静态形状（eager）", 69.7, 52.7, "exact"),
    ("4 + torch.compile（静态形状）", 63.0, 51.7, "exact"),
    ("× 直接 compile step03", 111.5, None, "exact"),
    ("int8 权重 + compile（有损）", 114.3, 113.6, "lossy"),
    ("llama.cpp F32（llama-server）", 37.5, None, "llamacpp"),
]
LLAMA_F32_MS, LEVEL4_MATMUL_MS = 37.5, 51.7


# ---------- 画框与箭头的小工具 ----------

def blank(ax, xlim=(0, 1), ylim=(0, 1)):
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.axis("off")


def box(ax, x, y, w, h, text, color, fontsize=10, round_=False, **kw):
    """左下角 (x, y)、宽 w、高 h 的框，文字居中。"""
    if round_:
        patch = FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.01,rounding_size=0.02", facecolor=color,
                               edgecolor="black", linewidth=1, zorder=3, **kw)
    else:
        patch = Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=1, zorder=3, **kw)
    ax.add_patch(patch)
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, zorder=4)
    return patch


def arrow(ax, start, end, text="", rad=0.0, color="black", fontsize=9, text_xy=None, ha="center"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, linewidth=1.3, color=color,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2, zorder=5))
    if text:
        x, y = text_xy or ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
        ax.text(x, y, text, ha=ha, va="center", fontsize=fontsize,
                bbox=dict(facecolor="white", edgecolor="none", alpha=0.9, pad=1))


def token_row(ax, x, y, tokens, w, h, color, fontsize=9):
    """一排 token 框，从 (x, y) 往右。返回右端的 x。"""
    for i, t in enumerate(tokens):
        box(ax, x + i * w, y, w, h, t, color, fontsize=fontsize)
    return x + len(tokens) * w


def node(ax, x, y, label, color="white", r=0.035):
    ax.add_patch(plt.Circle((x, y), r, facecolor=color, edgecolor="black", linewidth=1.2, zorder=3))
    ax.text(x, y, label, ha="center", va="center", fontsize=9, zorder=4)


def save(fig, out: Path, name: str) -> Path:
    path = out / name
    fig.savefig(path, dpi=DPI, metadata={"Software": None})   # 不写 matplotlib 版本：换版本不改文件
    plt.close(fig)
    return path


# ---------- 第 06 章 ----------

def radix_split(out: Path) -> Path:
    """第 06 章第 3 节的例子：A = <s> This is the end .，B = <s> This is the end !（块大小 4）。"""
    common = ["<s>", "This", "is", "the", "end"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1, 1.25, 1.15]})
    tw, th = 0.13, 0.07

    ax = axes[0]
    blank(ax)
    ax.set_title("① 只有 A：根下一条边存 A 的 6 个 token", fontsize=11)
    node(ax, 0.5, 0.9, "根")
    ax.plot([0.5, 0.5], [0.865, 0.2], color="black", linewidth=1.2)
    token_row(ax, 0.5 - 3 * tw, 0.5, common + ["."], tw, th, USED)
    node(ax, 0.5, 0.16, "A")
    ax.text(0.5, 0.04, "节点里存着这 6 个 token 各自的 KV 槽号", ha="center", fontsize=9)

    ax = axes[1]
    blank(ax)
    ax.set_title("② 插入 B：匹配停在边的中间（end 之后），把边分裂成两段", fontsize=11)
    node(ax, 0.5, 0.9, "根")
    ax.plot([0.5, 0.5], [0.865, 0.56], color="black", linewidth=1.2)
    token_row(ax, 0.5 - 2.5 * tw * 0.85, 0.69, common, tw * 0.85, th, CACHED)
    node(ax, 0.5, 0.52, "分叉", color=PREFILL_A)
    for x_leaf, tok, name, col in ((0.22, ".", "A", USED), (0.78, "!", "B", PREFILL_B)):
        ax.plot([0.5, x_leaf], [0.485, 0.2], color="black", linewidth=1.2)
        xm = (0.5 + x_leaf) / 2
        box(ax, xm - tw * 0.425, 0.3, tw * 0.85, th, tok, col)
        node(ax, x_leaf, 0.16, name)
    ax.text(0.5, 0.04, "公共的 5 个 token 只存一份；B 只新存 \"!\" 这 1 个 token", ha="center", fontsize=9)
    ax.text(0.82, 0.52, "_split：新节点接管\n前 5 个 token", ha="center", va="center", fontsize=9)

    ax = axes[2]
    blank(ax)
    ax.set_title("③ 对照：整块匹配（块大小 4）", fontsize=11)
    bw = 0.11
    ax.text(0.02, 0.84, "A", fontsize=11, va="center")
    x = token_row(ax, 0.08, 0.8, common[:4], bw, th, CACHED)
    ax.text(0.08 + 2 * bw, 0.91, "块 0：写满，登记 key", ha="center", fontsize=9)
    token_row(ax, x + 0.02, 0.8, ["end", "."], bw, th, USED)
    ax.text(x + 0.02 + bw, 0.91, "块 1：没写满，不登记", ha="center", fontsize=9)
    ax.text(0.02, 0.54, "B", fontsize=11, va="center")
    x = token_row(ax, 0.08, 0.5, common[:4], bw, th, CACHED)
    token_row(ax, x + 0.02, 0.5, ["end", "!"], bw, th, PREFILL_B)
    ax.text(0.5, 0.32, "B 的块 0 命中：复用 4 个 token；\"end\" 在没写满的块里，要重算", ha="center", fontsize=9)
    ax.text(0.5, 0.2, "基数树（②）按 token 匹配：复用 5 个 token", ha="center", fontsize=9)
    fig.tight_layout()
    return save(fig, out, "06_radix_split.png")


def block_lifecycle(out: Path) -> Path:
    """step06 的 BlockManager（前缀缓存）：块在四种状态之间怎么走。"""
    fig, ax = plt.subplots(figsize=(12, 5.6))
    blank(ax)
    w, h = 0.24, 0.17
    states = {   # 名字: (左下 x, 左下 y, 文字, 颜色)
        "free": (0.03, 0.42, "空闲\nref = 0，没有 key\n（free_blocks）", FREE),
        "used": (0.38, 0.76, "使用中\nref ≥ 1，没有 key\n（没写满，或内容重复没登记）", USED),
        "cached": (0.73, 0.42, "已缓存、有人用\nref ≥ 1，带 key（登记在前缀表里）\n再被命中：acquire，ref + 1", CACHED),
        "evictable": (0.38, 0.06, "可回收\nref = 0，仍带 key\n（evictable，LRU 顺序）", EVICT),
    }
    for x, y, text, color in states.values():
        box(ax, x, y, w, h, text, color, fontsize=10, round_=True)

    def side(name, where):
        x, y = states[name][:2]
        return {"top": (x + w / 2, y + h), "bottom": (x + w / 2, y), "left": (x, y + h / 2),
                "right": (x + w, y + h / 2)}[where]

    arrow(ax, side("free", "top"), side("used", "left"), "allocate\n（分给一个请求）", rad=-0.25,
          text_xy=(0.16, 0.8))
    arrow(ax, side("used", "right"), side("cached", "top"), "前向写满这一块：\ncache_block 登记 key", rad=-0.25,
          text_xy=(0.82, 0.8))
    arrow(ax, (0.40, 0.76), (0.25, 0.59), "free（ref → 0）：\n没有 key 的块直接回空闲", rad=0.0, text_xy=(0.29, 0.69))
    arrow(ax, side("cached", "bottom"), side("evictable", "right"), "最后一个持有者 free\n（ref → 0）：内容留着",
          rad=-0.25, text_xy=(0.83, 0.17))
    arrow(ax, (0.62, 0.2), (0.76, 0.42), "命中：acquire\n（ref + 1，从队列中间取出）", rad=0.0, text_xy=(0.66, 0.33))
    arrow(ax, side("evictable", "left"), side("free", "bottom"), "被回收：allocate 缺空块时\n取 LRU 最前面的一块，删掉 key",
          rad=-0.25, text_xy=(0.13, 0.17))
    ax.text(0.5, 0.55, "num_free = 空闲 + 可回收\n（缓存占着的块随时能让出来）", ha="center", va="center", fontsize=9,
            color="#444444")
    fig.tight_layout()
    return save(fig, out, "06_block_lifecycle.png")


# ---------- 第 07 章 ----------

def varlen_row(out: Path) -> Path:
    """第 07 章第 4 节的那一行：3 个 decode、提示词 a 的第 5..8 个 token、提示词 b 的第一块。"""
    tokens = ["d0", "d1", "d2", "a5", "a6", "a7", "a8", "b0", "b1", "b2"]
    positions = [37, 12, 90, 5, 6, 7, 8, 0, 1, 2]
    colors = [DECODE] * 3 + [PREFILL_A] * 4 + [PREFILL_B] * 3
    fig = plt.figure(figsize=(13, 6.4))
    top = fig.add_axes([0.02, 0.5, 0.96, 0.48])
    blank(top)
    x0, tw, th = 0.06, 0.064, 0.14
    top.text(0.01, 0.47, "行", fontsize=10, va="center")
    top.text(0.01, 0.27, "位置", fontsize=10, va="center")
    for i, (t, p, c) in enumerate(zip(tokens, positions, colors)):
        box(top, x0 + i * tw, 0.4, tw, th, t, c, fontsize=11)
        top.text(x0 + (i + 0.5) * tw, 0.27, str(p), ha="center", va="center", fontsize=11)
    segments = [(0, 3, "decode 段：3 个请求各 1 个 token\n一起按块表读各自的全部 K/V"),
                (3, 7, "prefill 块 a：已缓存 5 个（位置 0..4，读池子）\n+ 这一步的 4 个新 token"),
                (7, 10, "prefill 块 b：全新提示词的第一块\n不读池子")]
    for a, b, text in segments:
        xa, xb = x0 + a * tw, x0 + b * tw
        top.plot([xa + 0.004, xa + 0.004, xb - 0.004, xb - 0.004], [0.6, 0.64, 0.64, 0.6], color="black", linewidth=1)
        top.text((xa + xb) / 2, 0.76, text, ha="center", va="center", fontsize=9)
    bounds = [0, 1, 2, 3, 7, 10]
    for k in bounds:
        top.plot([x0 + k * tw] * 2, [0.13, 0.19], color="black", linewidth=1.2)
        top.text(x0 + k * tw, 0.07, str(k), ha="center", va="center", fontsize=10)
    top.text(x0 + 10 * tw + 0.03, 0.1, "cu_seqlens = [0, 1, 2, 3, 7, 10]\n（vLLM 叫 query_start_loc）：第 i 个请求的\n"
             "query 是这一行的 [cu[i], cu[i+1])", ha="left", va="center", fontsize=9)
    top.text(x0 + 10 * tw + 0.03, 0.47, "线性层、MLP、RMSNorm、RoPE：\n一行 10 个 token 各算各的，没有填充",
             ha="left", va="center", fontsize=9)

    # 下面两张：两个 prefill 段各自的掩码（行 = query，列 = key；涂色 = 可以看）
    for left, (title, q_pos, k_pos, cached) in zip(
            (0.08, 0.58),
            (("段 a：4 个 query × 9 个 key（带偏移的因果掩码）", [5, 6, 7, 8], list(range(9)), 5),
             ("段 b：3 个 query × 3 个 key（普通因果掩码）", [0, 1, 2], [0, 1, 2], 0))):
        ax = fig.add_axes([left, 0.06, 0.36, 0.36])
        ax.set_xlim(0, len(k_pos))
        ax.set_ylim(len(q_pos), 0)
        for qi, q in enumerate(q_pos):
            for ki, k in enumerate(k_pos):
                if k <= q:
                    color = POOL if k < cached else (PREFILL_A if cached else PREFILL_B)
                else:
                    color = "white"
                ax.add_patch(Rectangle((ki, qi), 1, 1, facecolor=color, edgecolor="#888888", linewidth=0.6))
        ax.set_xticks([i + 0.5 for i in range(len(k_pos))], [str(k) for k in k_pos])
        ax.set_yticks([i + 0.5 for i in range(len(q_pos))], [str(q) for q in q_pos])
        ax.set_xlabel("key 的位置" + ("（绿 = 从池子读回的已缓存前缀）" if cached else ""), fontsize=9)
        ax.set_ylabel("query 的位置", fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.tick_params(length=0)
        ax.set_aspect("equal")
    return save(fig, out, "07_varlen_row.png")


# ---------- 第 08 章 ----------

def quant_pool_layout(out: Path) -> Path:
    """step08 kv_cache.py 的量化池子：pool (layers, 2, num_blocks+1, H_kv, block_size, D) 存码，scales 同样按块寻址。"""
    fig, ax = plt.subplots(figsize=(13, 6.2))
    blank(ax)
    ax.text(0.5, 0.96, "pool：(层 30, K/V 2, num_blocks + 1, H_kv 3, block_size 16, D 64) int8 / fp8 码    "
            "scales：(30, 2, num_blocks + 1, 3, 16, 1) float32",
            ha="center", va="center", fontsize=10.5)
    ax.text(0.5, 0.9, "下面是其中一层、K、一块（pool[layer, 0, block] 与 scales[layer, 0, block]）；V 那一半一模一样",
            ha="center", va="center", fontsize=10, color="#444444")
    rows, cols = 16, 16                          # 画 16 列代表 D = 64
    cw, ch, gap, step, y0 = 0.0135, 0.02, 0.012, 0.32, 0.15
    hi_head, hi_tok = 1, 5                       # 高亮一个 (token, 头)
    for hd in range(3):
        x = 0.06 + hd * step
        ax.text(x + cols * cw / 2, y0 + rows * ch + 0.03, f"头 {hd}", ha="center", fontsize=10)
        for r in range(rows):
            hi = (hd, r) == (hi_head, hi_tok)
            yr = y0 + (rows - 1 - r) * ch
            for c in range(cols):
                ax.add_patch(Rectangle((x + c * cw, yr), cw, ch, facecolor=PREFILL_A if hi else USED,
                                       edgecolor="white", linewidth=0.4))
            ax.add_patch(Rectangle((x + cols * cw + gap, yr), cw * 1.5, ch, facecolor=PREFILL_A if hi else CACHED,
                                   edgecolor="white", linewidth=0.4))
        ax.add_patch(Rectangle((x, y0), cols * cw, rows * ch, fill=False, edgecolor="black", linewidth=1))
        ax.add_patch(Rectangle((x + cols * cw + gap, y0), cw * 1.5, rows * ch, fill=False, edgecolor="black",
                               linewidth=1))
        ax.text(x + cols * cw / 2, y0 - 0.03, "D = 64 个码（各 1 字节）", ha="center", fontsize=9)
        ax.text(x + cols * cw + gap + cw * 0.75, y0 - 0.03, "scale", ha="center", fontsize=9)
    ax.text(0.035, y0 + rows * ch / 2, "block_size = 16 个 token", rotation=90, ha="center", va="center",
            fontsize=9)
    hx = 0.06 + hi_head * step
    ax.annotate("token 5 在头 1 的 64 个码共用这一个 scale：\n写入时 s = max|x| / 127，码 = round(x / s)；\n"
                "读出时 $\\hat{x}$ = 码 × s（fp8：s = max|x| / 448，码是 e4m3）",
                xy=(hx + cols * cw + gap + cw * 1.5, y0 + (rows - 1 - hi_tok + 0.5) * ch),
                xytext=(0.5, 0.72), ha="center", va="center", fontsize=9.5,
                arrowprops=dict(arrowstyle="-|>", color="black"))
    ax.text(0.5, 0.03, "每 token 字节数 = 2（K、V）× 30 层 × 3 头 × (64 个码 + 4 字节 scale) = 12 240（float32 是 46 080，0.266 倍）",
            ha="center", va="center", fontsize=10)
    return save(fig, out, "08_quant_pool_layout.png")


def swap_path(out: Path) -> Path:
    """swap.py 的 SwapSpace 与 scheduler.py 的换出式抢占：一个占 3 块的请求被换出、再换回。"""
    fig, axes = plt.subplots(2, 1, figsize=(12, 7.4))
    pool_n, cpu_n, bw, bh = 12, 8, 0.045, 0.12

    def grid(ax, x, y, n, owned, label, color):
        for b in range(n):
            box(ax, x + b * bw, y, bw, bh, str(b), color if b in owned else "white", fontsize=9)
        ax.text(x + n * bw / 2, y + bh + 0.07, label, ha="center", fontsize=10)
        return {b: (x + (b + 0.5) * bw, y) for b in range(n)}

    ax = axes[0]
    blank(ax)
    ax.set_title("① 抢占：swap_out 把请求的块（量化池子：码与 scale 一起）拷到第二层，池子里的块还给分配器", fontsize=11)
    p = grid(ax, 0.02, 0.55, pool_n, {2, 5, 9}, "池子（GPU 显存；在 CPU 上就是普通内存）", USED)
    c = grid(ax, 0.62, 0.55, cpu_n, {0, 1, 2}, "第二层 SwapSpace（CPU 内存；池子在 CUDA 上时是锁页内存）", EVICT)
    for src, dst in zip((2, 5, 9), (0, 1, 2)):
        arrow(ax, p[src], c[dst], rad=0.25, color="#b35806")
    ax.text(0.02, 0.2, "抢占前：块表 [2, 5, 9]", fontsize=10)
    ax.text(0.02, 0.06, "之后：请求进 swapped 队列，swap_handle 记下第二层的块 [0, 1, 2]；第二层装不下时退回重算"
            "（扔掉块，之后重新 prefill）", fontsize=10)

    ax = axes[1]
    blank(ax)
    ax.set_title("② 重新接纳（先于等待队列里的新请求）：池子里另分 3 块，swap_in 拷回，块表换成新块号", fontsize=11)
    p = grid(ax, 0.02, 0.55, pool_n, {3, 7, 10}, "池子：新分到的块号可以和原来不同", CACHED)
    c = grid(ax, 0.62, 0.55, cpu_n, {0, 1, 2}, "第二层：拷回之后这 3 块释放", EVICT)
    for src, dst in zip((0, 1, 2), (3, 7, 10)):
        arrow(ax, c[src], p[dst], rad=-0.25, color="#1b7837")
    ax.text(0.02, 0.2, "换回后：块表 [3, 7, 10]；拷贝逐位相同，之后的计算与从未被抢占时一样", fontsize=10)
    ax.text(0.02, 0.06, "代价：2 次拷贝，字节数 = 块数 × 每块字节；重算的代价是 prefill \"提示词 + 已生成的 token\"",
            fontsize=10)
    fig.tight_layout()
    return save(fig, out, "08_swap_path.png")


# ---------- 第 14 章 ----------

D_COL, M_COL, LO_COL, HI_COL, X_COL = "#fdae6b", "#fdd0a2", "#9ecae1", "#c6dbef", "#a1d99b"


def q4_1_blocks(out: Path) -> Path:
    """step14 formats.py：GGUF 里一块 Q4_1（20 字节）/ Q8_0（34 字节），与 repack_blocks 把 16 行的同一块并成一条记录。"""
    fig = plt.figure(figsize=(13, 9.6))

    # ① 一块 Q4_1：d、m、16 个字节的半字节
    ax = fig.add_axes([0.02, 0.58, 0.96, 0.37])
    blank(ax)
    ax.set_title("① 一块 Q4_1 = 同一个输出行上、沿输入维连续的 32 个权重，20 字节：值 = d·q + m，q ∈ 0..15", fontsize=11)
    bw, bh, x0, y0 = 0.04, 0.12, 0.1, 0.68
    box(ax, x0, y0, 2 * bw, bh, "d\n(fp16)", D_COL, fontsize=9)
    box(ax, x0 + 2 * bw, y0, 2 * bw, bh, "m\n(fp16)", M_COL, fontsize=9)
    for j in range(16):
        box(ax, x0 + (4 + j) * bw, y0, bw, bh, f"qs\n{j}", LO_COL, fontsize=8)
    for i in (0, 2, 4, 19):
        ax.text(x0 + (i + 0.5) * bw, y0 + bh + 0.04, str(i), ha="center", fontsize=8, color="#555555")
    ax.text(x0 - 0.01, y0 + bh + 0.04, "字节", ha="right", fontsize=8, color="#555555")
    # 32 个权重：前 16 个来自低半字节，后 16 个来自高半字节
    ww, wy = 0.0255, 0.2
    for k in range(32):
        box(ax, 0.09 + k * ww, wy, ww, 0.09, str(k), LO_COL if k < 16 else HI_COL, fontsize=7)
    ax.text(0.08, wy + 0.045, "权重", ha="right", va="center", fontsize=9)
    for j, (lo_c, hi_c) in ((0, ("#08519c", "#6baed6")), (1, ("#08519c", "#6baed6")), (15, ("#08519c", "#6baed6"))):
        src = (x0 + (4 + j + 0.5) * bw, y0)
        arrow(ax, src, (0.09 + (j + 0.5) * ww, wy + 0.09), color=lo_c)
        arrow(ax, src, (0.09 + (j + 16.5) * ww, wy + 0.09), color=hi_c)
    ax.text(0.5, 0.47, "qs[j] 的低 4 位（深色箭头）是第 j 个权重，高 4 位（浅色）是第 j + 16 个，不是相邻的两个：qs[j] = (q[j+16] << 4) | q[j]",
            ha="center", fontsize=10, bbox=dict(facecolor="white", edgecolor="none", pad=1))
    ax.text(0.5, 0.05, "Q8_0（词嵌入，也是 tie 的 lm_head）：[ d (fp16) | qs[0] … qs[31] (int8) ]，34 字节，值 = d·q；"
            "d·q 在 float32 里没有舍入，Q4_1 只在 + m 处舍入一次",
            ha="center", fontsize=9.5)

    # ② 重排：16 行的同一块 → 一条 320 字节的记录
    ax = fig.add_axes([0.02, 0.01, 0.96, 0.52])
    blank(ax)
    ax.set_title("② repack_blocks：一个行组（16 个输出行）的第 b 块并成一条记录；字节一个没多，只是换了顺序", fontsize=11)
    rh, cw, gx, gy = 0.035, 0.045, 0.05, 0.3
    nb_drawn, hb = 5, 2
    for r in range(16):
        yr = gy + (15 - r) * rh
        for b in range(nb_drawn):
            box(ax, gx + b * cw, yr, cw, rh, "", USED if b == hb else "white", fontsize=6)
        ax.text(gx - 0.008, yr + rh / 2, f"行 {r}", ha="right", va="center", fontsize=7)
    for b in range(nb_drawn):
        label = "块 b" if b == hb else "…" if b == nb_drawn - 1 else ""
        ax.text(gx + (b + 0.5) * cw, gy + 16 * rh + 0.015, label, ha="center", fontsize=8)
    ax.text(gx + nb_drawn * cw / 2, gy - 0.06, "GGUF 里的顺序：(N, K/32, 20)\n一行的块挨着存", ha="center", fontsize=9)

    rx, ry, rw, rrh = 0.36, 0.68, 0.6, 0.085
    parts = [("d × 16 行\n32 B", D_COL, 2), ("m × 16 行\n32 B", M_COL, 2)] + \
            [(f"qs[{j}]\n× 16 行", LO_COL, 1) for j in (0, 1, 2)] + [("…", "white", 1)] + \
            [("qs[15]\n× 16 行", LO_COL, 1)]
    unit = rw / sum(u for _, _, u in parts)
    x = rx
    spans = []
    for text, col, u in parts:
        box(ax, x, ry, u * unit, rrh, text, col, fontsize=8)
        spans.append((x, u * unit))
        x += u * unit
    ax.text(rx + rw / 2, ry + rrh + 0.04, "记录 (行组 g, 块 b)：320 字节 = 16 行 × 20 字节", ha="center", fontsize=10)
    arrow(ax, (gx + (hb + 1) * cw + 0.005, gy + 8 * rh), (rx, ry + rrh / 2), "16 行的第 b 块", rad=-0.2,
          text_xy=(0.3, 0.8))
    # 放大 qs[0] 那 16 个字节
    qx, qy, qw = 0.38, 0.4, 0.56
    for r in range(16):
        box(ax, qx + r * qw / 16, qy, qw / 16, 0.08, f"r{r}", LO_COL, fontsize=7)
    x_q0, w_q0 = spans[2]
    ax.plot([x_q0, qx], [ry, qy + 0.08], color="#555555", linewidth=0.8)
    ax.plot([x_q0 + w_q0, qx + qw], [ry, qy + 0.08], color="#555555", linewidth=0.8)
    ax.text(qx + qw / 2, qy - 0.06, "qs[j] × 16 行：16 个相邻的字节 = 16 个输出行各自的第 j（低 4 位）与第 j + 16 个（高 4 位）权重\n"
            "内核读 16 个字节、零扩展成 16 个 int32，就是一个 AVX-512 向量里 16 行的同一个位置",
            ha="center", va="center", fontsize=9)
    ax.text(rx + rw / 2, 0.12, "一个行组的全部记录（块 0 … K/32 − 1）在内存里连续：内核从头到尾顺着读一遍。\n"
            "N 不是 16 的倍数时最后一个行组补全 0 的块（d = m = 0）；Q8_0 的记录是 [d × 16 | qs[0..31] × 16]，544 字节",
            ha="center", va="center", fontsize=9)
    return save(fig, out, "14_q4_1_blocks.png")


def register_tile(out: Path) -> Path:
    """step14 kernels.py 的 tile_q4_1：一个行组 × MT 行激活，累加器留在寄存器里，一块一块地读记录。"""
    fig = plt.figure(figsize=(13, 7.4))
    fig.suptitle("寄存器分块（kernels.py 的 tile_q4_1）：读 16 个字节得到 16 个输出行的权重，对 MT 行激活全部乘加完才读下一批",
                 fontsize=11, y=0.985)
    ax = fig.add_axes([0.0, 0.0, 1.0, 0.94])
    blank(ax)
    lane, lh, bx = 0.02, 0.055, 0.03

    def lanes(x, y, color, n=16, w=lane):
        for r in range(n):
            box(ax, x + r * w, y, w, lh, "", color)

    lanes(bx, 0.86, LO_COL)
    ax.text(bx + 8 * lane, 0.86 + lh + 0.02, "记录 (g, b) 里的 qs[j] × 16 行：16 个字节，一次读入", ha="center", fontsize=9)
    arrow(ax, (bx + 8 * lane, 0.86), (bx + 8 * lane, 0.66 + lh), "vnibbles：零扩展成 int32、& 15 / >> 4、转 float",
          text_xy=(bx + 8 * lane, 0.79), fontsize=8.5)
    lanes(bx, 0.66, LO_COL)
    ax.text(bx + 16 * lane + 0.01, 0.66 + lh / 2, "低 4 位：16 行各自的 q[j]", va="center", fontsize=9)
    lanes(bx, 0.57, HI_COL)
    ax.text(bx + 16 * lane + 0.01, 0.57 + lh / 2, "高 4 位：q[j + 16]", va="center", fontsize=9)
    lanes(bx, 0.4, D_COL)
    ax.text(bx + 16 * lane + 0.01, 0.4 + lh / 2, "d × 16 行", va="center", fontsize=9)
    lanes(bx, 0.31, M_COL)
    ax.text(bx + 16 * lane + 0.01, 0.31 + lh / 2, "m × 16 行", va="center", fontsize=9)
    ax.text(bx + 8 * lane, 0.26, "记录开头的 fp16，每块转一次 float（vhalf）", ha="center", va="top", fontsize=8.5)

    box(ax, 0.5, 0.44, 0.13, 0.2, "fma(q, d, m)\n= d·q + m\n逐位等于\nformats.decode", "white", fontsize=9.5, round_=True)
    arrow(ax, (0.47, 0.64), (0.5, 0.58))
    arrow(ax, (0.47, 0.43), (0.5, 0.5))

    wl, wx = 0.016, 0.68
    lanes(wx, 0.66, LO_COL, w=wl)
    ax.text(wx + 8 * wl, 0.66 + lh + 0.015, "w_lo：16 行的第 j 个权重（fp32，只在寄存器里）", ha="center", fontsize=8.5)
    lanes(wx, 0.52, HI_COL, w=wl)
    ax.text(wx + 8 * wl, 0.52 + lh + 0.015, "w_hi：16 行的第 j + 16 个", ha="center", fontsize=8.5)
    arrow(ax, (0.63, 0.57), (wx, 0.68))
    arrow(ax, (0.63, 0.52), (wx, 0.55))

    MT, ay = 4, 0.1
    for m in range(MT):
        lanes(wx, ay + (MT - 1 - m) * lh, CACHED, w=wl)
        ax.text(wx - 0.008, ay + (MT - 1 - m + 0.5) * lh, f"acc[{m}]", ha="right", va="center", fontsize=9)
    ax.text(wx + 8 * wl, ay + MT * lh + 0.015, "MT 个累加器：每个是 16 个输出行的部分和，一个向量寄存器", ha="center",
            fontsize=8.5)
    arrow(ax, (wx + 8 * wl, 0.52), (wx + 8 * wl, ay + MT * lh + 0.045))
    ax.text(wx + 8 * wl, 0.045, "acc[m][0] += x[m][j] · w_lo，acc[m][1] += x[m][j+16] · w_hi\n"
            "（x 广播成 16 份，一条 FMA；图里每行只画了一个累加器）", ha="center", va="center", fontsize=8.5)

    xx = 0.43
    for m in range(MT):
        box(ax, xx + m * 0.045, 0.17, 0.045, lh, f"x[{m}][j]", X_COL, fontsize=7.5)
    ax.text(xx + MT * 0.045 / 2, 0.17 - 0.02, "xt[k][m]：这 MT 个数相邻\n（激活每次调用转置一次）", ha="center", va="top",
            fontsize=8.5)
    arrow(ax, (xx + MT * 0.045, 0.17 + lh / 2), (wx - 0.05, ay + 2 * lh))

    ax.text(0.985, 0.99, "循环：行组 g（OpenMP 按行组分给线程）\n → 激活每 MT 行一段（AVX-512 MT ≤ 8，AVX2 ≤ 4）\n"
            "   → 块 b = 0 … K/32 − 1\n     → j = 0 … 15\n最后把 acc 写进 y[m][16g … 16g + 15]",
            ha="right", va="top", multialignment="left", fontsize=9,
            bbox=dict(facecolor="#f7f7f7", edgecolor="#999999", pad=4))
    ax.text(bx, 0.13, "每个权重字节每次调用只从内存读一次，不管 M 多大。\nM = 1 时只有一行激活：同一个累加器的一串 FMA\n"
            "要排队等上一条（约 4 个周期），所以每行分 P 个\n累加器轮流加（kernels.py 的 Chains）",
            ha="left", va="center", fontsize=8.5)
    return save(fig, out, "14_register_tile.png")
# ---------- 第 12 章 ----------

# 第 12 章第 6 节的一次 h2o 压紧：预算 B = 8、块大小 4、最近 R = 4，一层、3 个 KV 头。槽数到 B + 块 = 12 时压回 8 个。
# 累计分数是编的（槽 0..7；最近的 8..11 一定留）；留哪些由 step12 的 eviction.kept_slots 现算，与引擎同一个函数。
H2O_SCORES12 = [[5.0, 0.2, 1.5, 0.3, 0.9, 0.1, 1.2, 0.4],
                [4.0, 1.1, 0.2, 0.9, 0.3, 1.3, 0.1, 0.2],
                [3.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]]
OLD_BLOCKS12, NEW_BLOCKS12 = [7, 2, 9], [4, 11]


def compaction(out: Path) -> Path:
    """第 12 章第 6 节：压紧。旧块表的 12 个槽 → 每个 KV 头留的槽（kept_slots）→ 新块表的 8 个槽，格子里是挪过来的 token
    与缓存位置时要补转的角度 (n − o)·θ。同一个槽号，不同的头存的是不同的 token。"""
    import torch

    B, bs, R, S = 8, 4, 4, 12
    scores = torch.tensor([[row + [0.0] * R for row in H2O_SCORES12]])              # (1 层, 3 头, 12)
    kept = kept_slots("h2o", S, B, 1, 3, recent=R, scores=scores)[0].tolist()        # 3 个头，各 B 个旧槽号，升序
    deltas = rotation_deltas(torch.tensor([kept]))[0].tolist()                        # n − o
    fig, ax = plt.subplots(figsize=(15, 7.4))
    blank(ax, (0, 15), (0, 7.4))
    ax.set_title(f"h2o 的一次压紧（预算 B = {B}、块大小 {bs}、最近 R = {R}；画一层、3 个 KV 头）：槽数到 B + 一块 = {S} 时压回 B 个",
                 fontsize=12)
    w, h, gap = 0.42, 0.56, 0.14
    rows_y = [5.1, 4.35, 3.6]

    def xs_of(x0, n, cw):
        return [x0 + s * cw + (s // bs) * gap for s in range(n)]

    def table_header(xs, cw, title, blocks):
        """块表的标题、每块的物理块号、每个槽的槽号。"""
        ax.text(xs[0], 6.55, title, fontsize=11, va="center")
        for b, phys in enumerate(blocks):
            ax.text(xs[b * bs] + bs * cw / 2, 6.1, f"物理块 {phys}", ha="center", fontsize=9, color="#444444")
        for n, x in enumerate(xs):
            ax.text(x + cw / 2, 5.8, str(n), ha="center", fontsize=8.5, color="#444444")

    # ① 旧块表
    xo = xs_of(0.55, S, w)
    table_header(xo, w, f"① 压紧前：{S} 个槽，块表 {OLD_BLOCKS12}", OLD_BLOCKS12)
    ax.text(xo[0] - 0.08, 5.8, "槽", ha="right", fontsize=8.5, color="#444444")
    for hd, y in enumerate(rows_y):
        ax.text(xo[0] - 0.08, y + h / 2, f"头 {hd}", ha="right", va="center", fontsize=10)
        for s_, x in enumerate(xo):
            keep = s_ in kept[hd]
            box(ax, x, y, w, h, f"t{s_}", (CACHED if s_ < S - R else USED) if keep else "white", fontsize=9,
                linestyle="-" if keep else ":")
            if not keep:
                ax.plot([x + 0.06, x + w - 0.06], [y + 0.08, y + h - 0.08], color="#999999", linewidth=1, zorder=5)

    # ② 每个头留哪些
    ax.text(7.45, 6.45, "② kept_slots：\n每个 (层, 头) 一行旧槽号", ha="center", fontsize=11, va="center")
    for hd, y in enumerate(rows_y):
        ax.text(7.45, y + h / 2, f"头 {hd}：{kept[hd]}", ha="center", va="center", fontsize=9)
    ax.text(7.45, 2.95, "→ 第 n 个留下的旧槽 o 搬到新槽 n", ha="center", va="center", fontsize=9)
    ax.text(xo[0], 2.95, f"蓝：最后 R = {R} 个，必留；绿：其余按累计注意力\n留最高的 {B - R} 个；虚线 + 斜线：这次扔掉的",
            va="center", fontsize=9, color="#444444")

    # ③ 新块表
    wn = 0.66
    xn = xs_of(8.95, B, wn)
    table_header(xn, wn, f"③ 压紧后：正好 B = {B} 个槽，块表 {NEW_BLOCKS12}", NEW_BLOCKS12)
    for hd, y in enumerate(rows_y):
        for n, x in enumerate(xn):
            o, d = kept[hd][n], deltas[hd][n]
            box(ax, x, y, wn, h, f"t{o}\n{'不转' if d == 0 else f'−{-d}θ'}", CACHED if o < S - R else USED, fontsize=8.5)
    col = 2                                                   # 同一个槽号、不同的 token
    ax.add_patch(Rectangle((xn[col] - 0.04, rows_y[-1] - 0.06), wn + 0.08, rows_y[0] - rows_y[-1] + h + 0.12,
                           fill=False, edgecolor=PREFILL_A, linewidth=2.5, zorder=6))
    ax.annotate(f"同一个槽号 {col}：头 0 存 t{kept[0][col]}，头 1 存 t{kept[1][col]}，头 2 存 t{kept[2][col]}\n"
                "块表只有一张；每个头在槽 s 里存它自己留下的第 s 个 token（原文顺序）",
                xy=(xn[col] + wn / 2, rows_y[-1] - 0.06), xytext=(12.0, 2.8), ha="center", va="center", fontsize=9.5,
                arrowprops=dict(arrowstyle="-|>", color=PREFILL_A))

    notes = [
        "搬法（kv_cache.compact）：先把每层、每个头留下的 K/V 全部读出，再按新顺序写进新块；旧块整个还回池子（新块号由分配器给，"
        "可以恰好是刚还掉的）。",
        f"块数 {len(OLD_BLOCKS12)} → {len(NEW_BLOCKS12)}：多出来的块真的空出来。每层各做一遍，每层留的也可以不同；分数跟着留下的槽搬走，"
        "新写的槽从 0 开始记。",
        "格子里的角度：缓存位置（--kv-positions cache）时 K 从槽 o 挪到槽 n 要补转 R((n − o)·θ)，n ≤ o 所以是往回转（每对维度用它自己的 θ）；"
        "V 没有位置，不转。",
        "原文位置（h2o / snapkv 的默认）只搬不转；16 位的池子用缓存位置时存 RoPE 之前的 K，也只搬不转（注意力之前按槽号转一次）。",
    ]
    for i, t in enumerate(notes):
        ax.text(0.45, 1.75 - 0.42 * i, t, fontsize=9.5, va="center")
    fig.tight_layout()
    return save(fig, out, "12_compaction.png")


def cache_positions(out: Path) -> Path:
    """第 12 章第 3 节：汇 4 个 + 最近 4 个留在缓存里时，RoPE 用原文位置还是缓存位置；query 与汇的距离。"""
    n_text, sinks, recent = 16, 4, 4
    kept = list(range(sinks)) + list(range(n_text - recent, n_text))
    fig, ax = plt.subplots(figsize=(14, 6.4))
    blank(ax, (0, 14), (0, 6.4))
    ax.set_title(f"缓存里留着汇 t0..t{sinks - 1} 与最近的 {recent} 个 token，decode t{n_text}：RoPE 用原文位置还是缓存位置",
                 fontsize=12)
    w, h, x0 = 0.7, 0.5, 1.6

    def col(i):
        return x0 + i * w

    def color(i):
        return PREFILL_A if i == n_text else CACHED if i < sinks else USED

    y = 5.3                                                   # 原文
    ax.text(x0 - 0.15, y + h / 2, "原文", ha="right", va="center", fontsize=10)
    for i in range(n_text + 1):
        box(ax, col(i), y, w, h, f"t{i}", color(i) if i in kept or i == n_text else "white", fontsize=9)
        if i not in kept and i != n_text:
            ax.plot([col(i) + 0.08, col(i) + w - 0.08], [y + 0.08, y + h - 0.08], color="#999999", linewidth=1,
                    zorder=5)
    ax.text(col(sinks) + (n_text - recent - sinks) * w / 2, y + h + 0.2, "已被驱逐（K/V 不在池子里）", ha="center",
            fontsize=9, color="#666666")
    ax.text(col(n_text) + w / 2, y + h + 0.2, "query", ha="center", fontsize=9)

    y = 3.9                                                   # 原文位置
    ax.text(x0 - 0.15, y + h / 2, "原文位置\n(text)", ha="right", va="center", fontsize=10)
    for i in kept + [n_text]:
        box(ax, col(i), y, w, h, str(i), color(i), fontsize=10)
    arrow(ax, (col(n_text) + w / 2, y), (col(0) + w / 2, y), rad=-0.08)
    ax.text(col(8) + w / 2, y - 0.62, f"query 与汇 t0 的距离 = {n_text}：随文本一起长", ha="center", va="center", fontsize=9.5)

    y = 2.1                                                   # 缓存位置
    ax.text(x0 - 0.15, y + h / 2, "缓存位置\n(cache)", ha="right", va="center", fontsize=10)
    for slot, i in enumerate(kept + [n_text]):
        box(ax, col(slot), y, w, h, f"{slot}\nt{i}", color(i), fontsize=8.5)
    arrow(ax, (col(len(kept)) + w / 2, y), (col(0) + w / 2, y), rad=-0.15)
    ax.text(col(len(kept)) / 2 + col(0) / 2 + w / 2, y - 0.68, f"距离 = {len(kept)}：永远不超过缓存的大小", ha="center",
            va="center", fontsize=9.5)
    ax.text(col(len(kept)) + 1.1, y + h / 2 + 0.15,
            f"压紧时 t{n_text - recent}..t{n_text - 1} 从槽 {n_text - recent}..{n_text - 1} 挪到槽 {sinks}..{len(kept) - 1}："
            f"K 补转 ({sinks} − {n_text - recent})·θ = −{n_text - recent - sinks}θ，V 不转\n"
            "（16 位的池子存 RoPE 之前的 K：注意力之前按槽号转一次）\n"
            f"窗口内部 t{n_text - recent}..t{n_text - 1} 两两的距离在两种编号下相同；只有汇与窗口之间的\"缺口\"不同",
            va="center", fontsize=9.5)
    ax.text(0.3, 0.35, "本章的长文本（预算 512）：原文位置下汇与 query 的距离一直长到 16,384，越过训练长度 8,192 后 NLL 往上走；"
            "缓存位置下 decode 时不超过 527，一块 256 个 token 的 prefill 里不超过 767。", fontsize=9.5, va="center")
    fig.tight_layout()
    return save(fig, out, "12_cache_positions.png")


# ---------- 第 13 章 ----------

def selective_recompute(out: Path) -> Path:
    """第 13 章第 3 节：横轴是一个请求的 token（模板开头、两篇复用的文档、问题），纵轴是层。reuse 只算问题部分；
    blend 先跑检查段（全部 token 的第 0 层 + 第 1 层的 K），再把偏差最大的几个 token 与问题部分一起逐层重算。"""
    segs = [("模板开头", 2, False), ("文档 A（块缓存，转到新位置）", 9, True), ("文档 B（块缓存，转到新位置）", 9, True),
            ("问题", 4, False)]
    selected = {4, 9, 15}                       # 偏差最大的几个复用 token（编的；r ≈ 0.15：18 个复用的里选 2–3 个）
    layers = ["0", "1", "2", "3", "…", "L − 1"]
    n = sum(k for _, k, _ in segs)
    reused = [r for _, k, r in segs for _ in range(k)]
    fig, axes = plt.subplots(2, 1, figsize=(14, 9.2))
    w, h, x0 = 0.42, 0.42, 1.3

    def panel(ax, title, blend):
        blank(ax, (0, 14), (-0.45, 4.2))
        ax.set_title(title, fontsize=11)
        x = x0
        for name, k, _ in segs:
            ax.plot([x + 0.03, x + 0.03, x + k * w - 0.03, x + k * w - 0.03], [3.45, 3.55, 3.55, 3.45], color="black",
                    linewidth=1)
            ax.text(x + k * w / 2, 3.8, name, ha="center", va="center", fontsize=9)
            x += k * w
        for li, name in enumerate(layers):
            y = 2.9 - li * h * 1.15
            ax.text(x0 - 0.1, y + h / 2, name if name == "…" else f"层 {name}", ha="right", va="center", fontsize=9)
            for t in range(n):
                xt = x0 + t * w
                if name == "…":
                    ax.text(xt + w / 2, y + h / 2, "…", ha="center", va="center", fontsize=9)
                    continue
                recompute = not reused[t] or (blend and t in selected)
                color = (PREFILL_A if reused[t] else DECODE) if recompute else CACHED
                ax.add_patch(Rectangle((xt, y), w, h, facecolor=color, edgecolor="white", linewidth=1, zorder=3))
                if blend and name == "0":                    # 检查段：全部 token 的第 0 层
                    ax.add_patch(Rectangle((xt, y), w, h, fill=False, hatch="///", edgecolor="#7f2704", linewidth=0,
                                           zorder=4))
                if blend and name == "1":                    # 检查层：只算 K（或 V），与复用的比
                    ax.add_patch(Rectangle((xt + w * 0.3, y + h * 0.3), w * 0.4, h * 0.4, facecolor="#7f2704",
                                           edgecolor="none", zorder=4))
        xr = x0 + n * w + 0.35
        if blend:
            ax.text(xr, 2.9 + h / 2, "检查段（斜线）：全部 token 照完整 prefill 走第 0 层——\n注意力看全部前文，第 0 层的输出是精确的",
                    va="center", fontsize=9)
            ax.text(xr, 2.9 - h * 1.15 + h / 2, "检查层 1（小方块）：全部 token 只算新的 K（或 V），\n"
                    "与复用的比，偏差 = Σ_头 Σ_维 (新 − 旧)²", va="center", fontsize=9)
            ax.text(xr, 1.05, "偏差最大的 r × 复用数 个（向下取整，橙）+ 不是复用来的（蓝）：\n从第 0 层起逐层重算，新 K/V 盖掉复用的那几列；\n"
                    "它们的 query 按各自的位置看这一层的全部 key。\n第 0 层：橙色的 token 在检查段里已经算过一遍，又算一遍",
                    va="center", fontsize=9)
            ax.text(x0, -0.2, "代价（折成走完全部 L 层的 token 数）：n / L（检查段）+ r × n_复用（取整）+ n_问题。"
                    "r = 1：全部重算 = 完整 prefill 的结果，代价 n + n / L", fontsize=9.5, va="center")
        else:
            ax.text(xr, 1.6, "块缓存里的 K/V 原样用（K 已转到新位置），\n哪一层都不重算；\n只有不是复用来的 token（蓝）走完全部层，\n"
                    "它们的 query 看全部 key", va="center", fontsize=9)
            ax.text(x0, -0.2, "代价：n_问题（不是复用来的 token，这里 6 个）。错在文档的第 1 层起：文档 B 的 token 从没看过文档 A",
                    fontsize=9.5, va="center")

    panel(axes[0], "reuse（= blend r = 0）：复用的 token 一个不算", False)
    panel(axes[1], "blend（CacheBlend，r ≈ 0.15）：检查段选出偏差最大的几个，和问题部分一起逐层重算", True)
    fig.legend(handles=[Patch(facecolor=CACHED, label="复用：块缓存里单独算好的 K/V"),
                        Patch(facecolor=DECODE, label="不是复用来的：逐层计算"),
                        Patch(facecolor=PREFILL_A, label="选中重算的复用 token"),
                        Patch(facecolor="white", edgecolor="#7f2704", hatch="///", label="检查段：全部 token 的第 0 层")],
               loc="lower center", ncol=4, fontsize=9.5, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return save(fig, out, "13_selective_recompute.png")


# ---------- 第 15 章 ----------

# 第 15 章第 1 节的例子。DFA 的状态号由 step15 的代码现算（纯 Python，不要分词器）；token 的切法与"这个状态允许几个
# token"是默认模型 SmolLM2 的分词器（49152 词表）上量的：`hf('{"name": "Ada", "age": 36, "city": "Paris"}',
# add_special_tokens=False)` 的前 7 个 token 是 {" name ": ␣" Ad a ",；计数是 CompiledGrammar.masks(状态) 的 token 数。
# 换了分词器，这几行要跟着改。
SCHEMA15 = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                              "city": {"enum": ["Paris", "Beijing", "Lima"]}},
            "required": ["name", "age", "city"]}
TOKENS15 = [b'{"', b"name", b'":', b' "', b"Ad", b"a", b'",']        # 模型的切法（分词器的）
ALLOWED15 = [2, 4, 2, 29, 48783, 48783, 48783]                          # 每个 token 开始的那个状态允许几个 token
FORCED_TOKENS15 = 3                                                     # jump-forward 放进去的：{" name ":（退回之后）
HANZI15 = [b"\xe5\x8c", b"\x97", b"\xe4\xba", b"\xac"]                   # "北京" 在 SmolLM2 里的 4 个 token


def byte_label(b: int) -> str:
    return "␣" if b == 32 else chr(b) if 32 < b < 127 else f"{b:02X}"


def dfa_tokens(out: Path) -> Path:
    """第 15 章第 1 节：横轴是字节的位置，圆圈是读到这里时 DFA 的状态；下面的括号是 token：一个 token 一步走过好几个状态。"""
    fig, axes = plt.subplots(2, 1, figsize=(14, 7.2), gridspec_kw={"height_ratios": [1.5, 1]})

    def walk(dfa, data: bytes) -> list[int]:
        states = [START]
        for b in data:
            states.append(dfa.trans[states[-1]][b])
        return states

    def row(ax, data, states, x0, dx, y, boundary=()):
        """状态圆圈 + 字节边；返回每个位置的 x。boundary：这些位置的圆圈涂色（token 的边界）。"""
        xs = [x0 + i * dx for i in range(len(states))]
        for i, b in enumerate(data):
            arrow(ax, (xs[i] + 0.012, y), (xs[i + 1] - 0.012, y))
            ax.text((xs[i] + xs[i + 1]) / 2, y + 0.06, byte_label(b), ha="center", va="center", fontsize=10)
        for i, (x, s) in enumerate(zip(xs, states)):   # 标记（以点为单位）在任何长宽比下都是圆的
            ax.plot([x], [y], "o", markersize=19, markerfacecolor=CACHED if i in boundary else "white",
                    markeredgecolor="black", zorder=6)
            ax.text(x, y, str(s), ha="center", va="center", fontsize=8.5, zorder=7)
        return xs

    def bracket(ax, xa, xb, y, text, color, below=True, fontsize=10):
        d = -0.025 if below else 0.025
        ax.plot([xa + 0.004, xa + 0.004, xb - 0.004, xb - 0.004], [y - d, y, y, y - d], color=color, linewidth=2)
        ax.text((xa + xb) / 2, y + (-0.045 if below else 0.045), text, ha="center", va="center", fontsize=fontsize)

    # ① JSON Schema 的开头
    ax = axes[0]
    blank(ax, ylim=(0.05, 0.86))
    dfa = compile_regex(schema_to_regex(SCHEMA15))
    data = b"".join(TOKENS15)
    states = walk(dfa, data)
    ends = [0]
    for t in TOKENS15:
        ends.append(ends[-1] + len(t))
    x0, dx, y = 0.05, 0.92 / len(data), 0.6
    forced_all = next(i for i, s in enumerate(states) if sum(dfa.trans[s][b] != 0 for b in range(256)) != 1)
    ax.add_patch(Rectangle((x0 - dx * 0.4, y - 0.05), dx * (forced_all + 0.8), 0.15, facecolor=PREFILL_B,
                           edgecolor="none", zorder=1))
    xs = row(ax, data, states, x0, dx, y, boundary=set(ends))
    for k, (t, n) in enumerate(zip(TOKENS15, ALLOWED15)):
        a, b = ends[k], ends[k + 1]
        color = PREFILL_A if k == len(TOKENS15) - 1 else ("#08519c" if k < FORCED_TOKENS15 else "#444444")
        bracket(ax, xs[a], xs[b], y - 0.08, "".join(byte_label(c) for c in t), color)
        ax.text((xs[a] + xs[b]) / 2, y - 0.2, f"允许 {n:,}", ha="center", va="center", fontsize=8.5, color="#444444")
    ax.text(xs[0] - 0.01, y - 0.27, "↑ token 开始的那个状态里，词表（SmolLM2，49,152 个）中合法的 token 有几个",
            ha="left", va="center", fontsize=9, color="#444444")
    bracket(ax, xs[0], xs[1], y + 0.16, "{", "#888888", below=False, fontsize=9)
    bracket(ax, xs[1], xs[2], y + 0.16, '"', "#888888", below=False, fontsize=9)
    ax.text(xs[2] + 0.01, y + 0.2, "同一段文本的另一种切法 { + \"：也合法，状态 1 的掩码里两个都有；"
            f"橙色底：语法唯一确定的 {forced_all} 个字节（forced_bytes）", ha="left", va="center", fontsize=9.5)
    a, b = ends[-2], ends[-1]
    ax.annotate(f"一个 token 走过两个状态：{states[a]} ─\"→ {states[a + 1]} ─,→ {states[b]}，"
                "从字符串里面走到逗号之后", xy=((xs[a] + xs[b]) / 2, y - 0.15), xytext=(0.72, y - 0.37),
                ha="center", va="center", fontsize=9.5, arrowprops=dict(arrowstyle="-|>", color=PREFILL_A))
    ax.text(0.5, 0.1, f"蓝括号：jump-forward 直接放进去的 {FORCED_TOKENS15} 个 token。␣\" 退回、留给模型自己采样："
            f"状态 {states[ends[FORCED_TOKENS15]]} 允许 {ALLOWED15[FORCED_TOKENS15]} 个 token，"
            "其中 ␣\"\"、␣\"_ 这样的比 ␣\" 长、跨过强制串的结尾", ha="center", va="center", fontsize=9.5)
    ax.set_title("① schema {name: string, age: integer, city: enum} 的开头：字节上的 DFA（圆圈里是状态号，"
                 "绿 = token 的边界）与模型的 token", fontsize=11)

    # ② 一个汉字切在两个 token 里
    ax = axes[1]
    blank(ax, ylim=(0.3, 0.88))
    dfa = compile_regex("北京|北海道")
    data = b"".join(HANZI15)
    states = walk(dfa, data)
    ends = [0]
    for t in HANZI15:
        ends.append(ends[-1] + len(t))
    x0, dx, y = 0.12, 0.09, 0.55
    xs = row(ax, data, states, x0, dx, y, boundary=set(ends))
    for k, t in enumerate(HANZI15):
        bracket(ax, xs[ends[k]], xs[ends[k + 1]], y - 0.12, " ".join(f"{c:02X}" for c in t), "#444444")
    for k, ch in enumerate("北京"):
        bracket(ax, xs[3 * k], xs[3 * k + 3], y + 0.2, f"{ch}（{ch.encode().hex(' ').upper()}）", "#888888",
                below=False)
    ax.text(xs[0] - 0.03, y - 0.16, "token", ha="right", va="center", fontsize=10)
    ax.text(xs[0] - 0.03, y + 0.25, "字符", ha="right", va="center", fontsize=10)
    ax.text(xs[-1] + 0.05, y, f"第一个 token（E5 8C）停在状态 {states[2]}：\"北\"的 3 个字节读了 2 个。\n"
            "字符上的自动机没有这个状态，也就说不出这个 token 合不合法；\n字节上的 DFA 照常走：没掉进死状态，就合法",
            ha="left", va="center", fontsize=9.5)
    ax.set_title("② 正则 北京|北海道：\"北京\"在 SmolLM2 里是 4 个 token，两个汉字都被切开——所以自动机一次吃一个字节",
                 fontsize=11)
    fig.tight_layout()
    return save(fig, out, "15_dfa_tokens.png")


# ---------- 附录 ----------

def decode_ladder(out: Path) -> Path:
    """附录的阶梯：每一级一步多少 ms，剖析过的几级拆成"矩阵乘"和"其余开销"。"""
    fig, ax = plt.subplots(figsize=(11, 5.2))
    names = [r[0] for r in LADDER][::-1]
    for i, (name, total, matmul, kind) in enumerate(LADDER[::-1]):
        if matmul is None:
            color = {"exact": USED, "llamacpp": CACHED}[kind]
            ax.barh(i, total, color=color, edgecolor="black", linewidth=0.6)
        else:
            ax.barh(i, matmul, color="#4292c6", edgecolor="black", linewidth=0.6)
            ax.barh(i, total - matmul, left=matmul, color=USED, edgecolor="black", linewidth=0.6)
        ax.text(total + 1, i, f"{total:.1f}", va="center", fontsize=9)
    ax.set_yticks(range(len(names)), names, fontsize=9)
    ax.axvline(LLAMA_F32_MS, color="#1b7837", linestyle="--", linewidth=1)
    ax.axvline(LEVEL4_MATMUL_MS, color="#08519c", linestyle=":", linewidth=1)
    ax.set_title("decode 一步的时间：我们的阶梯与 llama.cpp（同一份权重、同样 2 个线程）", fontsize=11)
    ax.set_xlabel("decode 一步 (ms)")
    ax.set_xlim(0, 190)
    ax.legend(handles=[Patch(facecolor="#4292c6", edgecolor="black", label="其中矩阵乘（torch.profiler）"),
                       Patch(facecolor=USED, edgecolor="black", label="其余开销（没有剖析的行：整步）"),
                       Patch(facecolor=CACHED, edgecolor="black", label="llama.cpp（整步）"),
                       Line2D([], [], color="#1b7837", linestyle="--", label=f"llama.cpp F32 一步 {LLAMA_F32_MS} ms"),
                       Line2D([], [], color="#08519c", linestyle=":",
                              label=f"第 4 级光矩阵乘（oneDNN 打包的内核）{LEVEL4_MATMUL_MS} ms")],
              loc="center right", fontsize=9)
    fig.tight_layout()
    return save(fig, out, "appendix_decode_ladder.png")


DIAGRAMS = (radix_split, block_lifecycle, varlen_row, quant_pool_layout, swap_path, compaction, cache_positions,
            selective_recompute, q4_1_blocks, register_tile, dfa_tokens, decode_ladder)


def main(argv=None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs/images"), help="PNG 写到哪个目录（默认 docs/images）")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    use_chinese_font()
    paths = [draw(out) for draw in DIAGRAMS]
    for p in paths:
        print(p)
    return paths


if __name__ == "__main__":
    main()
