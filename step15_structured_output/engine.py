"""step15 引擎：step09 的引擎（分页 KV cache + 连续批处理 + 前缀缓存 + 分块 prefill + 量化的池子 + 换出式抢占 + 投机解码）
加上结构化输出：请求可以带一个约束（正则、JSON Schema、任意 JSON 对象、几个字符串之一），输出保证满足它。
一步一步地驱动（与 vLLM 的 LLMEngine 同样的接口）。
与 step03 逐 token 一致的道理（块表 + 按位置的掩码；每个请求自己的随机数发生器，被抢占后只重算 K/V）
和每一步的记账（StepStats、每个请求的时刻）都同 step05 的引擎。

    add_request(request, structured_output=None) -> request_id
                                           检查请求（和它的约束）、放进等待队列（到达时刻 = 时钟的读数）
    step() -> list[RequestOutput]          一次前向：猜测 → 调度 → 排出这次前向的地址（plan）→ 模型 → 验证、结束的还块
    abort(request_id)                      立刻还块；下一次 step() 报告它 finish_reason="abort"
    has_unfinished_requests()
    generate(requests)                     只是上面几个的循环

step09 加的投机解码（spec_method 不是 "none" 时）：每一步开头，提议者（proposer.py：prompt lookup 或草稿模型）给
每个在 decode 的请求猜接下来的至多 k 个 token；调度器让它这一步算 1 + k 个 token（上一步采样出的 + k 个猜测，
scheduler.py），plan 给出这 1 + k 个位置各自的 logits（kv_cache.py）；_postprocess 用 rejection_sampler.verify
决定留下几个：接受的猜测 + 一个来自目标模型的 token，一次前向产出 1..k+1 个 token（RequestOutput.new_token_ids）。
被拒绝的猜测的 K/V 不算进 num_computed_tokens（回滚），猜测也从不进 token_ids，所以前缀缓存只登记真正的 token。
没有猜测的请求走同一个 verify：空猜测时它就是 step08 的那一次 sample()，spec_method="none" 与 step08 逐位相同；
贪心时猜不猜输出都逐 token 相同，抽样时分布相同。接受率一直很低的请求暂停猜测一阵（SPEC_WINDOW 等常数）。

logprobs（第 11 章的服务器要的，不属于投机解码；这是服务器默认挂的引擎里最早的一步，所以从这里开始有）：
请求要了 logprobs 时，每个新 token 带上它在模型原始分布 log_softmax(logits) 里的 logprob 和最可能的 k 个
（token_logprobs；投机的一步里每个接受的猜测和最后那个 token 各用自己那一行 verify 的 logits）；要了 prompt_logprobs
时，plan 为它的提示词位置多排 logits 行（分块 prefill 的每一块各算各的），max_new_tokens 0 时 prefill 完就结束、不采样。

step15 加的结构化输出（structured.py；语法本身在 regex_parser.py / automaton.py / schema.py / token_index.py）：
  · add_request 编译约束（同一个语法只编译一次），编不出来（写错、不支持的关键字、什么也匹配不了）就抛 UserError，
    什么也不分配；Sequence 带一个 GrammarMatcher，append_token 每记一个 token 就推进它。
  · 每一步的前向之后、任何别的处理（logit_bias、惩罚、温度、top-k/p）之前，把这一批有约束的请求的掩码铺到它们的
    logits 行上（不允许的置 -inf）。logprobs 也是铺了掩码之后的 log_softmax：vLLM 的 raw_logprobs 同样取自
    铺过语法掩码的 logits（掩码在采样器之前）。EOS 只在语法的接受状态允许；匹配器接受了 EOS，请求以 "stop" 结束。
  · 投机解码：猜测先按语法截断到第一个不合法的 token（_propose），验证的 1 + k 行各自一行掩码（接受了前 i 个猜测之后的），
    匹配器只随真正接受的 token 前进（被拒绝的猜测从没进过它）。
  · jump-forward（jump_forward=True，run.py 的 --no-jump-forward 关掉）：采样之后，语法唯一确定的一段字节直接分词、
    追加进输出（structured.jump_forward_tokens：结尾按 llguidance 的做法退回几个 token），不一个一个采样；这些 token
    像被抢占后重算那样走 prefill 的路（num_prefill_tokens 延长到它们），下一次前向作为一块一起算完再采样。
    请求一开始（add_request）语法就强制的开头（JSON 的 `{"name":`）与提示词一起 prefill。要 logprobs 的请求不跳：
    强制的 token 没有采样用的分布。
  没有约束的请求一行新代码也不走：输出、前向次数都与 step09 相同。
"""
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from common.clock import Clock, WallClock
from common.errors import UserError
from common.stats import STEP_STATS_KEPT, EngineStats, StepStats, collect_stats, last_steps
from step02_sampling.sampler import make_generator
from step04_static_batching.request import Request

