"""step05：块管理器的账（性质测试 + 手算）、plan 手算、块表 gather 与连续缓存一致、读路径拷贝的字节数、
空块和没写过的槽里放什么都不影响输出、前缀已在池子里的 prefill 行、调度器的抢占账目；step API（add_request /
step / abort / has_unfinished_requests）：每一步的输出与结束原因、abort 立刻还块、前向中途出错之后块一个不少；
小池子 / 随机负载下每个请求的输出都等于 step03 单独生成、停止字符串、干等的记账，以及命令行。"""
import importlib
import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common import cli
from common.clock import VirtualClock
from common.compare import MARGIN_TOL, compare
from common.errors import UserError
from common.harness import Arrival, replay
from conftest import cli_error, one_arch
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single.cache import PreallocKVCache
from step03_kvcache_single.engine import generate as generate_single
from step04_static_batching.request import Request
from step05_paged import run as step05_run
from step05_paged.block_manager import BlockManager
from step05_paged.engine import EngineConfig, LLMEngine
from step05_paged.kv_cache import PagedKVCache
from step05_paged.scheduler import Scheduler
from step05_paged.sequence import RequestOutput, Sequence, SequenceStatus

TOL = MARGIN_TOL[torch.float32]


def make_seq(prompt_ids, max_new_tokens=8, rid=0) -> Sequence:
    return Sequence(rid, Request(list(prompt_ids), max_new_tokens), torch.Generator(), 0.0)


def assert_pool_free(engine) -> None:
    """每个块都还回来了：引用计数全 0，空闲链表里正好是全部块（没有重复、没有丢失）。"""
    bm = engine.block_manager
    assert not any(bm.ref_counts) and bm.num_free_blocks == bm.num_blocks
    assert sorted(bm.free_blocks) == list(range(bm.num_blocks))
    assert not engine.scheduler.waiting and not engine.scheduler.running and not engine.has_unfinished_requests()


# ---------- 块管理器：随机的分配 / 按请求分块、增长、释放之后，账目始终自洽 ----------

def check_invariants(bm: BlockManager, tables: list[list[int]]) -> None:
    held = [0] * bm.num_blocks
    for blocks in tables:
        assert len(set(blocks)) == len(blocks)          # 一个块表里不会出现同一块两次
        for b in blocks:
            held[b] += 1
    assert bm.ref_counts == held                        # 引用计数 = 持有它的块表个数（step05 里没有共享：0 或 1）
    free = list(bm.free_blocks)
    assert len(set(free)) == len(free) == bm.num_free_blocks   # 空闲链表没有重复
    assert set(free) == {b for b in range(bm.num_blocks) if held[b] == 0}   # 没人持有 ⇔ 空闲：不泄漏、不双重分配


