"""step02：step01 的朴素循环（每步整段重算，O(n²)），只改两件事：
怎么选下一个 token（采样器代替 argmax），以及什么时候停（多了停止字符串）。
"""
import torch

from step02_sampling.sampler import SamplingParams, make_generator, sample
from step02_sampling.stop_strings import completes_stop_string


@torch.inference_mode()
def generate(model, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, eos_ids=(),
             ignore_eos: bool = False, stop_strings=(), tokenizer=None) -> list[int]:
    """返回新 token。停止条件：生成满 max_new_tokens；生成了 EOS 或 params.stop_token_ids 里的 token（包含它，同 HF）；
    新生成文本里出现任一停止字符串（包含补全它的那个 token，同 HF 的 StopStringCriteria）。
    生成满 params.min_tokens 个之前只有第一条算数；之后补全的停止串才算（同 vLLM）。"""
    # >>> step02 新增：检查参数；每次调用一个自己的随机数发生器（种子相同 → 输出相同）
    params.validate(model.cfg.vocab_size)
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode the generated text")
    generator = make_generator(params.seed, model.device)
    end_ids = () if ignore_eos else tuple(eos_ids)   # min_tokens 之前要屏蔽的 EOS（ignore_eos 时 EOS 不结束请求，不必屏蔽）
    # <<<
    ids = list(prompt_ids)
    out = []
    for _ in range(max_new_tokens):
        x = torch.tensor([ids], device=model.device)              # (1, T)：整段序列，每步都从头算
        pos = torch.arange(len(ids), device=model.device)[None]   # (1, T)：位置 0..T-1
        logits = model(x, pos, last_only=True)[0, -1]             # (V,)：只要最后一个位置的下一个 token 分布
        tok = sample(logits, prompt_ids, out, params, generator, end_ids)   # step02 修改：采样器代替 argmax
        ids.append(tok)
        out.append(tok)
        # >>> step02 新增：min_tokens 之前什么都不结束请求（EOS 与停止 token 已被采样器屏蔽，停止字符串在这里跳过）
        if len(out) < params.min_tokens:
            continue
        if tok in end_ids or tok in params.stop_token_ids:   # 停止 token 与 EOS 一样：算进输出
            break
        # 停止字符串：只解码输出的尾巴，找结束在这个 token 带来的新文本里的（跨 token 的也找得到）；
        # 提示词里出现的、前 min_tokens 个 token 里结束的都不算
        if stop_strings and completes_stop_string(tokenizer, out, stop_strings, params.min_tokens):
            break
        # <<<
    return out
