"""step09 的提议者（proposer）：猜出接下来的几个 token，交给目标模型用一次前向验证。

    NgramProposer       prompt lookup：在"提示词 + 已生成"里找与结尾相同的 n-gram，把它后面跟着的 token 当作猜测。
                        不要第二个模型；找不到就不猜（这一步照常 decode）
    DraftModelProposer  草稿模型：自己的模型、自己的分页 KV 池，连走 k 步（贪心或抽样），每步记下抽样用的分布 q
                        （草稿模型走不通时——池子满了——也是不猜）
    FakeProposer        测试用：按脚本给出猜测

猜得对不对不影响结果（验证规则保证输出的分布与不猜时完全相同，见 rejection_sampler.py），只影响快慢。
"""
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Union

import torch

from step02_sampling.sampler import SamplingParams, draw, process_logits, sample

from .block_manager import BlockManager
from .kv_cache import PagedKVCache


@dataclass
class Proposal:
    token_ids: list[int]                         # 0..k 个猜测；空 = 这一步照常 decode
    draft_probs: Optional[torch.Tensor] = None   # (len(token_ids), V)：第 i 个猜测是从分布 q_i 里抽出来的；
                                                 # None = 确定性的猜测（n-gram、贪心草稿），q 是 one-hot
    # step15：紧接着的下一个猜测被语法截掉了（不合法），它是从这个分布 q 抽的 (V,)；None = 没有截掉，或 q 是 one-hot
    cut_q: Optional[torch.Tensor] = None


class Proposer(Protocol):
    def propose(self, seqs: list, max_tokens: list[int]) -> list[Proposal]:
        """每个请求一份猜测，seqs[i] 至多 max_tokens[i] 个（引擎算好的：再多也留不下）。
        seq 上用到的：token_ids（提示词 + 已生成）、num_tokens、request.params、generator。"""
        ...

    def free(self, seq) -> None:
        """请求结束、被 abort 或被抢占（调度器的 on_preempt）：丢掉为它保存的状态（草稿模型的 KV 块）。"""
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

    def propose(self, seqs: list, max_tokens: list[int]) -> list[Proposal]:
        return [Proposal(self.lookup(seq.token_ids)[:n]) for seq, n in zip(seqs, max_tokens)]

    def free(self, seq) -> None:
        pass                                                # 没有按请求保存的状态


def draft_token(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], params: SamplingParams,
                generator: torch.Generator) -> tuple[int, Optional[torch.Tensor]]:
    """草稿模型走一步：logits (V,) → (猜的 token, 它是从哪个分布 q 抽出来的 (V,))。output_ids = 已生成 + 这一轮已猜的。
    用与目标相同的 step02 处理链（偏置、惩罚、min_tokens、温度、top-k/p、min-p）：q 离 p 越近，接受率越高。
    草稿不知道 EOS（不传 eos_ids）：min_tokens 之前猜了 EOS 也只是被目标拒绝（那里 p(EOS) = 0），输出的分布不变。
    贪心时直接取 argmax（与 step02 相同），q 是 one-hot，返回 None。"""
    if params.greedy:
        return sample(logits, prompt_ids, output_ids, params, generator), None
    q = process_logits(logits.float(), prompt_ids, output_ids, params).softmax(-1)   # (V,)
    return draw(q, generator), q