ops = st.lists(st.tuples(st.sampled_from(["allocate", "admit", "grow", "free"]), st.integers(0, 12)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 16), block_size=st.integers(1, 4), ops=ops)
def test_allocator_invariants_under_random_operations(num_blocks, block_size, ops):
    """allocate(n) 直接拿块；admit 按一个 n+1 个 token 的请求分块（allocate_seq）；grow 让一个请求 decode n 个 token，
    每写满一块加一块（needs_slot / append_slot）；free 还回一个块表（请求用 free_seq）。"""
    bm = BlockManager(num_blocks, block_size)
    owners: list = []                                   # list[int]（直接分配的块）或 Sequence
    table = lambda o: o.block_table if isinstance(o, Sequence) else o   # noqa: E731
    for op, n in ops:
        if op == "allocate":
            if bm.can_allocate(n):
                owners.append(bm.allocate(n))
            else:
                before = (list(bm.free_blocks), list(bm.ref_counts))
                with pytest.raises(RuntimeError):
                    bm.allocate(n)
                assert before == (list(bm.free_blocks), list(bm.ref_counts))   # 失败的分配不改变任何状态
        elif op == "admit":
            seq = make_seq(range(n + 1))
            if bm.can_allocate_seq(seq):
                bm.allocate_seq(seq)
                assert len(seq.block_table) == -(-(n + 1) // block_size)
                owners.append(seq)
            else:
                assert bm.blocks_for(n + 1) > bm.num_free_blocks
        elif owners and isinstance(owners[n % len(owners)], Sequence) and op == "grow":
            seq = owners[n % len(owners)]
            for _ in range(n):
                seq.output_ids.append(7)
                if bm.needs_slot(seq):
                    if not bm.can_allocate(1):
                        seq.output_ids.pop()
                        break
                    bm.append_slot(seq)
                assert not bm.needs_slot(seq)
            assert len(seq.block_table) == bm.blocks_for(seq.num_tokens)   # 一次只长一块：块表正好盖住全部 token
        elif owners and op == "free":
            o = owners.pop(n % len(owners))
            if isinstance(o, Sequence):
                o.num_computed_tokens = o.num_tokens
                bm.free_seq(o)
                assert o.block_table == [] and o.num_computed_tokens == 0
            else:
                bm.free(o)
        check_invariants(bm, [table(o) for o in owners])
    for o in owners:
        bm.free(table(o))
    check_invariants(bm, [])
    assert bm.num_free_blocks == num_blocks


def test_block_manager_by_hand():
    """块大小 4、10 块。先进先出：刚还回来的块排在空闲链表最后，最后才被重用。"""
    bm = BlockManager(10, 4)
    seq = make_seq(range(5))
    assert bm.can_allocate_seq(seq)
    bm.allocate_seq(seq)                                # 5 个 token → 2 块
    assert seq.block_table == [0, 1] and bm.num_free_blocks == 8 and bm.ref_counts[:3] == [1, 1, 0]
    seq.output_ids += [7, 7, 7]                         # 8 个 token：两块正好放满
    assert not bm.needs_slot(seq)
    seq.output_ids.append(7)                            # 第 9 个 token（位置 8）落在第 2 块
    assert bm.needs_slot(seq)
    bm.append_slot(seq)
    assert seq.block_table == [0, 1, 2] and not bm.needs_slot(seq) and bm.num_free_blocks == 7
    seq.num_computed_tokens = 9
    assert bm.usage([seq]) == (12, 9)                   # 持有 3 块 12 槽，存着 9 个 token
    bm.free_seq(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert list(bm.free_blocks) == [3, 4, 5, 6, 7, 8, 9, 0, 1, 2] and not any(bm.ref_counts)
    other = bm.allocate(8)
    assert other == [3, 4, 5, 6, 7, 8, 9, 0]
    assert not bm.can_allocate_seq(make_seq(range(9)))  # 要 3 块，只剩 2 块
    with pytest.raises(RuntimeError, match="asked for 3 blocks but only 2"):
        bm.allocate(3)
    bm.free(other)
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(other[:1])
    assert bm.num_free_blocks == 10
    with pytest.raises(ValueError):
        BlockManager(0, 4)


# ---------- 分页缓存：槽号、掩码，以及 gather 出来的 K/V 与 step03 的连续缓存相同 ----------

def seq_with(prompt_len: int, block_table: list[int]) -> Sequence:
    s = make_seq(range(100, 100 + prompt_len))
    s.block_table = list(block_table)
    return s


def new_tokens(seqs) -> list[int]:
    """每个请求这一步算几个 token：还没进池子的全部（step05 的 prefill 与 decode 都是这样）。"""
    return [s.num_tokens - s.num_computed_tokens for s in seqs]


@one_arch
def test_plan_by_hand(tiny):
    """块大小 4：A 有 3 个 token、块表 [3]；B 有 6 个、块表 [0, 2]。左填充到 L = 6。gather 的读法（行号、掩码、
    V 尾巴）；最后看 paged 的 plan：同样的写入，读只要块表和每行的长度。"""
    cache = PagedKVCache(tiny.cfg, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32, attention="gather")
    a, b = seq_with(3, [3]), seq_with(6, [0, 2])
    p = cache.plan([a, b], [3, 6])
    assert p.input_ids.tolist() == [[0, 0, 0, 100, 101, 102], [100, 101, 102, 103, 104, 105]]
    assert p.positions.tolist() == [[0, 0, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5]]
    assert p.token_index.tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert p.slot_mapping.tolist() == [12, 13, 14, 0, 1, 2, 3, 8, 9]   # 块号 × 4 + 块内偏移
    assert p.block_tables.tolist() == [[3, 4], [0, 2]]                 # A 的块表用空块（第 4 块）补齐
    assert p.logits_index.tolist() == [5]                              # 左填充：每行最后一个 token 都在最后一列
    # 全新的 prefill 不读池子：注意力只看这次前向自己的 K/V (B, H_kv, L, D)，掩码与 step04 的左填充相同
    assert p.read_rows is None and p.mask.shape == (2, 1, 1, 6, 6)
    assert p.mask[0, 0, 0, 5].tolist() == [False, False, False, True, True, True]   # A 的最后一个 query 看它的 3 个 token
    assert p.mask[0, 0, 0, 1].tolist() == [False] * 6                               # 填充的 query 什么都看不到
    # decode：A 已进池子 3 个、新 token 在位置 3（仍在第 0 块）；B 的位置 6 落在第 1 块（物理块 2）的偏移 2
    a.output_ids, b.output_ids = [7], [9]
    a.num_computed_tokens, b.num_computed_tokens = 3, 6
    p = cache.plan([a, b], [1, 1])
    assert p.input_ids.tolist() == [[7], [9]] and p.positions.tolist() == [[3], [6]]
    assert p.slot_mapping.tolist() == [15, 10]
    assert p.mask.shape == (2, 1, 1, 1, 8)                             # 读回 max_blocks × 4 = 8 个位置
    assert p.mask[:, 0, 0, 0].tolist() == [[True] * 4 + [False] * 4, [True] * 7 + [False]]
    # 读的行：池子一层看成 (2 × 5 块 × H_kv 头, 4·D)，(K/V, 块, 头) 在 (kv·5 + 块)·H_kv + 头
    H = tiny.cfg.num_kv_heads
    rows = p.read_rows.view(2, 2, H, 2)                                # (K/V, B, H_kv, max_blocks)
    assert rows[0, 0, 0].tolist() == [3 * H, 4 * H] and rows[1, 1, H - 1].tolist() == [(5 + 0) * H + H - 1, (5 + 2) * H + H - 1]
    # 要清零的 V 尾巴只在各行自己的最后一块里：A 长 4，它的块 3 正好写满（位置 4..7 是补齐的空块，plan 已把空块的 V
    # 清零）；B 长 7，它的块 2 里位置 7 还没写
    S = 8
    tail = [(r // S // H, r // S % H, r % S) for r in p.v_tail_rows.tolist()]    # v_all 看成 (B·H_kv·S, D) 的行号
    assert tail == [(1, h, 7) for h in range(H)]
    assert not cache.pool[:, 1, cache.null_block].any()
    # paged：同样的槽号，不建读的行号和缓冲；内核要的是 int32 的块表、每行 key 数与 query 数
    paged = PagedKVCache(tiny.cfg, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32).plan([a, b], [1, 1])
    assert paged.slot_mapping.tolist() == p.slot_mapping.tolist() and paged.read_rows is None
    assert paged.block_tables.dtype == torch.int32 and paged.block_tables.tolist() == [[3, 4], [0, 2]]
    assert paged.seq_lens.tolist() == [4, 7] and paged.query_lens.tolist() == [1, 1]


@one_arch
def test_plan_rejects_what_the_scheduler_got_wrong(tiny):
    """调度器忘了分配块、或者给出的 token 数不对：plan 给出说清楚的错误，而不是 IndexError 或者写到别人的槽里。"""
    cache = PagedKVCache(tiny.cfg, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="does not cover position 4"):
        cache.plan([seq_with(5, [1])], [5])
    for n in (0, 6):                                    # 一个也不算、或者比它有的 token 还多
        with pytest.raises(RuntimeError, match="cannot compute"):
            cache.plan([seq_with(5, [1, 2])], [n])


@one_arch
def test_block_table_gather_equals_contiguous_cache(tiny):
    """同样的 K/V 分别写进分页池（块表打乱、跨块）和 step03 的 PreallocKVCache：prefill 不读池子，直接用自己的 K/V；
    之后每个 decode 步每层按块表读回的 K/V 与连续缓存完全相同（每行自己长度之内）。"""
    cfg, bs, H_kv, D = tiny.cfg, 4, tiny.cfg.num_kv_heads, tiny.cfg.head_dim
    cache = PagedKVCache(cfg, num_blocks=12, block_size=bs, device="cpu", dtype=torch.float32, attention="gather")
    seqs = [seq_with(7, [7, 2]), seq_with(11, [0, 9, 4]), seq_with(1, [5])]
    dense = [PreallocKVCache(cfg, 16, "cpu", torch.float32) for _ in seqs]
    g = torch.Generator().manual_seed(0)
    for step in range(4):                              # 一次 prefill + 三次 decode
        if step == 2:                                  # 位置 8 和 12 各要跨进一个新块
            seqs[0].block_table.append(11)
            seqs[1].block_table.append(1)
        p = cache.plan(seqs, new_tokens(seqs))
        B, L = p.input_ids.shape
        for layer in range(cfg.num_layers):
            k = torch.randn(B, H_kv, L, D, generator=g)
            v = torch.randn(B, H_kv, L, D, generator=g)
            k_all, v_all = p.update(layer, k, v)       # (B, H_kv, S, D)
            if step == 0:                              # 全新的 prefill：返回的就是传进去的 K/V，不读池子
                assert k_all is k and v_all is v
            for i, (seq, dc) in enumerate(zip(seqs, dense)):
                n_new = seq.num_tokens - seq.num_computed_tokens
                kd, vd = dc.update(layer, k[i:i + 1, :, L - n_new:], v[i:i + 1, :, L - n_new:])  # 只取真实 token
                if step > 0:
                    assert torch.equal(k_all[i:i + 1, :, :seq.num_tokens], kd)
                    assert torch.equal(v_all[i:i + 1, :, :seq.num_tokens], vd)
                    assert not v_all[i, :, seq.num_tokens:].any()   # 长度之外（空块、最后一块的尾巴）的 V 清零
        assert p.gather_bytes == (0 if step == 0 else cfg.num_layers * 2 * B * H_kv * p.block_tables.shape[1] * bs * D * 4)
        for seq, dc in zip(seqs, dense):
            dc.advance(seq.num_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens = seq.num_tokens
            seq.output_ids.append(1)
    used = {b for s in seqs for b in s.block_table}
    for blk in set(range(13)) - used:                  # 填充的 query 没有写进任何槽：块表之外的块（含空块）仍全是 0
        assert not cache.pool[:, :, blk].any()


# ---------- 读路径：拷贝的字节数、空块与没写过的槽、前缀已在池子里的 prefill ----------

def run_model(model, p):
    return model(p.input_ids, p.positions, p, logits_index=p.logits_index)


@torch.inference_mode()   # 引擎在 inference_mode 里前向（读路径的 index_select(out=) 不支持求导）
@one_arch
def test_gather_bytes_equal_the_formula_by_hand(tiny):
    """块大小 4；A 有 3 个 token（块表 [3]），B 有 6 个（块表 [0, 2]）。全新的 prefill 不读池子：0 字节。
    接着一个 decode 步：B = 2 行，最长的块表 2 块 → 每层 K、V 各拷 2 × H_kv × 2 块 × 4 × D 个数。
    tiny：2 层、H_kv = 2、D = 16、float32 → 每 token 的 K/V 2 × 2 × 2 × 16 × 4 = 512 字节，
    一步 = B × max_blocks × block_size × 512 = 2 × 2 × 4 × 512 = 8192 字节（其中 A 补齐的空块占 4 × 512）。"""
    assert tiny.cfg.kv_bytes_per_token(4) == 512
    cache = PagedKVCache(tiny.cfg, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32, attention="gather")
    a, b = seq_with(3, [3]), seq_with(6, [0, 2])
    p = cache.plan([a, b], [3, 6])
    run_model(tiny.model, p)
    assert p.gather_bytes == 0
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        seq.output_ids.append(7)
    p = cache.plan([a, b], [1, 1])
    run_model(tiny.model, p)
    assert p.gather_bytes == 8192
    paged = PagedKVCache(tiny.cfg, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32)                 # paged：同样的一步，一个字节都不拷
    for seq in (a, b):
        seq.num_computed_tokens -= 1
    p = paged.plan([a, b], [1, 1])
    run_model(tiny.model, p)
    assert p.gather_bytes == 0 and p.read_buf is None


def poisoned_run(model, requests, num_blocks, value):
    engine = LLMEngine(model, EngineConfig(num_blocks, block_size=4, max_batch_size=8), eos_ids=[1])
    if value is not None:
        engine.kv_cache.pool.fill_(value)     # 整个池子：空块、空闲块、每个请求最后一块还没写到的尾巴
    return engine.generate(requests)


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
@pytest.mark.parametrize("attention", ["gather", "paged"])
def test_decode_logits_bitwise_equal_with_poisoned_null_block(tiny, attention):
    """更直接：同一个 decode 步，空块和最后一块的尾巴里是 0 还是 NaN，logits 逐位相同（不是"差不多"）。"""
    cache = PagedKVCache(tiny.cfg, num_blocks=4, block_size=4, device="cpu", dtype=torch.float32, attention=attention)
    a, b = seq_with(2, [1]), seq_with(9, [0, 3, 2])
    run_model(tiny.model, cache.plan([a, b], [2, 9]))
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        seq.output_ids.append(7)
    logits = []
    for value in (0.0, float("nan")):
        cache.pool[:, :, cache.null_block] = value
        cache.pool[:, :, 1, :, 3:] = value              # A 的块里还没写到的尾巴（位置 3）
        logits.append(run_model(tiny.model, cache.plan([a, b], [1, 1])))
    assert not logits[0].isnan().any() and torch.equal(logits[0], logits[1])


@torch.inference_mode()   # 引擎在 inference_mode 里前向（读路径的 index_select(out=) 不支持求导）
@one_arch
@pytest.mark.parametrize("attention", ["gather", "paged"])
def test_prefill_with_a_computed_prefix_reads_the_prefix_from_the_pool(tiny, attention):
    """step06（前缀缓存）要走的路径，plan 现在就支持：一个请求前 8 个 token 的 K/V 已经在池子里（两整块），
    这一步 prefill 剩下的 3 个；同一次前向里还有一个全新的请求。前缀行读池子（它自己的块 + 刚写进去的新 token），
    全新的行在同一个张量里；两行每个位置的 logits 都与不用缓存、整段重算的结果相同（浮点容差内）。"""
    cache = PagedKVCache(tiny.cfg, num_blocks=8, block_size=4, device="cpu", dtype=torch.float32, attention=attention)
    ids = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    prefix = make_seq(ids[:8])
    prefix.block_table = [5, 2]
    run_model(tiny.model, cache.plan([prefix], [8]))          # 写进块 5、2
    full = make_seq(ids)
    full.block_table, full.num_computed_tokens = [5, 2, 7], 8   # 前 8 个已在池子里（块 5、2）
    fresh = seq_with(5, [0, 1])                                  # 全新：5 个 token
    p = cache.plan([full, fresh], [3, 5])
    assert (p.read_rows is not None) == (attention == "gather") and p.input_ids.shape == (2, 5)
    assert p.positions.tolist() == [[0, 0, 8, 9, 10], [0, 1, 2, 3, 4]]
    logits = tiny.model(p.input_ids, p.positions, p)    # (2, 5, V)
    copied = tiny.cfg.num_layers * 2 * 2 * tiny.cfg.num_kv_heads * 3 * 4 * tiny.cfg.head_dim * 4
    assert p.gather_bytes == (copied if attention == "gather" else 0)
    for row, seq, n in ((0, full, 3), (1, fresh, 5)):
        t = seq.token_ids
        ref = tiny.model(torch.tensor([t]), torch.arange(len(t))[None])[0, -n:]
        torch.testing.assert_close(logits[row, -n:], ref, rtol=1e-4, atol=1e-4)


# ---------- 调度器：接纳、逐块增长、抢占最新的请求并放回队头 ----------

def computed(seqs, token=42):
    """模拟一次前向：全部 token 写进池子，每个请求采样出一个 token。"""
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
        s.output_ids.append(token)


def test_scheduler_preempts_newest_and_requeues_at_front():
    bm = BlockManager(5, 4)
    sched = Scheduler(bm, max_batch_size=4, max_prefill_tokens=1000)
    a, b, c = (make_seq(range(n), rid=i) for i, n in enumerate((4, 7, 5)))
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()                           # 提示词需要 1 + 2 + 2 = 5 块：正好放下
    assert batch.is_prefill and batch.seqs == [a, b, c] and batch.num_new_tokens == [4, 7, 5] and bm.num_free_blocks == 0
    assert all(s.status is SequenceStatus.RUNNING for s in (a, b, c))
    computed((a, b, c))
    batch = sched.schedule()
    # a 有 5 个 token：位置 4 需要第 2 块，池子空了 → 抢占最新的 c（还回 2 块），a 拿 1 块；b 的 8 个 token 正好 2 块
    assert not batch.is_prefill and batch.seqs == [a, b] and batch.num_new_tokens == [1, 1]
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert c.output_ids == [42] and list(sched.waiting) == [c]   # 已生成的 token 保留；在队头
    assert [s.num_preemptions for s in (a, b, c)] == [0, 0, 1] and len(a.block_table) == 2 and bm.num_free_blocks == 1
    assert sorted(a.block_table + b.block_table) == sorted(set(range(5)) - set(bm.free_blocks))
    sched.finish(a, "length")
    assert bm.num_free_blocks == 3 and sched.running == [b] and a.status is SequenceStatus.FINISHED
    batch = sched.schedule()                           # c 重算 提示词 + 已生成 = 6 个 token → 2 块
    assert batch.is_prefill and batch.seqs == [c] and batch.num_new_tokens == [6]
    assert len(c.block_table) == 2 and bm.num_free_blocks == 1


def test_scheduler_preempts_itself_when_it_is_the_newest():
    bm = BlockManager(2, 2)
    sched = Scheduler(bm, max_batch_size=4, max_prefill_tokens=1000)
    a, b = make_seq([1, 2], rid=0), make_seq([1, 2], rid=1)
    sched.add(a), sched.add(b)
    sched.schedule()
    computed((a, b), token=5)
    batch = sched.schedule()                           # 两个都要新块：a 先来，抢占 b 给 a
    assert batch.seqs == [a] and b.status is SequenceStatus.WAITING and b.num_preemptions == 1
    assert len(a.block_table) == 2 and bm.num_free_blocks == 0


def test_scheduler_admits_first_come_first_served_within_the_limits():
    """接纳停在第一个放不下的请求：批满、prefill 张量 B × L 超限（第一个总是放行）、块不够——不跳过它去接后面的小请求。"""
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, max_batch_size=3, max_prefill_tokens=20)
    seqs = [make_seq(range(n), rid=i) for i, n in enumerate((21, 3, 9, 2, 1))]   # 21 个 token：要 6 块
    for s in seqs:
        sched.add(s)
    assert sched.schedule().seqs == [seqs[0]]           # 21 > 20 也放行（它是第一个）；池子满了
    computed([seqs[0]])
    sched.finish(seqs[0], "stop")
    batch = sched.schedule()                            # 3 + 9：2 × 9 = 18 ≤ 20；再加一个 3 × 9 = 27 > 20
    assert batch.seqs == seqs[1:3] and batch.num_new_tokens == [3, 9]
    computed(batch.seqs)
    assert sched.schedule().seqs == [seqs[3]]           # 又一步 prefill：运行集合还有一个空位…
    computed([seqs[3]])
    batch = sched.schedule()                            # …运行集合已有 3 个（max_batch_size）：最后一个等着，这一步 decode
    assert not batch.is_prefill and batch.seqs == seqs[1:4] and list(sched.waiting) == [seqs[4]]


# ---------- 引擎：与 step03 单独生成逐 token 一致 ----------

def assert_equal_to_step03(model, requests, outputs, eos_ids, tokenizer=None):
    def logits_fn(ids):
        return model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    for i, (r, got) in enumerate(zip(requests, outputs)):
        ref = generate_single(model, r.prompt_ids, r.max_new_tokens, r.params, eos_ids, r.ignore_eos,
                              stop_strings=r.stop, tokenizer=tokenizer)
        c = compare(f"request {i}", r.prompt_ids, ref, got, logits_fn, TOL)
        assert c.ok, c.describe()


def test_tiny_pool_forces_preemption_and_stays_token_exact(tiny):
    rng = random.Random(1)
    requests = [Request([rng.randrange(2, 256) for _ in range(rng.randint(3, 20))], 24,
                        SamplingParams(temperature=0.9, seed=i) if i % 2 else SamplingParams(), ignore_eos=True)
                for i in range(6)]
    engine = LLMEngine(tiny.model, EngineConfig(num_blocks=12, block_size=4, max_batch_size=6), eos_ids=[1])   # 最大的请求要 11 块
    outputs, stats = engine.generate(requests)
    assert stats.preemptions > 0
    assert [len(o) for o in outputs] == [24] * 6
    assert_equal_to_step03(tiny.model, requests, outputs, [1])
    assert_pool_free(engine)


@one_arch
@pytest.mark.parametrize("attention", ["gather", "paged"])
def test_kv_waste_accounting_by_hand(tiny, attention):
    """提示词 5、块大小 4、生成 3 个：前两次前向之后持有 2 块 = 8 槽，池子里有 5、6 个 token。
    gather 每个 decode 步拷出 1 行 × 2 块；paged 一个字节都不拷。"""
    engine = LLMEngine(tiny.model, EngineConfig(num_blocks=4, block_size=4, attention=attention))
    _, st = engine.generate([Request([5, 6, 7, 8, 9], 3, ignore_eos=True)])
    assert (st.num_forwards, st.prefill_steps, st.decode_steps, st.prefill_tokens) == (3, 1, 2, 5)
    assert [(x.kv_slots_held, x.kv_slots_used) for x in st.steps[:2]] == [(8, 5), (8, 6)]
    # decode 步按块表读：每步 1 行 × 2 块 × 4 槽 × 每 token 512 字节
    assert [x.gather_bytes for x in st.steps] == ([0, 2 * 4 * 512, 2 * 4 * 512] if attention == "gather" else [0, 0, 0])
    assert [(x.rows, x.width, x.tokens, x.decode_tokens) for x in st.steps] == [(1, 5, 5, 0), (1, 1, 1, 1), (1, 1, 1, 1)]
    assert st.cached_tokens == [0] and st.preempted == [0]


@one_arch
def test_the_last_forward_of_a_request_counts_in_kv_waste_and_concurrency(tiny):
    """"每次前向之后采样一次"：一个请求最后一次前向时它的块还在池子里、它也在批里。上面手算的例子第 3 次前向之后
    持有 8 槽、存着 7 个 token → KV 浪费 (3+2+1)/24 = 25%；4 个 max_new_tokens=1 的请求同一次前向跑完，
    峰值并发是 4（不是 0）。"""
    engine = LLMEngine(tiny.model, EngineConfig(num_blocks=16, block_size=4))
    _, st = engine.generate([Request([5, 6, 7, 8, 9], 3, ignore_eos=True)])
    assert [(x.kv_slots_held, x.kv_slots_used) for x in st.steps] == [(8, 5), (8, 6), (8, 7)]
    assert st.kv_waste == pytest.approx(0.25)
    _, st = engine.generate([Request([5, 6, 7, 8, 9 + i], 1) for i in range(4)])
    assert st.num_forwards == 1 and st.peak_running == 4


@one_arch
def test_request_that_exactly_fills_the_pool_runs(tiny):
    """提示词 6 + 生成 11 - 1 = 16 个 token = 正好 4 块 × 4：能跑完；再多一个 token 就开始前报错，块一个不少。"""
    engine = LLMEngine(tiny.model, EngineConfig(num_blocks=4, block_size=4))
    r = Request(list(range(10, 16)), 11, ignore_eos=True)
    outputs, st = engine.generate([r, r])
    assert_equal_to_step03(tiny.model, [r, r], outputs, [])
    assert st.preempted == [0, 1]                        # prefill 时各要 2 块、一起进来；长到 4 块时第二个让路
    with pytest.raises(UserError, match="needs up to 5 KV blocks"):
        engine.generate([r, Request(list(range(10, 16)), 12)])
    assert_pool_free(engine)


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
    engine = LLMEngine(tiny.model, EngineConfig(num_blocks=24, block_size=4, max_batch_size=16), eos_ids=[1])   # 最大的请求要 16 块
    outputs, stats = engine.generate(requests)
    assert stats.preemptions > 0 and stats.peak_running > 1
    assert_equal_to_step03(tiny.model, requests, outputs, [1])
    assert_pool_free(engine)


@one_arch
def test_stall_is_the_prefill_a_decoding_request_waits_for(tiny, monkeypatch):
    """A、B 的提示词各 10 个 token，一次 prefill 最多 15 个位置：第 1 步只 prefill A；第 2 步 prefill B，
    这时 A 已经有首 token、在 decode，却一个 token 也没前进——它干等了第 2 步的全部时间。之后两个一起 decode。
    时间是虚拟的：每次前向恰好 1 秒（包一层模型的 forward，在里面拨一下时钟），所以每个时刻都能手算。"""
    clock, forward = VirtualClock(), tiny.model.forward

    def one_second_forward(*args, **kwargs):
        clock.tick()
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiny.model, "forward", one_second_forward)
    engine = LLMEngine(tiny.model, EngineConfig(num_blocks=16, block_size=4, max_batch_size=4, max_prefill_tokens=15),
                       clock=clock)
    reqs = [Request(list(range(2, 12)), 5, ignore_eos=True), Request(list(range(20, 30)), 5, ignore_eos=True)]
    _, st = engine.generate(reqs)
    assert [(x.prefill, x.rows, x.stalled) for x in st.steps] == [(True, 1, 0), (True, 1, 1)] + [(False, 2, 0)] * 4
    assert [x.seconds for x in st.steps] == [1.0] * 6 and st.wall_s == 6.0
    assert st.stall_s == [1.0, 0.0]
    assert st.first_token_s == [1.0, 2.0] and st.finish_s == [6.0, 6.0] and st.ttft_s() == [1.0, 2.0]
    assert st.token_s == [[1.0, 3.0, 4.0, 5.0, 6.0], [2.0, 3.0, 4.0, 5.0, 6.0]] and st.max_gap_s() == [2.0, 1.0]
    assert st.tpot_s() == [1.25, 1.0] and st.tpot_s(without_stall=True) == [1.0, 1.0]


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
    engine = LLMEngine(tiny.model, EngineConfig(num_blocks=10, block_size=4, max_batch_size=6), tokenizer=tok)
    out5 = engine.generate(requests)
    assert out5.stats.preemptions > 0
    for outs in (generate_batch(tiny.model, requests, 6, (), tok).outputs,
                 generate_batch(tiny.model, requests, 4, (), tok).outputs, out5.outputs):
        assert outs == refs
    with pytest.raises(UserError, match="tokenizer"):
        LLMEngine(tiny.model, EngineConfig(num_blocks=10, block_size=4)).generate(requests)


# ---------- step API：add_request / step / abort / has_unfinished_requests ----------

def find_eos_and_stop(model, rng):
    """找一个提示词，它贪心生成的第 3 个 token 在前两个里没出现过（拿它当 EOS），
    第 3 个 token 的字母也不在前两个的字母里（拿它当停止字符串）：两种 "stop" 都恰好在第 3 个 token 触发。"""
    tok = CharTokenizer()
    for _ in range(50):
        prompt = [rng.randrange(2, 256) for _ in range(rng.randint(3, 9))]
        ref = generate_single(model, prompt, 6, SamplingParams(), (), True)
        if ref[2] not in ref[:2] and tok.decode(ref[2:3]) not in tok.decode(ref[:2]):
            return prompt, ref
    raise AssertionError("no suitable prompt found")


@one_arch
def test_step_outputs_and_finish_reasons(tiny):
    """一步一步地驱动：每一步每个请求最多一个新 token；结束的那一步 finished=True 并给出原因，之后不再出现：
    EOS → "stop"（EOS 算进输出）；停止字符串 → "stop"；生成满 max_new_tokens → "length"；
    第 max_new_tokens 个 token 恰好是 EOS → "stop"（与 vLLM 相同）。拼起来的 token 等于 step03 单独生成。"""
    rng = random.Random(11)
    (p1, ref1), (p2, ref2) = find_eos_and_stop(tiny.model, rng), find_eos_and_stop(tiny.model, rng)
    tok = CharTokenizer()
    eos = ref1[2]
    requests = {   # 名字 → (请求, 期望的输出, 期望的结束原因)
        "eos": (Request(p1, 6), ref1[:3], "stop"),
        "eos_at_last": (Request(p1, 3), ref1[:3], "stop"),
        "stop_string": (Request(p2, 6, ignore_eos=True, stop=(tok.decode(ref2[2:3]),)), ref2[:3], "stop"),
        "length": (Request(p1, 5, ignore_eos=True), ref1[:5], "length"),
    }
    engine = LLMEngine(tiny.model, EngineConfig(num_blocks=32, block_size=4, max_batch_size=8), tokenizer=tok,
                       eos_ids=[eos])
    assert not engine.has_unfinished_requests() and engine.step() == []
    rids = {name: engine.add_request(r) for name, (r, _, _) in requests.items()}
    assert sorted(rids.values()) == list(range(4)) and engine.has_unfinished_requests()
    tokens, reasons, steps = {rid: [] for rid in rids.values()}, {}, 0
    while engine.has_unfinished_requests():
        active = set(tokens) - set(reasons)
        outs = engine.step()
        steps += 1
        assert sorted(o.request_id for o in outs) == sorted(active)      # 都在批里：每个没结束的请求正好一项
        for o in outs:
            assert len(o.new_token_ids) == 1
            tokens[o.request_id] += o.new_token_ids
            assert (o.finish_reason is not None) == o.finished and o.finish_reason in (None, "stop", "length")
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    for name, (r, expected, reason) in requests.items():
        assert tokens[rids[name]] == expected, name
        assert reasons[rids[name]] == reason, name
    assert steps == 5 and engine.step() == []
    assert_pool_free(engine)


@one_arch
def test_abort_waiting_and_running_frees_blocks_at_once(tiny):
    """运行集合最多 2 个：A、B 在跑，C 在等。abort C（等待中，没有块）和 A（运行中）：A 的块立刻还回来（不等下一步），
    下一次 step() 报告两个 finish_reason="abort"、没有新 token，同一步里 B 照常 decode；B 的输出不受影响，
    等于 step03 单独生成。不认识的 id、已经结束或已经 abort 过的请求，abort 什么也不做。"""
    engine = LLMEngine(tiny.model, EngineConfig(num_blocks=16, block_size=4, max_batch_size=2))
    bm = engine.block_manager
    ra, rb, rc = (Request(list(range(10 * i + 2, 10 * i + 9)), 8, ignore_eos=True) for i in range(3))   # 7 个 token：2 块
    a, b, c = (engine.add_request(r) for r in (ra, rb, rc))
    seq_a, seq_b, seq_c = (engine.seqs[rid] for rid in (a, b, c))
    assert [o.request_id for o in engine.step()] == [a, b]              # prefill A、B；C 等着（批满）
    assert [o.request_id for o in engine.step()] == [a, b]              # decode：位置 7 还在第 2 块
    blocks_a = list(seq_a.block_table)
    assert len(blocks_a) == 2 and bm.num_free_blocks == 12 and list(engine.scheduler.waiting) == [seq_c]
    engine.abort(c)
    assert bm.num_free_blocks == 12 and not engine.scheduler.waiting and engine.has_unfinished_requests()
    engine.abort(a)
    assert bm.num_free_blocks == 14 and [bm.ref_counts[blk] for blk in blocks_a] == [0, 0]
    assert set(blocks_a) <= set(bm.free_blocks) and sum(bm.ref_counts) == len(seq_b.block_table) == 2
    assert seq_a.block_table == [] and engine.scheduler.running == [seq_b]
    assert (seq_a.status, seq_a.finish_reason, seq_c.status) == (SequenceStatus.FINISHED, "abort", SequenceStatus.FINISHED)
    for rid in (a, c, 999):
        engine.abort(rid)                                                # 已经 abort 过 / 不认识：什么也不做
    outs = engine.step()
    assert outs[:2] == [RequestOutput(c, [], True, "abort"), RequestOutput(a, [], True, "abort")]
    assert [(o.request_id, len(o.new_token_ids), o.finished) for o in outs[2:]] == [(b, 1, False)]
    while engine.has_unfinished_requests():
        assert all(o.request_id == b for o in engine.step())
    assert seq_b.finish_reason == "length" and len(seq_a.output_ids) == 2 and seq_c.output_ids == []
    assert_equal_to_step03(tiny.model, [rb], [seq_b.output_ids], [])
    engine.abort(b)                                                      # 已经结束：什么也不做
    assert engine.step() == []
    assert_pool_free(engine)


@one_arch
def test_abort_the_only_request_and_has_unfinished_requests(tiny):
    """abort 立刻还块；has_unfinished_requests() 在 abort 的结果交出去之前仍为 True（`while has_unfinished_requests():
    step()` 的循环才收得到它），下一次 step() 报告它（不做前向），之后为 False。到达时刻是 add_request 时时钟的读数。"""
    clock = VirtualClock()
    engine = LLMEngine(tiny.model, EngineConfig(num_blocks=8, block_size=4), clock=clock)
    rid = engine.add_request(Request([3, 4, 5], 4))
    clock.tick(), clock.tick()
    rid2 = engine.add_request(Request([3, 4, 5, 6], 4))
    assert [engine.seqs[r].arrival_time for r in (rid, rid2)] == [0.0, 2.0]
    engine.abort(rid)
    engine.abort(rid2)
    assert engine.has_unfinished_requests() and not engine.seqs and not engine.scheduler.waiting
    assert engine.step() == [RequestOutput(rid, [], True, "abort"), RequestOutput(rid2, [], True, "abort")]
    assert not engine.has_unfinished_requests()
    assert engine.step() == [] and not engine.step_stats and engine.num_steps == 0   # 没有做任何前向
    assert_pool_free(engine)


@one_arch
@pytest.mark.parametrize("step", ["step05_paged", "step06_prefix_cache", "step07_chunked_prefill", "step08_kv_quant",
                                  "step09_speculative", "step10_tensor_parallel"])
def test_step_stats_keep_only_the_last_steps_and_runs_still_count_their_own(tiny, step, monkeypatch):
    """step05 起每个引擎的 step_stats 是有界的（服务器一直跑）：留满以后最老的行被挤掉，num_steps 照数；
    generate / replay 的统计仍是这次运行自己的每一步（引擎已经留满时也是）。"""
    mod = importlib.import_module(f"{step}.engine")
    monkeypatch.setattr(mod, "STEP_STATS_KEPT", 6)
    engine = mod.LLMEngine(tiny.model, mod.EngineConfig(num_blocks=16, block_size=4), clock=VirtualClock())
    runs = [engine.generate([Request([5, 6, 7 + i], 4, ignore_eos=True)]).stats for i in range(2)]   # 各 1 + 3 步
    runs.append(replay(engine, [Arrival(0.0, Request([9, 8, 7], 5, ignore_eos=True))], engine.clock).stats)
    assert engine.num_steps == 4 + 4 + 5 and len(engine.step_stats) == 6
    assert [st.num_forwards for st in runs] == [4, 4, 5]
    assert [x.prefill for x in runs[2].steps] == [True] + [False] * 4
    assert list(engine.step_stats)[-5:] == runs[2].steps


@one_arch
def test_add_request_rejects_bad_input_before_queueing(tiny):
    """非法请求在 add_request 时就报 UserError，什么也不进队列。"""
    engine = LLMEngine(tiny.model, EngineConfig(num_blocks=4, block_size=4))
    ctx = tiny.cfg.max_position_embeddings
    for bad, match in [(Request([], 4), "empty prompt"), (Request([5], 0), "max_new_tokens"),
                       (Request([5] * ctx, 1), "context"), (Request([5] * 10, 8), "needs up to 5 KV blocks"),
                       (Request([5], 4, SamplingParams(temperature=-1.0)), "temperature")]:
        with pytest.raises(UserError, match=match):
            engine.add_request(bad)
    assert not engine.has_unfinished_requests() and not engine.scheduler.waiting and engine.step() == []
    with pytest.raises(UserError, match="max_batch_size"):
        LLMEngine(tiny.model, EngineConfig(num_blocks=4, block_size=4, max_batch_size=0))


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "ctrl_c"])
@one_arch
def test_exception_mid_run_frees_every_block(tiny, monkeypatch, exc):
    """第 3 次前向（第 2 个 decode 步）抛出异常（模型出错，或者 Ctrl-C）：异常从 generate() 原样传出来；
    那一刻 3 个请求持有 9 块，之后每一块都回到池子（引用计数全 0），同一个引擎接着 generate() 照常工作、
    输出等于 step03（池子在引擎上跨调用活着：漏掉的块会让下一次静悄悄地少几块）。"""
    engine = LLMEngine(tiny.model, EngineConfig(num_blocks=10, block_size=4, max_batch_size=4))
    bm, forward, held = engine.block_manager, tiny.model.forward, []
    reqs = [Request(list(range(10 + i, 17 + i)), 8, ignore_eos=True) for i in range(3)]   # 7 + 8 - 1 = 14 个 token：4 块

    def failing_forward(*args, **kwargs):
        held.append(bm.num_blocks - bm.num_free_blocks)
        if len(held) == 3:
            raise exc
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiny.model, "forward", failing_forward)
    with pytest.raises(type(exc)):
        engine.generate(reqs)
    assert held == [6, 6, 9]                             # 出错那一刻：每个请求 3 块（第 9 个 token 进了第 3 块）
    assert_pool_free(engine)
    outputs, st = engine.generate(reqs)                  # 第 4 次起前向照常
    assert st.preemptions > 0                            # 10 块放不下 3 × 4 块：用到了全部块
    assert_equal_to_step03(tiny.model, reqs, outputs, [])
    assert_pool_free(engine)


