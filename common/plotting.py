"""画图的共用设置：中文字体。

matplotlib 自带的字体没有中文字形，中文标签会变成方框。PyPI 包 `mplfonts` 带着 Noto Sans CJK SC 字体文件，
把这个文件注册到 matplotlib 的字体管理器、设为默认字体就够了（不需要系统里装字体，也不联网）。
"""
from pathlib import Path

import matplotlib
from matplotlib import font_manager

FONT_FILE = "NotoSansCJKsc-Regular.otf"


def use_chinese_font() -> str:
    """注册 mplfonts 里的 Noto Sans CJK SC 并设为默认字体，返回字体名。画任何带中文的图之前调用一次。"""
    import mplfonts  # 只用它带的字体文件

    path = Path(mplfonts.__file__).parent / "fonts" / FONT_FILE
    font_manager.fontManager.addfont(str(path))
    name = font_manager.FontProperties(fname=str(path)).get_name()
    matplotlib.rcParams["font.family"] = "sans-serif"
    matplotlib.rcParams["font.sans-serif"] = [name, "DejaVu Sans"]
    matplotlib.rcParams["axes.unicode_minus"] = False  # CJK 字体里没有 Unicode 减号，用 ASCII 的 "-"
    return name
