"""章节模式用的混合负载：提示词长短悬殊、输出长短悬殊，一部分请求自然地以 EOS 结束。

连续批处理和分页要解决的正是这种"参差不齐"：静态批里短请求陪长请求空转，连续预留按最坏情况占内存。
负载由固定种子生成，每次运行完全相同。
"""
import random

from common.prompts import LONG_PROMPT
from step02_sampling.sampler import SamplingParams
from step04_static_batching.request import Request

# 简短的对话问题：SmolLM2-Instruct 通常几十个 token 内答完并输出 EOS（<|im_end|>）
QUESTIONS = [
    "What is 2 + 2?",
    "Name one primary color.",
    "What is the capital of Japan?",
    "Say hello in French.",
    "Give me a synonym for happy.",
    "What is the largest planet in the solar system?",
]


def mixed_workload(tok, quick: bool, seed: int = 0) -> list[Request]:
    """完整：32 个请求，提示词 5–500 token，max_new_tokens 8–256；--quick：12 个，提示词 5–200，输出 8–48。
    每 4 个里有 1 个是对话问题（会以 EOS 结束），其余是 LONG_PROMPT 里随机截取的一段（通常写满 max_new_tokens）。"""
    n, (p_lo, p_hi), (o_lo, o_hi) = (12, (5, 200), (8, 48)) if quick else (32, (5, 500), (8, 256))
    rng = random.Random(seed)
    text = tok.encode(LONG_PROMPT)
    requests = []
    for i in range(n):
        if i % 4 == 3:
            ids = tok.encode(QUESTIONS[(i // 4) % len(QUESTIONS)], chat=True)
        else:
            length = rng.randint(p_lo, p_hi)
            start = rng.randint(0, len(text) - length)
            ids = text[start:start + length]
        requests.append(Request(ids, rng.randint(o_lo, o_hi)))
    return requests


def preemption_workload(requests: list[Request], base_seed: int = 1000) -> list[Request]:
    """小池子那次运行用：同样的提示词和长度，奇数号改成带种子的采样（每个请求自己的种子），全部 ignore_eos。
    ignore_eos 让每个请求的长度固定为 max_new_tokens，于是调度（谁在哪一步被抢占）只取决于长度、与数值无关，
    换设备、换精度都一样；贪心和采样的请求混在同一批里跑。"""
    return [Request(r.prompt_ids, r.max_new_tokens,
                    SamplingParams(temperature=0.8, top_p=0.95, seed=base_seed + i) if i % 2 else r.params,
                    ignore_eos=True) for i, r in enumerate(requests)]
