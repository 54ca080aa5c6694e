"""prefill / decode 分离时两组机器之间搬的是什么：请求的 KV 块。每个 token 的 KV 字节数由模型结构定
（`ModelConfig.kv_bytes_per_token`），这里再用真实的块池张量核对一遍，然后算出几种提示词长度要搬多少字节。

    python step07_chunked_prefill/analysis/pd_transfer.py [--model 目录] [--block-size 16] [--prompt-lens 500,4096,32768]

只读 config.json、建一个 2 块的小池子，不加载权重。链路带宽那几列是假设的整数（没有测网络）：
100 Gb/s ≈ 12.5 GB/s（常见以太网），400 Gb/s ≈ 50 GB/s（一张 400G InfiniBand / RoCE 网卡）。
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from common.bench import table  # noqa: E402
from common.config import ModelConfig  # noqa: E402
from step07_chunked_prefill.kv_cache import PagedKVCache  # noqa: E402

LINKS = {"100 Gb/s": 12.5e9, "400 Gb/s": 50e9}   # 假设的链路带宽（字节/秒）
KIB = 2**10


def pool_bytes_per_token(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> float:
    """量真实张量：建一个 2 块（另有 1 个空块）的池子，nbytes ÷ (块数 × 块大小)。"""
    cache = PagedKVCache(cfg, 2, block_size, "cpu", dtype, attention="gather")
    return cache.pool.nbytes / (cache.pool.shape[2] * block_size)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="模型目录（默认：默认模型；只读 config.json）")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt-lens", default="500,4096,32768")
    args = ap.parse_args()
    from common.prepare import resolve_model
    path = resolve_model(args.model)
    cfg = ModelConfig.from_dir(path)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        formula = cfg.kv_bytes_per_token(dtype.itemsize)
        measured = pool_bytes_per_token(cfg, args.block_size, dtype)
        if measured != formula:
            sys.exit(f"error: pool holds {measured} bytes per token, formula says {formula}")
        for p in (int(x) for x in args.prompt_lens.split(",")):
            nbytes = p * formula
            rows.append([str(dtype).removeprefix("torch."), f"{formula} = {formula / KIB:g} KiB",
                         f"{-(-p // args.block_size)} × {formula * args.block_size / KIB:g} KiB", p,
                         f"{nbytes / 2**20:.1f}", *[f"{nbytes / bw * 1e3:.2f}" for bw in LINKS.values()]])
    print(f"{path.name}：{cfg.num_layers} 层 × {cfg.num_kv_heads} 个 KV 头 × head_dim {cfg.head_dim}，"
          f"块大小 {args.block_size}；每 token 字节数 = 2·{cfg.num_layers}·{cfg.num_kv_heads}·{cfg.head_dim}·每个数的字节数"
          "（与真实池子张量的 nbytes 核对过）")
    print(table(["精度", "每 token", "块数 × 每块", "提示词", "要搬 (MiB)", *[f"{k} (ms)" for k in LINKS]], rows))


if __name__ == "__main__":
    main()