# ---------- decode_bench 里的几种读法 ----------

@torch.inference_mode()
@one_arch
def test_alternative_reads_in_decode_bench_compute_the_same_logits(tiny):
    """analysis/decode_bench.py 里比较速度的几种读法必须算的是同一个东西：池子里放随机数，同一个 decode 步，
    logits 与 step05 自己的读法在浮点容差内相同（逐行注意力的求和顺序不同，所以不要求逐位相同）。"""
    from step05_paged.analysis.decode_bench import READS, as_read
    cache = PagedKVCache(tiny.cfg, num_blocks=12, block_size=4, device="cpu", dtype=torch.float32, attention="gather")
    cache.pool.normal_(generator=torch.Generator().manual_seed(0))
    seqs = [seq_with(9, [7, 2, 5]), seq_with(2, [0]), seq_with(13, [9, 4, 1, 3])]
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens - 1
    ref = run_model(tiny.model, cache.plan(seqs, [1, 1, 1]))
    assert len(READS) > 1
    for name, read in READS.items():
        got = run_model(tiny.model, as_read(cache.plan(seqs, [1, 1, 1]), read))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=name)


# ---------- 命令行 ----------

def test_run_py_num_blocks_too_small_is_a_user_error(tiny_tok_dir, capsys):
    line = cli_error(step05_run, ["--model", str(tiny_tok_dir), "--prompt", "Hello there", "--num-blocks", "1",
                                  "--max-new-tokens", "32"], capsys)
    assert "--num-blocks" in line
    assert capsys.readouterr().out == ""                # 开始生成之前就报错


