"""第 02 章的小算例：5 个 token 的玩具 logits，逐个策略用 sampler.py 里的真实函数算出来，打印成 Markdown 表。

    python step02_sampling/worked_example.py

章节 docs/02_sampling.md 里的表格就是这个脚本的输出（tests/test_step02_sampling.py 检查两者一致）。
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from step02_sampling.sampler import (apply_min_p, apply_repetition_penalty, apply_temperature,  # noqa: E402
                                     apply_top_k, apply_top_p)

TOKENS = ["猫", "狗", "鱼", "鸟", "车"]
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])   # (V=5,)：已按从大到小排好，方便看
HISTORY = [1, 4]                                     # 重复惩罚的例子："狗" 和 "车" 已经出现过


def fmt(x: torch.Tensor) -> list[str]:
    return [f"{float(v):.3f}" if v != float("-inf") else "-inf" for v in x]


def row(label: str, values: list[str]) -> str:
    return "| " + " | ".join([label] + values) + " |"


def tables() -> list[list[str]]:
    header = row("", TOKENS)
    rule = "|" + "---|" * (len(TOKENS) + 1)
    out = []

    # 1) softmax 与温度
    t = [header, rule, row("logit z", fmt(LOGITS))]
    for temp in (0.5, 1.0, 2.0):
        t.append(row(f"p, T={temp}", fmt(apply_temperature(LOGITS, temp).softmax(-1))))
    out.append(t)

    # 2) top-k / top-p / min-p（都在 T=1 上）：过滤后的 logit 与重新归一化的概率
    t = [header, rule, row("p（不过滤）", fmt(LOGITS.softmax(-1)))]
    cum = LOGITS.softmax(-1).cumsum(-1)
    t.append(row("累计概率", fmt(cum)))
    for label, filtered in (("top-k=2", apply_top_k(LOGITS, 2)),
                            ("top-p=0.8", apply_top_p(LOGITS, 0.8)),
                            ("min-p=0.1", apply_min_p(LOGITS, 0.1)),
                            ("T=0.5 再 min-p=0.1", apply_min_p(apply_temperature(LOGITS, 0.5), 0.1))):
        t.append(row(f"p, {label}", fmt(filtered.softmax(-1))))
    out.append(t)

    # 3) 重复惩罚 r=1.5：history 里的 "狗"（正 logit）除以 r，"车"（负 logit）乘以 r
    t = [header, rule, row("logit z", fmt(LOGITS))]
    pen = apply_repetition_penalty(LOGITS, HISTORY, 1.5)
    t.append(row("z, r=1.5", fmt(pen)))
    t.append(row("p, r=1.5", fmt(pen.softmax(-1))))
    out.append(t)
    return out


if __name__ == "__main__":
    for t in tables():
        print("\n".join(t) + "\n")
