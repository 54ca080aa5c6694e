"""章节模式的负载：请求陆续到达（泊松过程），大多是短提示词、输出几十个 token；每隔几个来一个很长的提示词。

长提示词到达时，别的请求正在 decode：step06 用一整次前向给它做 prefill，正在 decode 的请求全都停下来等；
step07 把它切成块，和 decode 混在一起算。负载由固定种子生成（内容、长度、到达的先后与间隔）；到达间隔以
"一次 decode 前向的时间"为单位（run.py 在本机量出来），所以在快慢不同的机器上，同时在跑的请求数差不多。
"""
import random

from common.harness import Arrival
from common.prompts import LONG_PROMPT
from step02_sampling.sampler import SamplingParams
from step04_static_batching.request import Request


def is_long(i: int) -> bool:
    """arrival_workload 的第 i 个请求是不是长提示词。"""
    return i % 5 == 3


def long_document(k: int) -> str:
    """第 k 份长文档（约 1200 token）：开头就各不相同，长提示词之间没有可以共享的前缀块。"""
    return f"Weather report number {k}.\n" + " ".join(
        f"Station {k}-{i} at km {37 * i + k} measured {(i * k) % 17} mm of rain and {(3 * i + k) % 13} hours of sun."
        for i in range(1, 40)) + "\nQuestion: which station had the most rain? Answer:"


def arrival_workload(tok, quick: bool, step_s: float, seed: int = 0) -> list[Arrival]:
    """完整：28 个请求，每 5 个里第 4 个是长提示词（约 600–1000 token，输出 16–32），其余短提示词 20–100 token、
    输出 32–96；平均每 10 个 decode 步到达一个。--quick：10 个请求，长提示词 200–300 token，短的 10–40 / 输出 8–24，
    平均每 6 步到达一个。每 3 个里有 1 个带种子采样（温度 0.8、top-p 0.95），其余贪心。
    step_s：一次 decode 前向的秒数，到达间隔 = 指数分布的步数 × step_s（第一个请求在 0 时刻到达）。"""
    if quick:
        n, short, short_out, long_, long_out, gap_steps = 10, (10, 40), (8, 24), (200, 300), (8, 8), 6
    else:
        n, short, short_out, long_, long_out, gap_steps = 28, (20, 100), (32, 96), (600, 1000), (16, 32), 10
    rng = random.Random(seed)
    text = tok.encode(LONG_PROMPT)
    requests, t = [], 0.0
    for i in range(n):
        if is_long(i):
            ids = tok.encode(long_document(i))[:rng.randint(*long_)]
            max_new = rng.randint(*long_out)
        else:
            length = rng.randint(*short)
            start = rng.randint(0, len(text) - length)
            ids, max_new = text[start:start + length], rng.randint(*short_out)
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=3000 + i) if i % 3 == 1 else SamplingParams()
        requests.append(Arrival(t, Request(ids, max_new, params)))
        t += rng.expovariate(1 / gap_steps) * step_s
    return requests


def check_workload(tok, quick: bool) -> list[Request]:
    """检查"任意块大小都给出同样的 token"用的短负载，全部在 0 时刻到达（调度与计时无关，每次运行的前向完全相同）：
    几个长短不一的提示词，其中一个是另一个的前缀加一段（分块 prefill 与前缀缓存一起工作），贪心与带种子采样各半。"""
    text = tok.encode(LONG_PROMPT)
    lengths, max_new = ([37, 5, 53, 21], 8) if quick else ([61, 7, 113, 29, 90, 45], 16)
    prompts = [text[13 * i:13 * i + n] for i, n in enumerate(lengths)]
    prompts.append(prompts[0] + text[400:400 + 19])                  # 与第 0 个共享前 37/61 个 token
    return [Request(ids, max_new + i % 3, SamplingParams(temperature=0.8, top_p=0.95, seed=4000 + i) if i % 2 else
                    SamplingParams()) for i, ids in enumerate(prompts)]


def mid_prefill_preemption_workload(tok) -> tuple[list[Request], int, int]:
    """逼出"prefill 到一半被抢占"：两个短提示词各生成 60 个 token，一个 300 token 的长提示词跟在后面分块 prefill。
    池子（24 块 × 16）刚好装下三个请求接纳时要的块；两个短请求写满第 2 块、要第 3 块时池子已空，抢占最新的——
    正在分块 prefill 的长提示词。它写满的块已经登记进前缀缓存，重新接纳时（没被回收的部分）直接命中。
    返回 (请求, 块数, 预算)；全部 ignore_eos、都在 0 时刻到达：谁在哪一步被抢占只取决于长度。"""
    text = tok.encode(LONG_PROMPT)
    requests = [Request(text[:20], 60, ignore_eos=True),
                Request(text[50:70], 60, SamplingParams(temperature=0.8, top_p=0.95, seed=5000), ignore_eos=True),
                Request(tok.encode(long_document(99))[:300], 4, ignore_eos=True)]
    return requests, 24, 16
