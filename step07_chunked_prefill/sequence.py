"""一个请求在引擎里的运行状态（vLLM / nano-vllm 叫 Sequence），以及引擎每一步交给调用方的 RequestOutput。

Request（step04）只说用户要什么；Sequence 记"做到哪了"：已生成的 token、块表、KV 已进池子的 token 数、
前缀缓存的账、状态、被抢占的次数，以及计时用的几个时刻（都来自引擎的时钟）。step07 加一项：prefill 可能
分好几步做完，所以请求自己记着这一轮 prefill 要算到哪（num_prefill_tokens；in_prefill 由它和
num_computed_tokens 得出）。
"""
import enum
from dataclasses import dataclass, field
from typing import Optional

import torch

from step04_static_batching.request import Request


class SequenceStatus(enum.Enum):
    WAITING = "waiting"     # 在等待队列里：还没有块（新来的，或被抢占后释放了全部块）
    RUNNING = "running"     # 在运行集合里：持有块，每步都参与调度
    FINISHED = "finished"   # 生成完毕或被 abort，块已还回去


@dataclass
class RequestOutput:
    """step() 的返回值里每个请求一项：这一步新产出的 token、是否结束、为什么结束。"""
    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: Optional[str] = None   # "stop"（EOS 或停止字符串）/ "length"（max_new_tokens）/ "abort"
    num_cached_tokens: int = 0            # 提示词里有几个 token 直接用了前缀缓存


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
    num_prefill_tokens: int = field(init=False)   # 这一轮 prefill 要算到第几个 token：提示词长；被抢占重算时是那时的全部 token
    # 计时（秒，引擎时钟的读数）
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    token_times: list[float] = field(default_factory=list)   # 每个输出 token 产出的时刻
    stall_time: float = 0.0       # 已经有输出、却因为这一步在给别人做 prefill 而干等的时间

    def __post_init__(self):
        self.num_prefill_tokens = len(self.request.prompt_ids)

    @property
    def in_prefill(self) -> bool:
        """还在（重新）prefill：K/V 还没算到 num_prefill_tokens。算完的那一步采样出 token，之后是 decode
        （num_computed_tokens = num_tokens − 1：最后一个 token 刚采样出来，还没算）。"""
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

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
        之前都不算）→ "stop"；生成满 max_new_tokens → "length"。两者同时成立时算 "stop"（与 vLLM 相同）。"""
        self.output_ids.append(token)
        if self.request.stops(self.output_ids, eos_ids, tokenizer):
            return "stop"
        return "length" if len(self.output_ids) == self.request.max_new_tokens else None
