"""step07：展平的混合前向（手算的位置、掩码、槽号；与分开跑每一段的 logits 相同），块边界落在提示词的每一个位置上
（池子里的 K/V 与一次 prefill 完的相同、输出 token 相同），预算调度的账目，请求陆续到达，以及随机负载 + 小池子的浸泡测试。

比较的标准：token 逐个相等（小模型上没有贴得那么近的 logit，不用 near-tie 容差）；K/V 按相对误差比
（分块改变了矩阵乘的形状，浮点末位可以不同），容差 1e-5。
"""
import json
import random

import pytest
import torch

from common import cli
from common.errors import UserError
from conftest import cli_error, one_arch
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single.cache import PreallocKVCache
from step03_kvcache_single.engine import forward as forward_single
from step03_kvcache_single.engine import generate as generate_single
from step04_static_batching.request import Request
from step05_paged.engine import blocks_needed
from step05_paged.paged_cache import PagedKVCache
from step06_prefix_cache.engine import PrefixCachingEngine
from step06_prefix_cache.sequence import Sequence
from step07_chunked_prefill import run as step07_run
from step07_chunked_prefill.engine import ChunkedPrefillEngine
from step07_chunked_prefill.flat_forward import plan_flat
from step07_chunked_prefill.varlen_bench import FLAT, compare as compare_varlen

KV_RTOL = 1e-5


def step03_outputs(model, requests, eos_ids=()):
    return [generate_single(model, r.prompt_ids, r.max_new_tokens, r.params, eos_ids, r.ignore_eos) for r in requests]


def assert_idle(engine):
    a = engine.allocator
    assert not any(a.ref_counts) and a.num_free == a.num_blocks


def seq_at(prompt: list[int], outputs: list[int], cached: int, block_table: list[int]) -> Sequence:
    seq = Sequence(Request(prompt, 8), torch.Generator())
    seq.output_ids, seq.num_cached_tokens, seq.block_table = list(outputs), cached, block_table
    return seq


# ---------- 一次混合前向：手算 ----------

@torch.inference_mode()
@one_arch
def test_mixed_forward_positions_slots_and_masks_by_hand(tiny):
    """块大小 4。两个 decode（d1：提示词 5 + 1 个输出；d2：提示词 9 + 1 个输出）、一个带已缓存前缀的块
    （c1：提示词 7，已缓存 4，这次算 3 个——算到末尾，要采样）、一个全新提示词的第一块（c2：提示词 6，这次算 3 个，不采样）。"""
    cache = PagedKVCache(tiny.cfg, 16, 4, "cpu", torch.float32)
    d1 = seq_at([11, 12, 13, 14, 15], [16], 5, [3, 7])
    d2 = seq_at(list(range(20, 29)), [29], 9, [0, 1, 2])
    c1 = seq_at([31, 32, 33, 34, 35, 36, 37], [], 4, [5, 6])
    c2 = seq_at([41, 42, 43, 44, 45, 46], [], 0, [8, 9])
    fwd = plan_flat(cache, [d1, d2, c1, c2], [1, 1, 3, 3])
    # 一行：两个 decode，然后 c1 的 3 个、c2 的 3 个；每个 token 在自己请求里的位置
    assert fwd.input_ids.tolist() == [[16, 29, 35, 36, 37, 41, 42, 43]]
    assert fwd.positions.tolist() == [[5, 9, 4, 5, 6, 0, 1, 2]]
    assert fwd.logits_index.tolist() == [0, 1, 4]            # d1、d2、c1 的最后一个 token；c2 还没算完，不采样
    assert fwd.num_tokens == 8                               # 没有填充
    dec, s1, s2 = fwd.segments
    assert dec.input_ids.shape == (2, 1) and s1.input_ids.shape == (1, 3) and s2.input_ids.shape == (1, 3)
    # 槽号 = 块号 × 4 + 块内偏移：d1 位置 5 在逻辑块 1（物理 7）偏移 1；d2 位置 9 在逻辑块 2（物理 2）偏移 1
    assert dec.slot_mapping.tolist() == [7 * 4 + 1, 2 * 4 + 1]
    assert s1.slot_mapping.tolist() == [6 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2]     # 位置 4、5、6：逻辑块 1（物理 6）
    assert s2.slot_mapping.tolist() == [8 * 4 + 0, 8 * 4 + 1, 8 * 4 + 2]     # 位置 0、1、2
    # decode 段：读回各自的块（d1 补齐到 3 块），key 位置 ≤ 自己的位置
    assert dec.block_tables.tolist() == [[3, 7, cache.null_block], [0, 1, 2]]
    assert dec.mask[:, 0, 0, 0].tolist() == [[k <= 5 for k in range(12)], [k <= 9 for k in range(12)]]
    # c1：已缓存 4 个 + 这次 3 个，读 2 块 = 8 个 key；第 i 个 query（位置 4+i）看 key 0..4+i
    assert s1.block_tables.tolist() == [[5, 6]]
    assert s1.mask[0, 0, 0].tolist() == [[k <= p for k in range(8)] for p in (4, 5, 6)]
    # c2：全新的 prefill，只看自己的 3 个 K/V，普通的下三角；不读池子
    assert s2.read_rows is None and s2.mask[0, 0, 0].tolist() == [[k <= q for k in range(3)] for q in range(3)]
    # c2 的块表只用到这次算到的位置所在的块（后面的块接纳时就分好了，但这一步用不到）
    assert s2.block_tables.tolist() == [[8]]


