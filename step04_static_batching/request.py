"""请求（要什么）与它在批里的运行状态（做到哪了）。

Request 只描述用户要什么：提示词、最多生成几个 token、采样参数、是否忽略 EOS。step05 沿用同一个 Request。
Sequence 是批里的一行（vLLM / nano-vllm 也叫 Sequence）：已生成的 token、是否已结束、它自己的随机数发生器。
"""
from dataclasses import dataclass, field

import torch

from common.errors import UserError
from step02_sampling.sampler import SamplingParams


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)   # 默认贪心
    ignore_eos: bool = False

    def validate(self, context_len: int) -> None:
        """非法输入抛 UserError：在任何一个请求开始生成之前，先把所有请求都检查一遍。"""
        if not self.prompt_ids:
            raise UserError("empty prompt")
        if self.max_new_tokens <= 0:
            raise UserError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if len(self.prompt_ids) + self.max_new_tokens > context_len:
            raise UserError(f"prompt has {len(self.prompt_ids)} tokens; with max_new_tokens {self.max_new_tokens} "
                            f"that exceeds the model's context of {context_len} tokens")
        self.params.validate()


@dataclass
class Sequence:
    request: Request
    generator: torch.Generator        # 每个请求一个，用它自己的 seed：与 step03 单独生成时消耗同一串随机数
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False

    @property
    def token_ids(self) -> list[int]:
        """提示词 + 已生成：采样器的 history（重复惩罚要用），与 step03 传给 sample() 的相同。"""
        return self.request.prompt_ids + self.output_ids

    def append(self, token: int, eos_ids) -> None:
        """记下一个新 token，并按这一行自己的条件判断是否结束（与 step03 相同：EOS 也算进输出）。"""
        self.output_ids.append(token)
        hit_eos = token in eos_ids and not self.request.ignore_eos
        self.finished = hit_eos or len(self.output_ids) == self.request.max_new_tokens
