"""step05：分配器的不变量（性质测试）、块表 gather 与连续缓存一致、读路径拷贝的字节数与公式、
空块和没写过的槽里放什么都不影响输出、前缀已缓存再 prefill 的行（step06 要用的路径）、调度器的抢占账目、
小池子 / 随机负载下每个请求的输出都等于 step03 单独生成、停止字符串、干等的记账，以及命令行。"""
import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.compare import MARGIN_TOL, compare
from common.errors import UserError
from conftest import cli_error, one_arch, run_py
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single.cache import PreallocKVCache
from step03_kvcache_single.engine import generate as generate_single
from step04_static_batching.request import Request
from step05_paged import run as step05_run
from step05_paged.block_allocator import BlockAllocator
from step05_paged.engine import PagedEngine
from step05_paged.paged_cache import PagedKVCache
from step05_paged.scheduler import Scheduler
from step05_paged.sequence import Sequence, Status

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


@one_arch
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
    # 全新的 prefill 不读池子：注意力只看这次前向自己的 K/V (B, H_kv, L, D)，掩码与 step04 的左填充相同
    assert p.read_rows is None and p.mask.shape == (2, 1, 1, 6, 6)
    assert p.mask[0, 0, 0, 5].tolist() == [False, False, False, True, True, True]   # A 的最后一个 query 看它的 3 个 token
    assert p.mask[0, 0, 0, 1].tolist() == [False] * 6                               # 填充的 query 什么都看不到
    # decode：A 已缓存 3 个、新 token 在位置 3（仍在第 0 块）；B 的位置 6 落在第 1 块（物理块 2）的偏移 2
    a.output_ids, b.output_ids = [7], [9]
    a.num_cached_tokens, b.num_cached_tokens = 3, 6
    p = cache.plan([a, b])
    assert p.input_ids.tolist() == [[7], [9]] and p.positions.tolist() == [[3], [6]]
    assert p.slot_mapping.tolist() == [15, 10]
    assert p.mask.shape == (2, 1, 1, 1, 8)                             # 读回 max_blocks × 4 = 8 个位置
    assert p.mask[:, 0, 0, 0].tolist() == [[True] * 4 + [False] * 4, [True] * 7 + [False]]
    # 读的行：池子一层看成 (2 × 5 块 × H_kv 头, 4·D)，(K/V, 块, 头) 在 (kv·5 + 块)·H_kv + 头
    H = tiny.cfg.num_kv_heads
    rows = p.read_rows.view(2, 2, H, 2)                                # (K/V, B, H_kv, max_blocks)
    assert rows[0, 0, 0].tolist() == [3 * H, 4 * H] and rows[1, 1, H - 1].tolist() == [(5 + 0) * H + H - 1, (5 + 2) * H + H - 1]


@one_arch
def test_block_table_gather_equals_contiguous_cache(tiny):
    """同样的 K/V 分别写进分页池（块表打乱、跨块）和 step03 的 PreallocKVCache：prefill 不读池子，直接用自己的 K/V；
    之后每个 decode 步每层按块表读回的 K/V 与连续缓存完全相同（每行自己长度之内）。"""
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
            if step == 0:                              # 全新的 prefill：返回的就是传进去的 K/V，不读池子
                assert k_all is k and v_all is v
            for i, (seq, dc) in enumerate(zip(seqs, dense)):
                n_new = seq.num_tokens - seq.num_cached_tokens
                kd, vd = dc.update(layer, k[i:i + 1, :, L - n_new:], v[i:i + 1, :, L - n_new:])  # 只取真实 token
                if step > 0:
                    assert torch.equal(k_all[i:i + 1, :, :seq.num_tokens], kd)
                    assert torch.equal(v_all[i:i + 1, :, :seq.num_tokens], vd)
                    assert not v_all[i, :, seq.num_tokens:].any()   # 长度之外（空块、最后一块的尾巴）的 V 清零
        assert p.gather_bytes == (0 if step == 0 else cfg.num_layers * 2 * B * H_kv * p.block_tables.shape[1] * bs * D * 4)
        for seq, dc in zip(seqs, dense):
            dc.advance(seq.num_tokens - seq.num_cached_tokens)
            seq.num_cached_tokens = seq.num_tokens
            seq.output_ids.append(1)
    used = {b for s in seqs for b in s.block_table}
    for blk in set(range(13)) - used:                  # 填充的 query 没有写进任何槽：块表之外的块（含空块）仍全是 0
        assert not cache.pool[:, :, blk].any()


# ---------- 读路径：拷贝的字节数、空块与没写过的槽、前缀已缓存的 prefill ----------