@torch.inference_mode()
@one_arch
def test_mixed_forward_logits_equal_running_each_segment_alone(tiny):
    """同一步的状态，混合前向的 logits 与把每一段单独用 step05 的 plan 跑一次相同（同一个池子、同样的 K/V）。"""
    def state():
        cache = PagedKVCache(tiny.cfg, 16, 4, "cpu", torch.float32)
        cache.pool.copy_(torch.randn(cache.pool.shape, generator=torch.Generator().manual_seed(0)))
        seqs = [seq_at([11, 12, 13, 14, 15], [16], 5, [3, 7]), seq_at(list(range(20, 29)), [29], 9, [0, 1, 2]),
                seq_at([31, 32, 33, 34, 35, 36, 37], [], 4, [5, 6])]
        return cache, seqs

    cache, seqs = state()
    fwd = plan_flat(cache, seqs, [1, 1, 3])
    mixed = tiny.model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index)[0]          # (3, V)
    cache, seqs = state()
    alone = []
    for group in (seqs[:2], seqs[2:]):
        p = cache.plan(group)
        alone.append(tiny.model(p.input_ids, p.positions, p, last_only=True)[:, -1])                 # (B, V)
    torch.testing.assert_close(mixed, torch.cat(alone), rtol=1e-5, atol=1e-5)


# ---------- 块边界落在每一个位置 ----------

@torch.inference_mode()
def test_chunk_boundary_at_every_position_gives_the_same_kv(tiny):
    """13 个 token 的提示词，先算前 k 个、再算剩下的（k = 1..12）：池子里 13 个位置的 K/V 与单独一次 prefill
    （step03 的连续缓存）写出的相同（相对误差 ≤ 1e-5），最后一个位置的 logits 也相同。"""
    prompt, bs = list(range(50, 63)), 4
    dense = PreallocKVCache(tiny.cfg, len(prompt), "cpu", torch.float32)
    ref_logits = forward_single(tiny.model, dense, prompt, start=0)            # (V,)
    ref = dense.kv[:, :, 0, :, :len(prompt)]                                   # (layers, 2, H_kv, 13, D)
    for k in range(1, len(prompt)):
        cache = PagedKVCache(tiny.cfg, 8, bs, "cpu", torch.float32)
        seq = seq_at(prompt, [], 0, [6, 2, 5, 0])                              # 故意打乱的物理块
        for n in (k, len(prompt) - k):
            fwd = plan_flat(cache, [seq], [n])
            logits = tiny.model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index)[0]
            seq.num_cached_tokens += n
        got = cache.pool[:, :, seq.block_table].transpose(2, 3).flatten(3, 4)[:, :, :, :len(prompt)]
        # (layers, 2, 4, H_kv, bs, D) -> (layers, 2, H_kv, 4, bs, D) -> (layers, 2, H_kv, 16, D)
        assert float((got - ref).abs().max() / ref.abs().max()) <= KV_RTOL, k
        torch.testing.assert_close(logits[0], ref_logits, rtol=1e-5, atol=1e-5)


