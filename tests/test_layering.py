"""分层：common/ 是地基，不 import 任何一步（也不 import 各步之上的 perf/、bench/、step11 的服务器）。

按语法树查每个 common/*.py 的每一条 import（包括函数里面的：在函数里 import 只是把循环藏起来）。
"""
import ast
import re

from conftest import ROOT

ABOVE_COMMON = re.compile(r"^(step\d\d_\w+|perf|bench)$")   # 顶层包名：各步，以及各步之上的层


def imported_packages(path) -> list[tuple[int, str]]:
    """(行号, 顶层包名)：import X.Y、from X.Y import Z（相对 import 留在 common 里，不算）。"""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def test_common_imports_no_step():
    files = sorted((ROOT / "common").glob("*.py"))
    assert files
    bad = [f"common/{p.name}:{line} imports {pkg}" for p in files for line, pkg in imported_packages(p)
           if ABOVE_COMMON.match(pkg)]
    assert not bad, "common/ must not depend on a step or a layer above the steps:\n" + "\n".join(bad)



def test_chapter_py_does_not_import_run_py():
    """run.py 调用 chapter.py（章节模式）；反过来 chapter.py 要 run.py 的东西（engine_for）时由 run.py 传进去，
    两个文件不互相 import。"""
    bad = []
    for p in sorted(ROOT.glob("step*/chapter.py")) + sorted(ROOT.glob("step*/analysis/*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{p.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if re.fullmatch(r"step\d\d_\w+\.run", n)]
    assert not bad, "\n".join(bad)


def test_reference_simulation_imports_no_engine_module():
    """step12 的 reference.py 是检查引擎的对照（掩码模拟）：与引擎共用一段代码，那一段的 bug 两边一起错、查不出来。
    所以它不 import 任何一步的任何模块（相对 import 也不行：同一个文件夹里都是引擎），只用 common/ 与 torch。"""
    path = ROOT / "step12_kv_eviction" / "reference.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    relative = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0]
    bad = [f"line {line} imports {pkg}" for line, pkg in imported_packages(path) if re.match(r"step\d\d_", pkg)]
    bad += [f"line {line}: relative import" for line in relative]
    assert not bad, "reference.py must not import engine code:\n" + "\n".join(bad)