@torch.inference_mode()   # 引擎在 inference_mode 里前向（读路径的 index_select(out=) 不支持求导）
@one_arch
def test_gather_bytes_equal_the_formula_by_hand(tiny):
    """块大小 4；A 有 3 个 token（块表 [3]），B 有 6 个（块表 [0, 2]）。全新的 prefill 不读池子：0 字节。
    接着一个 decode 步：B = 2 行，最长的块表 2 块 → 每层 K、V 各拷 2 × H_kv × 2 块 × 4 × D 个数。
    tiny：2 层、H_kv = 2、D = 16、float32 → 每 token 的 K/V 2 × 2 × 2 × 16 × 4 = 512 字节，
    一步 = B × max_blocks × block_size × 512 = 2 × 2 × 4 × 512 = 8192 字节（其中 A 补齐的空块占 4 × 512）。"""
    assert tiny.cfg.kv_bytes_per_token(4) == 512
    cache = PagedKVCache(tiny.cfg, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32)
    a, b = seq_with(3, [3]), seq_with(6, [0, 2])
    p = cache.plan([a, b])
    tiny.model(p.input_ids, p.positions, p, last_only=True)
    assert p.gather_bytes == 0
    for seq in (a, b):
        seq.num_cached_tokens = seq.num_tokens
        seq.output_ids.append(7)
    p = cache.plan([a, b])
    tiny.model(p.input_ids, p.positions, p, last_only=True)
    assert p.gather_bytes == 8192


def poisoned_run(model, requests, num_blocks, value):
    engine = PagedEngine(model, num_blocks=num_blocks, block_size=4, max_batch_size=8)
    if value is not None:
        engine.cache.pool.fill_(value)     # 整个池子：空块、空闲块、每个请求最后一块还没写到的尾巴
    return engine.generate(requests, eos_ids=[1])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 3e38], ids=["nan", "inf", "huge"])
@one_arch
def test_poisoned_pool_does_not_change_outputs(tiny, value):
    """池子里没被自己写过的槽放什么都不影响输出：读回后每行长度之外的位置 K 被掩码替换、V 清零
    （否则 0 × NaN = NaN）。整个池子先填满毒值，长短不一的请求（补齐的空块多）加小池子（块被别人用过再分配、
    抢占后重算）跑完，每个请求的输出与干净的池子逐 token 相同。"""
    rng = random.Random(5)
    requests = [Request([rng.randrange(2, 256) for _ in range(rng.randint(1, 30))], rng.randint(4, 16),
                        SamplingParams(temperature=0.9, seed=i) if i % 3 == 0 else SamplingParams(), ignore_eos=True)
                for i in range(8)]
    for num_blocks in (64, 12):                         # 12 块：最大的请求要 12 块，一定抢占、复用别人的块
        clean, st = poisoned_run(tiny.model, requests, num_blocks, None)
        poisoned, st_p = poisoned_run(tiny.model, requests, num_blocks, value)
        assert poisoned == clean
        assert st_p.preemptions == st.preemptions and (num_blocks == 64 or st.preemptions > 0)


@torch.inference_mode()   # 引擎在 inference_mode 里前向（读路径的 index_select(out=) 不支持求导）
@one_arch
def test_decode_logits_bitwise_equal_with_poisoned_null_block(tiny):
    """更直接：同一个 decode 步，空块里是 0 还是 NaN，logits 逐位相同（不是"差不多"）。"""
    cache = PagedKVCache(tiny.cfg, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32)
    a, b = seq_with(2, [1]), seq_with(9, [0, 3, 2])
    p = cache.plan([a, b])
    tiny.model(p.input_ids, p.positions, p, last_only=True)
    for seq in (a, b):
        seq.num_cached_tokens = seq.num_tokens
        seq.output_ids.append(7)
    logits = []
    for value in (0.0, float("nan")):
        cache.pool[:, :, cache.null_block] = value
        cache.pool[:, :, 1, :, 3:] = value              # A 的块里还没写到的尾巴（位置 3）
        p = cache.plan([a, b])
        logits.append(tiny.model(p.input_ids, p.positions, p, last_only=True))
    assert torch.equal(logits[0], logits[1])


