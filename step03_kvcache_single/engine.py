"""step03：带 KV cache 的单请求生成。模型的数学一点没变，只是不再重算过去 token 的 K/V。

    prefill：整段提示词一次前向，把每层的 K/V 写进缓存，得到第一个新 token 的 logits；
    decode ：每步只把上一步生成的 1 个 token 喂进去（位置 = 缓存长度），对缓存里的全部 K/V 做注意力。

采样与停止条件原样沿用 step02（同一个 sample()、同样的 EOS / 停止字符串规则），所以同样的参数和种子
给出与 step02 相同的 token。
"""
import torch

from step02_sampling.sampler import SamplingParams, make_generator, sample
from step02_sampling.stop_strings import completes_stop_string
from step03_kvcache_single.cache import CACHES


def forward(model, cache, token_ids: list[int], start: int) -> torch.Tensor:
    """把 L 个新 token（绝对位置 start .. start+L-1）跑一次前向，K/V 写进缓存；返回最后位置的 logits (V,)。"""
    # 位置必须正好接在缓存后面：RoPE 按绝对位置旋转 q 和 k，差一位，新 query 与缓存里每个 key 的相对位置就全错了
    if start != cache.length:
        raise ValueError(f"positions start at {start} but the cache holds {cache.length} positions")
    L = len(token_ids)
    x = torch.tensor([token_ids], device=model.device)                         # (1, L)
    pos = torch.arange(start, start + L, device=model.device)[None]            # (1, L)：真实位置，带偏移
    # mask=None：模型用右下对齐的因果掩码 (L, S)，prefill 时是普通下三角，decode 时 (1, S) 全部可见
    logits = model(x, pos, cache=cache, last_only=True)[0, -1]                 # (V,)
    cache.advance(L)  # 全部层都写完之后才推进长度：每次前向正好一次
    return logits


@torch.inference_mode()
def generate(model, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, eos_ids=(),
             ignore_eos: bool = False, cache="prealloc", stop_strings=(), tokenizer=None) -> list[int]:
    """返回新 token，停止条件与 step02 相同。cache: "prealloc" / "cat"，或一个空的缓存对象（测试与基准用，
    好在生成后查看它复制了多少字节）。"""
    params.validate(model.cfg.vocab_size)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode the generated text")
    generator = make_generator(params.seed, model.device)
    end_ids = () if ignore_eos else tuple(eos_ids)   # 同 step02：min_tokens 之前屏蔽
    # >>> step03 新增：建缓存。最后生成的那个 token 不会再喂回模型，所以需要 提示词 + N - 1 个位置
    if isinstance(cache, str):
        if cache not in CACHES:
            raise ValueError(f"unknown cache {cache!r} (choose from {', '.join(CACHES)})")
        cache = CACHES[cache](model.cfg, len(prompt_ids) + max_new_tokens - 1, model.device, model.dtype)
    if cache.length != 0:
        raise ValueError("generate() needs an empty cache")
    logits = forward(model, cache, prompt_ids, start=0)                        # prefill：整段提示词，一次
    # <<<
    ids = list(prompt_ids)
    out = []
    while True:
        tok = sample(logits, prompt_ids, out, params, generator, end_ids)
        ids.append(tok)
        out.append(tok)
        if len(out) == max_new_tokens:
            break
        if len(out) >= params.min_tokens and (tok in end_ids or tok in params.stop_token_ids or (
                stop_strings and completes_stop_string(tokenizer, out, stop_strings, params.min_tokens))):
            break
        # >>> step03 修改：decode 只喂新 token，它的位置是它在整段序列里的下标 len(ids) - 1
        logits = forward(model, cache, [tok], start=len(ids) - 1)
        # <<<
    return out
