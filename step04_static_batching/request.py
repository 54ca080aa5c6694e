"""请求（要什么）与它在批里的运行状态（做到哪了）。

Request 只描述用户要什么：提示词、最多生成几个 token、采样参数、是否忽略 EOS、停止字符串。
step05 起的引擎沿用同一个 Request（什么时候到达不是请求的属性：调用方什么时候 add_request，它就什么时候到）。
logprobs / prompt_logprobs 是服务器（step11）要的：只有 step09、step10 的引擎算它们，更早的引擎不看这两项
（服务器对那些引擎回 400，见 docs/11 的 logprobs 一节）。
Sequence 是批里的一行（vLLM / nano-vllm 也叫 Sequence）：已生成的 token、是否已结束、它自己的随机数发生器、
首 token 与结束的时刻。step05 起每个引擎有自己的 Sequence（再加上分页的状态：块表、已进池子的 token 数……）。
"""
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from common.errors import UserError
from step02_sampling.sampler import SamplingParams
from step02_sampling.stop_strings import completes_stop_string


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)   # 默认贪心
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()        # 停止字符串：新生成的文本里出现任一个就停（同 step02 / step03）
    # 每个新 token 的 logprob 与最可能的这么多个（0 = 只要采样出的那个；None = 不要）。vLLM 的 SamplingParams.logprobs
    logprobs: Optional[int] = None
    # 提示词每个 token 的（第一个没有前文）；给了它 max_new_tokens 可以是 0：只 prefill、不采样。vLLM 的 prompt_logprobs
    prompt_logprobs: Optional[int] = None

    def validate(self, context_len: int, vocab_size: int | None = None) -> None:
        """非法输入抛 UserError：在任何一个请求开始生成之前，先把所有请求都检查一遍。
        vocab_size：给了就检查采样参数里的 token id（logit_bias、stop_token_ids）在词表之内。"""
        if not self.prompt_ids:
            raise UserError("empty prompt")
        if self.max_new_tokens < 0 or (self.max_new_tokens == 0 and self.prompt_logprobs is None):
            raise UserError(f"max_new_tokens must be > 0 (0 only with prompt_logprobs: prefill only), "
                            f"got {self.max_new_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and k >= 0):
                raise UserError(f"{name} must be None or an integer >= 0, got {k!r}")
        if len(self.prompt_ids) + self.max_new_tokens > context_len:
            raise UserError(f"prompt has {len(self.prompt_ids)} tokens; with max_new_tokens {self.max_new_tokens} "
                            f"that exceeds the model's context of {context_len} tokens")
        if any(not s for s in self.stop):
            raise UserError("stop strings must not be empty")
        self.params.validate(vocab_size)
        if self.params.min_tokens > self.max_new_tokens:   # vLLM 同样拒绝
            raise UserError(f"min_tokens ({self.params.min_tokens}) must be <= max_new_tokens ({self.max_new_tokens})")

    def end_ids(self, eos_ids) -> tuple[int, ...]:
        """会结束这个请求的 EOS（ignore_eos 时没有）：采样器在 min_tokens 之前屏蔽它们（连同 stop_token_ids）。"""
        return () if self.ignore_eos else tuple(eos_ids)

    def stops(self, output_ids: list[int], eos_ids, tokenizer=None) -> bool:
        """刚 append 了 output_ids[-1] 之后，这个请求是否因为"停止"而结束（与 step02 的 generate 相同的规则）：
        EOS（ignore_eos 时不算）或 stop_token_ids 里的 token（都算进输出）；这个 token 补全了一个停止字符串
        （包含它；只解码输出的尾巴，跨 token 的停止串也找得到）。生成满 min_tokens 个之前都不算，前 min_tokens 个
        token 里结束的停止串之后也不算（vLLM 相同；EOS 与停止 token 此时已被采样器屏蔽，这里只是兜底）。"""
        if len(output_ids) < self.params.min_tokens:
            return False
        token = output_ids[-1]
        return (token in self.end_ids(eos_ids) or token in self.params.stop_token_ids
                or completes_stop_string(tokenizer, output_ids, self.stop, self.params.min_tokens))

    def parallel_samples(self, n: int) -> list["Request"]:
        """同一个提示词的 n 个样本（step06 起 run.py 的 --n、step11 的 n）：种子 S, S+1, ..., S+n-1
        （没给种子时各自随机）。它们是 n 个独立的请求，共享提示词的整块是前缀缓存自己发现的
        （vLLM V1 的并行采样也是这样做的）。"""
        seed = self.params.seed
        return [replace(self, params=replace(self.params, seed=None if seed is None else seed + k)) for k in range(n)]


@dataclass(eq=False)   # 运行状态按对象区分：两个请求内容相同也是两行（`in`、list.remove 按身份比较）
class Sequence:
    request: Request
    generator: torch.Generator        # 每个请求一个，用它自己的 seed：与 step03 单独生成时消耗同一串随机数
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    # 计时（秒，相对本次运行开始）：TTFT = first_token_time − 到达时刻（step04 里都在 0 时刻到达），
    # TPOT = (finish_time − first_token_time) ÷ (输出数 − 1)
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None

    @property
    def token_ids(self) -> list[int]:
        """提示词 + 已生成（step03 里的 ids）。"""
        return self.request.prompt_ids + self.output_ids

    def append(self, token: int, eos_ids, tokenizer=None) -> bool:
        """记下一个新 token，按这一行自己的条件判断是否结束，返回 finished。条件与 step03 相同：生成满 max_new_tokens，
        或 Request.stops（EOS、停止 token、停止字符串；min_tokens 之前不算）。"""
        self.output_ids.append(token)
        r = self.request
        self.finished = len(self.output_ids) == r.max_new_tokens or r.stops(self.output_ids, eos_ids, tokenizer)
        return self.finished
