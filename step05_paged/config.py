"""step05 引擎的配置：EngineConfig（run.py 的命令行参数由带 help 的字段生成，common/cli.py）与它的检查，
以及不给 --num-blocks 时按 KV 预算换算块数。engine.py 只管循环。"""
from dataclasses import dataclass, field

import torch

from common.errors import UserError

from .kv_cache import ATTENTION_CHOICES, PagedKVCache

DEFAULT_KV_MIB = 256               # 不给 --num-blocks 时，池子按这么大的 KV 预算换算块数


@dataclass
class EngineConfig:
    # 带 help 的字段是 run.py 的命令行参数（common/cli.py 的 add_config_args 按 metadata 生成）
    num_blocks: int = field(metadata={
        "group": "分页与调度",
        "help": f"池子的块数；默认按 {DEFAULT_KV_MIB} MiB 的 KV 预算换算（SmolLM2 float32、块大小 16 时为 364 块）"})
    block_size: int = field(default=16, metadata={"group": "分页与调度", "help": "每块多少个 token（默认 16，同 vLLM）"})
    max_batch_size: int = field(default=8, metadata={"group": "分页与调度", "help": "运行集合最多几个请求（默认 8）"})
    max_prefill_tokens: int = 2048   # 一次 prefill 前向最多 B × L 个 token 位置（限制 CPU 上的峰值内存和单步延迟）
    attention: str = field(default="paged", metadata={   # 读池子的注意力
        "group": "分页与调度", "choices": ATTENTION_CHOICES,
        "help": "读 KV 池子的注意力：paged（默认）按块表直接读、不拷贝；gather 先按块表拷成连续的再算（可读的参考）"})

    def validate(self) -> None:
        for name in ("num_blocks", "block_size", "max_batch_size", "max_prefill_tokens"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0):
                raise UserError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.attention not in ATTENTION_CHOICES:
            raise UserError(f"unknown --attention {self.attention!r} (choose from {', '.join(ATTENTION_CHOICES)})")


def num_blocks_for_budget(cfg, block_size: int, dtype: torch.dtype, mib: int = DEFAULT_KV_MIB) -> int:
    return mib * 2**20 // PagedKVCache.bytes_per_block(cfg, block_size, dtype)
