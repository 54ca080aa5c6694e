"""编码器–解码器模型（T5、BART、Whisper）的两种 KV：解码器自注意力的缓存每步长一个位置；交叉注意力的 K/V 由
编码器输出算出，第一步算一次，之后原样复用，大小始终是输入长度。HF 把两者装在一个 `EncoderDecoderCache` 里
（`.self_attention_cache` 与 `.cross_attention_cache`，各是一个 DynamicCache）。

    python step03_kvcache_single/analysis/encoder_decoder_cache.py [--src-len 20] [--steps 6]

用随机小 T5（离线生成，几秒）贪心解码几步，每步打印两个缓存的长度与字节数。
"""
import argparse
import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


def tiny_t5(seed: int = 0):
    """随机小 T5：2 层编码器 + 2 层解码器，d_model 32，4 个头 × d_kv 8。只供演示，数值没有意义。"""
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(cfg).eval()


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.inference_mode()
def decode_with_cache(model, src_ids: list[int], steps: int) -> list[dict]:
    """贪心解码 steps 步（第一步送 decoder_start_token，之后每步只送新 token），每步之后记录：
    自注意力缓存的长度 / 字节、交叉注意力缓存的长度 / 字节、交叉注意力第 0 层 K 的 data_ptr（看它是否被重算）。"""
    from transformers import DynamicCache, EncoderDecoderCache
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
    src = torch.tensor([src_ids])
    enc = model.get_encoder()(input_ids=src)                # 编码器只跑一次
    tok, rows = model.config.decoder_start_token_id, []
    for _ in range(steps):
        out = model(encoder_outputs=enc, decoder_input_ids=torch.tensor([[tok]]), use_cache=True,
                    **{cache_kw: cache})
        tok = int(out.logits[0, -1].argmax())
        sa, ca = cache.self_attention_cache, cache.cross_attention_cache
        rows.append(dict(token=tok, self_len=sa.get_seq_length(), self_bytes=cache_bytes(sa),
                         cross_len=ca.get_seq_length(), cross_bytes=cache_bytes(ca),
                         cross_ptr=ca.layers[0].keys.data_ptr()))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src-len", type=int, default=20, help="编码器输入的 token 数")
    ap.add_argument("--steps", type=int, default=6, help="解码步数")
    args = ap.parse_args()
    model = tiny_t5()
    c = model.config
    rows = decode_with_cache(model, list(range(2, 2 + args.src_len)), args.steps)
    per_tok = 2 * c.num_decoder_layers * c.num_heads * c.d_kv * 4
    print(f"随机小 T5：解码器 {c.num_decoder_layers} 层 × {c.num_heads} 头 × d_kv {c.d_kv}，float32；"
          f"每个位置每种缓存 2·{c.num_decoder_layers}·{c.num_heads}·{c.d_kv}·4 = {per_tok} 字节；输入 {args.src_len} 个 token")
    print("步  自注意力长度  自注意力字节  交叉注意力长度  交叉注意力字节  交叉 K 是同一块内存")
    for i, r in enumerate(rows, 1):
        same = "—" if i == 1 else ("是" if r["cross_ptr"] == rows[0]["cross_ptr"] else "否（被重算了）")
        print(f"{i:<3} {r['self_len']:<13} {r['self_bytes']:<13} {r['cross_len']:<15} {r['cross_bytes']:<15} {same}")


if __name__ == "__main__":
    main()
