"""一次混合前向（几个 decode + 一个 prefill 块）的四种做法，算的是同一件事，量它们各花多少：

  展平 + 一次内核调用（step07 的 plan，paged）      一行 T 个 token；注意力一次调用，每个请求按块表读自己的 K/V
  展平 + 按段注意力（step07 的 plan，gather）       一行 T 个 token；decode 一段、每个块一段，各自拷出自己的 K/V
  左填充 + 掩码（step05/06 的 plan 直接用于混合批） (B, L) 一批：decode 行也补齐到块的长度 L，线性层为填充付钱
  展平 + 块对角掩码（一行、一个掩码）          一行 T 个 query 对所有请求拼起来的 ΣS 个 key 算分数，再遮掉别人的

chapter.py 的 [4] 用 compare()；直接运行本文件可以换上下文和块的长度：

    python step07_chunked_prefill/analysis/varlen_bench.py [--quick] [--contexts 280,310,295,330,270,305,320,290] [--chunk 200,56]

池子里先填好随机数（种子固定）当作已缓存的 K/V：三种做法读的是同一个池子，算出的 logits 应当相同
（矩阵形状不同，浮点末位可以不同）。每次调用都重算同一步（写同样的槽、读同样的块），交替计时各取中位数。
"""
import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from common.bench import interleaved_medians, machine, table  # noqa: E402
from common.kv_cache import KVCache  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402
from step07_chunked_prefill.gather import plan_segment  # noqa: E402
from step07_chunked_prefill.kv_cache import FlatAttentionMetadata, PagedKVCache  # noqa: E402
from step07_chunked_prefill.sequence import Sequence  # noqa: E402

PAGED, FLAT, PADDED, DENSE = ("展平 + 一次内核调用（paged）", "展平 + 按段注意力（gather）", "左填充 + 掩码（step05 的 plan）",
                              "展平 + 块对角掩码")


@dataclass
class DenseRowForward(KVCache):
    """对照：一行 T 个 query，K/V 是这一步全部请求的块按顺序拼起来的 ΣS 个位置，掩码 (T, ΣS) 是块对角的
    （只看自己请求的、位置不超过自己的 key）。写入与 step05 相同（按槽）；读一次把全部请求的块拷出来。"""
    pool: torch.Tensor          # (layers, 2, num_blocks + 1, H_kv, block_size, D)
    slot_mapping: torch.Tensor  # (T,)
    read_rows: torch.Tensor     # (2·H_kv·nb,)  nb = 各请求用到的块数之和
    read_buf: torch.Tensor      # (2·H_kv·nb, block_size·D)
    mask: torch.Tensor          # (1, 1, 1, T, ΣS)

    def update(self, layer_idx, k, v):
        layer = self.pool[layer_idx]
        bs, D = layer.shape[3], layer.shape[4]
        block, offset = self.slot_mapping // bs, self.slot_mapping % bs
        for kv, new in ((0, k), (1, v)):
            layer[kv, block, :, offset] = new[0].transpose(0, 1)                 # (1, H_kv, T, D) -> (T, H_kv, D)
        torch.index_select(layer.view(-1, bs * D), 0, self.read_rows, out=self.read_buf)    # (2·H_kv·nb, bs·D)
        k_all, v_all = self.read_buf.view(2, 1, layer.shape[2], -1, D)            # 各 (1, H_kv, ΣS, D)
        return k_all, v_all


