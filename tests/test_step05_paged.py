"""step05：分配器的不变量（性质测试）、块表 gather 与连续缓存一致、调度器的抢占账目、
小池子 / 随机负载下每个请求的输出都等于 step03 单独生成，以及命令行的错误处理。"""
import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.compare import MARGIN_TOL, compare
from common.errors import UserError
from conftest import run_py
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single.cache import PreallocKVCache
from step03_kvcache_single.engine import generate as generate_single
from step04_static_batching.request import Request
from step05_paged.block_allocator import BlockAllocator
from step05_paged.engine import PagedEngine
from step05_paged.paged_cache import PagedKVCache
from step05_paged.scheduler import Scheduler
from step05_paged.sequence import Sequence, Status
from step05_paged.static_baseline import static_kv_waste, static_peak_concurrency, static_timings

TOL = MARGIN_TOL[torch.float32]


# ---------- 分配器：随机的 allocate / free / fork 序列之后，账目始终自洽 ----------

def check_invariants(a: BlockAllocator, owners: list[list[int]]) -> None:
    held = [0] * a.num_blocks
    for blocks in owners:
        assert len(set(blocks)) == len(blocks)          # 一个块表里不会出现同一块两次
        for b in blocks:
            held[b] += 1
    assert a.ref_counts == held                         # 引用计数 = 持有它的块表个数
    free = list(a.free_blocks)
    assert len(set(free)) == len(free)                  # 空闲链表没有重复
    assert set(free) == {b for b in range(a.num_blocks) if held[b] == 0}  # 没人持有 ⇔ 在空闲链表里：不泄漏、不双重分配


ops = st.lists(st.tuples(st.sampled_from(["allocate", "free", "fork"]), st.integers(0, 12)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 16), ops=ops)
def test_allocator_invariants_under_random_operations(num_blocks, ops):
    a = BlockAllocator(num_blocks)
    owners: list[list[int]] = []
    for op, n in ops:
        if op == "allocate":
            if a.can_allocate(n):
                owners.append(a.allocate(n))
            else:
                before = (list(a.free_blocks), list(a.ref_counts))
                with pytest.raises(RuntimeError):
                    a.allocate(n)
                assert before == (list(a.free_blocks), list(a.ref_counts))   # 失败的分配不改变任何状态
        elif owners:
            i = n % len(owners)
            if op == "free":
                a.free(owners.pop(i))
            else:
                owners.append(a.fork(owners[i]))
        check_invariants(a, owners)
    for blocks in owners:
        a.free(blocks)
    check_invariants(a, [])
    assert a.num_free == num_blocks


def test_allocator_rejects_double_free_and_fork_of_free_block():
    a = BlockAllocator(4)
    blocks = a.allocate(2)
    shared = a.fork(blocks)
    a.free(blocks)
    assert a.num_free == 2                  # 还有一个持有者：块不回空闲链表
    a.free(shared)
    assert a.num_free == 4
    with pytest.raises(RuntimeError):
        a.free(blocks)
    with pytest.raises(RuntimeError):
        a.fork(blocks)


# ---------- 分页缓存：槽号、掩码，以及 gather 出来的 K/V 与 step03 的连续缓存相同 ----------

class FakeRequest:
    def __init__(self, prompt_ids, max_new_tokens=8):
        self.prompt_ids, self.max_new_tokens = prompt_ids, max_new_tokens
        self.ignore_eos, self.params = False, SamplingParams()


def seq_with(prompt_len: int, block_table: list[int]) -> Sequence:
    s = Sequence(FakeRequest(list(range(100, 100 + prompt_len))), torch.Generator())
    s.block_table = list(block_table)
    return s


