"""所有引擎一起比：同一组请求经过 step01 … step07、step08 的精确模式、step09 与 step15（每步一个小适配器），在随机小模型（float32）上给出完全相同的 token；
再用一个只有 1 个 KV 头（MQA）的小模型把整条链跑一遍，贪心时加上 HF transformers 的 generate。

各步自己的测试拿"上一步"当参考；这里把整条链放在一起，哪一步偏了一眼就能看出来。step05 起默认按块表直接读池子
（--attention paged）；gather 读法各留一行，两种读法给出同样的 token。
加一步 = 在 ENGINES 里加一行：`Engine(名字, fn(model, requests, eos_ids) -> 每个请求的新 token, 是否支持采样)`。
比较用 ==（逐 token 完全相同），不用近似打平的容差：小模型上没有贴得那么近的 logit；真遇到了就换一个种子，而不是放宽。
"""
import random
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from common.hf_reference import hf_greedy, load_hf_model
from common.weights import load_model
from step01_naive.engine import generate as generate01
from step02_sampling.engine import generate as generate02
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single.engine import generate as generate03
from step04_static_batching.engine import generate_batch
from common.clock import VirtualClock
from common.harness import Arrival, replay
from step04_static_batching.request import Request
from step05_paged import engine as step05_engine
from step06_prefix_cache import engine as step06_engine
from step07_chunked_prefill import engine as step07_engine
from step08_kv_quant import engine as step08_engine
from step09_speculative import engine as step09_engine
from step15_structured_output import engine as step15_engine

from conftest import make_tiny_model_dir

blocks_needed = step05_engine.blocks_needed


@dataclass
class Engine:
    name: str
    run: Callable[..., list[list[int]]]   # (model, requests, eos_ids) -> 每个请求的新 token，顺序同 requests
    sampling: bool = True                 # step01 只有贪心


def one_by_one(generate, **kw):
    def run(model, requests, eos_ids):
        return [generate(model, r.prompt_ids, r.max_new_tokens, r.params, eos_ids, r.ignore_eos, **kw)
                for r in requests]
    return run


def step01(model, requests, eos_ids):
    return [generate01(model, r.prompt_ids, r.max_new_tokens, eos_ids, r.ignore_eos) for r in requests]


def step04(max_batch_size):
    def run(model, requests, eos_ids):
        return generate_batch(model, requests, max_batch_size, eos_ids).outputs
    return run


def pool_blocks(requests, block_size, pool: str) -> int:
    """pool "roomy"：池子放得下全部请求；"tight"：只放得下最大的请求两份，一定会抢占。"""
    biggest = max(blocks_needed(r, block_size) for r in requests)
    return 2 * biggest if pool == "tight" else sum(blocks_needed(r, block_size) for r in requests)


def step05(block_size, max_batch_size, pool: str, step=step05_engine, attention="paged"):
    def run(model, requests, eos_ids):
        config = step.EngineConfig(pool_blocks(requests, block_size, pool), block_size, max_batch_size,
                                   attention=attention)
        outputs, stats = step.LLMEngine(model, config, eos_ids=eos_ids).generate(requests)
        assert pool != "tight" or stats.preemptions > 0, "the tight pool was meant to preempt"
        assert step is step05_engine or sum(stats.cached_tokens) > 0, "step06 was meant to hit its cache"
        return outputs
    return run


def step07(budget, max_batch_size, pool: str, every_steps: int = 0, step=step07_engine, **config):
    """token 预算 budget，pool 同 step05；every_steps > 0 时请求每隔这么多步陆续到达（虚拟时钟：与机器快慢无关；
    分块 prefill 与正在 decode 的请求混在一起）。"""
    def run(model, requests, eos_ids):
        clock = VirtualClock()
        cfg = step.EngineConfig(pool_blocks(requests, 4, pool), 4, max_batch_size, budget, **config)
        engine = step.LLMEngine(model, cfg, eos_ids=eos_ids, clock=clock)
        outputs, stats = replay(engine, [Arrival(i * every_steps, r) for i, r in enumerate(requests)], clock)
        assert pool != "tight" or stats.preemptions > 0, "the tight pool was meant to preempt"
        assert stats.prefill_padding_slots == 0
        assert not config.get("preempt") == "swap" or engine.swap.num_swap_out > 0, "swap mode was meant to swap"
        return outputs
    return run