def run_cli(run_module, argv, capsys) -> dict:
    """进程内跑 run.py 的生成模式（与命令行同一条路：cli.run_main），断言退出码 0，返回最后一行的 JSON。"""
    with pytest.raises(SystemExit) as e:
        cli.run_main(run_module.make_parser(), run_module.main, argv + ["--json"])
    captured = capsys.readouterr()
    assert e.value.code == 0, captured.err[-2000:]
    return json.loads(captured.out.strip().splitlines()[-1])


def test_run_py_generation_mode_with_stop_strings_equals_step03(tiny_tok_dir, capsys):
    """生成模式（进程内）：真实分词器 + 随机小模型，--stop 与小池子（一定抢占）；结果按提示词的顺序，
    每个与 step03 单独生成逐 token 相同，且确实有请求被停止串截断、有请求生成满。"""
    prompts, stop = ["Hello there", "The sky is", "Once upon a time"], ["e", "?"]
    out = run_cli(step05_run, [a for p in prompts for a in ("--prompt", p)] + [
        "--model", str(tiny_tok_dir), "--num-blocks", "6", "--block-size", "4", "--max-new-tokens", "12",
        "--ignore-eos", *[a for x in stop for a in ("--stop", x)]], capsys)
    s = cli.open_session(str(tiny_tok_dir), "cpu", "float32")
    lengths = []
    for p, res in zip(prompts, out["results"]):
        ids = s.encode(p)
        ref = generate_single(s.model, ids, 12, SamplingParams(), s.tok.eos_ids, ignore_eos=True,
                              stop_strings=stop, tokenizer=s.tok)
        assert (res["prompt"], res["prompt_ids"], res["output_ids"]) == (p, ids, ref)
        assert res["text"] == s.tok.decode(ref)
        lengths.append(len(ref))
    assert min(lengths) < 12 and out["stats"]["num_blocks"] == 6