def test_plan_by_hand(tiny):
    """块大小 4：A 有 3 个 token、块表 [3]；B 有 6 个、块表 [0, 2]。左填充到 L = 6。"""
    cache = PagedKVCache(tiny.cfg, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32)
    a, b = seq_with(3, [3]), seq_with(6, [0, 2])
    p = cache.plan([a, b])
    assert p.input_ids.tolist() == [[0, 0, 0, 100, 101, 102], [100, 101, 102, 103, 104, 105]]
    assert p.positions.tolist() == [[0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]]
    assert p.token_index.tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert p.slot_mapping.tolist() == [12, 13, 14, 0, 1, 2, 3, 8, 9]   # 块号 × 4 + 块内偏移
    assert p.block_tables.tolist() == [[3, 4], [0, 2]]                 # A 的块表用空块（第 4 块）补齐
    assert p.mask.shape == (2, 1, 1, 6, 8)
    assert p.mask[0, 0, 0, 5].tolist() == [True, True, True, False, False, False, False, False]  # 位置 2 看 key 0..2
    # decode：A 已缓存 3 个、新 token 在位置 3（仍在第 0 块）；B 的位置 6 落在第 1 块（物理块 2）的偏移 2
    a.output_ids, b.output_ids = [7], [9]
    a.num_cached_tokens, b.num_cached_tokens = 3, 6
    p = cache.plan([a, b])
    assert p.input_ids.tolist() == [[7], [9]] and p.positions.tolist() == [[3], [6]]
    assert p.slot_mapping.tolist() == [15, 10]


def test_block_table_gather_equals_contiguous_cache(tiny):
    """同样的 K/V 分别写进分页池（块表打乱、跨块）和 step03 的 PreallocKVCache：每层读回的 K/V 完全相同。"""
    cfg, bs, H_kv, D = tiny.cfg, 4, tiny.cfg.num_kv_heads, tiny.cfg.head_dim
    cache = PagedKVCache(cfg, num_blocks=12, block_size=bs, device="cpu", dtype=torch.float32)
    seqs = [seq_with(7, [7, 2]), seq_with(11, [0, 9, 4]), seq_with(1, [5])]
    dense = [PreallocKVCache(cfg, 16, "cpu", torch.float32) for _ in seqs]
    g = torch.Generator().manual_seed(0)
    for step in range(4):                              # 一次 prefill + 三次 decode
        if step == 2:                                  # 位置 8 和 12 各要跨进一个新块
            seqs[0].block_table.append(11)
            seqs[1].block_table.append(1)
        p = cache.plan(seqs)
        B, L = p.input_ids.shape
        for layer in range(cfg.num_layers):
            k = torch.randn(B, H_kv, L, D, generator=g)
            v = torch.randn(B, H_kv, L, D, generator=g)
            k_all, v_all = p.update(layer, k, v)       # (B, H_kv, S, D)
            for i, (seq, dc) in enumerate(zip(seqs, dense)):
                n_new = seq.num_tokens - seq.num_cached_tokens
                kd, vd = dc.update(layer, k[i:i + 1, :, L - n_new:], v[i:i + 1, :, L - n_new:])  # 只取真实 token
                assert torch.equal(k_all[i:i + 1, :, :seq.num_tokens], kd)
                assert torch.equal(v_all[i:i + 1, :, :seq.num_tokens], vd)
        for seq, dc in zip(seqs, dense):
            dc.advance(seq.num_tokens - seq.num_cached_tokens)
            seq.num_cached_tokens = seq.num_tokens
            seq.output_ids.append(1)
    used = {b for s in seqs for b in s.block_table}
    for blk in set(range(13)) - used:                  # 填充的 query 没有写进任何槽：块表之外的块（含空块）仍全是 0
        assert not cache.pool[:, :, blk].any()


# ---------- 调度器：接纳、逐块增长、抢占最新的请求并放回队头 ----------