@one_arch
def test_every_budget_gives_the_same_tokens(tiny):
    """一个 13 个 token 的提示词单独跑，预算 k = 1..13：每次前向最多 k 个 token，所以块边界落在 k、2k、……——
    每个位置都当过一次第一个边界。输出与 step03 逐 token 相同；每个预算下 prefill 用了 ⌈13 / k⌉ 次前向。"""
    r = Request(list(range(50, 63)), 5, ignore_eos=True)
    ref = step03_outputs(tiny.model, [r])
    for k in range(1, 14):
        engine = ChunkedPrefillEngine(tiny.model, 8, 4, max_batch_size=1, max_num_batched_tokens=k)
        out, st = engine.generate([r])
        assert out == ref, k
        assert st.num_forwards == -(-13 // k) + 4 and st.prefill_steps == -(-13 // k)
        assert_idle(engine)


# ---------- 调度的账目 ----------

@one_arch
def test_budget_schedule_by_hand(tiny):
    """预算 8、批上限 4、块大小 4。A（提示词 3）先到；B（提示词 10）同时到：
    第 1 步：A 整段 3 个 + B 的前 5 个 = 8；第 2 步：A decode 1 + B 剩下的 5 个 = 6（B 采样出首 token）；
    之后每步两个 decode。"""
    steps = []
    engine = ChunkedPrefillEngine(tiny.model, 16, 4, max_batch_size=4, max_num_batched_tokens=8)
    reqs = [Request([5, 6, 7], 4, ignore_eos=True), Request(list(range(10, 20)), 3, ignore_eos=True)]
    out, st = engine.generate(reqs, on_step=lambda batch, running: steps.append(list(batch.num_new_tokens)))
    assert steps == [[3, 5], [1, 5], [1, 1], [1, 1]]
    assert [(x.prefill, x.rows, x.width, x.tokens, x.decode_tokens) for x in st.steps] == [
        (True, 1, 8, 8, 0), (True, 1, 6, 6, 1), (False, 1, 2, 2, 2), (False, 1, 2, 2, 2)]
    assert st.prefill_tokens == 13 and st.prefill_padding_slots == 0
    assert out == step03_outputs(tiny.model, reqs)


@one_arch
def test_budget_smaller_than_batch_size_is_a_user_error(tiny):
    with pytest.raises(UserError, match="at least --max-batch-size"):
        ChunkedPrefillEngine(tiny.model, 16, 4, max_batch_size=8, max_num_batched_tokens=7)
    ChunkedPrefillEngine(tiny.model, 16, 4, max_batch_size=8, max_num_batched_tokens=7, chunked_prefill=False)   # 不分块时不用它


@one_arch
def test_no_chunked_prefill_is_step06_exactly(tiny):
    """--no-chunked-prefill：输出、每一次前向（是否 prefill、行数、宽度、token 数）、抢占次数都与 step06 相同。"""
    rng = random.Random(4)
    prefix = [rng.randrange(2, 256) for _ in range(14)]
    reqs = [Request(prefix + [rng.randrange(2, 256) for _ in range(rng.randint(1, 8))], rng.randint(4, 16),
                    SamplingParams(temperature=0.8, seed=i) if i % 2 else SamplingParams(), ignore_eos=True)
            for i in range(8)]
    out6, st6 = PrefixCachingEngine(tiny.model, 14, 4, 8).generate(reqs)
    out7, st7 = ChunkedPrefillEngine(tiny.model, 14, 4, 8, chunked_prefill=False).generate(reqs)
    shapes = [[(x.prefill, x.rows, x.width, x.tokens) for x in st.steps] for st in (st6, st7)]
    assert out7 == out6 and shapes[0] == shapes[1] and st7.preemptions == st6.preemptions > 0


@one_arch
def test_padding_is_measured_from_the_forward_shapes(tiny):
    """同时到达、长短不一的提示词：step06 的 prefill 左填充（浪费 > 0，由 (B, L) 与真实 token 数算出），
    step07 同样的请求一行排开，算出来是 0。"""
    reqs = [Request(list(range(start, start + n)), 3, ignore_eos=True) for start, n in ((10, 3), (20, 11), (40, 6))]
    _, st6 = PrefixCachingEngine(tiny.model, 16, 4, 4).generate(reqs)
    _, st7 = ChunkedPrefillEngine(tiny.model, 16, 4, 4, 64).generate(reqs)
    assert st6.prefill_padding_slots == 3 * 11 - 20 and st7.prefill_padding_slots == 0
    assert st7.steps[0].width == 20 and st7.prefill_tokens == 20


# ---------- 请求陆续到达 ----------

@one_arch
def test_requests_are_scheduled_only_after_they_arrive(tiny):
    """到达时刻相隔 1000 秒：引擎不真的等（时钟直接拨过去，空闲记在 idle_s），每个请求的首 token 都在它到达之后，
    第二个请求到达时第一个早已结束——各自单独跑，输出与 step03 相同。step06（同一个到达机制）也一样。"""
    reqs = [Request([5, 6, 7], 4, ignore_eos=True), Request([8, 9], 3, ignore_eos=True, arrival_s=1000.0),
            Request([10, 11, 12, 13], 2, ignore_eos=True, arrival_s=1000.0)]
    for engine in (ChunkedPrefillEngine(tiny.model, 16, 4, 4, 8), PrefixCachingEngine(tiny.model, 16, 4, 4)):
        out, st = engine.generate(reqs)
        assert out == step03_outputs(tiny.model, reqs)
        assert st.wall_s < 100 and st.idle_s > 999                       # 没有真的睡 1000 秒
        assert st.first_token_s[0] < 1000 <= min(st.first_token_s[1:])
        assert st.finish_s[0] < 1000 and all(t >= 0 for t in st.ttft_s())
        assert all(len(ts) == len(o) and ts == sorted(ts) for ts, o in zip(st.token_s, out))
        assert st.max_gap_s()[2] is not None and st.max_gap_s()[2] < 100


@one_arch
def test_negative_arrival_time_is_a_user_error(tiny):
    with pytest.raises(UserError, match="arrival time"):
        ChunkedPrefillEngine(tiny.model, 16, 4, 4, 8).generate([Request([5], 2, arrival_s=-1.0)])


# ---------- 浸泡：随机到达、共享前缀、小池子 ----------

@one_arch
def test_soak_arrivals_shared_prefixes_tiny_pool_equals_step03(tiny):
    """40 个请求陆续到达（间隔 0–3 ms），几组共享前缀，贪心 / 带种子采样混在一起；池子只比最大的请求多一点，
    预算从 4 到 23 里随机取：分块、抢占（包括 prefill 到一半的）、驱逐都会发生。每个输出都等于 step03 单独生成，
    结束后引用计数全为 0。"""
    rng = random.Random(7)
    prefixes = [[rng.randrange(2, 256) for _ in range(rng.randint(4, 24))] for _ in range(4)]
    reqs, t = [], 0.0
    for i in range(40):
        params = SamplingParams(temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 20]), seed=i) \
            if rng.random() < 0.4 else SamplingParams()
        reqs.append(Request(rng.choice(prefixes) + [rng.randrange(2, 256) for _ in range(rng.randint(0, 12))],
                            rng.randint(1, 14), params, ignore_eos=rng.random() < 0.5, arrival_s=t))
        t += rng.uniform(0, 0.003)
    ref = step03_outputs(tiny.model, reqs, [1])
    num_blocks = max(blocks_needed(r, 4) for r in reqs) + 2
    preemptions = mid_prefill = evictions = 0
    for budget in (4, 7, 23):
        engine = ChunkedPrefillEngine(tiny.model, num_blocks, block_size=4, max_batch_size=4, max_num_batched_tokens=budget)
        ledger = step07_run.ChunkLedger()
        out, st = engine.generate(reqs, eos_ids=[1], on_step=ledger)
        assert out == ref, budget
        assert st.prefill_padding_slots == 0
        preemptions, mid_prefill, evictions = (preemptions + st.preemptions, mid_prefill + ledger.preempted_mid_prefill,
                                               evictions + st.evictions)
        assert_idle(engine)
    assert preemptions > 0 and mid_prefill > 0 and evictions > 0, (preemptions, mid_prefill, evictions)


