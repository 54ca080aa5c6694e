"""step04：静态批处理（static batching）。

请求按给定顺序切成每批最多 max_batch_size 个（split_batches）。每一批：
  1. 左填充到这批最长的提示词，一次批量前向做完所有行的 prefill（不是一个一个地做）；
  2. 然后每步一次前向、每行各生成一个 token，直到每一行都结束；
     先结束的行继续占着自己那一行陪跑（算出来的结果扔掉），整批结束后才开始下一批。
每一行有自己的停止条件（max_new_tokens、EOS、停止字符串）、自己的采样参数和自己的随机数发生器，
所以每个请求的输出与它在 step03 里单独生成时相同。

缓存直接用 step03 的 PreallocKVCache，只是 batch_size = B：左填充让所有行在同一列写入（见 batch.py），
整批共用一个 length，update / advance 与 step03 完全相同。每次前向把它和本次的逐行掩码包成一个 MaskedCache
交给模型（common/kv_cache.py 的接口：update + mask），模型代码一行不改。

每次前向记一行 StepStats（stats.py），每个请求记下首 token 与结束的时刻：step05 用同一套记账和它比较。
"""
import time
from typing import NamedTuple, Optional

import torch

from common.errors import UserError
from step02_sampling.sampler import make_generator, sample
from step03_kvcache_single.cache import PreallocKVCache
from step04_static_batching.batch import MaskedCache, attention_mask, left_pad, positions
from step04_static_batching.request import Request, Sequence
from common.stats import EngineStats, StepStats


class BatchOutput(NamedTuple):
    outputs: list[list[int]]   # 每个请求的新 token，顺序与 requests 相同
    stats: EngineStats


def forward(model, cache: PreallocKVCache, x: torch.Tensor, pad_lens: torch.Tensor) -> torch.Tensor:
    """x (B, L)：整批的第 cache.length .. cache.length+L-1 列跑一次前向，K/V 写进缓存；
    返回每行最后一列的 logits (B, V)。"""
    start, L = cache.length, x.shape[1]
    # >>> step04 修改：位置与掩码逐行不同（step03 是 arange(start, start+L) 和模型默认的因果掩码）
    view = MaskedCache(cache, attention_mask(pad_lens, start, L))              # 本次前向：缓存 + (B, 1, 1, L, S) 掩码
    logits = model(x, positions(pad_lens, start, L), view, last_only=True)     # (B, 1, V)
    # <<<
    cache.advance(L)  # 全部层都写完之后才推进长度：每次前向正好一次
    return logits[:, -1]                                                        # (B, V)


def reserved_len(requests: list[Request]) -> int:
    """一批的缓存每行预留多少列：最长的提示词 + 最多的新 token - 1（最后采样出的 token 不再喂回模型）。"""
    return max(len(r.prompt_ids) for r in requests) + max(r.max_new_tokens for r in requests) - 1


def split_batches(requests: list[Request], max_batch_size: int,
                  max_kv_slots: Optional[int] = None) -> list[range]:
    """按到达顺序切批，返回每批的下标范围。一批最多 max_batch_size 个；给了 KV 预算 max_kv_slots（以槽计）时，
    这批的预留 B × reserved_len 也不能超出预算（step05 的 chapter.py 用它算"同样的 KV 内存，连续预留能同时跑几个"）。"""
    def fits(lo: int, hi: int) -> bool:
        n = hi - lo
        return n <= max_batch_size and (max_kv_slots is None or n * reserved_len(requests[lo:hi]) <= max_kv_slots)

    batches, start = [], 0
    for end in range(1, len(requests) + 1):
        if not fits(start, end):              # 再加第 end-1 个就放不下：前面的成一批，它开始新的一批
            if end - 1 > start:
                batches.append(range(start, end - 1))
                start = end - 1
            if not fits(start, end):          # 单独一个都放不下（只可能是 KV 预算太小）
                raise UserError(f"request {start} alone needs {reserved_len(requests[start:end])} KV slots, "
                                f"more than the budget of {max_kv_slots}")
    if requests:
        batches.append(range(start, len(requests)))
    return batches


