"""step06 的请求状态：step05 的 Sequence 加两项前缀缓存的账目。"""
from dataclasses import dataclass
from typing import Optional

from step05_paged.sequence import Sequence as PagedSequence


@dataclass(eq=False)   # 与 step05 相同：按对象区分
class Sequence(PagedSequence):
    # >>> step06 新增
    num_registered_blocks: int = 0        # 块表开头已经交给前缀缓存登记过（或本来就是命中得来）的满块数
    cached_tokens: Optional[int] = None   # 第一次被接纳时，提示词里有多少 token 直接用了缓存（None = 还没被接纳过）
    # <<<