@torch.inference_mode()   # 引擎在 inference_mode 里前向（读路径的 index_select(out=) 不支持求导）
@one_arch
def test_prefill_with_a_cached_prefix_reads_the_prefix_from_the_pool(tiny):
    """step06（前缀缓存）要走的路径，现在就测：一个请求前 8 个 token 的 K/V 已经在池子里（两整块），
    这一步 prefill 剩下的 3 个；同一次前向里还有一个全新的请求。前缀行读池子（它自己的块 + 刚写进去的新 token），
    全新的行在同一个张量里；两行每个位置的 logits 都与不用缓存、整段重算的结果相同（浮点容差内）。"""
    cache = PagedKVCache(tiny.cfg, num_blocks=8, block_size=4, device="cpu", dtype=torch.float32)
    ids = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    prefix = seq_with(8, [5, 2])
    prefix.request.prompt_ids = ids[:8]
    p = cache.plan([prefix])
    tiny.model(p.input_ids, p.positions, p)             # 写进块 5、2
    full = seq_with(11, [5, 2, 7])
    full.request.prompt_ids = ids
    full.num_cached_tokens = 8                          # 前 8 个已在池子里（共享了 prefix 的两块）
    fresh = seq_with(5, [0, 1])                         # 全新：5 个 token
    p = cache.plan([full, fresh])
    assert p.read_rows is not None and p.input_ids.shape == (2, 5)
    assert p.positions.tolist() == [[0, 0, 8, 9, 10], [0, 1, 2, 3, 4]]
    logits = tiny.model(p.input_ids, p.positions, p)    # (2, 5, V)
    assert p.gather_bytes == tiny.cfg.num_layers * 2 * 2 * tiny.cfg.num_kv_heads * 3 * 4 * tiny.cfg.head_dim * 4
    for row, seq, n in ((0, full, 3), (1, fresh, 5)):
        t = seq.request.prompt_ids
        ref = tiny.model(torch.tensor([t]), torch.arange(len(t))[None])[0, -n:]
        torch.testing.assert_close(logits[row, -n:], ref, rtol=1e-4, atol=1e-4)


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


@one_arch
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


@one_arch
def test_kv_waste_accounting_by_hand(tiny):
    """提示词 5、块大小 4、生成 3 个：每步分配 2 块 = 8 槽，缓存里依次有 5、6、7 个 token → 浪费 (3+2+1)/24。"""
    engine = PagedEngine(tiny.model, num_blocks=4, block_size=4)
    _, st = engine.generate([Request([5, 6, 7, 8, 9], 3, ignore_eos=True)])
    assert (st.num_forwards, st.prefill_steps, st.decode_steps) == (3, 1, 2)
    assert (st.kv_slot_steps_held, st.kv_slot_steps_used) == (24, 18) and st.kv_waste == pytest.approx(0.25)
    # 同一个 KV 浪费的定义、同一段代码（step04 的 EngineStats）：每步持有 8 槽，存着 5、6、7 个 token
    assert [(x.kv_slots_held, x.kv_slots_used) for x in st.steps] == [(8, 5), (8, 6), (8, 7)]
    # decode 步按块表读：每步 1 行 × 2 块 × 4 槽 × 每 token 512 字节
    assert [x.gather_bytes for x in st.steps] == [0, 2 * 4 * 512, 2 * 4 * 512]


@one_arch
def test_request_that_exactly_fills_the_pool_runs(tiny):
    """提示词 6 + 生成 11 - 1 = 16 个 token = 正好 4 块 × 4：能跑完；再多一个 token 就开始前报错。"""
    engine = PagedEngine(tiny.model, num_blocks=4, block_size=4)
    r = Request(list(range(10, 16)), 11, ignore_eos=True)
    outputs, _ = engine.generate([r, r])
    assert_equal_to_step03(tiny.model, [r, r], outputs, [])
    with pytest.raises(UserError, match="needs up to 5 KV blocks"):
        engine.generate([r, Request(list(range(10, 16)), 12)])
    assert engine.allocator.num_free == 4


@one_arch
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


@one_arch
def test_stall_is_the_prefill_a_decoding_request_waits_for(tiny):
    """A、B 的提示词各 10 个 token，一次 prefill 最多 15 个位置：第 1 步只 prefill A；第 2 步 prefill B，
    这时 A 已经有首 token、在 decode，却一个 token 也没前进——它干等了第 2 步的全部时间。之后两个一起 decode。"""
    engine = PagedEngine(tiny.model, num_blocks=16, block_size=4, max_batch_size=4, max_prefill_tokens=15)
    reqs = [Request(list(range(2, 12)), 5, ignore_eos=True), Request(list(range(20, 30)), 5, ignore_eos=True)]
    _, st = engine.generate(reqs)
    assert [(x.prefill, x.rows, x.stalled) for x in st.steps[:3]] == [(True, 1, 0), (True, 1, 1), (False, 2, 0)]
    assert st.stall_s == [st.steps[1].seconds, 0.0]
    assert st.first_token_s[0] < st.first_token_s[1]
    bare, tpot = st.tpot_s(without_stall=True), st.tpot_s()
    assert bare[0] == pytest.approx(tpot[0] - st.stall_s[0] / 4) and bare[1] == tpot[1]


