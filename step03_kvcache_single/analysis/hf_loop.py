"""HF transformers 自己的 KV cache 循环：第一次前向送整段提示词，之后每次只送上一步生成的那 1 个 token，
把缓存对象传回去（transformers 5.24 里参数叫 `cache=`，旧版本和大多数教程里叫 `past_key_values=`，
5.24 仍接受旧名但会警告）——结果与 `generate` 逐 token 相同。对照一个常见的错误写法：每步都把整段 input_ids
连同缓存一起送进去（有的教程的 GPT-2 例子就这么写），缓存里同一批位置被重复写入，长度每步翻着涨，输出随之跑偏。

    python step03_kvcache_single/analysis/hf_loop.py [--model 目录] [--max-new-tokens 8]

默认用 tests 里那种随机小 Llama（离线生成，几秒）；--model 给一个 HF 目录（如默认模型的目录）就用真实模型。
"""
import argparse
import inspect
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


def cache_kwarg(hf) -> str:
    """forward 收缓存的参数名：5.24 起是 cache，之前是 past_key_values。"""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


@torch.inference_mode()
def hf_cached_greedy(hf, prompt_ids: list[int], max_new_tokens: int, feed_all: bool = False):
    """手写的贪心循环。返回 (新 token, 每次前向之后缓存的长度)。
    feed_all=False：正确写法，第 2 次起只送新 token；True：错误写法，每次都送到目前为止的全部 token。"""
    from transformers import DynamicCache
    cache_kw = cache_kwarg(hf)
    ids = list(prompt_ids)
    cache = DynamicCache(config=hf.config)
    step_in = ids                                    # 第一次：整段提示词（prefill）
    new, lengths = [], []
    for _ in range(max_new_tokens):
        out = hf(torch.tensor([step_in]), **{cache_kw: cache}, use_cache=True)  # cache 原地追加了这次的 K/V
        lengths.append(cache.get_seq_length())
        tok = int(out.logits[0, -1].argmax())
        new.append(tok)
        ids.append(tok)
        step_in = ids if feed_all else [tok]        # 正确：只送新 token；错误：又送一遍全部
    return new, lengths


@torch.inference_mode()
def hf_generate(hf, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    x = torch.tensor([prompt_ids])
    out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                      min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
                      temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt_ids):].tolist()


def tiny_llama_dir(path: Path, seed: int = 0) -> Path:
    """与 tests/conftest.py 的 make_tiny_model_dir 同样形状的随机小 Llama（2 层，hidden 64，4/2 头）。"""
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=1, bos_token_id=0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF 模型目录（默认：临时生成的随机小 Llama）")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    args = ap.parse_args()
    from common.hf_reference import load_hf_model
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else tiny_llama_dir(Path(tmp))
        hf = load_hf_model(path, "cpu", torch.float32)
        prompt = list(range(2, 14))   # 12 个 token；随机模型不需要分词器
        ref = hf_generate(hf, prompt, args.max_new_tokens)
        good, good_len = hf_cached_greedy(hf, prompt, args.max_new_tokens)
        bad, bad_len = hf_cached_greedy(hf, prompt, args.max_new_tokens, feed_all=True)
    print(f"提示词 {len(prompt)} 个 token，生成 {args.max_new_tokens} 个")
    print(f"generate                 : {ref}")
    print(f"只送新 token（正确）      : {good}   {'== generate' if good == ref else '!= generate'}")
    print(f"  每次前向后的缓存长度    : {good_len}")
    print(f"每步送整段 input_ids（错）: {bad}   {'== generate' if bad == ref else '!= generate'}")
    print(f"  每次前向后的缓存长度    : {bad_len}")


if __name__ == "__main__":
    main()
