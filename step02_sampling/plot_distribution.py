"""画第 02 章的图：真实模型的下一 token 分布在不同温度下的样子，以及 top-p 因此保留多少 token。

    python step02_sampling/plot_distribution.py [--out docs/images/02_sampling_temperature_top_p.png] [--model DIR]

同时把图里的数字打印出来（章节引用的就是这些数字）。中文字体来自 PyPI 包 mplfonts（common/plotting.py）。
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib  # noqa: E402

matplotlib.use("Agg")   # 不需要显示器
import matplotlib.pyplot as plt  # noqa: E402

from common.cli import open_session  # noqa: E402
from common.plotting import use_chinese_font  # noqa: E402
from common.prompts import CHAPTER_PROMPTS  # noqa: E402
from step02_sampling.sampler import apply_temperature, apply_top_p  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PREFIX = CHAPTER_PROMPTS[0][1]          # "The three primary colors are"
TEMPERATURES = (0.5, 1.0, 1.5)
TOP_P = 0.9
SHOW = 12                               # 左图画概率最高的几个 token


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs/images/02_sampling_temperature_top_p.png"))
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)

    s = open_session(args.model, "cpu", "float32")
    ids = s.encode(PREFIX)
    logits = s.full_logits(ids)[-1]                                   # (V,)
    top = logits.topk(SHOW).indices                                   # 按 T=1 的概率排名（温度不改变排名）
    labels = [repr(s.tok.decode([int(t)])) for t in top]

    use_chinese_font()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(TEMPERATURES)
    print(f"prefix {PREFIX!r}, top-p {TOP_P}")
    for i, temp in enumerate(TEMPERATURES):
        probs = apply_temperature(logits, temp).softmax(-1)           # (V,)
        kept = int((apply_top_p(apply_temperature(logits, temp), TOP_P) > float("-inf")).sum())
        ranked = probs.sort(descending=True).values.cumsum(-1)       # (V,)：按概率排序后的累计概率
        left.bar([x + (i - 1) * width for x in range(SHOW)], probs[top].tolist(), width, label=f"T={temp}")
        right.plot(range(1, len(ranked) + 1), ranked.tolist(), label=f"T={temp}：top-p {TOP_P} 留下 {kept} 个 token")
        right.axvline(kept, color=right.lines[-1].get_color(), linestyle=":", linewidth=1)
        print(f"T={temp}: max prob {float(probs.max()):.3f}, top-{SHOW} mass {float(probs[top].sum()):.3f}, "
              f"top-p {TOP_P} keeps {kept} of {len(probs)} tokens")

    left.set_xticks(range(SHOW), labels, rotation=60, ha="right")
    left.set_xlabel(f"T = 1 时概率最高的 {SHOW} 个 token（按概率排序）")
    left.set_ylabel("概率")
    left.set_title(f"{PREFIX!r} 之后的下一个 token：温度越高，分布越平")
    left.legend()
    right.axhline(TOP_P, color="gray", linestyle="--", linewidth=1)
    right.set_xscale("log")
    right.set_xlabel("按概率从大到小排序后的名次（对数刻度）")
    right.set_ylabel("累计概率")
    right.set_title(f"top-p = {TOP_P}：温度越高，留下的 token 越多")
    right.legend(loc="lower right")
    fig.suptitle(f"{s.path.name} 的真实下一 token 分布", fontsize=10)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
