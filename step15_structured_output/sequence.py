"""一个请求在引擎里的运行状态（vLLM / nano-vllm 叫 Sequence），以及引擎每一步交给调用方的 RequestOutput。

Request（step04）只说用户要什么；Sequence 记"做到哪了"：已生成的 token、块表、KV 已进池子的 token 数、
前缀缓存的账、这一轮 prefill 要算到哪（num_prefill_tokens）、状态（含被换出的 SWAPPED）、被抢占的次数，以及计时用的几个时刻（都来自
引擎的时钟）。step09 加的投机解码：decode 中的请求每步可以带几个猜测（spec_token_ids，提议者给出）一起进前向；
猜测不是请求的 token，不在 token_ids 里，验证后被接受的才 append 进来；spec_* 另几项是按请求的接受率账。
logprobs（服务器要的，docs/11）：RequestOutput 带着每个新 token 的 Logprob；请求要了 prompt_logprobs 时，
提示词各位置的 Logprob 跨分块 prefill 攒在 Sequence.prompt_logprobs 里，prefill 算完的那一步一次交出去。
step15 加的结构化输出：有约束的请求带一个 GrammarMatcher（matcher）。append_token 每记下一个 token 就推进它
（采样的、被接受的猜测、jump-forward 强制的都走这里）；匹配器接受了 EOS（结束了）请求就以 "stop" 结束。
"""
import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from step04_static_batching.request import Request

from .swap import SwapHandle
from .token_index import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"     # 在等待队列里：还没有块（新来的，或被抢占后释放了全部块）
    RUNNING = "running"     # 在运行集合里：持有块，每步都参与调度
    SWAPPED = "swapped"     # 被换出：池子里的块已还回去，前 num_computed_tokens 个 token 的 K/V 在第二层
    FINISHED = "finished"   # 生成完毕或被 abort，块已还回去


class Logprob(NamedTuple):
    """一个位置的 logprob：模型的原始分布 log_softmax(logits) 里这个 token 的 log 概率，与最可能的 k 个（engine.token_logprobs）。"""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]   # (token id, logprob)，从大到小


@dataclass
class RequestOutput:
    """step() 的返回值里每个请求一项：这一步新产出的 token、是否结束、为什么结束。"""
    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: Optional[str] = None   # "stop"（EOS 或停止字符串）/ "length"（max_new_tokens）/ "abort"
    num_cached_tokens: int = 0            # 提示词里有几个 token 直接用了前缀缓存
    error: Optional[Exception] = None      # finish_reason 为 "error" 时：这个请求自己的采样或猜测抛出的异常
    logprobs: Optional[list[Logprob]] = None   # 请求要了 logprobs 时：与 new_token_ids 一一对应
    # 请求要了 prompt_logprobs 时，只在 prefill 算完的那一步给一次：提示词每个 token 一项，第 0 个没有前文，是 None
    prompt_logprobs: Optional[list[Optional[Logprob]]] = None