def test_scheduler_preempts_newest_and_requeues_at_front():
    alloc = BlockAllocator(5)
    sched = Scheduler(alloc, block_size=4, max_batch_size=4, max_prefill_tokens=1000)
    a, b, c = (Sequence(FakeRequest(list(range(n))), torch.Generator()) for n in (4, 7, 5))
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()                           # 提示词需要 1 + 2 + 2 = 5 块：正好放下
    assert batch.is_prefill and batch.seqs == [a, b, c] and alloc.num_free == 0
    for s in (a, b, c):                                # 模拟这次前向：全部写进缓存，各采样一个 token
        s.num_cached_tokens = s.num_tokens
        s.output_ids.append(42)
    batch = sched.schedule()
    # a 有 5 个 token：位置 4 需要第 2 块，池子空了 → 抢占最新的 c（还回 2 块），a 拿 1 块；b 的 8 个 token 正好 2 块
    assert not batch.is_prefill and batch.seqs == [a, b]
    assert c.status is Status.WAITING and c.block_table == [] and c.num_cached_tokens == 0
    assert c.output_ids == [42] and list(sched.waiting) == [c]   # 已生成的 token 保留；在队头
    assert sched.num_preemptions == 1 and len(a.block_table) == 2 and alloc.num_free == 1
    assert sorted(a.block_table + b.block_table) == sorted(set(range(5)) - set(alloc.free_blocks))
    sched.finish(a)
    assert alloc.num_free == 3 and sched.running == [b]
    batch = sched.schedule()                           # c 重算 提示词 + 已生成 = 6 个 token → 2 块
    assert batch.is_prefill and batch.seqs == [c] and len(c.block_table) == 2 and alloc.num_free == 1


def test_scheduler_preempts_itself_when_it_is_the_newest():
    alloc = BlockAllocator(2)
    sched = Scheduler(alloc, block_size=2, max_batch_size=4, max_prefill_tokens=1000)
    a, b = (Sequence(FakeRequest([1, 2]), torch.Generator()) for _ in range(2))
    sched.add(a), sched.add(b)
    sched.schedule()
    for s in (a, b):
        s.num_cached_tokens = s.num_tokens
        s.output_ids.append(5)
    batch = sched.schedule()                           # 两个都要新块：a 先来，抢占 b 给 a
    assert batch.seqs == [a] and b.status is Status.WAITING and alloc.num_free == 0


# ---------- 引擎：与 step03 单独生成逐 token 一致 ----------

def assert_equal_to_step03(model, requests, outputs, eos_ids):
    def logits_fn(ids):
        return model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    for i, (r, got) in enumerate(zip(requests, outputs)):
        ref = generate_single(model, r.prompt_ids, r.max_new_tokens, r.params, eos_ids, r.ignore_eos)
        c = compare(f"request {i}", r.prompt_ids, ref, got, logits_fn, TOL)
        assert c.ok, c.describe()


def test_tiny_pool_forces_preemption_and_stays_token_exact(tiny):
    rng = random.Random(1)
    requests = [Request([rng.randrange(2, 256) for _ in range(rng.randint(3, 20))], 24,
                        SamplingParams(temperature=0.9, seed=i) if i % 2 else SamplingParams(), ignore_eos=True)
                for i in range(6)]
    engine = PagedEngine(tiny.model, num_blocks=12, block_size=4, max_batch_size=6)   # 最大的请求要 11 块
    outputs, stats = engine.generate(requests, eos_ids=[1])
    assert stats.preemptions > 0
    assert [len(o) for o in outputs] == [24] * 6
    assert_equal_to_step03(tiny.model, requests, outputs, [1])
    assert engine.allocator.num_free == 12 and not any(engine.allocator.ref_counts)


def test_kv_waste_accounting_by_hand(tiny):
    """提示词 5、块大小 4、生成 3 个：每步分配 2 块 = 8 槽，缓存里依次有 5、6、7 个 token → 浪费 (3+2+1)/24。"""
    engine = PagedEngine(tiny.model, num_blocks=4, block_size=4)
    _, st = engine.generate([Request([5, 6, 7, 8, 9], 3, ignore_eos=True)])
    assert (st.steps, st.prefill_steps, st.decode_steps) == (3, 1, 2)
    assert (st.allocated_slot_steps, st.used_slot_steps) == (24, 18) and st.kv_waste == pytest.approx(0.25)


def test_request_that_exactly_fills_the_pool_runs(tiny):
    """提示词 6 + 生成 11 - 1 = 16 个 token = 正好 4 块 × 4：能跑完；再多一个 token 就开始前报错。"""
    engine = PagedEngine(tiny.model, num_blocks=4, block_size=4)
    r = Request(list(range(10, 16)), 11, ignore_eos=True)
    outputs, _ = engine.generate([r, r])
    assert_equal_to_step03(tiny.model, [r, r], outputs, [])
    with pytest.raises(UserError, match="needs up to 5 KV blocks"):
        engine.generate([r, Request(list(range(10, 16)), 12)])
    assert engine.allocator.num_free == 4