def test_run_py_generation_mode_with_preemption_equals_step03(real, capsys, monkeypatch):
    """真实模型（这个文件里唯一的一个）：4 块 × 8 token 的池子放不下 3 个请求（各要 2 块），一定抢占；
    每个请求与 step03 单独生成逐 token 相同（容差见 common/compare.py）。run.py 拿到的是已经加载好的同一个模型
    （省掉第二次加载；加载本身由 test_prepare_and_errors 测）。"""
    monkeypatch.setattr(cli, "load_session", lambda args: real if args.model is None else pytest.fail(args.model))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # 机器上有别的负载时，两个线程互相等待能慢几倍（2 核、负载 5 时量过：1 线程快约 7 倍）
    try:
        prompts = ["The three primary colors are", "def add(a, b):", "Paris is the capital of"]
        out = run_cli(step05_run, [a for p in prompts for a in ("--prompt", p)] + [
            "--num-blocks", "4", "--block-size", "8", "--max-new-tokens", "10", "--ignore-eos"], capsys)
        assert out["stats"]["preemptions"] > 0
        for p, res in zip(prompts, out["results"]):
            ids = real.encode(p)
            ref = generate_single(real.model, ids, 10, SamplingParams(), real.tok.eos_ids, ignore_eos=True)
            c = compare(p, ids, ref, res["output_ids"], real.full_logits, TOL)
            assert res["prompt"] == p and res["prompt_ids"] == ids and c.ok, c.describe()
    finally:
        torch.set_num_threads(threads)