class CharTokenizer:
    """测试用：token i 解码成字母表里的第 i % 26 个字母，停止字符串可以跨 token（"ab" = 两个 token）。"""
    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


@one_arch
def test_stop_strings_equal_step03(tiny):
    """停止字符串与 step02/03 同一语义：新生成的文本里出现任一个就停，包含补全它的那个 token。
    step04（一批和两批）、step05（含抢占）的每个请求都与 step03 单独生成逐 token 相同，且确实有请求被停止串截断。"""
    from step04_static_batching.engine import generate_batch
    tok = CharTokenizer()
    rng = random.Random(7)
    requests = [Request([rng.randrange(2, 256) for _ in range(rng.randint(2, 20))], 20,
                        SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams(),
                        ignore_eos=True, stop=stop)
                for i, stop in enumerate([("e",), ("ab", "q"), (), ("z", "kk"), ("a",), ("m", "n", "o")])]
    refs = [generate_single(tiny.model, r.prompt_ids, r.max_new_tokens, r.params, (), True,
                            stop_strings=r.stop, tokenizer=tok) for r in requests]
    assert any(len(ref) < 20 for ref in refs)
    for outs in (generate_batch(tiny.model, requests, 6, (), tok).outputs,
                 generate_batch(tiny.model, requests, 4, (), tok).outputs,
                 PagedEngine(tiny.model, num_blocks=10, block_size=4, max_batch_size=6).generate(requests, (), tok).outputs):
        assert outs == refs
    with pytest.raises(ValueError, match="tokenizer"):
        PagedEngine(tiny.model, num_blocks=10, block_size=4).generate(requests)


# ---------- 命令行（真实模型） ----------

def test_run_py_num_blocks_too_small_is_a_user_error(tiny_tok_dir, capsys):
    line = cli_error(step05_run, ["--model", str(tiny_tok_dir), "--prompt", "Hello there", "--num-blocks", "1",
                                  "--max-new-tokens", "32"], capsys)
    assert "--num-blocks" in line
    assert capsys.readouterr().out == ""                # 开始生成之前就报错


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


@one_arch
def test_plan_rejects_block_table_that_does_not_cover_the_new_tokens(tiny):
    """调度器忘了分配块：plan 给出说清楚的错误，而不是 IndexError 或者写到别人的槽里。"""
    cache = PagedKVCache(tiny.cfg, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="does not cover position 4"):
        cache.plan([seq_with(5, [1])])


def test_run_py_stop_strings_equal_step03(real):
    """--stop：小池子里每个请求被停止字符串截断的位置与 step03 单独生成相同。"""
    texts = ["The three primary colors are", "Paris is the capital of", "def add(a, b):"]
    stop = [",", "\n"]
    r = run_py("step05_paged", *[a for p in texts for a in ("--prompt", p)], "--max-new-tokens", "16",
               "--num-blocks", "4", "--block-size", "8", *[a for x in stop for a in ("--stop", x)], "--json")
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout.strip().splitlines()[-1])["results"]
    lengths = []
    for res in results:
        ref = generate_single(real.model, res["prompt_ids"], 16, SamplingParams(), real.tok.eos_ids,
                              stop_strings=stop, tokenizer=real.tok)
        c = compare(res["prompt"], res["prompt_ids"], ref, res["output_ids"], real.full_logits, MARGIN_TOL[torch.float32])
        assert c.ok, c.describe()
        lengths.append(len(ref))
    assert min(lengths) < 16


@torch.inference_mode()
@one_arch
def test_alternative_reads_in_decode_bench_compute_the_same_logits(tiny):
    """decode_bench.py 里比较速度的几种读法必须算的是同一个东西：池子里放随机数，同一个 decode 步，
    logits 与 step05 自己的读法在浮点容差内相同（逐行注意力的求和顺序不同，所以不要求逐位相同）。"""
    from step05_paged.decode_bench import READS, as_read
    cache = PagedKVCache(tiny.cfg, num_blocks=12, block_size=4, device="cpu", dtype=torch.float32)
    cache.pool.normal_(generator=torch.Generator().manual_seed(0))
    seqs = [seq_with(9, [7, 2, 5]), seq_with(2, [0]), seq_with(13, [9, 4, 1, 3])]
    for seq in seqs:
        seq.num_cached_tokens = seq.num_tokens - 1
    fwd = cache.plan(seqs)
    ref = tiny.model(fwd.input_ids, fwd.positions, fwd, last_only=True)
    for name, read in READS.items():
        got = tiny.model(fwd.input_ids, fwd.positions, as_read(cache.plan(seqs), read), last_only=True)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=name)
