"""一个请求在引擎里的运行状态（vLLM / nano-vllm 叫 Sequence）。

Request（step04 定义）只描述"要什么"：提示词、最多生成几个 token、采样参数、是否忽略 EOS。
Sequence 记录"做到哪了"：已生成的 token、块表、KV 已写进缓存的 token 数、状态、它自己的随机数生成器。
"""
import enum
from dataclasses import dataclass, field
from typing import Optional

import torch

from step04_static_batching.request import Request


class Status(enum.Enum):
    WAITING = "waiting"     # 在等待队列里：还没有块（新来的，或被抢占后释放了全部块）
    RUNNING = "running"     # 在运行集合里：持有块，每步都参与前向
    FINISHED = "finished"   # 生成完毕，块已还给分配器


@dataclass
class Sequence:
    request: Request
    generator: torch.Generator       # 每个请求一个，按它自己的 seed：与 step03 单独生成时消耗同一串随机数
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)  # 第 i 个逻辑块 → 物理块号
    num_cached_tokens: int = 0       # 前多少个 token 的 K/V 已经写进池里（其余的下一次前向要算）
    status: Status = Status.WAITING
    num_preemptions: int = 0
    # 计时（秒，相对本次运行开始）：TTFT = first_token_time，TPOT = (finish - first) / (输出数 - 1)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    def append(self, token: int, eos_ids) -> bool:
        """记下新 token，返回是否该结束（遇到 EOS，或到了 max_new_tokens）。"""
        self.output_ids.append(token)
        hit_eos = token in eos_ids and not self.request.ignore_eos
        return hit_eos or len(self.output_ids) >= self.request.max_new_tokens