def plan_dense(cache: PagedKVCache, seqs, num_new_tokens: list[int], flat: FlatAttentionMetadata) -> DenseRowForward:
    """与 step07 的 plan 同样的行（同样的顺序、位置、写入的槽），注意力换成一个 (T, ΣS) 的块对角掩码。"""
    bs, H_kv, dev = cache.block_size, cache.H_kv, cache.pool.device
    singles = [i for i, n in enumerate(num_new_tokens) if n == 1]
    order = singles + [i for i, n in enumerate(num_new_tokens) if n > 1]     # step07 plan 的行顺序
    q_owner = torch.tensor([i for i in order for _ in range(num_new_tokens[i])])
    q_pos = flat.positions[0].cpu()
    tables = [seqs[i].block_table[:-(-(seqs[i].num_computed_tokens + num_new_tokens[i]) // bs)] for i in order]
    k_owner = torch.tensor([i for i, t in zip(order, tables) for _ in range(len(t) * bs)])
    k_pos = torch.cat([torch.arange(len(t) * bs) for t in tables])
    mask = (k_owner[None, :] == q_owner[:, None]) & (k_pos[None, :] <= q_pos[:, None])   # (T, ΣS)
    blocks = torch.tensor([b for t in tables for b in t])                                 # (nb,)
    kv = torch.arange(2)[:, None, None]
    heads = torch.arange(H_kv)[None, :, None]
    read_rows = ((kv * (cache.num_blocks + 1) + blocks[None, None, :]) * H_kv + heads).flatten()   # (2, H_kv, nb) 展平
    read_buf = torch.empty(len(read_rows), bs * cache.D, device=dev, dtype=cache.pool.dtype)
    return DenseRowForward(cache.pool, flat.slot_mapping, read_rows.to(dev), read_buf, mask[None, None, None].to(dev))


def score_count(fwd) -> int:
    """注意力每个头、每层要算的分数个数：Σ 段 B × L × S（掩码的形状），块对角的是 T × ΣS；
    paged 的内核只算每个请求自己的 query × 它读的 key（按块取整）。"""
    if isinstance(fwd, FlatAttentionMetadata) and fwd.segments is None:
        bs = fwd.pool.shape[4]
        return int(sum(q * -(-k // bs) * bs for q, k in zip(fwd.query_lens.tolist(), fwd.seq_lens.tolist())))
    if isinstance(fwd, FlatAttentionMetadata):
        return sum(score_count(seg) for seg in fwd.segments)
    B, _, _, L, S = fwd.mask.shape
    return B * L * S


def mixed_step(s, decode_contexts: list[int], chunk: tuple[int, int], block_size: int, attention: str = "gather"):
    """造一个池子和这一步的请求：每个 decode 已缓存 c-1 个 token、这一步算第 c 个；prefill 块已缓存 chunk[0] 个、
    这一步算 chunk[1] 个（算到提示词末尾，所以它也要采样）。返回 (池子, 请求, 每个请求这一步的 token 数)。
    池子的内容由固定种子决定：两种 attention 的池子装的是同样的数。"""
    computed, L = chunk                                  # prefill 块：已在池子里的 token 数，这一步算的数
    lengths = decode_contexts + [computed + L]
    need = [-(-n // block_size) for n in lengths]
    cache = PagedKVCache(s.cfg, sum(need), block_size, s.device, s.dtype, attention)
    g = torch.Generator(device="cpu").manual_seed(0)
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=g).to(cache.pool.dtype) * 0.5)   # 当作已缓存的 K/V
    seqs, first = [], 0
    for i, n in enumerate(lengths):
        seq = Sequence(i, Request(list(range(1, n + 1)), 4), torch.Generator(), 0.0)
        seq.block_table = list(range(first, first + need[i]))
        first += need[i]
        seq.num_computed_tokens = n - 1 if i < len(decode_contexts) else computed
        seqs.append(seq)
    return cache, seqs, [1] * len(decode_contexts) + [L]


@torch.inference_mode()
def compare(s, decode_contexts: list[int], chunk: tuple[int, int], block_size: int, repeats: int) -> dict:
    """四种做法各跑一次取 logits（要采样的每个请求一行）比较，再交替计时。返回每种的 ms、矩阵乘的 token 位置数、
    注意力分数个数，以及 logits 与 paged 的最大相对差（max|Δ| ÷ max|paged 的 logits|）。"""
    cache, seqs, num_new = mixed_step(s, decode_contexts, chunk, block_size)
    cache_p, seqs_p, _ = mixed_step(s, decode_contexts, chunk, block_size, "paged")
    model = s.model

    def paged():
        fwd = cache_p.plan(seqs_p, num_new)
        return fwd, fwd.input_ids, model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index)[0]  # (R, V)

    def flat():
        fwd = cache.plan(seqs, num_new)
        return fwd, fwd.input_ids, model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index)[0]  # (R, V)

    def padded():
        fwd = plan_segment(cache, seqs, num_new)      # step05/06 的 plan：一个左填充的 (B, L) 批
        # 左填充：每行最后一列就是它这一步的最后一个 token；行顺序与 plan 的 logits_index 相同（decode 在前）
        return fwd, fwd.input_ids, model(fwd.input_ids, fwd.positions, fwd, last_only=True)[:, -1]            # (B, V)

    def dense():
        f = cache.plan(seqs, num_new)
        fwd = plan_dense(cache, seqs, num_new, f)
        return fwd, f.input_ids, model(f.input_ids, f.positions, fwd, logits_index=f.logits_index)[0]         # (R, V)

    fns = {PAGED: paged, FLAT: flat, PADDED: padded, DENSE: dense}
    results = {name: fn() for name, fn in fns.items()}
    ref = results[PAGED][2]
    times = interleaved_medians(fns, repeats, s.device)
    out = {}
    for name, (fwd, input_ids, logits) in results.items():
        out[name] = {"ms": times[name] * 1e3, "token_slots": input_ids.numel(), "scores": score_count(fwd),
                     "max_rel_diff": float((logits - ref).abs().max() / ref.abs().max()),
                     "same_argmax": bool((logits.argmax(-1) == ref.argmax(-1)).all())}
    return out


def print_comparison(res: dict, decode_contexts: list[int], chunk: tuple[int, int]) -> None:
    flat = res[PAGED]
    print(f"一步 = {len(decode_contexts)} 个 decode（上下文 {decode_contexts}）+ 1 个 prefill 块"
          f"（已缓存 {chunk[0]}，这一步算 {chunk[1]} 个）；交替计时各取中位数：")
    print(table(["做法", "一步 (ms)", "÷ paged", "矩阵乘的 token 位置", "注意力分数（每头每层）", "分数 ÷ paged",
                 "logits 与 paged 最大相对差", "argmax 相同"],
                [[name, f"{r['ms']:.1f}", f"{r['ms'] / flat['ms']:.2f}", r["token_slots"], r["scores"],
                  f"{r['scores'] / flat['scores']:.1f}", f"{r['max_rel_diff']:.1e}", "是" if r["same_argmax"] else "否"]
                 for name, r in res.items()]))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--contexts", default="280,310,295,330,270,305,320,290", help="各 decode 的上下文长度")
    p.add_argument("--chunk", default="200,56", help="prefill 块：已缓存的 token 数,这一步算的 token 数")
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    from common.cli import open_session
    s = open_session()
    contexts = [int(c) for c in args.contexts.split(",")]
    chunk = tuple(int(c) for c in args.chunk.split(","))
    print(f"机器: {machine()}")
    res = compare(s, contexts, chunk, args.block_size, repeats=3 if args.quick else 9)
    print_comparison(res, contexts, chunk)


if __name__ == "__main__":
    main()
