"""step09 的提议者（proposer）：猜出接下来的几个 token，交给目标模型用一次前向验证。

    NgramProposer       prompt lookup：在"提示词 + 已生成"里找与结尾相同的 n-gram，把它后面跟着的 token 当作猜测。
                        不要第二个模型；找不到就不猜（这一步照常 decode）
    DraftModelProposer  草稿模型：自己的模型、自己的分页 KV 池，连走 k 步（贪心或抽样），每步记下抽样用的分布 q
    FakeProposer        测试用：按脚本给出猜测

猜得对不对不影响结果（验证规则保证输出的分布与不猜时完全相同，见 rejection_sampler.py），只影响快慢。
"""
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Union

import torch

from step02_sampling.sampler import SamplingParams, draw, process_logits, sample


@dataclass
class Proposal:
    token_ids: list[int]                         # 0..k 个猜测；空 = 这一步照常 decode
    draft_probs: Optional[torch.Tensor] = None   # (len(token_ids), V)：第 i 个猜测是从分布 q_i 里抽出来的；
                                                 # None = 确定性的猜测（n-gram、贪心草稿），q 是 one-hot


class Proposer(Protocol):
    def propose(self, seqs: list) -> list[Proposal]:
        """每个请求一份猜测。seq 上用到的：token_ids（提示词 + 已生成）、request.params、generator。"""
        ...

    def free(self, seq) -> None:
        """请求结束或被抢占：丢掉为它保存的状态（草稿模型的 KV 块）。"""
        ...


class NgramProposer:
    """prompt lookup（vLLM 的 ngram、HF 的 prompt_lookup_num_tokens）。

    取 token 序列结尾的 n 个 token（n 从 max_n 往下试到 min_n），在它之前的位置里找同样的 n 个 token；
    找到就把那次出现后面的（至多）k 个 token 作为猜测。n 越长，匹配越可信，所以先试长的。
    同一个 n-gram 出现多次时取最早的一次——与 vLLM（v1/spec_decode/ngram_proposer.py：反转序列后做 KMP，
    相同长度时记下原序列里最早的位置）和 HF（PromptLookupCandidateGenerator 取第一个匹配）都相同。
    出现可以与结尾重叠（[7, 7, 7] 的 2-gram [7, 7] 最早出现在 0，后面跟着 7），但不能就是结尾本身。"""

    def __init__(self, min_n: int, max_n: int, k: int):
        assert 1 <= min_n <= max_n and k >= 0
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def lookup(self, token_ids: list[int]) -> list[int]:
        total = len(token_ids)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = token_ids[total - n:]
            for start in range(total - n):                  # 出现的起点；start + n <= total - 1：后面至少还有一个 token
                if token_ids[start:start + n] == suffix:
                    return token_ids[start + n:start + n + self.k]
        return []

    def propose(self, seqs: list) -> list[Proposal]:
        return [Proposal(self.lookup(seq.token_ids)) for seq in seqs]

    def free(self, seq) -> None:
        pass                                                # 没有按请求保存的状态


def draft_token(logits: torch.Tensor, history: list[int], params: SamplingParams,
                generator: torch.Generator) -> tuple[int, Optional[torch.Tensor]]:
    """草稿模型走一步：logits (V,) → (猜的 token, 它是从哪个分布 q 抽出来的 (V,))。
    用与目标相同的 step02 处理链（重复惩罚、温度、top-k/p、min-p）：q 离 p 越近，接受率越高。
    贪心时直接取 argmax（与 step02 相同），q 是 one-hot，返回 None。"""
    if params.greedy:
        return sample(logits, history, params, generator), None
    q = process_logits(logits.float(), history, params).softmax(-1)   # (V,)
    return draw(q, generator), q


class DraftModelProposer:
    """草稿模型：一个更小的同词表模型，自己的分页 KV 池，每步为每个请求连走 k 步，每步用 draft_token 抽一个 token。
    第二阶段接入引擎：KV 池、按块表的批量前向、被拒后 KV 的回滚都在那时加上。"""

    def __init__(self, model, k: int):
        self.model, self.k = model, k

    def propose(self, seqs: list) -> list[Proposal]:
        raise NotImplementedError("DraftModelProposer needs the engine's paged KV pool (step09 phase 2)")

    def free(self, seq) -> None:
        pass


class FakeProposer:
    """测试用：script(token_ids) 返回这一步要猜的 token（或一个完整的 Proposal）。"""

    def __init__(self, script: Callable[[list[int]], Union[list[int], Proposal]]):
        self.script = script
        self.calls = 0

    def propose(self, seqs: list) -> list[Proposal]:
        self.calls += 1
        out = [self.script(seq.token_ids) for seq in seqs]
        return [p if isinstance(p, Proposal) else Proposal(list(p)) for p in out]

    def free(self, seq) -> None:
        pass
