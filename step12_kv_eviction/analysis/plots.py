"""step12 章节模式的两张图：NLL 随位置（StreamingLLM 的那张图，在我们的模型上），与每个请求持有的 KV 块随已处理的 token。"""
from .texts import moving_average


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.plotting import use_chinese_font
    use_chinese_font()
    return plt


def plot_nll(path, runs: dict, width: int, trained: int, chunk: int, source: str) -> None:
    """runs：{label: Run}；每条线是以该位置结尾的 width 个 token 的平均 NLL。虚线：模型训练过的长度。"""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.6))
    for label, run in runs.items():
        nll = run.nll
        ax.plot(range(1, len(nll) + 1), moving_average(nll, width), lw=1.0 if label != "full" else 1.6,
                label=label, color="black" if label == "full" else None)
    n = max(len(r.nll) for r in runs.values()) + 1
    if trained < n:
        ax.axvline(trained, ls="--", color="gray", lw=0.8)
        ax.text(trained, ax.get_ylim()[1], f" 训练长度 {trained}", va="top", fontsize=8, color="gray")
    ax.set_yscale("log")
    ax.set_xlabel(f"文本中的位置（token）；整段当一个提示词，每次前向 {chunk} 个 token")
    ax.set_ylabel(f"NLL（nat/token，{width} 个 token 的滑动平均，对数轴）")
    ax.set_title(f"逐位置 NLL：{source}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_blocks(path, runs: dict, block_size: int, bytes_per_token: float) -> None:
    """每次前向之后这个请求持有几块（左轴）与多少 MiB（右轴），横轴是已经算过的 token。
    full 画两条：持有的块（step09 的做法：接纳时就分好整个提示词的块）与其中已经写了 K/V 的块（随长度一直长）；
    驱逐的设置预算相同时各条线重合，只画出来、在图例里列名字。"""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for label, run in runs.items():
        xs = [0] + [c for c, _, _ in run.trace]
        ys = [0] + [b for _, b, _ in run.trace]
        if label == "full":
            ax.step(xs, ys, where="post", lw=1.6, color="black", ls="--", label="full：持有的块（接纳时分好整个提示词）")
            ax.step(xs, [-(-c // block_size) for c in xs], where="post", lw=1.6, color="black",
                    label="full：已写入 K/V 的块")
        else:
            ax.step(xs, ys, where="post", lw=1.0, label=label)
    ax.set_xlabel("已经算过的 token（提示词 + 生成）")
    ax.set_ylabel(f"这个请求的 KV 块（每块 {block_size} token）")
    right = ax.twinx()
    lo, hi = ax.get_ylim()
    right.set_ylim(lo * block_size * bytes_per_token / 2**20, hi * block_size * bytes_per_token / 2**20)
    right.set_ylabel("MiB")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    ax.set_title("每次前向（及压缩）之后：驱逐的请求持有的块不再随长度增长", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