from .block_manager import BlockManager
from .config import EngineConfig
from .kv_cache import PagedKVCache
from .proposer import DraftModelProposer, NgramProposer, Proposal, Proposer
from .quant import kv_format
from .rejection_sampler import verify
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Logprob, RequestOutput, Sequence
from .structured import (Grammars, StructuredOutputsParams, check_sampled, fill_rows, jump_forward_tokens,
                         legal_prefix)
from .swap import SwapSpace
from .token_index import allocate_token_bitmask, apply_token_bitmask_

# 按请求关掉投机：一个请求最近 SPEC_WINDOW 次验证的平均接受率低于 SPEC_MIN_ACCEPTANCE，就有 SPEC_PAUSE_STEPS 步
# 不猜（照常 decode），然后重新试。验证 k 个猜测要花 c(k) 次 decode 的时间，划算要 接受率 > (c(k) − 1) / k：
# 空闲的 2 核 CPU 上 c(4) = 1.30（packed 权重；plain 时 1.84），保本点约 0.08；0.5 是有意定高的保守值（理由见 docs/09 第 10 节），换了硬件就重量 c(k)
SPEC_WINDOW = 4
SPEC_MIN_ACCEPTANCE = 0.5
SPEC_PAUSE_STEPS = 16


def blocks_needed(r: Request, block_size: int) -> int:
    """一个请求一生最多占几块：最后采样出的 token 不再喂回模型、不进缓存，所以是 提示词 + N - 1 个 token
    （N = 0 只 prefill：整个提示词）。"""
    return -(-(len(r.prompt_ids) + max(r.max_new_tokens, 1) - 1) // block_size)


@dataclass
class SpecStats:
    """投机解码的累计账（引擎活多久记多久）：接受率 = accepted ÷ proposed。"""
    proposed: int = 0         # 验证过的猜测
    accepted: int = 0         # 其中被接受的
    verifications: int = 0    # 带着猜测的验证（一个请求一次前向算一次）


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[Logprob]:
    """logits (m, V) 的第 i 行 → token_ids[i] 的 logprob 与最可能的 k 个 (id, logprob)，从大到小。
    分布是模型的原始输出 log_softmax(logits)：不经重复惩罚、温度、top-k/p（vLLM V1 的默认 logprobs_mode="raw_logprobs"），
    说的是"模型认为这个 token 多可能"，与这个请求怎么采样无关——贪心和抽样的请求在同一个位置得到同一个数。"""
    lp = torch.log_softmax(logits.float(), dim=-1)                                       # (m, V)
    ids = torch.tensor(token_ids, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()                                   # (m,)
    top_lp, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)                              # (m, k)：从大到小
    return [Logprob(t, c, list(zip(i, v))) for t, c, i, v in zip(token_ids, chosen, top_ids.tolist(), top_lp.tolist())]


@dataclass
class StructuredStats:
    """step15：结构化输出的累计账。mask_seconds 是算掩码（含投机的逐行掩码）与铺到 logits 上的时间（引擎时钟）。"""
    masked_rows: int = 0       # 铺过掩码的 logits 行
    mask_steps: int = 0        # 有掩码要铺的前向次数
    mask_seconds: float = 0.0
    jumps: int = 0             # jump-forward 的次数
    jump_tokens: int = 0       # 强制追加、没有一个一个采样的 token（每个省一次 decode 前向）


class GenerateOutput(NamedTuple):
    outputs: list[list[int]]   # 每个请求的新 token，顺序与 requests 相同
    stats: EngineStats
    finish_reasons: list[str]  # step15：每个请求为什么结束（"stop" / "length"）


class LLMEngine:
    def __init__(self, model, config: EngineConfig, tokenizer=None, eos_ids=(), clock: Clock | None = None,
                 draft_model=None, proposer: Optional[Proposer] = None):
        """draft_model：spec_method="draft" 的草稿模型（词表与 model 相同）；proposer：直接给一个提议者
        （测试用脚本化的 FakeProposer），给了就不看 spec_method。"""
        config.validate()
        self.model, self.config = model, config
        self.tokenizer, self.eos_ids = tokenizer, tuple(eos_ids)   # tokenizer：有请求带停止字符串时需要
        self.clock = clock or WallClock()
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        try:  # 整个池子只分配一次；--num-blocks 过大时给一行 error 而不是 traceback
            self.kv_cache = PagedKVCache(model.cfg, config.num_blocks, config.block_size, model.device, model.dtype,
                                         config.attention, kv_format(config.kv_dtype, model.dtype))
            self.swap = (SwapSpace(self.kv_cache.tensors(), config.swap_blocks or config.num_blocks, block_dim=2)
                         if config.preempt == "swap" else None)
        except (RuntimeError, MemoryError) as e:
            raise UserError(f"cannot allocate a KV pool of {config.num_blocks} blocks x {config.block_size} "
                            f"tokens: {e}") from None
        self.proposer = proposer if proposer is not None else self._make_proposer(draft_model)
        self.scheduler = Scheduler(self.block_manager, config.max_batch_size, config.max_num_batched_tokens, self.swap,
                                   on_preempt=self.proposer.free if self.proposer is not None else None)
        self.spec_stats = SpecStats()
        # step15：分词器这一侧的语法索引（第一个有约束的请求来时才建）
        self.grammars = (Grammars(getattr(tokenizer, "hf", tokenizer), self.eos_ids, model.cfg.vocab_size)
                         if tokenizer is not None else None)
        self.structured_stats = StructuredStats()
        self.seqs: dict[int, Sequence] = {}          # 还没结束的请求
        self.step_stats: deque[StepStats] = deque(maxlen=STEP_STATS_KEPT)   # 每一步一行，只留最近的（服务器一直跑）
        self.num_steps = 0                           # 一共走过几步（step_stats 留满以后也照数）
        self._aborted: list[RequestOutput] = []      # step() 之外结束的（abort、猜测出错），还没在 step() 里报告
        self._next_id = 0

    def _make_proposer(self, draft_model) -> Optional[Proposer]:
        c = self.config
        if c.spec_method == "ngram":
            return NgramProposer(c.ngram_min, c.ngram_max, c.num_spec_tokens)
        if c.spec_method == "draft":
            if draft_model is None:
                raise UserError("--spec-method draft needs --draft-model DIR")
            if draft_model.cfg.vocab_size != self.model.cfg.vocab_size:
                raise UserError(f"the draft model's vocabulary ({draft_model.cfg.vocab_size} tokens) differs from the "
                                f"target's ({self.model.cfg.vocab_size}): they must share the tokenizer")
            return DraftModelProposer(draft_model, c.num_spec_tokens, c.num_blocks, c.block_size,
                                      c.max_num_batched_tokens, c.attention)
        return None

    def add_request(self, request: Request, structured_output: Optional[StructuredOutputsParams] = None) -> int:
        """检查请求（非法输入抛 UserError），放进等待队列，返回 request_id。
        step15：structured_output = 这个请求的约束（None = 不约束）。编译不了的约束在这里就拒绝，什么也不分配。"""
        request.validate(self.model.cfg.max_position_embeddings, self.model.cfg.vocab_size)  # 空提示词、N ≤ 0、超出上下文、采样参数
        need, have = blocks_needed(request, self.config.block_size), self.config.num_blocks
        if need > have:   # 单独一个就放不进池子的请求永远跑不完（抢占别人也腾不出更多块）
            raise UserError(f"a request needs up to {need} KV blocks of {self.config.block_size} tokens (prompt "
                            f"{len(request.prompt_ids)} + max_new_tokens {request.max_new_tokens} - 1) but the pool "
                            f"has only {have}: raise --num-blocks or lower --max-new-tokens")
        if request.stop and self.tokenizer is None:
            raise UserError("stop strings need a tokenizer to decode the generated text")
        matcher = self._matcher(request, structured_output) if structured_output is not None else None
        rid, self._next_id = self._next_id, self._next_id + 1
        seq = Sequence(rid, request, make_generator(request.params.seed, self.model.device), self.clock.now())
        if matcher is not None:
            seq.matcher = matcher
            self._jump_at_start(seq)
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def _matcher(self, request: Request, params: StructuredOutputsParams):
        if self.grammars is None:
            raise UserError("structured output needs the tokenizer (the grammar is matched against token bytes)")
        if request.params.min_tokens > 0:   # 语法只剩 EOS 可选、min_tokens 又屏蔽 EOS 时，一个 token 也选不出来
            raise UserError("min_tokens cannot be combined with structured output: the grammar decides where the "
                            "output may end")
        return self.grammars.matcher(params)

    def _can_jump(self, seq: Sequence) -> bool:
        """要 logprobs 的请求不跳：强制的 token 没有采样它的那一行 logits。"""
        r = seq.request
        return self.config.jump_forward and r.logprobs is None and r.prompt_logprobs is None

    def _jump_at_start(self, seq: Sequence) -> None:
        """语法一开始就强制的一段（JSON Schema 的 `{"name":`，结尾的 ` "` 退回）直接放进输出，与提示词一起 prefill。
        至多 max_new_tokens − 1 个（至少留一个 token 采样），也不含 EOS：请求不会在第一次前向之前就结束。
        有停止串或停止 token 的请求不在这里跳（它们可能在强制的这段里就停下，那要等到第一步才能报告）。"""
        r = seq.request
        if not self._can_jump(seq) or r.stop or r.params.stop_token_ids:
            return
        tokens = jump_forward_tokens(seq.matcher, self.grammars, r.max_new_tokens - 1, with_eos=False)
        for token in tokens:
            seq.append_token(token, self.eos_ids, self.tokenizer)
        if tokens:
            seq.jump_pending = list(tokens)
            seq.num_prefill_tokens = seq.num_tokens
            self.structured_stats.jumps += 1
            self.structured_stats.jump_tokens += len(tokens)

    def abort(self, request_id: int) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None:  # 不认识或已经结束：什么也不做
            self._end_early(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        """还有没结束的请求，或者还有 abort 的结果没交出去（下一次 step() 交）。"""
        return bool(self.seqs or self._aborted)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        if not self.scheduler.has_unfinished():
            return outputs
        t0 = self.clock.now()
        self._propose()                                                      # 猜测也算在这一步的时间里
        batch = self.scheduler.schedule()
        fwd = self.kv_cache.plan(batch.seqs, batch.num_new_tokens,           # 这次前向的地址信息
                                 [seq.prompt_logits for seq in batch.seqs])
        logits = self.model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index).flatten(0, 1)  # (R, V)
        new = self._postprocess(batch, logits, fwd.logits_rows, fwd.prompt_rows)
        self._record(batch, fwd, self.clock.now() - t0, new)
        for o in new:
            if o.finished:                           # 记完这一步的账再还块：下一步就能接纳新请求
                seq = self.seqs.pop(o.request_id)
                self.scheduler.finish(seq, o.finish_reason)
                if self.proposer is not None:
                    self.proposer.free(seq)
        return outputs + new

    def _propose(self) -> None:
        """给每个在 decode 的请求要这一步的猜测，只要留得下的：至多 num_spec_tokens 个，也不超过 max_new_tokens 还剩的
        减 1（验证最多产出 k+1 个 token；add_request 检查过 提示词 + max_new_tokens ≤ 上下文，所以也不会超出上下文），
        全部加起来不超过 token 预算减去 decode 的请求数（调度器先给每个 decode 1 个 token，再按同样的顺序给猜测）。
        猜多了也是被截掉，草稿模型却要为每一个多走一步。暂停中的请求这一步不猜。调度器可能再砍掉几个（块不够）。"""
        if self.proposer is None:
            return
        running = self.scheduler.running
        seqs, caps, budget = [], [], self.config.max_num_batched_tokens - sum(not seq.in_prefill for seq in running)
        for seq in running:
            left = seq.request.max_new_tokens - len(seq.output_ids)
            if seq.in_prefill or left < 2:
                continue
            if seq.spec_paused_steps > 0:
                seq.spec_paused_steps -= 1
                continue
            n = min(self.config.num_spec_tokens, left - 1, budget)
            if n > 0:
                seqs.append(seq)
                caps.append(n)
                budget -= n
        if not seqs:
            return
        try:
            proposals = self.proposer.propose(seqs, caps)
        except Exception:   # 一批里是谁的猜测出的错？一个一个地重猜：出错的只结束它自己，别的请求照常
            proposals = [self._propose_one(seq, n) for seq, n in zip(seqs, caps)]
        for seq, n, proposal in zip(seqs, caps, proposals):
            if isinstance(proposal, Exception):
                self._end_early(seq, "error", proposal)
                continue
            seq.spec_token_ids, seq.spec_probs = list(proposal.token_ids), proposal.draft_probs
            seq.trim_spec(n)                             # 提议者多给了（FakeProposer）也只留 n 个
            if seq.matcher is not None:                  # step15：截到第一个不合法的猜测为止
                k = legal_prefix(seq.matcher, seq.spec_token_ids)
                if k < len(seq.spec_token_ids):
                    q = seq.spec_probs[k] if seq.spec_probs is not None else None
                    seq.trim_spec(k)
                    seq.spec_cut_q = q

    def _propose_one(self, seq: Sequence, n: int):
        try:
            return self.proposer.propose([seq], [n])[0]
        except Exception as e:
            return e

    def _end_early(self, seq: Sequence, reason: str, error: Optional[Exception] = None) -> None:
        """step() 之外结束一个请求（abort，或它自己的猜测出错："error"）：立刻还块，下一次 step() 报告它。"""
        del self.seqs[seq.request_id]
        self.scheduler.finish(seq, reason)
        if self.proposer is not None:
            self.proposer.free(seq)
        self._aborted.append(RequestOutput(seq.request_id, [], True, reason, seq.num_cached_tokens or 0, error))

    def _postprocess(self, batch: SchedulerOutput, logits: torch.Tensor, logits_rows: list[range],
                     prompt_rows: list[range]) -> list[RequestOutput]:
        """每个请求的 K/V 往前推它这一步算的 token 数，猜测先不算；算到了最后一个 token 的请求验证它的猜测
        （prefill 的前几块不采样）：接受的猜测 + 一个目标模型的 token 依次 append（遇到结束条件就停，后面的扔掉）。
        接受的猜测的 K/V 这次前向已经写进池子，算进 num_computed_tokens；被拒绝的不算——这就是回滚，它们的槽以后被覆盖。
        这一步的 token 一起产出（记下同一个时刻）；结束的请求由 step() 记完账后立刻还块。
        logprobs：prompt_rows 是这一块里还要的提示词位置（接着已攒的往后），采样的 token 各用自己那一行。
        step15：有约束的请求的 logits 行先铺上语法的掩码（_apply_masks），之后的一切都只看得见语法允许的 token；
        采样之后，语法唯一确定的一段直接追加（jump-forward），下一步作为一块 prefill 算。"""
        mask_errors = self._apply_masks(batch, logits, logits_rows)
        outputs, now = [], self.clock.now()
        for seq, n, rows, prows in zip(batch.seqs, batch.num_new_tokens, logits_rows, prompt_rows):
            spec = seq.spec_token_ids
            if prows:                                      # 位置 p 的 logits 给出第 p+1 个提示词 token 的 logprob
                first = len(seq.prompt_logprobs) + 1
                seq.prompt_logprobs += token_logprobs(logits[prows.start:prows.stop],
                                                      seq.request.prompt_ids[first:first + len(prows)],
                                                      seq.request.prompt_logprobs)
            seq.num_computed_tokens += n - len(spec)
            if not rows:                                   # plan 没给 logits 行：prefill 还没算完
                self.block_manager.cache_full_blocks(seq)   # 新写满的块登记进前缀缓存（之后结束、被抢占也还能命中）
                continue
            # 提示词的 logprobs 在 prefill 算完的这一步交出去，只交一次（被抢占后重算时 first_token_time 已经有了）
            prompt_lps = ([None] + seq.prompt_logprobs if seq.request.prompt_logprobs is not None
                          and seq.first_token_time is None else None)
            if seq.request.max_new_tokens == 0:            # 只要 prompt logprobs：prefill 完就结束，不采样
                self.block_manager.cache_full_blocks(seq)
                seq.finish_time = now
                outputs.append(RequestOutput(seq.request_id, [], True, "length", seq.num_cached_tokens,
                                             prompt_logprobs=prompt_lps))
                continue
            # logits 的这 1 + k 行：第 i 行判断第 i+1 个猜测，最后一行给奖励 token
            # 与 step03 同一套采样：提示词、已生成（接受的猜测随之变长）、会结束它的 EOS，发生器是这个请求自己的；
            # 没有猜测时就是一次 sample()
            r = seq.request
            try:
                if seq.request_id in mask_errors:        # step15：这个请求的语法算不出掩码：只结束它
                    raise mask_errors[seq.request_id]
                tokens = verify(logits[rows.start:rows.stop], r.prompt_ids, seq.output_ids,
                                Proposal(spec, seq.spec_probs, seq.spec_cut_q), r.params, seq.generator,
                                r.end_ids(self.eos_ids))
                if not all(0 <= t < logits.shape[-1] for t in tokens):   # 坏了的分布（NaN）采出越界的 id：喂回模型会让下一步的前向整批出错
                    raise ValueError(f"sampling produced token ids outside the vocabulary: {tokens}")
                if seq.matcher is not None:              # step15：掩码保证了合法；不合法只能是 logits 坏了（NaN）
                    check_sampled(seq.matcher, tokens)
            except Exception as e:   # 只属于这个请求（它的采样）：只结束它，同一批别的请求照常；服务器据此只回它一个错误
                outputs.append(RequestOutput(seq.request_id, [], True, "error", seq.num_cached_tokens, e))
                continue
            self._count_spec(seq, len(spec), len(tokens) - 1)
            seq.trim_spec(0)
            new, reason = seq.jump_pending, None          # step15：add_request 时强制的开头与第一个采样的 token 一起报告
            seq.jump_pending = []
            seq.token_times += [now] * len(new)
            sampled = []
            for i, token in enumerate(tokens):
                reason = seq.append_token(token, self.eos_ids, self.tokenizer)
                seq.token_times.append(now)
                sampled.append(token)
                if i < len(tokens) - 1:
                    seq.num_computed_tokens += 1      # 被接受的猜测：它的 K/V 已经在池子里
                if reason is not None:
                    break
            new = new + sampled
            if reason is None and seq.matcher is not None and self._can_jump(seq):
                forced, reason = self._jump(seq, now)
                new += forced
            self.block_manager.cache_full_blocks(seq)
            if seq.first_token_time is None:         # 被抢占后重算的那次 prefill 不算"首 token"
                seq.first_token_time = now
            if reason is not None:
                seq.finish_time = now
            k = seq.request.logprobs                  # 第 i 个新 token 由第 i 行决定（接受的猜测、更正或奖励 token）
            lps = token_logprobs(logits[rows.start:rows.start + len(sampled)], sampled, k) if k is not None else None
            outputs.append(RequestOutput(seq.request_id, new, reason is not None, reason, seq.num_cached_tokens,
                                         logprobs=lps, prompt_logprobs=prompt_lps))
        return outputs

    def _apply_masks(self, batch: SchedulerOutput, logits: torch.Tensor, logits_rows: list[range]) -> dict:
        """step15：这一步要采样的、有约束的请求，它们的每一行 logits（验证猜测时 1 + k 行）的掩码一起填进一个
        (n, ceil(V/32)) 的位图，一次铺上。返回 {request_id: 异常}：语法在某个状态一个 token 也接不上（词表里缺了
        某个字节的分词器才会这样）的请求，由 _postprocess 只结束它们。"""
        todo = [(seq, rows) for seq, rows in zip(batch.seqs, logits_rows) if rows and seq.matcher is not None]
        errors = {}
        if not todo:
            return errors
        t0 = self.clock.now()
        bitmask = allocate_token_bitmask(sum(len(rows) for _, rows in todo), logits.shape[-1])   # (n, W)
        index = []
        for seq, rows in todo:
            try:
                fill_rows(seq.matcher, seq.spec_token_ids, bitmask, len(index))
            except ValueError as e:
                errors[seq.request_id] = e
                continue
            index += rows
        if index:   # 在一切别的处理（logit_bias、惩罚、温度、top-k/p）之前；-inf 经过惩罚也还是极小，softmax 后正好是 0
            rows = torch.tensor(index, device=logits.device)
            logits[rows] = apply_token_bitmask_(logits[rows], bitmask[:len(index)])
        st = self.structured_stats
        st.masked_rows += len(index)
        st.mask_steps += 1
        st.mask_seconds += self.clock.now() - t0
        return errors

    def _jump(self, seq: Sequence, now: float) -> tuple[list[int], Optional[str]]:
        """step15 的 jump-forward：语法唯一确定的 token（structured.jump_forward_tokens）直接追加，不超过 max_new_tokens。
        它们与刚采样的那个 token 都还没算 K/V：num_prefill_tokens 延长到最后，下一步像被抢占后重算一样把它们作为一块
        prefill 算完（调度器为它们补块），算完的那一行 logits 采样下一个 token。返回 (追加的 token, 结束原因)。"""
        r, reason = seq.request, None
        try:
            tokens = jump_forward_tokens(seq.matcher, self.grammars, r.max_new_tokens - len(seq.output_ids))
        except ValueError:   # 语法在强制的这段里接不上任何 token：不跳；下一步算掩码时这个请求自己报错
            tokens = []
        for i, token in enumerate(tokens):
            reason = seq.append_token(token, self.eos_ids, self.tokenizer)
            seq.token_times.append(now)
            if reason is not None:
                tokens = tokens[:i + 1]
                break
        if tokens:
            seq.num_prefill_tokens = seq.num_tokens
            self.structured_stats.jumps += 1
            self.structured_stats.jump_tokens += len(tokens)
        return tokens, reason

    def _count_spec(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """记账；最近 SPEC_WINDOW 次验证的平均接受率太低就暂停这个请求的猜测。"""
        if proposed == 0:
            return
        seq.num_spec_proposed += proposed
        seq.num_spec_accepted += accepted
        self.spec_stats.proposed += proposed
        self.spec_stats.accepted += accepted
        self.spec_stats.verifications += 1
        seq.spec_recent = (seq.spec_recent + [accepted / proposed])[-SPEC_WINDOW:]
        if len(seq.spec_recent) == SPEC_WINDOW and sum(seq.spec_recent) / SPEC_WINDOW < SPEC_MIN_ACCEPTANCE:
            seq.spec_paused_steps, seq.spec_recent = SPEC_PAUSE_STEPS, []

    def _record(self, batch: SchedulerOutput, fwd, seconds: float, outputs: list[RequestOutput]) -> None:
        """这一步的一行账。干等 = 运行集合里已经有输出、这一步却没有产出 token 的请求（在等别人的 prefill）。"""
        produced = {o.request_id for o in outputs}
        # step15：看"产出过 token"而不是 output_ids：jump-forward 在第一次前向之前就放进输出的 token 还不算产出
        stalled = [seq for seq in self.scheduler.running
                   if seq.first_token_time is not None and seq.request_id not in produced]
        for seq in stalled:
            seq.stall_time += seconds
        held, used = self.block_manager.usage(self.scheduler.running)
        T = fwd.input_ids.shape[1]                   # 一行 (1, T)，没有填充
        self.step_stats.append(StepStats(
            prefill=batch.is_prefill, rows=1, width=T, tokens=T, idle_rows=0, kv_slots_held=held, kv_slots_used=used,
            seconds=seconds, gather_bytes=fwd.gather_bytes, stalled=len(stalled),
            decode_tokens=batch.num_decode_tokens, num_running=len(self.scheduler.running)))
        self.num_steps += 1

    def generate(self, requests: list[Request],
                 structured_output: Optional[StructuredOutputsParams] = None) -> GenerateOutput:
        """用连续批处理跑完全部请求（都在此刻到达）。先检查全部请求，任何一个不合法都在开始生成之前报告；
        中途出错（包括 Ctrl-C）时把这些请求全部 abort，块一个不少地还回去。
        step15：structured_output 给了就约束每一个请求（run.py 的 --regex / --json-schema / --choice）。"""
        seqs, first_step, t0 = [], self.num_steps, self.clock.now()
        try:
            for r in requests:
                seqs.append(self.seqs[self.add_request(r, structured_output)])
            while self.has_unfinished_requests():
                for o in self.step():
                    if o.error is not None:              # 一次性跑完的调用者：一个请求失败就是这次调用失败
                        raise o.error
        finally:
            ids = {seq.request_id for seq in seqs}
            for i in ids:
                self.abort(i)                        # 已经结束的请求 abort 什么也不做
            self._aborted = [o for o in self._aborted if o.request_id not in ids]   # 自己的收尾，不留给下一次 step()
        steps = last_steps(self.step_stats, self.num_steps - first_step)   # 这次运行的每一步
        return GenerateOutput([s.output_ids for s in seqs], collect_stats(seqs, steps, self.clock.now() - t0),
                              [s.finish_reason for s in seqs])
