"""生成 docs/patches/NN-MM.diff：相邻两步共有的每个文件的统一 diff（step05 起每一步的引擎是同名的一组文件）。

    python docs/patches/make_patches.py            # 重新生成（make patches）
    python docs/patches/make_patches.py --check    # 只检查：提交的 diff 与现在的文件夹一致吗（tests/test_patches.py）

diff 就是这一步的课：每个文件里只有这一步的概念带来的改动。比较的是两步文件夹里同名的 .py：引擎的六个文件按读的
顺序在前，其余（swap.py、quant.py……）按名字在后；run.py、chapter.py 不比（每一步的命令行与章节脚本各讲各的），
analysis/ 也不比（每章自己的测量脚本：两章的 workload.py 同名，却是两份不同的负载）。一处修正只改了一份拷贝、
没改下一步的，下一份 diff 里就会多出一段，一眼能看见。这一步新加的文件（例如 step08 的 quant.py）不进 diff，列在开头。
一步通常从前一步出发；不是的在 BASE 里写明（step12 从 step09 出发：张量并行与驱逐无关；step15 也从 step09 出发：
结构化输出与并行、驱逐、块复用都无关），diff 就与它配对（09-12、09-15）。
"""
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent
ENGINE_FILES = ("sequence.py", "block_manager.py", "scheduler.py", "kv_cache.py", "config.py", "engine.py")
NOT_COMPARED = ("run.py", "chapter.py")
BASE = {"step12_kv_eviction": "step09_speculative",   # 不是从前一步出发的步骤：文件夹 → 它出发的那一步
        "step15_structured_output": "step09_speculative"}


def steps() -> list[Path]:
    """step05 起、有 engine.py 的步骤文件夹，按编号排好。"""
    return sorted(p.parent for p in ROOT.glob("step*/engine.py") if int(p.parent.name[4:6]) >= 5)


def pairs() -> list[tuple[Path, Path]]:
    """(出发的那一步, 这一步)：通常是前一步，BASE 里写明的除外。"""
    s = steps()
    return [(ROOT / BASE[b.name] if b.name in BASE else a, b) for a, b in zip(s, s[1:])]


def shared(a: Path, b: Path) -> list[str]:
    """两步文件夹里都有的 .py（run.py、chapter.py 除外）：引擎的六个文件按读的顺序在前，其余按名字。"""
    names = {p.name for p in a.glob("*.py")} & {p.name for p in b.glob("*.py")} - set(NOT_COMPARED)
    return [n for n in ENGINE_FILES if n in names] + sorted(names - set(ENGINE_FILES))


def patch(a: Path, b: Path) -> str:
    new = sorted(p.name for p in b.glob("*.py") if not (a / p.name).exists() and p.name not in NOT_COMPARED)
    names = shared(a, b)
    same = [n for n in names if (a / n).read_bytes() == (b / n).read_bytes()]
    changed = [n for n in names if n not in same]
    lines = [f"# {a.name} → {b.name}：两步共有的 .py（{', '.join(NOT_COMPARED)} 除外）的统一 diff，"
             "由 docs/patches/make_patches.py 生成\n",
             f"# 有改动：{', '.join(changed) or '无'}；没有改动：{', '.join(same) or '无'}；"
             f"这一步新加的文件：{', '.join(new) or '无'}\n"]
    for name in names:
        old = (a / name).read_text(encoding="utf-8").splitlines(keepends=True)
        cur = (b / name).read_text(encoding="utf-8").splitlines(keepends=True)
        lines += difflib.unified_diff(old, cur, f"{a.name}/{name}", f"{b.name}/{name}", n=3)
    return "".join(lines)


def patches() -> dict[Path, str]:
    return {OUT / f"{a.name[4:6]}-{b.name[4:6]}.diff": patch(a, b) for a, b in pairs()}


def stat(text: str) -> tuple[int, int]:
    """(+ 行数, − 行数)，不算文件头。"""
    body = [line for line in text.splitlines() if not line.startswith(("+++", "---"))]
    return sum(line.startswith("+") for line in body), sum(line.startswith("-") for line in body)


def main() -> int:
    check = "--check" in sys.argv
    stale = []
    for path, text in patches().items():
        if check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(path.name)
        else:
            path.write_text(text, encoding="utf-8")
            add, rm = stat(text)
            print(f"{path.relative_to(ROOT)}: +{add} −{rm}")
    if stale:
        print(f"error: docs/patches out of date ({', '.join(stale)}): run `make patches`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
