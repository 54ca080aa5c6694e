"""章节里指向代码行的链接（`file.py#L12-L20`）在代码移动后不会悄悄指错地方。

约定（写在链接文字里，读者也看得到）：每个行号链接的文字里有一个反引号代码片段，它必须从所指范围的**第一行**
开始（范围开头的装饰器、注释行可以先跳过；片段可以延续到后面几行；空白按一个空格比较；`…` 表示中间省略任意内容）：

    [`generate`（engine.py 第 N–M 行）](../step01_naive/engine.py#LN-LM)      第 N 行是 def generate(（或它的装饰器）
    [`tok = sample(…)`，第 N 行](../step02_sampling/engine.py#LN)             第 N 行含 tok = sample(
    [`Transformer.forward`（第 N–M 行）](../common/model.py#LN-LM)            `A.b`：第一行有 b，且 A 是 b 所在的类或模块名

文件名样子的片段（`engine.py`）不算。正文里不带链接的"第 N 行"不允许：读者没法点过去，代码移动时也没人发现。
代码移动了：改行号（必要时也改片段）；这个测试列出所有对不上的链接。另有一个测试检查相对链接指向的文件都还在。
"""
import json
import re
from pathlib import Path

from conftest import ROOT

DOCS = sorted(p for pattern in ("README.md", "docs/*.md", "docs/notebooks/*.md", "step*/README.md")
              for p in ROOT.glob(pattern))
NOTEBOOKS = sorted(ROOT.glob("docs/notebooks/*.ipynb"))

TARGET = re.compile(r"\]\((?P<path>[^)\s#]+)#L(?P<a>\d+)(?:-L(?P<b>\d+))?\)")
LINE_REF = re.compile(r"第\s*\d+\s*(?:[–-]\s*\d+\s*)?行")
FILE_NAME = re.compile(r"^[\w./-]+\.(?:py|md|json|ipynb)$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")


def sources() -> list[tuple[Path, str]]:
    """(文件, Markdown 文本)：各 .md 文件，加上 notebook 的 markdown 单元格。"""
    out = [(p, p.read_text(encoding="utf-8")) for p in DOCS]
    for nb in NOTEBOOKS:
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        out.append((nb, "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")))
    return out


def link_text(text: str, close: int) -> tuple[int, str]:
    """text[close] 是链接文字的 `]`：往回找配对的 `[`（链接文字里可以有成对的方括号）。返回 ([ 的位置, 链接文字)。"""
    depth = 0
    for i in range(close, -1, -1):
        depth += {"]": 1, "[": -1}.get(text[i], 0)
        if depth == 0:
            return i, text[i + 1:close]
    raise ValueError(f"unbalanced link text before offset {close}")


def squash(s: str) -> str:
    return " ".join(s.split())


def anchors():
    """每个行号链接：(出处 "doc:行", 链接文字, 目标文件, 起始行, 结束行, 链接文字在正文里的区间)。"""
    for doc, text in sources():
        for m in TARGET.finditer(text):
            start, label = link_text(text, m.start())
            where = f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            a = int(m["a"])
            yield where, label, (doc.parent / m["path"]).resolve(), a, int(m["b"] or a), (start, m.end())


def snippet_of(label: str) -> str | None:
    spans = [s for s in re.findall(r"`([^`]+)`", label) if not FILE_NAME.match(s)]
    return re.sub(r"^(\w+)\(\)$", r"\1", spans[0]) if spans else None   # `forward()` 按 `forward` 找


def enclosing_class(lines: list[str], a: int) -> str | None:
    """第 a 行（从 1 数）往上最近的顶层 `class X`。"""
    for line in reversed(lines[:a]):
        m = re.match(r"class (\w+)", line)
        if m:
            return m[1]
    return None


def head_end(lines: list[str], a: int, b: int) -> int:
    """范围开头的装饰器、注释之后的第一行（从 1 数）：片段从它或它之前开始都算"在第一行"。空行不跳过。"""
    for i in range(a, b + 1):
        if not lines[i - 1].strip().startswith(("@", "#")):
            return i
    return b