# ---------- 对照实验与命令行 ----------

@one_arch
def test_varlen_bench_three_ways_compute_the_same_logits(tiny):
    """varlen_bench 的三种做法（展平 + 按段、左填充 + 掩码、块对角掩码）在同一步上给出相同的 logits。"""
    from common.cli import Session
    s = Session(tiny.model, None, tiny.cfg, None, "cpu", torch.float32)
    res = compare_varlen(s, [9, 14, 11], (6, 5), block_size=4, repeats=1)
    assert all(r["max_rel_diff"] <= 1e-5 and r["same_argmax"] for r in res.values())
    assert res[FLAT]["token_slots"] == 3 + 5


def test_run_py_generation_mode_equals_step06(tiny_tok_dir, capsys):
    """生成模式（进程内，同一条 cli.run_main）：预算 9（批上限 8），两个提示词分块 prefill；输出与 step06 的引擎相同，
    前向比它多（prefill 分了块），填充为 0。"""
    from common.weights import load_model
    argv = ["--model", str(tiny_tok_dir), "--prompt", "The three primary colors are", "--prompt", "def fibonacci(n):",
            "--max-new-tokens", "6", "--ignore-eos", "--max-num-batched-tokens", "9", "--json"]
    with pytest.raises(SystemExit) as e:
        cli.run_main(step07_run.make_parser(), step07_run.main, argv)
    captured = capsys.readouterr()
    assert e.value.code == 0, captured.err[-2000:]
    out = json.loads(captured.out.strip().splitlines()[-1])
    model = load_model(tiny_tok_dir, "cpu", torch.float32)
    reqs = [Request(x["prompt_ids"], 6, ignore_eos=True) for x in out["results"]]
    assert sum(len(r.prompt_ids) for r in reqs) > 9          # 两个提示词一次前向放不下：第二个真的分了块
    ref, st6 = PrefixCachingEngine(model, 64, 16, 8).generate(reqs)
    assert [x["output_ids"] for x in out["results"]] == ref
    assert out["stats"]["forwards"] > st6.num_forwards and out["stats"]["prefill_padding_waste"] == 0


def test_run_py_budget_below_batch_size_is_a_user_error(tiny_tok_dir, capsys):
    line = cli_error(step07_run, ["--model", str(tiny_tok_dir), "--prompt", "hi", "--max-num-batched-tokens", "4"], capsys)
    assert "at least --max-batch-size" in line
