"""step13 引擎：step12 的引擎（分页 KV cache + 连续批处理 + 前缀缓存 + 分块 prefill + 量化的池子 + 换出式抢占 + 投机解码
+ KV 驱逐）加上非前缀的 K/V 复用（块缓存 + CacheBlend），一步一步地驱动（与 vLLM 的 LLMEngine 同样的接口）。
与 step03 逐 token 一致的道理（块表 + 按位置的掩码；每个请求自己的随机数发生器，被抢占后只重算 K/V）
和每一步的记账（StepStats、每个请求的时刻）都同 step05 的引擎。

    add_request(request) -> request_id     检查请求、放进等待队列（到达时刻 = 时钟的读数）
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

step12 加的 KV 驱逐（kv_policy 不是 "full" 时；full 与 step09 逐位相同）：每个请求每层、每个 KV 头最多留 kv_budget 个
token 的 K/V。每次前向之后（_evict），槽数到了 预算 + 一块 的请求被压缩到正好 预算 个槽：eviction.kept_slots 选出
要留的槽，块管理器先收回它的整张旧块表、再分 blocks_for(预算) 个新块，kv_cache.compact 把留下的 K/V 拷进去——
多出来的块真的回到池子里。多留一块的余量让压缩（和 cache 位置时的重新旋转）每 block_size 个 token 才做一次。
h2o 每次前向给它的全部 query 打分（plan 的 score_queries，kv_cache.py）。
snapkv 是论文的做法：prefill 时整个提示词都留着（这就是 SnapKV 真实的内存：add_request 按它检查块数），提示词最后
w 个位置的 query 投票（它们可能分在几块里算，票一直累加），算完提示词最后一个 token 的那次前向之后压缩一次、
提示词长于预算才压；decode 只往后追加，一个也不扔（同 SnapKV 的代码：只压缩提示词），所以它的槽数是 预算 + 生成的。
snapkv-chunked 是流式的变体：每一块 prefill 之后槽数到了 预算 + 一块 就压缩，投票的是这一块自己的最后 w 个 query
（问题在最后一块时，前面几块压缩时它还没来），提示词再长也不超预算；decode 同样只追加。
新块分不到（块被别人共享、池子满）时这一次不压缩，下一次前向之后再试（num_compactions_skipped）。
抢占默认换出（preempt 没给时）：重算要把 提示词 + 已生成 整段再 prefill 一遍，驱逐省下的又全要回来。
投机解码与量化的池子和驱逐不能同时开（EngineConfig.validate 说为什么）。

滑动窗口模型（mistral、开了 use_sliding_window 的 qwen2：cfg.layer_windows）是模型自己的注意力规则，不是驱逐策略：
窗口为 W 的层，位置 i 的 query 只看位置 (i − W, i] 的 key（与 HF 相同，结果精确）。内核没有窗口，这种模型走 gather
（掩码在 gather.py）。每一层都滑动时，整块落在每一层窗口之外的 K/V 再也没人看：每次前向之后把它们从块表开头还回池子
（_drop_out_of_window，vLLM 的 SlidingWindowManager.remove_skipped_blocks 的做法；不拷贝，只是块表去掉开头几块、
num_evicted 加上那么多槽——留下的槽仍是原文里连续的一段），一个请求的块数不随长度增长。有一层是全注意力时什么也不还：
那一层的 query 要看全部 key，而池子里一个槽存的是全部层的 K/V。这种模型只能用 kv_policy full（它本来就有窗口）。

step13 加的非前缀复用：add_request(request, chunks=[(start, end), ...]) 标出提示词里的段（检索到的文档）。
--blend 决定标了段的请求怎么得到 K/V（没标段的请求一律照 step12）：
    none    完整 prefill（不读前缀缓存，也不读块缓存）：精确，token 与 step12 相同
    prefix  只用前缀缓存（step06）：精确
    concat / reuse / blend   块缓存（chunk_cache.py）里每段单独算好的 K/V 拼起来，再按模式修（blend.py）：近似
后三种在请求被接纳、拿到块之后（调度器的 on_admit → _prefill_chunks）一次做完提示词前 n − 1 个 token 的 prefill：
每段查块缓存（没有就单独算一遍、存进去），按模式拼、转位置、选择性重算，结果写进请求自己的块；最后一个提示词 token
照常进这一步的前向、采样出第一个 token。段在这期间被持有（引用计数），不会被回收；它的块没人用时与前缀缓存的块排在
同一条 LRU 里。拼出来的 K/V 不登记进前缀缓存。拼段的 prefill 的时间算在这一步里（TTFT 含它）；它算掉的 token
（单独算的段 + 重算的 + 检查段，折算成走完全部层的）记在 BlendStepStats.blend_tokens，也算进这一步的 token 预算
（scheduler.py）：一步里拼段的 prefill 与前向加起来不超过 max_num_batched_tokens，正在 decode 的请求不会被几个同时接纳的
拼段请求卡住。拼段出错（它的段、它的前向）只结束那一个请求。与驱逐策略（K/V 的去留另有规则）、prompt logprobs（拼段的 prefill
不出提示词位置的 logits）不能同时用。
"""
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from common.clock import Clock, WallClock
from common.errors import UserError
from common.stats import STEP_STATS_KEPT, EngineStats, StepStats, collect_stats, last_steps
from step02_sampling.sampler import make_generator
from step04_static_batching.request import Request

