"""无界面执行 docs/notebooks/ 里的每个 notebook（QUICK 模式），任何一个单元格报错就失败。

- 执行的是读进内存的副本：提交的 notebook（输出已清空）不会被改写；
- 当前目录 = notebook 所在目录（与在 Jupyter 里打开时相同）；
- 图写到临时目录（NOTEBOOK_IMAGES），QUICK 模式的图不覆盖 docs/images/ 里的正式图；
  并检查 notebook 里每个 save(fig, "名字.png") 都真的写出了文件。
单独运行：  python -m pytest -q tests/test_notebooks.py
"""
import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "docs" / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = int(os.environ.get("NOTEBOOK_TIMEOUT", "900"))   # 每个单元格的上限（秒）：2 核机器很忙时也留足余量


def test_notebooks_exist():
    assert NOTEBOOKS, "docs/notebooks/ has no notebooks"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "clear outputs before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, tmp_path, monkeypatch):
    monkeypatch.setenv("NOTEBOOK_QUICK", "1")              # 内核进程继承这些环境变量
    monkeypatch.setenv("NOTEBOOK_IMAGES", str(tmp_path))
    # QUICK 只验证 notebook 能跑通，不看计时：默认单线程。2 核机器上还有别的进程在跑时，PyTorch 的两个线程互相
    # 等待（超订），同样的 notebook 会慢上十倍；已经设置了 OMP_NUM_THREADS 的话尊重它
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, startup_timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()   # 单元格出错时抛 CellExecutionError（带出错的单元格和 traceback），测试失败
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    figures = re.findall(r'save\(fig, "([^"]+\.png)"\)', source)
    assert figures, "notebook saves no figure"
    missing = [f for f in figures if not (tmp_path / f).is_file()]
    assert not missing, f"figures not written: {missing}"