def problem(label: str, path: Path, a: int, b: int) -> str | None:
    """这个链接对不上时返回原因，对得上返回 None。"""
    if not path.is_file() or ROOT not in path.parents:
        return f"{path} is not a file in the repository"
    lines = path.read_text(encoding="utf-8").splitlines()
    if not 1 <= a <= b <= len(lines):
        return f"lines {a}-{b} are outside {path.name} ({len(lines)} lines)"
    snippet = snippet_of(label)
    if snippet is None:
        return "no `snippet` in the link text"
    first = squash(lines[a - 1])
    if DOTTED.match(snippet):
        first = squash(" ".join(lines[a - 1:head_end(lines, a, b)]))
        owner, name = snippet.rsplit(".", 1)
        if not re.search(rf"\b{re.escape(name)}\b", first):
            return f"`{name}` is not on line {a}: {first!r}"
        if owner not in (path.stem, enclosing_class(lines, a)):
            return f"line {a} is not inside class {owner} (nor is {owner} the module name)"
        return None
    body = squash(" ".join(lines[a - 1:b]))
    pieces = [squash(p) for p in snippet.split("…")]
    pos = body.find(pieces[0])
    if not first or not 0 <= pos < len(squash(" ".join(lines[a - 1:head_end(lines, a, b)]))):
        return f"`{pieces[0]}` does not start on line {a}: {first!r}"
    pos += len(pieces[0])
    for piece in pieces[1:]:
        pos = body.find(piece, pos)
        if pos < 0:
            return f"`{piece}` is not in lines {a}-{b}"
        pos += len(piece)
    return None


def test_anchors_are_found():
    """正则确实找到了链接（否则下面的测试会空过）。"""
    assert sum(1 for _ in anchors()) > 50


def test_every_line_anchor_names_a_snippet_on_its_lines():
    bad = [f"{where}  [{squash(label)}] -> {path.relative_to(ROOT) if ROOT in path.parents else path}#L{a}-L{b}: {why}"
           for where, label, path, a, b, _ in anchors() if (why := problem(label, path, a, b))]
    assert not bad, ("line anchors that do not match the code (each `file#Lx-Ly` link needs a `snippet` in its text "
                     "that starts on line x; see this file's docstring):\n" + "\n".join(bad))


def test_line_numbers_only_in_anchored_links():
    """"第 N 行"只能出现在带 #L 锚点的链接文字里。"""
    linked = {}
    for where, _, _, _, _, span in anchors():
        linked.setdefault(where.split(":")[0], []).append(span)
    bad = []
    for doc, text in sources():
        spans = linked.get(str(doc.relative_to(ROOT)), [])
        for m in LINE_REF.finditer(text):
            if not any(s <= m.start() < e for s, e in spans):
                bad.append(f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m[0]}")
    assert not bad, "line numbers outside a `file#Lx-Ly` link:\n" + "\n".join(bad)


def test_relative_links_point_at_existing_files():
    """链接到仓库里文件的相对链接（带不带 #锚点都算）：文件必须还在（删掉或改名的文件会留下死链接）。"""
    bad = []
    for doc, text in sources():
        text = re.sub(r"`[^`]*`", lambda c: " " * len(c[0]), text)   # 代码片段里的 `](…)` 不是链接
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m[1].split("#")[0]
            if not target or re.match(r"^[a-z]+:", target):         # 页内锚点、http(s):、mailto:
                continue
            if not (doc.parent / target).exists():
                bad.append(f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m[1]}")
    assert not bad, "links to files that do not exist:\n" + "\n".join(bad)


def test_checker_catches_moved_code(tmp_path):
    """检查本身能失败：代码下移一行、片段不在第一行、类不对，都会被报告。"""
    f = ROOT / "common" / "model.py"
    lines = f.read_text(encoding="utf-8").splitlines()
    a = next(i for i, line in enumerate(lines, 1) if line.startswith("class Transformer"))
    fwd = next(i for i in range(a, len(lines) + 1) if "def forward" in lines[i - 1])
    assert problem("`Transformer`", f, a, a + 3) is None
    assert problem("`Transformer`", f, a + 1, a + 3) is not None           # 指到了下一行
    assert problem("`Transformer.forward`", f, fwd, fwd + 2) is None
    assert problem("`RMSNorm.forward`", f, fwd, fwd + 2) is not None       # 同名方法，但不在这个类里
    assert problem("`model.Transformer`", f, a, a) is None                 # 模块名也行
    assert problem("`class …Module`", f, a, a) is None
    assert problem("`class …nothing`", f, a, a) is not None
    assert problem("第 1 行", f, 1, 1) is not None                          # 没有片段
    assert problem("`x`", f, len(lines) + 1, len(lines) + 1) is not None   # 超出文件
