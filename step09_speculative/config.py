"""step09 引擎的配置：EngineConfig（run.py 的命令行参数由带 help 的字段生成，common/cli.py）与它的检查，
以及不给 --num-blocks 时按 KV 预算换算块数。engine.py 只管循环。"""
from dataclasses import dataclass, field
from typing import Optional

import torch

from common.errors import UserError

from .kv_cache import ATTENTION_CHOICES, PagedKVCache
from .quant import KV_DTYPE_CHOICES, kv_format

DEFAULT_KV_MIB = 256               # 不给 --num-blocks 时，池子按这么大的 KV 预算换算块数
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256   # 一次前向最多算多少个 token（取值见 docs/07 的预算扫描）
PREEMPT_CHOICES = ("recompute", "swap")
SPEC_METHODS = ("none", "ngram", "draft")


@dataclass
class EngineConfig:
    # 带 help 的字段是 run.py 的命令行参数（common/cli.py 的 add_config_args 按 metadata 生成）
    num_blocks: int = field(metadata={
        "group": "分页与调度",
        "help": f"池子的块数；默认按 {DEFAULT_KV_MIB} MiB 的 KV 预算换算（SmolLM2 float32、块大小 16 时为 364 块）"})
    block_size: int = field(default=16, metadata={"group": "分页与调度", "help": "每块多少个 token（默认 16，同 vLLM）"})
    max_batch_size: int = field(default=8, metadata={"group": "分页与调度", "help": "运行集合最多几个请求（默认 8）"})
    max_num_batched_tokens: int = field(   # 一次前向的 token 预算（vLLM 的同名参数）
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        metadata={"group": "分块 prefill", "help": "一次前向最多算多少个 token（decode 各 1 个，剩下的给 prefill 的块；"
                                                   f"默认 {DEFAULT_MAX_NUM_BATCHED_TOKENS}），不能小于 --max-batch-size"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "group": "前缀缓存", "flag": "--no-prefix-cache",
        "help": "关掉前缀缓存（同样的输出；再加 --no-chunked-prefill 就是 step05 的引擎：同样的前向次数）"})
    kv_dtype: Optional[str] = field(   # None = 模型的 dtype（精确）；"int8" / "fp8" / 另一种浮点
        default=None, metadata={"group": "KV 量化与换出", "choices": KV_DTYPE_CHOICES,
                                "help": "KV 池子的存法（默认：模型的 dtype，精确）；int8 / fp8 每个 (token, 头) 一个 scale"})
    preempt: str = field(default="recompute", metadata={   # "swap"：抢占时换出到第二层
        "group": "KV 量化与换出", "choices": PREEMPT_CHOICES,
        "help": "池子满了怎么让出块：recompute（扔掉 KV、之后重算）或 swap（换出到 CPU 内存、之后换回）"})
    swap_blocks: Optional[int] = None   # 第二层的块数；None = 与池子一样多
    attention: str = field(default="paged", metadata={   # 读池子的注意力
        "group": "分页与调度", "choices": ATTENTION_CHOICES,
        "help": "读 KV 池子的注意力：paged（默认）按块表直接读、不拷贝；gather 先按块表拷成连续的再算（可读的参考）"})
    spec_method: str = field(default="none", metadata={   # LLMEngine 的 draft_model 是草稿模型
        "group": "投机解码", "choices": SPEC_METHODS,
        "help": "谁来猜：ngram（prompt lookup，run.py 的默认）、draft（草稿模型）、none（不猜 = step08，EngineConfig 的默认）"})
    num_spec_tokens: int = field(default=4, metadata={   # vLLM 的 num_speculative_tokens
        "group": "投机解码", "help": "每步每个请求至多猜几个 token"})
    ngram_min: int = field(default=2, metadata={   # n-gram 长度范围：vLLM 的 prompt_lookup_min / max
        "group": "投机解码", "help": "prompt lookup 匹配的最短 n-gram"})
    ngram_max: int = field(default=4, metadata={"group": "投机解码", "help": "prompt lookup 先试的最长 n-gram"})

    def validate(self) -> None:
        for name in ("num_blocks", "block_size", "max_batch_size", "max_num_batched_tokens"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0):
                raise UserError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.attention not in ATTENTION_CHOICES:
            raise UserError(f"unknown --attention {self.attention!r} (choose from {', '.join(ATTENTION_CHOICES)})")
        if self.max_num_batched_tokens < self.max_batch_size:   # 否则批满时这一步连每个 decode 一个 token 都给不起
            raise UserError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                            f"--max-batch-size ({self.max_batch_size})")
        if self.preempt not in PREEMPT_CHOICES:
            raise UserError(f"unknown --preempt {self.preempt!r} (choose from {', '.join(PREEMPT_CHOICES)})")
        if self.swap_blocks is not None and not (isinstance(self.swap_blocks, int) and self.swap_blocks > 0):
            raise UserError(f"swap_blocks must be a positive integer, got {self.swap_blocks!r}")
        if self.spec_method not in SPEC_METHODS:
            raise UserError(f"unknown --spec-method {self.spec_method!r} (choose from {', '.join(SPEC_METHODS)})")
        if not (isinstance(self.num_spec_tokens, int) and self.num_spec_tokens >= 1):
            raise UserError(f"--num-spec-tokens must be an integer >= 1, got {self.num_spec_tokens!r}")
        if not (isinstance(self.ngram_min, int) and isinstance(self.ngram_max, int) and 1 <= self.ngram_min <= self.ngram_max):
            raise UserError(f"need 1 <= --ngram-min <= --ngram-max, got {self.ngram_min!r} and {self.ngram_max!r}")


def num_blocks_for_budget(cfg, block_size: int, dtype: torch.dtype, mib: float = DEFAULT_KV_MIB,
                          kv_dtype: Optional[str] = None) -> int:
    """同样的 MiB 预算能放几块：每 token 字节越少（量化），块越多。"""
    return int(mib * 2**20 // PagedKVCache.bytes_per_block(cfg, block_size, dtype, kv_format(kv_dtype, dtype)))