def test_soak_200_random_requests(tiny):
    """200 个随机请求（长度、输出数、EOS、贪心 / 带种子采样都随机），池子只比最大的请求多一点：
    全部跑完，每个输出都等于 step03 单独生成，池子最后全空。"""
    rng = random.Random(2024)
    requests = []
    for i in range(200):
        params = SamplingParams(temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 20]), seed=i) \
            if rng.random() < 0.3 else SamplingParams()
        requests.append(Request([rng.randrange(2, 256) for _ in range(rng.randint(1, 40))], rng.randint(1, 24),
                                params, ignore_eos=rng.random() < 0.5))
    engine = PagedEngine(tiny.model, num_blocks=24, block_size=4, max_batch_size=16)   # 最大的请求要 16 块
    outputs, stats = engine.generate(requests, eos_ids=[1])
    assert stats.preemptions > 0 and stats.peak_running > 1
    assert_equal_to_step03(tiny.model, requests, outputs, [1])
    assert engine.allocator.num_free == 24 and not any(engine.allocator.ref_counts)


# ---------- step04 对照组的账本（手算的例子） ----------

def test_static_baseline_accounting_by_hand():
    # 一批两行：提示词 2、4（P = 4），max_new 3、2 → 预留 2 × (4 + 3 - 1) = 12 槽；输出 3 个、1 个 → 3 次前向。
    # 第 j 次前向后存着真实 token：j=1: 2 + 4；j=2: 3 + 4；j=3: 4 + 4（第二行早已结束）→ 21 / 36
    prompts, max_new, outputs = [[1, 2], [1, 2, 3, 4]], [3, 2], [[7, 7, 7], [7]]
    assert static_kv_waste(prompts, max_new, outputs, 2) == pytest.approx(1 - 21 / 36)
    ttft, tpot = static_timings(outputs, 2, times=[1.0, 2.0, 3.0])
    assert ttft == [1.0, 1.0] and tpot == [1.0]
    with pytest.raises(RuntimeError):                  # 前向次数与输出长度对不上：计时包装没包住全部前向
        static_timings(outputs, 2, times=[1.0, 2.0])
    # 预算 40 槽：前两个 (10 + 6 - 1) × 2 = 30 放得下；加第三个要 (30 + 6 - 1) × 3 = 105，只好另开一批
    assert static_peak_concurrency([[1] * 10, [1] * 10, [1] * 30], [6, 6, 6], budget_slots=40) == 2


# ---------- 命令行（真实模型） ----------

def test_run_py_num_blocks_too_small_is_a_user_error():
    r = run_py("step05_paged", "--prompt", "Hello there", "--num-blocks", "1", "--max-new-tokens", "32")
    assert r.returncode == 2
    assert r.stderr.startswith("error:") and "--num-blocks" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""                               # 开始生成之前就报错


def test_run_py_generation_mode_with_preemption_equals_step03(real):
    prompts = ["The three primary colors are", "def add(a, b):", "Paris is the capital of"]
    r = run_py("step05_paged", *[a for p in prompts for a in ("--prompt", p)], "--num-blocks", "4",
               "--block-size", "8", "--max-new-tokens", "20", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["stats"]["preemptions"] > 0
    for p, res in zip(prompts, out["results"]):
        ids = real.encode(p)
        ref = generate_single(real.model, ids, 20, SamplingParams(), real.tok.eos_ids, ignore_eos=True)
        c = compare(p, ids, ref, res["output_ids"], real.full_logits, TOL)
        assert res["prompt_ids"] == ids and c.ok, c.describe()


def test_plan_rejects_block_table_that_does_not_cover_the_new_tokens(tiny):
    """调度器忘了分配块：plan 给出说清楚的错误，而不是 IndexError 或者写到别人的槽里。"""
    cache = PagedKVCache(tiny.cfg, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="does not cover position 4"):
        cache.plan([seq_with(5, [1])])