ENGINES = [
    Engine("step01_naive", step01, sampling=False),
    Engine("step02_sampling", one_by_one(generate02)),
    Engine("step03_prealloc", one_by_one(generate03, cache="prealloc")),
    Engine("step03_cat", one_by_one(generate03, cache="cat")),
    Engine("step04_one_batch", step04(max_batch_size=16)),
    Engine("step04_batches_of_3", step04(max_batch_size=3)),
    Engine("step05_roomy_pool", step05(block_size=4, max_batch_size=16, pool="roomy")),
    Engine("step05_tight_pool", step05(block_size=4, max_batch_size=16, pool="tight")),
    Engine("step05_tight_pool_gather", step05(block_size=4, max_batch_size=16, pool="tight", attention="gather")),
    Engine("step06_roomy_pool", step05(block_size=4, max_batch_size=16, pool="roomy", step=step06_engine)),
    Engine("step06_tight_pool", step05(block_size=4, max_batch_size=16, pool="tight", step=step06_engine)),
    Engine("step07_budget_5_tight_pool", step07(budget=5, max_batch_size=4, pool="tight")),
    Engine("step07_budget_16_arrivals", step07(budget=16, max_batch_size=8, pool="roomy", every_steps=3)),
    Engine("step07_budget_5_tight_pool_gather", step07(budget=5, max_batch_size=4, pool="tight", attention="gather")),
    # step08 的精确模式（--kv-dtype 默认 = 模型 dtype）：重算式与换出式抢占
    Engine("step08_exact_budget_5_tight_pool", step07(budget=5, max_batch_size=4, pool="tight", step=step08_engine)),
    Engine("step08_exact_swap_budget_5_tight_pool", step07(budget=5, max_batch_size=4, pool="tight", step=step08_engine,
                                                           preempt="swap")),
    # step09：不投机（= step08）；prompt lookup 投机只比贪心——拒绝采样在分布上精确，但消耗随机数的方式与逐个采样
    # 不同，同一个种子抽出的样本不同（分布相同由 tests/test_step09_speculative.py 检验）
    Engine("step09_none_budget_5_tight_pool", step07(budget=5, max_batch_size=4, pool="tight", step=step09_engine)),
    Engine("step09_ngram_budget_16_tight_pool", step07(budget=16, max_batch_size=4, pool="tight", step=step09_engine,
                                                       spec_method="ngram", num_spec_tokens=3, ngram_min=1),
           sampling=False),
    # step15：不给约束时就是 step09 的引擎
    Engine("step15_none_budget_5_tight_pool", step07(budget=5, max_batch_size=4, pool="tight", step=step15_engine)),
    Engine("step15_ngram_budget_16_tight_pool", step07(budget=16, max_batch_size=4, pool="tight", step=step15_engine,
                                                       spec_method="ngram", num_spec_tokens=3, ngram_min=1),
           sampling=False),
]


def workload(seed: int, sampled: bool) -> list[Request]:
    """8 个请求：提示词 1–40 个 token（后 4 个接在前 4 个的提示词后面，step06 能命中），新 token 3–24 个，
    一半 ignore_eos；sampled 时奇数号带种子采样。"""
    rng = random.Random(seed)
    requests = []
    for i in range(8):
        params = SamplingParams()
        if sampled and i % 2:
            params = SamplingParams(temperature=0.9, top_k=rng.choice([0, 40]), top_p=rng.choice([1.0, 0.9]),
                                    repetition_penalty=rng.choice([1.0, 1.2]), seed=100 + i)
        prompt = [rng.randrange(2, 256) for _ in range(rng.choice([1, 3, 7, 12, 25, 40]))]
        if i >= 4:   # 与第 i-4 个请求共享前缀（step06 命中它写满的块）
            prompt = requests[i - 4].prompt_ids + prompt[:8]
        requests.append(Request(prompt, rng.randint(3, 24), params, ignore_eos=i % 4 == 0))
    return requests


def natural_eos(model, requests) -> list[int]:
    """挑一个 EOS：第一个贪心、不 ignore_eos 的请求单独生成时的第 3 个 token。这样至少有一个请求真的在中途停下。"""
    r = next(r for r in requests if not r.ignore_eos and r.params.seed is None)
    return [generate01(model, r.prompt_ids, r.max_new_tokens, ())[2]]


def run_every_engine(model, sampled: bool, extra: dict[str, list[list[int]]] | None = None):
    """ENGINES 全部跑同一组请求，逐 token 比较（extra：别处算好的结果，一起比）。"""
    requests = workload(seed=7, sampled=sampled)
    eos_ids = natural_eos(model, requests)
    engines = [e for e in ENGINES if e.sampling or not sampled]
    results = {e.name: e.run(model, requests, eos_ids) for e in engines}
    ref_name, ref = next(iter(results.items()))
    assert any(len(o) < r.max_new_tokens for o, r in zip(ref, requests)), "no request stopped at EOS"
    assert all(len(o) == r.max_new_tokens for o, r in zip(ref, requests) if r.ignore_eos)
    if sampled:   # 采样的请求确实在采样：换个种子输出就不同
        r = next(r for r in requests if r.params.seed is not None)
        other = Request(r.prompt_ids, r.max_new_tokens, SamplingParams(**{**vars(r.params), "seed": r.params.seed + 1}),
                        ignore_eos=True)
        assert one_by_one(generate02)(model, [other], ())[0] != \
            one_by_one(generate02)(model, [Request(r.prompt_ids, r.max_new_tokens, r.params, True)], ())[0]
    for name, fn in (extra or {}).items():
        results[name] = fn(requests, eos_ids)
    bad = {name: [i for i, (a, b) in enumerate(zip(ref, out)) if a != b] or "count"
           for name, out in results.items() if out != ref}
    assert not bad, f"engines that differ from {ref_name} (request indices): {bad}"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_every_engine_gives_the_same_tokens(tiny, sampled):
    run_every_engine(tiny.model, sampled)


@pytest.fixture(scope="module")
def mqa(tmp_path_factory):
    """H_kv = 1（MQA）的随机小模型：4 个 query 头共用 1 个 KV 头。它与 HF 的 logits 一致由 tests/test_model.py 检查。"""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("mqa"), "llama", num_key_value_heads=1)
    return load_model(path, "cpu", torch.float32), load_hf_model(path, "cpu", torch.float32)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_every_engine_runs_a_one_kv_head_model_unchanged(mqa, sampled):
    """第 03 章说 H_kv = 1 时引擎不用改一行：同一组请求经过每一步的引擎（缓存、分页池子、C++ 内核、gather、量化池子的
    精确模式、换出、投机），与 step01 逐 token 相同；贪心时再与 HF transformers 的 generate 比（不是我们写的参照）。"""
    model, hf = mqa
    assert model.cfg.num_kv_heads == 1 and model.cfg.num_heads == 4
    extra = {} if sampled else {"hf_generate": lambda requests, eos_ids: [
        hf_greedy(hf, r.prompt_ids, r.max_new_tokens, eos_ids, r.ignore_eos) for r in requests]}
    run_every_engine(model, sampled, extra)