def test_first_fit_allocator_accounting_and_fragmentation():
    """analysis/fragmentation.py 的首次适配分配器：分配取第一个够大的空闲区间，释放时与左右相邻的空闲区间合并；
    空闲总数够、但没有一段够长时拒绝（外部碎片）。同样的请求序列交给分页池（任意空闲块都能用）就放得下。"""
    from step05_paged.analysis.fragmentation import FirstFit, simulate
    ff = FirstFit(100)
    a, b, c, d = ff.alloc(30), ff.alloc(20), ff.alloc(30), ff.alloc(20)
    assert (a, b, c, d) == (0, 30, 50, 80) and ff.free_total == 0 and ff.alloc(1) is None
    ff.free(a, 30)
    ff.free(c, 30)                                   # 空闲 60 个槽，但分成两段各 30
    assert ff.holes == [[0, 30], [50, 30]] and ff.free_total == 60 and ff.largest_hole == 30
    assert ff.alloc(40) is None                      # 外部碎片：总数够，没有一段连续的 40
    ff.free(b, 20)                                   # 左右都是空闲：三段并成 [0, 80)
    assert ff.holes == [[0, 80]] and ff.alloc(40) == 0 and ff.holes == [[40, 40]]
    with pytest.raises(RuntimeError, match="double free"):
        ff.free(45, 10)
    # 模拟：两个长请求夹着一个短请求，短的先结束，空出的洞不够第四个请求
    lengths = [(30, 1), (20, 30), (30, 1), (40, 1)]   # 一生要 30、49、30、40 个槽
    cont = simulate(lengths, 112, "contiguous", block_size=16)
    paged = simulate(lengths, 112, "paged-reserve", block_size=16)
    assert cont.frag_refusals > 0 and cont.unusable_at_refusal and min(cont.unusable_at_refusal) >= 40
    assert paged.frag_refusals == 0 and paged.steps < cont.steps
    assert cont.admitted == paged.admitted == 4


def test_decode_bench_counts_packed_matmuls_as_linear_layers():
    """默认的 packed 线性层在剖析里是 mkldnn::_linear_pointwise：它必须算进"线性层矩阵乘"，不能落进"其它算子"。"""
    from step05_paged.analysis.decode_bench import CATEGORIES, categorize
    assert categorize("mkldnn::_linear_pointwise", [[8, 576], [576]]) == CATEGORIES[0]
    assert categorize("aten::matmul", [[8, 576], [576, 960]]) == CATEGORIES[0]
    assert categorize("aten::matmul", [[8, 3, 1, 64], [8, 3, 64, 40]]) == CATEGORIES[1]