from .blend import BLEND_MODES, blend_cost, blend_prefill, check_chunks, check_model, reuse_chunks, reuse_cost
from .block_manager import BlockManager
from .chunk_cache import ChunkStore, write_kv
from .config import SCORED_POLICIES, EngineConfig
from .eviction import kept_slots, rotation_deltas
from .kv_cache import PagedKVCache
from .proposer import DraftModelProposer, NgramProposer, Proposal, Proposer
from .quant import kv_format
from .rejection_sampler import verify
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Logprob, RequestOutput, Sequence
from .swap import SwapSpace

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
class BlendStepStats(StepStats):
    """step13：一步的账再加上接纳时拼段的 prefill 在前向之外算掉的 token（折算成走完全部层的，见 blend.blend_cost）。
    tokens + blend_tokens 是这一步一共算了多少，不超过 max_num_batched_tokens（一步只做一个比预算还大的拼段时除外）。"""
    blend_tokens: int = 0


@dataclass
class EvictionStats(EngineStats):
    """step12：EngineStats 加上每个请求的 KV 块数（顺序同 requests）：结束时块表有几块、一生中最多几块。"""
    kv_blocks: list[int] = field(default_factory=list)
    kv_blocks_peak: list[int] = field(default_factory=list)


@dataclass
class BlendStats(EvictionStats):
    """step13：再加上每个请求的提示词里 K/V 来自块缓存、没重算的 token 数，和段里被 blend 选中重算的 token 数。"""
    reused_tokens: list[int] = field(default_factory=list)
    recomputed_tokens: list[int] = field(default_factory=list)


class GenerateOutput(NamedTuple):
    outputs: list[list[int]]   # 每个请求的新 token，顺序与 requests 相同
    stats: "BlendStats"


