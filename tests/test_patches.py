"""docs/patches/NN-MM.diff 与各步文件夹一致（make patches 生成）；step05 起每一步的引擎自成一体。

diff 是这一步的课：改了某一步的文件却没重新生成 diff、两步共有的文件改了却不在 diff 里，或者一处修正只改了
一份拷贝，这里就失败。
"""
import ast
import importlib.util

from conftest import ROOT

spec = importlib.util.spec_from_file_location("make_patches", ROOT / "docs/patches/make_patches.py")
make_patches = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_patches)


def test_committed_patches_match_the_step_folders():
    expected = make_patches.patches()
    assert [p.name for p in expected][:3] == ["05-06.diff", "06-07.diff", "07-08.diff"]
    assert {"09-10.diff", "09-12.diff", "09-15.diff"} <= {p.name for p in expected}   # step12、step15 从 step09 出发（BASE）
    stale = [p.name for p, text in expected.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    assert not stale, f"docs/patches out of date: {stale} — run `make patches`"
    committed = sorted(p.name for p in make_patches.OUT.glob("*.diff"))
    assert committed == sorted(p.name for p in expected), "a .diff for a step pair that no longer exists"


def test_every_shared_file_that_differs_is_in_the_patch():
    """相邻两步都有的 .py（run.py、chapter.py 除外：各步的命令行与章节脚本各讲各的）只要内容不同，就必须出现在
    提交的 diff 里：这一步对它的改动、或者一处只改了一份拷贝的修正，都藏不起来。这里自己列文件，不信 make_patches 的清单。"""
    s = make_patches.steps()
    assert len(s) >= 6
    for a, b in make_patches.pairs():
        path = make_patches.OUT / f"{a.name[4:6]}-{b.name[4:6]}.diff"
        text = path.read_text(encoding="utf-8")
        for old in sorted(a.glob("*.py")):
            new = b / old.name
            if old.name in ("run.py", "chapter.py") or not new.exists() or old.read_bytes() == new.read_bytes():
                continue
            assert f"--- {a.name}/{old.name}\n+++ {b.name}/{old.name}\n" in text, (
                f"{b.name}/{old.name} differs from {a.name}'s copy but {path.name} does not show it")


def imports(path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_each_engine_folder_reads_alone():
    """引擎文件只从 common/、step02 的采样器、step04 的 Request 与左填充掩码（batch.py）、step05 的注意力内核
    （paged_attention.py，像 step02 的采样器一样是做好的积木）和自己的文件夹导入；不导入更早一步的引擎、调度器、
    缓存，也不提到后面的步骤（没有为后面的步骤留的钩子）。"""
    allowed = {"step02_sampling.sampler", "step04_static_batching.request", "step04_static_batching.batch",
               "step05_paged.paged_attention"}
    for step in make_patches.steps():
        n = int(step.name[4:6])
        for name in make_patches.ENGINE_FILES + tuple(p.name for p in step.glob("*.py")
                                                      if p.name not in ("run.py", "chapter.py", "__init__.py")):
            path = step / name
            bad = {m for m in imports(path) if m.startswith("step") and m not in allowed}
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
            later = [f"step{k:02d}" for k in range(n + 1, 12)]
            text = path.read_text(encoding="utf-8")
            assert not any(s in text for s in later), f"{path.relative_to(ROOT)} mentions a later step"
