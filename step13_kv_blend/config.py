"""step13 引擎的配置：EngineConfig（run.py 的命令行参数由带 help 的字段生成，common/cli.py）与它的检查，
以及不给 --num-blocks 时按 KV 预算换算块数。engine.py 只管循环。"""
from dataclasses import dataclass, field
from typing import Optional

import torch

from common.errors import UserError

from .blend import ALL_MODES, BLEND_MODES, DEVIATIONS, check_ratio
from .kv_cache import ATTENTION_CHOICES, PagedKVCache
from .quant import KV_DTYPE_CHOICES, kv_format

DEFAULT_KV_MIB = 256               # 不给 --num-blocks 时，池子按这么大的 KV 预算换算块数
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256   # 一次前向最多算多少个 token（取值见 docs/07 的预算扫描）
PREEMPT_CHOICES = ("recompute", "swap")
SPEC_METHODS = ("none", "ngram", "draft")
DEFAULT_RECOMPUTE_RATIO = 0.15   # CacheBlend / LMCache 的默认（LMCACHE_BLEND_RECOMPUTE_RATIOS=0.15）
KV_POLICIES = ("full", "window", "sinks", "h2o", "snapkv", "snapkv-chunked")
SCORED_POLICIES = ("h2o", "snapkv", "snapkv-chunked")   # 按注意力分数挑的：要打分，不查前缀缓存（engine.py）
KV_POSITIONS = ("cache", "text")
DEFAULT_NUM_SINKS = 4            # StreamingLLM：4 个开头的 token 就够接住多余的注意力
DEFAULT_SNAPKV_WINDOW = 32       # SnapKV 的观察窗口（论文与参考代码的默认）
# SnapKV 投票的池化：参考代码的默认是核 5 的平均池化（snapkv_utils.py 的 init_snapkv），论文的 LongBench 结果用的是
# 核 7 的最大池化（experiments/LongBench 的 ablation_c4096_w32_k7_maxpool.json）。我们跟 LongBench 的配置：论文报告的
# 数字出自它；也只实现最大池化（一个高票 token 把邻居带上，票本身不被摊薄）
DEFAULT_SNAPKV_POOL = 7


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
    preempt: Optional[str] = field(default=None, metadata={   # None：有驱逐时 swap，否则 recompute（LLMEngine 定）
        "group": "KV 量化与换出", "choices": PREEMPT_CHOICES,
        "help": "池子满了怎么让出块：recompute（扔掉 KV、之后重算）或 swap（换出到 CPU 内存、之后换回）；"
                "默认 recompute；有驱逐（--kv-policy 不是 full，或每层都滑动的窗口模型）时默认 swap"})
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
    # step12：KV 驱逐（eviction.py）。full = step09，一个槽也不扔
    kv_policy: str = field(default="full", metadata={
        "group": "KV 驱逐", "choices": KV_POLICIES,
        "help": "每个请求的 KV 留哪些：full（全留 = step09）、window（最近的）、sinks（开头几个 + 最近的，StreamingLLM）、"
                "h2o（累计注意力最多的 + 最近的）、snapkv（整个提示词算完后，最后 w 个提示词 token 投票，压缩一次）、"
                "snapkv-chunked（每块 prefill 之后按那一块最后 w 个 token 的投票压缩：提示词也不超预算）"})
    kv_budget: Optional[int] = field(default=None, metadata={
        "group": "KV 驱逐", "help": "每个请求（每层、每个 KV 头）留多少个 token 的 K/V；full 以外的策略必须给"})
    num_sinks: Optional[int] = field(default=None, metadata={
        "group": "KV 驱逐", "help": f"sinks：开头留几个 token（默认 {DEFAULT_NUM_SINKS}）"})
    kv_positions: Optional[str] = field(default=None, metadata={
        "group": "KV 驱逐", "choices": KV_POSITIONS,
        "help": "RoPE 用的位置：cache（缓存里的槽号，StreamingLLM；window / sinks 的默认）或 text（原文里的位置；h2o / snapkv 的默认）"})
    h2o_recent: Optional[int] = field(default=None, metadata={
        "group": "KV 驱逐", "help": "h2o：预算里留给最近 token 的个数（默认 预算的一半）"})
    snapkv_window: Optional[int] = field(default=None, metadata={
        "group": "KV 驱逐", "help": f"snapkv / snapkv-chunked：观察窗口（最后几个提示词 token 投票，默认 {DEFAULT_SNAPKV_WINDOW}）"})
    snapkv_pool: Optional[int] = field(default=None, metadata={
        "group": "KV 驱逐", "help": f"snapkv / snapkv-chunked：投票的最大池化核（奇数，默认 {DEFAULT_SNAPKV_POOL}）"})
    max_model_len: Optional[int] = field(default=None, metadata={   # vLLM 的名字
        "group": "KV 驱逐", "help": "一个请求最多多少个 token（默认：模型的 max_position_embeddings；可以更大："
                                   "text 位置会超出训练过的范围，cache 位置不会）"})
    # step13：非前缀复用（blend.py）。只作用于标了段的请求
    blend: str = field(default="none", metadata={
        "group": "非前缀复用", "choices": ALL_MODES,
        "help": "标了段（--doc）的请求怎么得到 K/V：none（完整 prefill，精确）、prefix（只用前缀缓存，精确）、"
                "concat（块缓存里各段的 K/V 原样拼上）、reuse（K 转到新位置）、blend（再重算偏差最大的一部分，CacheBlend）"})
    recompute_ratio: Optional[float] = field(default=None, metadata={
        "group": "非前缀复用",
        "help": f"blend：复用的 token 里重算多少比例（0..1，默认 {DEFAULT_RECOMPUTE_RATIO}；0 = reuse，1 = 完整 prefill）"})
    deviation_on: Optional[str] = field(default=None, metadata={
        "group": "非前缀复用", "choices": DEVIATIONS,
        "help": "blend：在检查层比较新算的与复用的哪一个来选重算的 token：k（默认，同 LMCache）或 v（CacheBlend 原始代码）"})

    def validate(self) -> None:
        for name in ("num_blocks", "block_size", "max_batch_size", "max_num_batched_tokens"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0):
                raise UserError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.attention not in ATTENTION_CHOICES:
            raise UserError(f"unknown --attention {self.attention!r} (choose from {', '.join(ATTENTION_CHOICES)})")
        if self.max_num_batched_tokens < self.max_batch_size:   # 否则批满时这一步连每个 decode 一个 token 都给不起
            raise UserError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                            f"--max-batch-size ({self.max_batch_size})")
        if self.preempt is not None and self.preempt not in PREEMPT_CHOICES:
            raise UserError(f"unknown --preempt {self.preempt!r} (choose from {', '.join(PREEMPT_CHOICES)})")
        if self.swap_blocks is not None and not (isinstance(self.swap_blocks, int) and self.swap_blocks > 0):
            raise UserError(f"swap_blocks must be a positive integer, got {self.swap_blocks!r}")
        if self.spec_method not in SPEC_METHODS:
            raise UserError(f"unknown --spec-method {self.spec_method!r} (choose from {', '.join(SPEC_METHODS)})")
        if not (isinstance(self.num_spec_tokens, int) and self.num_spec_tokens >= 1):
            raise UserError(f"--num-spec-tokens must be an integer >= 1, got {self.num_spec_tokens!r}")
        if not (isinstance(self.ngram_min, int) and isinstance(self.ngram_max, int) and 1 <= self.ngram_min <= self.ngram_max):
            raise UserError(f"need 1 <= --ngram-min <= --ngram-max, got {self.ngram_min!r} and {self.ngram_max!r}")
        self._validate_eviction()
        self._validate_blend()

    def _validate_blend(self) -> None:
        """step13：--blend 的取值与它不能同开的东西（模型本身能不能服务在 LLMEngine 里查：blend.check_model）。"""
        b = self.blend
        if b not in ALL_MODES:
            raise UserError(f"unknown --blend {b!r} (choose from {', '.join(ALL_MODES)})")
        if self.recompute_ratio is not None:
            if b != "blend":
                raise UserError(f"--recompute-ratio is only used with --blend blend (got {b})")
            check_ratio(self.recompute_ratio)
        if self.deviation_on is not None:
            if self.deviation_on not in DEVIATIONS:
                raise UserError(f"unknown --deviation-on {self.deviation_on!r} (choose from {', '.join(DEVIATIONS)})")
            if b != "blend":
                raise UserError(f"--deviation-on is only used with --blend blend (got {b})")
        if b == "prefix" and not self.enable_prefix_caching:
            raise UserError("--blend prefix needs the prefix cache (drop --no-prefix-cache)")
        if b in BLEND_MODES and self.kv_policy != "full":   # 拼段的 prefill 一次写满整个提示词，驱逐的分块分配与压缩不管它
            raise UserError(f"--blend {b} cannot be combined with --kv-policy {self.kv_policy} (use --kv-policy full)")
        if b in BLEND_MODES and self.kv_dtype is not None:  # 段的 K 要在池子里转位置：码转不了
            raise UserError(f"--blend {b} needs the model's dtype in the pool (drop --kv-dtype)")

    @property
    def ratio(self) -> float:
        return self.recompute_ratio if self.recompute_ratio is not None else DEFAULT_RECOMPUTE_RATIO

    @property
    def deviation(self) -> str:
        return self.deviation_on if self.deviation_on is not None else "k"

    def _validate_eviction(self) -> None:
        """step12：每个旋钮只属于一个策略；预算至少放得下策略一定要留的 + 一块（否则每次压缩都留不下新 token）。"""
        p = self.kv_policy
        if p not in KV_POLICIES:
            raise UserError(f"unknown --kv-policy {p!r} (choose from {', '.join(KV_POLICIES)})")
        for name in ("kv_budget", "num_sinks", "h2o_recent", "snapkv_window", "snapkv_pool", "max_model_len"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and v > 0):
                raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        snap = ("snapkv", "snapkv-chunked")
        owner = {"num_sinks": ("sinks",), "h2o_recent": ("h2o",), "snapkv_window": snap, "snapkv_pool": snap}
        for name, policies in owner.items():
            if getattr(self, name) is not None and p not in policies:
                raise UserError(f"--{name.replace('_', '-')} is only used with --kv-policy {' / '.join(policies)} (got {p})")
        if self.kv_positions is not None and self.kv_positions not in KV_POSITIONS:
            raise UserError(f"unknown --kv-positions {self.kv_positions!r} (choose from {', '.join(KV_POSITIONS)})")
        if p == "full":
            for name in ("kv_budget", "kv_positions"):
                if getattr(self, name) is not None:
                    raise UserError(f"--{name.replace('_', '-')} needs an evicting --kv-policy (got full)")
            return
        if self.kv_budget is None:
            raise UserError(f"--kv-policy {p} needs --kv-budget TOKENS")
        if self.spec_method != "none":   # 被拒绝的猜测写了槽、给槽打了分，回滚时这些都要撤销
            raise UserError(f"--kv-policy {p} cannot be combined with --spec-method {self.spec_method} "
                            "(use --spec-method none)")
        if self.kv_dtype is not None:    # 打分和压缩都在原精度的池子上做
            raise UserError(f"--kv-policy {p} needs the model's dtype in the pool (drop --kv-dtype)")
        B, bs = self.kv_budget, self.block_size
        if p == "sinks" and B < self.sinks + bs:
            raise UserError(f"--kv-budget ({B}) must be at least --num-sinks ({self.sinks}) + --block-size ({bs})")
        if p in ("window", "h2o") and B < bs:
            raise UserError(f"--kv-budget ({B}) must be at least --block-size ({bs}) for --kv-policy {p}")
        if p == "h2o" and not 1 <= self.recent <= B - 1:
            raise UserError(f"--h2o-recent ({self.recent}) must be between 1 and --kv-budget - 1 ({B - 1})")
        if p == "snapkv" and B < self.obs_window:   # 只压缩一次：观察窗口放得下就行
            raise UserError(f"--kv-budget ({B}) must be at least --snapkv-window ({self.obs_window})")
        if p == "snapkv-chunked" and B < self.obs_window + bs:
            raise UserError(f"--kv-budget ({B}) must be at least --snapkv-window ({self.obs_window}) + "
                            f"--block-size ({bs})")
        if p in snap:
            if self.pool_kernel % 2 == 0:
                raise UserError(f"--snapkv-pool must be odd, got {self.pool_kernel}")

    # 策略旋钮的实际值（没给时的默认）
    @property
    def sinks(self) -> int:
        return self.num_sinks if self.num_sinks is not None else DEFAULT_NUM_SINKS

    @property
    def recent(self) -> int:
        return self.h2o_recent if self.h2o_recent is not None else (self.kv_budget or 0) // 2

    @property
    def obs_window(self) -> int:
        return self.snapkv_window if self.snapkv_window is not None else DEFAULT_SNAPKV_WINDOW

    @property
    def pool_kernel(self) -> int:
        return self.snapkv_pool if self.snapkv_pool is not None else DEFAULT_SNAPKV_POOL

    @property
    def positions(self) -> str:
        """RoPE 的位置：没给时 window / sinks 用缓存里的位置（StreamingLLM），h2o / snapkv 用原文位置（它们的参考代码）。"""
        if self.kv_positions is not None:
            return self.kv_positions
        return "cache" if self.kv_policy in ("window", "sinks") else "text"


def num_blocks_for_budget(cfg, block_size: int, dtype: torch.dtype, mib: float = DEFAULT_KV_MIB,
                          kv_dtype: Optional[str] = None) -> int:
    """同样的 MiB 预算能放几块：每 token 字节越少（量化），块越多。"""
    return int(mib * 2**20 // PagedKVCache.bytes_per_block(cfg, block_size, dtype, kv_format(kv_dtype, dtype)))
