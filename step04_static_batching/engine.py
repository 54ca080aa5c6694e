"""step04：静态批处理（static batching）。

请求按给定顺序切成每批最多 max_batch_size 个。每一批：
  1. 左填充到这批最长的提示词，一次批量前向做完所有行的 prefill（不是一个一个地做）；
  2. 然后每步一次前向、每行各生成一个 token，直到每一行都结束；
     先结束的行继续占着自己那一行陪跑（算出来的结果扔掉），整批结束后才开始下一批。
每一行有自己的停止条件、自己的采样参数和自己的随机数发生器，所以每个请求的输出与它在 step03 里单独生成时相同。

缓存直接用 step03 的 PreallocKVCache，只是 batch_size = B：左填充让所有行在同一列写入（见 batch.py），
整批共用一个 length，update / advance 与 step03 完全相同。每次前向把它和本次的逐行掩码包成一个 MaskedCache
交给模型（common/kv_cache.py 的接口：update + mask），模型代码一行不改。
"""
from typing import NamedTuple

import torch

from common.errors import UserError
from step02_sampling.sampler import make_generator, sample
from step03_kvcache_single.cache import PreallocKVCache
from step04_static_batching.batch import MaskedCache, attention_mask, left_pad, positions
from step04_static_batching.request import Request, Sequence
from step04_static_batching.stats import BatchStats


class BatchOutput(NamedTuple):
    outputs: list[list[int]]   # 每个请求的新 token，顺序与 requests 相同
    stats: BatchStats


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


@torch.inference_mode()
def generate_batch(model, requests: list[Request], max_batch_size: int, eos_ids=()) -> BatchOutput:
    if max_batch_size < 1:
        raise UserError(f"max_batch_size must be >= 1, got {max_batch_size}")
    for r in requests:   # 先检查全部请求，再开始生成：不会跑了一半才报错
        r.validate(model.cfg.max_position_embeddings)
    stats = BatchStats()
    outputs = []
    for i in range(0, len(requests), max_batch_size):
        outputs += run_batch(model, requests[i:i + max_batch_size], eos_ids, stats)
    return BatchOutput(outputs, stats)


def run_batch(model, requests: list[Request], eos_ids, stats: BatchStats) -> list[list[int]]:
    """跑完一批（B ≤ max_batch_size 行），把这一批的三种浪费记进 stats。"""
    device = model.device
    seqs = [Sequence(r, make_generator(r.params.seed, device)) for r in requests]
    input_ids, pad_lens = left_pad([r.prompt_ids for r in requests], device)    # (B, P), (B,)
    B, P = input_ids.shape
    # 一开始就按最坏情况预留：最长的提示词 + 最多的新 token - 1（最后采样出的 token 不再喂回模型）
    max_len = P + max(r.max_new_tokens for r in requests) - 1
    cache = PreallocKVCache(model.cfg, max_len, device, model.dtype, batch_size=B)

    # prefill：整批一次前向。左填充 → 每行最后一个真实 token 都在最后一列，last_only 正好取到它
    logits = forward(model, cache, input_ids, pad_lens)                         # (B, V)
    stats.prefill_slots += B * P
    stats.prefill_padding_slots += int(pad_lens.sum())
    num_forwards = 1
    while True:
        sample_rows(seqs, logits, eos_ids)
        if all(s.finished for s in seqs):
            break
        # decode：所有行一起往下一列写。已结束的行喂它自己的最后一个 token 陪跑：
        # 它写进缓存的 K/V 和算出的 logits 都没人用，但这一行的计算照样要做（这就是 decode 空转浪费）
        x = torch.tensor([[s.output_ids[-1]] for s in seqs], device=device)    # (B, 1)
        stats.decode_row_steps += B
        stats.decode_idle_row_steps += sum(s.finished for s in seqs)
        logits = forward(model, cache, x, pad_lens)                             # (B, V)
        num_forwards += 1

    stats.num_batches += 1
    stats.num_forwards += num_forwards
    stats.generated_tokens += sum(len(s.output_ids) for s in seqs)
    stats.kv_slots_reserved += B * max_len
    stats.kv_slots_used += sum(len(s.request.prompt_ids) + len(s.output_ids) - 1 for s in seqs)
    stats.peak_kv_slots_reserved = max(stats.peak_kv_slots_reserved, B * max_len)
    return [s.output_ids for s in seqs]


def sample_rows(seqs: list[Sequence], logits: torch.Tensor, eos_ids) -> None:
    """logits (B, V)：每个还没结束的行用自己的参数和发生器采一个 token（与 step03 调用同一个 sample()）。
    已结束的行不采样，也就不消耗它的随机数。"""
    for row, s in enumerate(seqs):
        if not s.finished:
            s.append(sample(logits[row], s.token_ids, s.request.params, s.generator), eos_ids)
