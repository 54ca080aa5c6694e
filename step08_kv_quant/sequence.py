"""step08 的请求状态：step06 的 Sequence 加一项——被换出时，它的块在第二层的哪里。"""
from dataclasses import dataclass
from typing import Optional

from step06_prefix_cache.sequence import Sequence as PrefixSequence

from .swap import SwapHandle


@dataclass(eq=False)   # 与 step05 相同：按对象区分
class Sequence(PrefixSequence):
    # >>> step08 新增
    swap_handle: Optional[SwapHandle] = None   # 不为 None = 被换出了：前 num_cached_tokens 个 token 的 K/V 在第二层
    num_swaps: int = 0                         # 被换出过几次
    # <<<