@dataclass(eq=False)
class DraftSequence:
    """草稿模型眼里的一个请求：kv_cache.plan 要的几项（与引擎的 Sequence 同名），块在草稿模型自己的池子里。
    token_ids = 请求的 token + 这一轮已经猜出的；池子里存着前 num_computed_tokens 个的 K/V。"""
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)   # 草稿模型自己不验证：永远为空

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftModelProposer:
    """草稿模型：一个更小的同词表模型，自己的分页 KV 池（与目标同一套 PagedKVCache / BlockManager，只是另一个实例），
    每步为这一批请求一起走至多 k 步（每个请求走到它留得下的个数为止）：第 1 步把草稿还没见过的 token（上一轮被接受的
    猜测和目标给的那个 token；新请求、被抢占过的请求是整段提示词）算进它的池子，之后每步 1 个 token；每步用
    draft_token 抽一个，记下 q。第 1 步也守 max_num_batched_tokens：整段提示词一次算不完就分几步追（见 propose）。

    回滚不用专门做：草稿池子里的 K/V 只对"它算过的 token 与请求现在的 token 相同"的那段前缀有效，
    每轮开头把 num_computed_tokens 截到这段公共前缀（被拒绝的猜测之后的都不算了，槽以后被覆盖）。
    草稿池子的块不够时这个请求这一步不猜（照常 decode），从不为此抢占。请求结束、被抢占时 free 还块。"""

    def __init__(self, model, k: int, num_blocks: int, block_size: int, max_num_batched_tokens: int,
                 attention: str = "paged"):
        self.model, self.k, self.max_num_batched_tokens = model, k, max_num_batched_tokens
        self.block_manager = BlockManager(num_blocks, block_size, enable_caching=False)
        self.kv_cache = PagedKVCache(model.cfg, num_blocks, block_size, model.device, model.dtype, attention)
        self.states: dict[int, DraftSequence] = {}    # request_id → 草稿的状态

    def propose(self, seqs: list, max_tokens: list[int]) -> list[Proposal]:
        """seqs[i] 至多猜 max_tokens[i] 个：草稿只走这么多步（猜多了引擎也留不下），也不走出草稿模型自己的上下文
        （第 j 个猜测要位置 num_tokens + j − 2 的 logits）。
        第 1 次前向要把草稿没见过的 token 算进池子——新请求是整段提示词。它也守 max_num_batched_tokens：按 seqs 的顺序
        分预算，分不够的请求这次只算一块、这一步不猜，下一步接着追（_sync 从它算到的地方接着）。与目标的分块 prefill
        同一个道理：一次几千 token 的草稿前向会让所有在 decode 的请求干等。vLLM 的草稿（EAGLE、草稿模型）跟着目标在
        同一次调度里算同样的 token，分块是调度器给的；我们的草稿是自己的一次前向，就地分块改动最小，调度器不用知道草稿。"""
        drafts = {}                                           # request_id → (猜的 token, 各自的 q)
        live, num_new, budget = [], [], self.max_num_batched_tokens
        for seq, n in zip(seqs, max_tokens):
            n = min(n, self.k, self.model.cfg.max_position_embeddings + 1 - seq.num_tokens)
            if n > 0 and budget > 0 and self._sync(seq, n):
                st = self.states[seq.request_id]
                live.append((seq, st, n))
                num_new.append(min(st.num_tokens - st.num_computed_tokens, budget))
                budget -= num_new[-1]
        while live:
            states = [st for _, st, _ in live]
            fwd = self.kv_cache.plan(states, num_new)
            logits = self.model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index).flatten(0, 1)  # (B, V)
            for st, m in zip(states, num_new):
                st.num_computed_tokens += m
            live = [x for x in live if x[1].num_computed_tokens == x[1].num_tokens]   # 追上了的：各有一行 logits
            for (seq, st, _), row in zip(live, logits):
                n_prompt = len(seq.request.prompt_ids)   # st.token_ids = 提示词 + 已生成 + 这一轮已猜的
                token, q = draft_token(row, st.token_ids[:n_prompt], st.token_ids[n_prompt:], seq.request.params,
                                       seq.generator)
                st.token_ids.append(token)                   # 下一步把它喂回去（最后一个猜测不再喂）
                ids, qs = drafts.setdefault(seq.request_id, ([], []))
                ids.append(token)
                qs.append(q)
            live = [x for x in live if len(drafts[x[0].request_id][0]) < x[2]]       # 还要猜的：下一次各算 1 个
            num_new = [1] * len(live)
        out = []
        for seq in seqs:
            ids, qs = drafts.get(seq.request_id, ([], []))
            out.append(Proposal(ids, torch.stack(qs) if ids and qs[0] is not None else None))
        return out

    def _sync(self, seq, n: int) -> bool:
        """把草稿的状态对齐到请求现在的 token，并给这一轮要写的位置（猜 n 个）分好块；分不到块返回 False（这一步不猜）。"""
        st = self.states.setdefault(seq.request_id, DraftSequence([]))
        # 至少重算最后一个 token：要它的 logits 才能猜下一个（它的 K/V 可能已在池子里——猜测被引擎截短、又正好猜对时）
        st.num_computed_tokens = min(st.num_computed_tokens, common_prefix_len(st.token_ids, seq.token_ids),
                                     seq.num_tokens - 1)
        st.token_ids = list(seq.token_ids)
        need = self.block_manager.blocks_for(st.num_tokens + n - 1) - len(st.block_table)   # 写到第 n-1 个猜测
        if need > 0:
            if not self.block_manager.can_allocate(need):
                return False
            st.block_table += self.block_manager.allocate(need)
        return True

    def free(self, seq) -> None:
        st = self.states.pop(seq.request_id, None)
        if st is not None:
            self.block_manager.free(st.block_table)


class FakeProposer:
    """测试用：script(token_ids) 返回这一步要猜的 token（或一个完整的 Proposal）。不看 max_tokens：猜多了由引擎截掉。"""

    def __init__(self, script: Callable[[list[int]], Union[list[int], Proposal]]):
        self.script = script
        self.calls = 0

    def propose(self, seqs: list, max_tokens: list[int]) -> list[Proposal]:
        self.calls += 1
        out = [self.script(seq.token_ids) for seq in seqs]
        return [p if isinstance(p, Proposal) else Proposal(list(p)) for p in out]

    def free(self, seq) -> None:
        pass