@torch.inference_mode()
def generate_batch(model, requests: list[Request], max_batch_size: int, eos_ids=(), tokenizer=None) -> BatchOutput:
    """tokenizer：有请求带停止字符串时需要（把新生成的 token 解码成文本再找）。"""
    if max_batch_size < 1:
        raise UserError(f"max_batch_size must be >= 1, got {max_batch_size}")
    for r in requests:   # 先检查全部请求，再开始生成：不会跑了一半才报错
        r.validate(model.cfg.max_position_embeddings, model.cfg.vocab_size)
    if tokenizer is None and any(r.stop for r in requests):
        raise ValueError("stop strings need a tokenizer to decode the generated text")
    seqs = [Sequence(r, make_generator(r.params.seed, model.device)) for r in requests]
    stats = EngineStats()
    t0 = time.perf_counter()
    for batch in split_batches(requests, max_batch_size):
        run_batch(model, [seqs[i] for i in batch], eos_ids, tokenizer, stats, t0)
    stats.wall_s = time.perf_counter() - t0
    stats.first_token_s = [s.first_token_time for s in seqs]
    stats.finish_s = [s.finish_time for s in seqs]
    stats.num_outputs = [len(s.output_ids) for s in seqs]
    stats.stall_s = [0.0] * len(seqs)    # 每批的 prefill 都在这批任何一行的首 token 之前：没有人在 decode 中途干等
    return BatchOutput([s.output_ids for s in seqs], stats)


def run_batch(model, seqs: list[Sequence], eos_ids, tokenizer, stats: EngineStats, t0: float) -> None:
    """跑完一批（B ≤ max_batch_size 行），每次前向往 stats 里记一行。"""
    device = model.device
    t = time.perf_counter()
    input_ids, pad_lens = left_pad([s.request.prompt_ids for s in seqs], device)    # (B, P), (B,)
    B, P = input_ids.shape
    # 一开始就按最坏情况预留：最长的提示词 + 最多的新 token - 1
    max_len = reserved_len([s.request for s in seqs])
    cache = PreallocKVCache(model.cfg, max_len, device, model.dtype, batch_size=B)

    # prefill：整批一次前向。左填充 → 每行最后一个真实 token 都在最后一列，last_only 正好取到它
    logits = forward(model, cache, input_ids, pad_lens)                              # (B, V)
    prompt_tokens = sum(len(s.request.prompt_ids) for s in seqs)
    used = kv_slots_used(seqs)
    sample_rows(seqs, logits, eos_ids, tokenizer, t0)
    stats.steps.append(StepStats(True, B, P, prompt_tokens, 0, B * max_len, used, time.perf_counter() - t))
    while not all(s.finished for s in seqs):
        t = time.perf_counter()
        # decode：所有行一起往下一列写。已结束的行喂它自己的最后一个 token 陪跑：
        # 它写进缓存的 K/V 和算出的 logits 都没人用，但这一行的计算照样要做（这就是 decode 空转浪费）
        x = torch.tensor([[s.output_ids[-1]] for s in seqs], device=device)         # (B, 1)
        idle = sum(s.finished for s in seqs)
        logits = forward(model, cache, x, pad_lens)                                  # (B, V)
        used = kv_slots_used(seqs)
        sample_rows(seqs, logits, eos_ids, tokenizer, t0)
        stats.steps.append(StepStats(False, B, 1, B - idle, idle, B * max_len, used, time.perf_counter() - t))


def kv_slots_used(seqs: list[Sequence]) -> int:
    """前向之后缓存里存着真实 token 的槽：提示词 + 已经喂回模型的输出。还在生成的行喂回了全部输出；
    已结束的行最后一个输出从没被喂回（之后陪跑写进去的 K/V 没人用，不算）。"""
    return sum(len(s.request.prompt_ids) + len(s.output_ids) - s.finished for s in seqs)


def sample_rows(seqs: list[Sequence], logits: torch.Tensor, eos_ids, tokenizer, t0: float) -> None:
    """logits (B, V)：每个还没结束的行用自己的参数和发生器采一个 token（与 step03 调用同一个 sample()）。
    已结束的行不采样，也就不消耗它的随机数。这一步的 token 一起产出：首 token / 结束时刻记这一步采样完的时刻。"""
    active = [(row, s) for row, s in enumerate(seqs) if not s.finished]
    for row, s in active:
        r = s.request
        token = sample(logits[row], r.prompt_ids, s.output_ids, r.params, s.generator, r.end_ids(eos_ids))
        s.append(token, eos_ids, tokenizer)
    now = time.perf_counter() - t0
    for _, s in active:
        if s.first_token_time is None:
            s.first_token_time = now
        if s.finished:
            s.finish_time = now