class LLMEngine:
    def __init__(self, model, config: EngineConfig, tokenizer=None, eos_ids=(), clock: Clock | None = None,
                 draft_model=None, proposer: Optional[Proposer] = None):
        """draft_model：spec_method="draft" 的草稿模型（词表与 model 相同）；proposer：直接给一个提议者
        （测试用脚本化的 FakeProposer），给了就不看 spec_method。"""
        config.validate()
        windows = model.cfg.layer_windows
        if model.cfg.sliding and config.kv_policy != "full":   # 窗口本身就限定了要看的 key；槽号也只能是原文连续的
            raise UserError(f"--kv-policy {config.kv_policy} cannot be used with a sliding-window model (its layers "
                            "already attend to a fixed window; blocks that leave it are freed): use --kv-policy full")
        # 每一层都滑动时，槽数最多留 最大窗口 − 1 个再加不满一块（_drop_out_of_window）；否则 None
        self.window_keep = (max(windows) - 1 if model.cfg.sliding and all(w is not None for w in windows) else None)
        self.model, self.config = model, config
        self.tokenizer, self.eos_ids = tokenizer, tuple(eos_ids)   # tokenizer：有请求带停止字符串时需要
        self.clock = clock or WallClock()
        evicting = config.kv_policy != "full" or self.window_keep is not None
        # 驱逐时每个请求在两次前向之间最多留的槽（snapkv 的 prefill 整个提示词都留着：None）
        self.max_kept = (None if config.kv_policy == "snapkv" else
                         (config.kv_budget or self.window_keep) + config.block_size - 1 if evicting else None)
        max_blocks = (-(-(self.max_kept + config.max_num_batched_tokens) // config.block_size)
                      if self.max_kept is not None else None)          # 再加一次前向写的：add_request 按它查池子
        # h2o / snapkv 的分数来自请求自己每个 query 的注意力：命中前缀缓存的 token 没有算过 query，分数就缺了一块，
        # 留下哪些 token 会随缓存里碰巧有什么而变。所以这些策略不查前缀缓存（同 prompt logprobs 的请求）
        self.block_manager = BlockManager(config.num_blocks, config.block_size,
                                          config.enable_prefix_caching and config.kv_policy not in SCORED_POLICIES)
        preempt = config.preempt or ("swap" if evicting else "recompute")   # 驱逐时默认换出（文件开头）
        try:  # 整个池子只分配一次；--num-blocks 过大时给一行 error 而不是 traceback
            self.kv_cache = PagedKVCache(model.cfg, config.num_blocks, config.block_size, model.device, model.dtype,
                                         config.attention, kv_format(config.kv_dtype, model.dtype))
            self.swap = (SwapSpace(self.kv_cache.tensors(), config.swap_blocks or config.num_blocks, block_dim=2)
                         if preempt == "swap" else None)
        except (RuntimeError, MemoryError) as e:
            raise UserError(f"cannot allocate a KV pool of {config.num_blocks} blocks x {config.block_size} "
                            f"tokens: {e}") from None
        self.proposer = proposer if proposer is not None else self._make_proposer(draft_model)
        if config.kv_policy != "full" and config.positions == "cache":
            self.kv_cache.use_cache_positions()
        self.scheduler = Scheduler(self.block_manager, config.max_batch_size, config.max_num_batched_tokens, self.swap,
                                   on_preempt=self.proposer.free if self.proposer is not None else None,
                                   evicting=evicting, max_blocks=max_blocks, split_at_prompt=config.kv_policy == "snapkv",
                                   on_admit=self._prefill_chunks)
        if config.blend in BLEND_MODES:
            check_model(model)
        self.chunk_store = ChunkStore(self.block_manager, self.kv_cache.pool)   # step13：段的 K/V，住在同一个池子里
        self.num_compactions = 0                     # step12：压缩过几次
        self.num_compactions_skipped = 0             # 到了该压缩的时候却分不到新块、推到下一次的次数
        self.spec_stats = SpecStats()
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

    def add_request(self, request: Request, chunks: Optional[list[tuple[int, int]]] = None) -> int:
        """检查请求（非法输入抛 UserError），放进等待队列，返回 request_id。
        step13：chunks = 提示词里各段的 [start, end)（token 下标，按顺序、不重叠）；怎么用它们由 --blend 决定。"""
        c = self.config
        request.validate(c.max_model_len or self.model.cfg.max_position_embeddings, self.model.cfg.vocab_size)  # 空提示词、N ≤ 0、超出上下文、采样参数
        need, have = blocks_needed(request, self.config.block_size), self.config.num_blocks
        if c.kv_policy == "snapkv":           # prefill 时留着整个提示词；压缩之后 预算 + 生成的（decode 不驱逐）
            slots = max(len(request.prompt_ids), c.kv_budget + max(request.max_new_tokens, 1) - 1)
            need = min(need, -(-slots // c.block_size))
        elif self.max_kept is not None:       # 驱逐时最多 预算 + 一块 − 1 个槽，加上一次前向写的；
            # snapkv-chunked 的 decode 不驱逐；滑动窗口模型的"预算"是 最大窗口 − 1
            cap = self.max_kept + c.max_num_batched_tokens
            need = min(need, -(-(cap + (request.max_new_tokens if c.kv_policy == "snapkv-chunked" else 0)) // c.block_size))
        if need > have:   # 单独一个就放不进池子的请求永远跑不完（抢占别人也腾不出更多块）
            raise UserError(f"a request needs up to {need} KV blocks of {self.config.block_size} tokens (prompt "
                            f"{len(request.prompt_ids)} + max_new_tokens {request.max_new_tokens} - 1) but the pool "
                            f"has only {have}: raise --num-blocks or lower --max-new-tokens")
        if request.stop and self.tokenizer is None:
            raise UserError("stop strings need a tokenizer to decode the generated text")
        if chunks is not None:
            chunks = check_chunks(chunks, len(request.prompt_ids))
            if c.blend in BLEND_MODES and request.prompt_logprobs is not None:
                raise UserError(f"prompt_logprobs cannot be combined with chunk marks under --blend {c.blend} "
                                "(the blended prefill computes no logits for prompt positions)")
        rid, self._next_id = self._next_id, self._next_id + 1
        seq = Sequence(rid, request, make_generator(request.params.seed, self.model.device), self.clock.now())
        if chunks:
            seq.chunks = chunks
            seq.read_prefix_cache = c.blend == "prefix"     # none：完整 prefill；concat / reuse / blend：走块缓存
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

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
        if batch.unschedulable is not None:   # 池子全空也接纳不了（块数的上界算少了）：以错误结束它，不让它卡住别人
            seq = batch.unschedulable
            self._end_early(seq, "error", UserError(
                f"request {seq.request_id} cannot be scheduled: even an empty pool of {self.config.num_blocks} KV blocks "
                f"cannot hold its next prefill chunk; raise --num-blocks"))
        if not batch.seqs:                    # 这一步谁也不算（刚抢占过，或只有上面那个）：不做前向
            outputs, self._aborted = outputs + self._aborted, []
            return outputs
        for seq in self.scheduler.running:
            seq.peak_blocks = max(seq.peak_blocks, len(seq.block_table))
        fwd = self.kv_cache.plan(batch.seqs, batch.num_new_tokens,           # 这次前向的地址信息
                                 [seq.prompt_logits for seq in batch.seqs], self._score_queries(batch))
        candidates = self._compaction_candidates(batch)                     # 前向之前定：要看的是这一步算了什么
        logits = self.model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index).flatten(0, 1)  # (R, V)
        new = self._postprocess(batch, logits, fwd.logits_rows, fwd.prompt_rows)
        self._record(batch, fwd, self.clock.now() - t0, new)
        for o in new:
            if o.finished:                           # 记完这一步的账再还块：下一步就能接纳新请求
                seq = self.seqs.pop(o.request_id)
                o.kv_blocks, o.kv_blocks_peak = len(seq.block_table), seq.peak_blocks
                o.reused_tokens, o.recomputed_tokens = seq.num_reused_tokens, seq.num_recomputed_tokens
                self.scheduler.finish(seq, o.finish_reason)
                if self.proposer is not None:
                    self.proposer.free(seq)
        self._evict(candidates)
        return outputs + new

    @torch.inference_mode()
    def _prefill_chunks(self, seq: Sequence, limit: Optional[int]) -> Optional[int]:
        """step13（调度器的 on_admit）：标了段的请求在 concat / reuse / blend 下，刚拿到块就一次做完提示词前 n − 1 个
        token 的 prefill：段的 K/V 从块缓存拿（没有就单独算、存进去），按模式拼好、修好，写进它自己的块。
        最后一个提示词 token 留给这一步的普通前向（它本来就要重算，它的 logits 给出第一个 token）。
        返回算掉的 token 数（折算成走完全部层的：单独算的段 + blend_cost），调度器记进这一步的预算；
        代价超过 limit（None = 不限）时什么也不做，返回 None。出错只结束这一个请求（还块，下一次 step() 报告），返回 0。"""
        if seq.chunks is None or self.config.blend not in BLEND_MODES or seq.num_computed_tokens:
            return 0
        n = len(seq.request.prompt_ids) - 1
        if n <= 0 or seq.chunks[0][0] >= n:
            return 0
        c, ids = self.config, seq.request.prompt_ids
        missing, num_reused = reuse_cost(self.chunk_store, ids, seq.chunks, n)
        cost = missing + blend_cost(n, num_reused, c.blend, c.ratio, self.model.cfg.num_layers)
        if limit is not None and cost > limit:
            return None
        try:
            kv, reused, held, _ = reuse_chunks(self.model, self.chunk_store, ids, seq.chunks, c.blend, n)
            try:
                res = blend_prefill(self.model, ids[:n], kv, reused, c.blend, c.ratio, c.deviation)
                write_kv(self.kv_cache.pool, seq.block_table, res.kv)
            finally:
                for e in held:                        # 段的 K/V 已经拷进这个请求的块：不再持有，没人用时可以回收
                    self.chunk_store.release(e)
        except Exception as e:   # 只属于这个请求（它的段、它的前向）：同 _postprocess，只结束它，别的请求照常
            self.block_manager.free_seq(seq)          # 还在等待队列里的请求 finish 不还块：这里先还
            self._end_early(seq, "error", e)
            return 0
        seq.num_computed_tokens, seq.approx_kv = n, True
        seq.num_reused_tokens = int((reused & ~res.selected).sum())
        seq.num_recomputed_tokens = int((reused & res.selected).sum())
        return cost

    def _must_compact(self, seq: Sequence, kv_len: int) -> bool:
        """step12：槽数到了 预算 + 一块 就压缩（多一块的余量：压缩每 block_size 个 token 才做一次）；
        snapkv 只压缩一次（_compaction_candidates 只在算完提示词的那一步给它），提示词长于预算就压。"""
        c = self.config
        if c.kv_policy == "snapkv":
            return kv_len > c.kv_budget
        return c.kv_policy != "full" and kv_len >= c.kv_budget + c.block_size

    def _compaction_candidates(self, batch: SchedulerOutput) -> Optional[list[Sequence]]:
        """step12：这一步前向之后要看要不要压缩的请求（None = 运行中的全部：window / sinks / h2o）。
        snapkv：这一步算到了提示词最后一个 token 的（调度器让一块停在那里）；snapkv-chunked：这一步算了提示词的。"""
        c = self.config
        if c.kv_policy == "snapkv":
            return [seq for seq, n in zip(batch.seqs, batch.num_new_tokens)
                    if seq.num_computed_tokens < len(seq.request.prompt_ids) == seq.num_computed_tokens + n]
        if c.kv_policy == "snapkv-chunked":
            return [seq for seq in batch.seqs if seq.in_prefill]
        return None

    def _score_queries(self, batch: SchedulerOutput) -> Optional[list[int]]:
        """step12：每个请求这一步让最后几个 query 打分。h2o：全部 query，每一步（分数从进缓存起一直累加）；
        snapkv：这一块里落在提示词最后 snapkv_window 个位置上的 query（一块停在提示词末尾，所以它们总是这一块的最后几个；
        票跨块累加，提示词不长于预算就不投）；snapkv-chunked：这一块 prefill 之后要压缩时，它的最后 snapkv_window 个
        query 投票（投票之前清零：每次压缩只看这一块）。"""
        c = self.config
        if c.kv_policy not in SCORED_POLICIES:
            return None
        out = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, P = seq.num_computed_tokens, len(seq.request.prompt_ids)
            if c.kv_policy == "h2o":
                out.append(n)
            elif c.kv_policy == "snapkv":
                out.append(min(n, max(0, start + n - (P - c.obs_window))) if start < P and P > c.kv_budget else 0)
            elif seq.in_prefill and self._must_compact(seq, seq.kv_len + n):
                if seq.kv_scores is not None:
                    seq.kv_scores.zero_()
                out.append(c.obs_window)
            else:
                out.append(0)
        return out

    def _evict(self, candidates: Optional[list[Sequence]]) -> None:
        """step12：每次前向之后，候选（_compaction_candidates）里槽数到了 预算 + 一块 的运行中请求压缩到正好 预算 个槽
        （snapkv：提示词长于预算）。先还掉整张旧块表、再分新块：旧块里登记过的前缀块进 evictable、内容不动，与别人
        共享的块还在别人手里，新块引用计数都是 0——从不写别人的块。分不到就这次不压缩，下一次前向之后再试
        （snapkv 不查前缀缓存，块都只有它自己用，总分得到：它只压缩这一次）。"""
        c, bm = self.config, self.block_manager
        if self.window_keep is not None:
            self._drop_out_of_window()
        if c.kv_policy == "full":
            return
        B = c.kv_budget
        for seq in self.scheduler.running if candidates is None else candidates:
            if seq.is_finished or seq not in self.scheduler.running or not self._must_compact(seq, seq.kv_len):
                continue
            n = bm.blocks_for(B)
            if not bm.can_replace(seq.block_table, n):
                self.num_compactions_skipped += 1
                continue
            kv_len, L, H_kv = seq.kv_len, self.model.cfg.num_layers, self.model.cfg.num_kv_heads
            recent = c.recent if c.kv_policy == "h2o" else c.obs_window
            kept = kept_slots(c.kv_policy, kv_len, B, L, H_kv, sinks=c.sinks, recent=recent, scores=seq.kv_scores,
                              pool_kernel=1 if c.kv_policy == "h2o" else c.pool_kernel)   # (L, H_kv, B)
            old = seq.block_table
            bm.free(old)
            seq.block_table = bm.allocate(n)
            self.kv_cache.compact(old, seq.block_table, kept,
                                  rotation_deltas(kept) if self.kv_cache.rerotates_on_compaction else None)
            if seq.kv_scores is not None:             # 分数跟着留下的槽走；之后的新槽从 0 开始
                scores = torch.zeros(L, H_kv, n * c.block_size, device=seq.kv_scores.device)
                scores[:, :, :B] = seq.kv_scores.gather(2, kept.to(seq.kv_scores.device))
                seq.kv_scores = scores
            seq.num_evicted += kv_len - B
            seq.num_registered_blocks = 0
            self.num_compactions += 1

    def _drop_out_of_window(self) -> None:
        """每一层都滑动的模型：下一个 query 在槽 kv_len（原文位置 num_computed_tokens），最大的窗口也只看槽号
        > kv_len − W 的 key，前 kv_len − (W − 1) 个槽再也没人看。其中整块的部分从块表开头还回池子（引用计数：共享的
        前缀块还在别人手里，登记过的进 evictable），num_evicted 加上这么多槽：留下的槽号整体前移整块，原文位置 = 槽 +
        num_evicted 仍然成立，什么也不用拷。之后的块不再是 token 前缀，不登记进前缀缓存（block_manager.cache_full_blocks）。"""
        bs = self.config.block_size
        for seq in self.scheduler.running:
            n = (seq.kv_len - self.window_keep) // bs         # 整块都在窗口外的块数
            if n > 0:
                self.block_manager.free(seq.block_table[:n])
                seq.block_table = seq.block_table[n:]
                seq.num_evicted += n * bs
                seq.num_registered_blocks = 0

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

    def _propose_one(self, seq: Sequence, n: int):
        try:
            return self.proposer.propose([seq], [n])[0]
        except Exception as e:
            return e

    def _end_early(self, seq: Sequence, reason: str, error: Optional[Exception] = None) -> None:
        """step() 之外结束一个请求（abort，或它自己的猜测出错："error"）：立刻还块，下一次 step() 报告它。"""
        del self.seqs[seq.request_id]
        blocks = len(seq.block_table)
        self.scheduler.finish(seq, reason)
        if self.proposer is not None:
            self.proposer.free(seq)
        self._aborted.append(RequestOutput(seq.request_id, [], True, reason, seq.num_cached_tokens or 0, error,
                                           kv_blocks=blocks, kv_blocks_peak=seq.peak_blocks))

    def _postprocess(self, batch: SchedulerOutput, logits: torch.Tensor, logits_rows: list[range],
                     prompt_rows: list[range]) -> list[RequestOutput]:
        """每个请求的 K/V 往前推它这一步算的 token 数，猜测先不算；算到了最后一个 token 的请求验证它的猜测
        （prefill 的前几块不采样）：接受的猜测 + 一个目标模型的 token 依次 append（遇到结束条件就停，后面的扔掉）。
        接受的猜测的 K/V 这次前向已经写进池子，算进 num_computed_tokens；被拒绝的不算——这就是回滚，它们的槽以后被覆盖。
        这一步的 token 一起产出（记下同一个时刻）；结束的请求由 step() 记完账后立刻还块。
        logprobs：prompt_rows 是这一块里还要的提示词位置（接着已攒的往后），采样的 token 各用自己那一行。"""
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
                tokens = verify(logits[rows.start:rows.stop], r.prompt_ids, seq.output_ids,
                                Proposal(spec, seq.spec_probs), r.params, seq.generator, r.end_ids(self.eos_ids))
                if not all(0 <= t < logits.shape[-1] for t in tokens):   # 坏了的分布（NaN）采出越界的 id：喂回模型会让下一步的前向整批出错
                    raise ValueError(f"sampling produced token ids outside the vocabulary: {tokens}")
            except Exception as e:   # 只属于这个请求（它的采样）：只结束它，同一批别的请求照常；服务器据此只回它一个错误
                outputs.append(RequestOutput(seq.request_id, [], True, "error", seq.num_cached_tokens, e))
                continue
            self._count_spec(seq, len(spec), len(tokens) - 1)
            seq.trim_spec(0)
            new, reason = [], None
            for i, token in enumerate(tokens):
                reason = seq.append_token(token, self.eos_ids, self.tokenizer)
                seq.token_times.append(now)
                new.append(token)
                if i < len(tokens) - 1:
                    seq.num_computed_tokens += 1      # 被接受的猜测：它的 K/V 已经在池子里
                if reason is not None:
                    break
            self.block_manager.cache_full_blocks(seq)
            if seq.first_token_time is None:         # 被抢占后重算的那次 prefill 不算"首 token"
                seq.first_token_time = now
            if reason is not None:
                seq.finish_time = now
            k = seq.request.logprobs                  # 第 i 个新 token 由第 i 行决定（接受的猜测、更正或奖励 token）
            lps = token_logprobs(logits[rows.start:rows.start + len(new)], new, k) if k is not None else None
            outputs.append(RequestOutput(seq.request_id, new, reason is not None, reason, seq.num_cached_tokens,
                                         logprobs=lps, prompt_logprobs=prompt_lps))
        return outputs

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
        stalled = [seq for seq in self.scheduler.running if seq.output_ids and seq.request_id not in produced]
        for seq in stalled:
            seq.stall_time += seconds
        held, used = self.block_manager.usage(self.scheduler.running)
        T = fwd.input_ids.shape[1]                   # 一行 (1, T)，没有填充
        self.step_stats.append(BlendStepStats(
            prefill=batch.is_prefill, rows=1, width=T, tokens=T, idle_rows=0, kv_slots_held=held, kv_slots_used=used,
            seconds=seconds, gather_bytes=fwd.gather_bytes, stalled=len(stalled),
            decode_tokens=batch.num_decode_tokens, num_running=len(self.scheduler.running),
            blend_tokens=batch.num_admit_tokens))
        self.num_steps += 1

    def generate(self, requests: list[Request], chunks: Optional[list] = None) -> GenerateOutput:
        """用连续批处理跑完全部请求（都在此刻到达）。先检查全部请求，任何一个不合法都在开始生成之前报告；
        中途出错（包括 Ctrl-C）时把这些请求全部 abort，块一个不少地还回去。step13：chunks[i] 是第 i 个请求的段（或 None）。"""
        seqs, first_step, t0, end_blocks = [], self.num_steps, self.clock.now(), {}
        try:
            for i, r in enumerate(requests):
                seqs.append(self.seqs[self.add_request(r, chunks[i] if chunks is not None else None)])
            while self.has_unfinished_requests():
                for o in self.step():
                    if o.error is not None:              # 一次性跑完的调用者：一个请求失败就是这次调用失败
                        raise o.error
                    if o.finished:
                        end_blocks[o.request_id] = o.kv_blocks
        finally:
            ids = {seq.request_id for seq in seqs}
            for i in ids:
                self.abort(i)                        # 已经结束的请求 abort 什么也不做
            self._aborted = [o for o in self._aborted if o.request_id not in ids]   # 自己的收尾，不留给下一次 step()
        steps = last_steps(self.step_stats, self.num_steps - first_step)   # 这次运行的每一步
        stats = collect_stats(seqs, steps, self.clock.now() - t0)
        return GenerateOutput([s.output_ids for s in seqs], BlendStats(
            **vars(stats), kv_blocks=[end_blocks.get(s.request_id, 0) for s in seqs],
            kv_blocks_peak=[s.peak_blocks for s in seqs], reused_tokens=[s.num_reused_tokens for s in seqs],
            recomputed_tokens=[s.num_recomputed_tokens for s in seqs]))