@dataclass(eq=False)   # 运行状态按对象区分：两个请求内容相同也是两个（`in`、list.remove 按身份比较）
class Sequence:
    request_id: int
    request: Request
    generator: torch.Generator    # 每个请求一个，用它自己的 seed：与 step03 单独生成时消耗同一串随机数
    arrival_time: float           # add_request 时的时钟读数（秒）
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: Optional[str] = None
    block_table: list[int] = field(default_factory=list)   # 第 i 个逻辑块 → 物理块号
    num_computed_tokens: int = 0  # 前多少个 token 的 K/V 已经写进池子（vLLM V1 的名字）；其余的下一次前向要算
    num_cached_tokens: Optional[int] = None   # 第一次被接纳时命中前缀缓存的 token 数（None = 还没被接纳过）
    num_registered_blocks: int = 0            # 块表开头已经登记进前缀缓存（或本来就是命中得来）的满块数
    num_preemptions: int = 0
    swap_handle: Optional[SwapHandle] = None   # SWAPPED 时：它的块在第二层的哪里
    num_prefill_tokens: int = field(init=False)   # 这一轮 prefill 要算到第几个 token：提示词长；被抢占重算时是那时的全部 token
    # 计时（秒，引擎时钟的读数）
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    token_times: list[float] = field(default_factory=list)   # 每个输出 token 产出的时刻
    stall_time: float = 0.0       # 已经有输出、却因为这一步在给别人做 prefill 而干等的时间
    # step09：投机解码
    spec_token_ids: list[int] = field(default_factory=list)   # 这一步要验证的猜测（每步开头给出，验证完清空）
    spec_probs: Optional[torch.Tensor] = None   # (len(spec_token_ids), V)：猜测是从哪些分布 q 抽的；None = one-hot
    num_spec_proposed: int = 0    # 一共验证过几个猜测
    num_spec_accepted: int = 0    # 其中被接受的
    spec_recent: list[float] = field(default_factory=list)   # 最近几次验证各自的接受率（按请求关掉投机用）
    spec_paused_steps: int = 0    # > 0：接受率太低，这么多步里不猜（engine.py 的 SPEC_* 常数）
    prompt_logprobs: list[Logprob] = field(default_factory=list)   # 提示词第 1、2…… 个 token 的，按位置攒（prompt_logits）
    # step15：结构化输出
    matcher: Optional[GrammarMatcher] = None   # 有约束的请求：语法走到哪了（随 append_token 推进）
    # 猜测在第 len(spec_token_ids) 个处因不合法被截掉、而那个猜测是从草稿分布 q 抽的：q（(V,)）。验证时它"必然被拒绝"，
    # 最后那个 token 要从 max(p − q, 0) 里抽，分布才与不猜时相同（rejection_sampler.py）；确定性的猜测（q one-hot）为 None
    spec_cut_q: Optional[torch.Tensor] = None
    jump_pending: list[int] = field(default_factory=list)   # add_request 时就强制进 output_ids、还没报告的 token

    def __post_init__(self):
        self.num_prefill_tokens = len(self.request.prompt_ids)

    @property
    def in_prefill(self) -> bool:
        """还在（重新）prefill：K/V 还没算到 num_prefill_tokens。算完的那一步采样出 token，之后是 decode
        （num_computed_tokens = num_tokens − 1：最后一个 token 刚采样出来，还没算）。"""
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def prompt_logits(self) -> range:
        """请求要了 prompt_logprobs 时还要 logits 的提示词位置：位置 p 的 logits 给出第 p+1 个提示词 token 的 logprob，
        所以是 已攒的个数 .. 提示词长 − 2（被抢占后重算时已攒的不再算）。plan 为它们多排 logits 行；前缀缓存不替它们算
        （block_manager.match_prefix）。"""
        if self.request.prompt_logprobs is None:
            return range(0)
        return range(len(self.prompt_logprobs), len(self.request.prompt_ids) - 1)

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """step09：这一步的前向一直算到哪：已有的 token 加上要验证的猜测。"""
        return self.num_tokens + len(self.spec_token_ids)

    def trim_spec(self, n: int) -> None:
        """step09：只留前 n 个猜测（预算、块、max_new_tokens 不够时）。step15：截短了（或清空），被语法截掉的那个猜测
        就不再紧跟在最后一个后面，spec_cut_q 作废（截短与猜测的内容无关，最后那个 token 照常从 p 抽就对）。"""
        if n < len(self.spec_token_ids) or n <= 0:
            self.spec_cut_q = None
        self.spec_token_ids = self.spec_token_ids[:max(n, 0)]
        if self.spec_probs is not None:
            self.spec_probs = self.spec_probs[:len(self.spec_token_ids)] if self.spec_token_ids else None

    @property
    def token_ids(self) -> list[int]:
        """提示词 + 已生成：要算 K/V 的全部 token（采样器分开要 request.prompt_ids 与 output_ids）。"""
        return self.request.prompt_ids + self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token: int, eos_ids, tokenizer=None) -> Optional[str]:
        """记下一个新 token；按与 step03 相同的条件判断是否该停，返回结束原因（还没结束为 None）：
        Request.stops（EOS 或 stop_token_ids 里的 token，都算进输出；新生成的文本里出现停止字符串；生成满 min_tokens
        之前都不算）→ "stop"；生成满 max_new_tokens → "length"。两者同时成立时算 "stop"（与 vLLM 相同）。
        step15：有约束的请求，匹配器结束（接受了 EOS）也是 "stop"。"""
        # >>> step15：语法跟着每个 token 走；接受了 EOS 就结束（ignore_eos 时也是：语法之后什么也不允许了）
        if self.matcher is not None and not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} is not allowed by the request's grammar")
        self.output_ids.append(token)
        if self.matcher is not None and self.matcher.is_terminated():
            return "stop"
        # <<<
        if self.request.stops(self.output_ids, eos_ids, tokenizer):
            return "stop"
        return "length" if len(self.output_ids) == self.request.max_new_tokens else None
