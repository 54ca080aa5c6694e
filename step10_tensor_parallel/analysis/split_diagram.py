"""画第 10 章的切分示意图（不跑模型，只画结构；同样的输入画出同样的 PNG）。

    python step10_tensor_parallel/analysis/split_diagram.py [--out docs/images]

10_tp_split.png：上半是 TP = 3 时一层 decoder 在 3 个 rank 上怎么切（SmolLM2-135M 的形状），下半是 PP = 2 的两个
stage 在两台"机器"上、只传 hidden states。中文字体来自 mplfonts（common/plotting.py）。
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from common.plotting import use_chinese_font  # noqa: E402

COL, ROW, COMM, KV, STAGE = "#9ecae1", "#fdae6b", "#fb6a4a", "#c7e9c0", "#f0f0f0"


def box(ax, x, y, w, h, text, color, fontsize=9):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=1, zorder=3))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, zorder=4)


def arrow(ax, start, end, text="", fontsize=8):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, linewidth=1.1, color="black",
                                 shrinkA=1, shrinkB=1, zorder=5))
    if text:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.012, text, ha="center", va="bottom",
                fontsize=fontsize)


def draw(out: Path) -> Path:
    use_chinese_font()
    fig, ax = plt.subplots(figsize=(13, 8.2))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.text(0.01, 0.975, "张量并行（TP = 3）：一层 decoder 切在 3 个 rank 上——每个子层一次 all-reduce",
            fontsize=12, va="top")
    h, gap = 0.085, 0.115
    ys = [0.80 - i * gap for i in range(3)]
    for r, y in enumerate(ys):
        ax.text(0.01, y + h / 2, f"rank {r}", fontsize=10, va="center")
        box(ax, 0.065, y, 0.075, h, "x (T, 576)\n每个 rank\n完整一份", "white", 8)
        box(ax, 0.16, y, 0.12, h, f"q/k/v 列切\nquery 头 {3 * r}–{3 * r + 2}\nKV 头 {r}", COL, 8)
        box(ax, 0.30, y, 0.11, h, f"注意力\n本 rank 的池子\n只存 KV 头 {r}", KV, 8)
        box(ax, 0.43, y, 0.10, h, "o_proj 行切\n部分和\n(T, 576)", ROW, 8)
        box(ax, 0.61, y, 0.12, h, f"gate/up 列切\nF 的 {512 * r}–{512 * r + 511}\nSiLU(g)·u", COL, 8)
        box(ax, 0.75, y, 0.10, h, "down 行切\n部分和\n(T, 576)", ROW, 8)
        for a, b in ((0.14, 0.16), (0.28, 0.30), (0.41, 0.43), (0.73, 0.75)):
            arrow(ax, (a, y + h / 2), (b, y + h / 2))
        arrow(ax, (0.53, y + h / 2), (0.55, y + h / 2))
        arrow(ax, (0.585, y + h / 2), (0.61, y + h / 2))
        arrow(ax, (0.85, y + h / 2), (0.87, y + h / 2))
        arrow(ax, (0.905, y + h / 2), (0.93, y + h / 2))
        ax.text(0.935, y + h / 2, "x + MLP\n下一层", fontsize=8, va="center")
    top, bottom = ys[0] + h, ys[-1]
    for x, label in ((0.55, "all-reduce\nΣ 部分和"), (0.87, "all-reduce\nΣ 部分和")):
        box(ax, x, bottom, 0.035, top - bottom, "", COMM)
        ax.text(x + 0.0175, top + 0.012, label, ha="center", va="bottom", fontsize=8, color="#a50f15")
    ax.text(0.065, bottom - 0.045,
            "列切：W 的输出维分给各 rank，不通信；行切：W 的输入维分给各 rank，正好接住列切留在本 rank 的那几列，"
            "各 rank 的部分和相加就是 X·W。\n每层 2 次、外加 embedding 1 次：SmolLM2 30 层，每个 decode 步 61 次 all-reduce，"
            "每次 T × 576 个数。词表（embedding / lm_head）也按行切，logits 在 rank 0 拼起来。",
            fontsize=8.5, va="top")
    # 下半：流水线
    ax.text(0.01, 0.33, "流水线并行（PP = 2）：层分成两段，stage 之间只传 hidden states（每步一次）", fontsize=12,
            va="top")
    for i, (x, name, layers, ranks) in enumerate(((0.04, "节点 0（一台机器）", "embedding + 第 0–14 层", "rank 0·1·2"),
                                                  (0.55, "节点 1（另一台机器）", "第 15–29 层 + norm + lm_head",
                                                   "rank 3·4·5"))):
        box(ax, x, 0.06, 0.41, 0.2, "", STAGE)
        ax.text(x + 0.01, 0.245, f"{name}：stage {i}", fontsize=9.5, va="top")
        box(ax, x + 0.03, 0.09, 0.35, 0.1, f"{layers}\n{ranks}：机器内部再做 TP（all-reduce 走 NVLink）\n"
                                            f"KV 池子只有这一段的层", COL if i == 0 else ROW, 8.5)
    arrow(ax, (0.42, 0.16), (0.58, 0.16), "send / recv：hidden (T, 576)")
    ax.annotate("", xy=(0.45, 0.075), xytext=(0.57, 0.075),
                arrowprops=dict(arrowstyle="-|>", color="#636363", linestyle="--"))
    ax.text(0.51, 0.045, "logits 回到 rank 0\n（采样在那里）", fontsize=8, ha="center", va="center", color="#636363")
    path = out / "10_tp_split.png"
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "images"))
    out = Path(p.parse_args(argv).out)
    out.mkdir(parents=True, exist_ok=True)
    return draw(out)


if __name__ == "__main__":
    print(main())
