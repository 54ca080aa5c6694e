"""step06：哈希链与查找（手算）、块管理器的不变量（性质测试：缓存、共享、驱逐、强制碰撞）、基数树（手算 + 与暴力
最长公共前缀比），以及引擎：命中的前缀（手算）、同一批里相同的整块只算一次（2 × 块大小的相同提示词正好 2 次
prefill）、小池子下的驱逐与抢占、随机负载，每个输出都等于 step03 / step05；step API（结束原因、abort 立刻还块、
前向中途出错之后块一个不少、可驱逐的缓存块算作空闲），以及命令行（--no-prefix-cache 真的是 step05 的引擎）。"""
import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common import cli
from common.compare import MARGIN_TOL, compare
from conftest import cli_error, one_arch
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single.cache import PreallocKVCache
from step03_kvcache_single.engine import forward as forward_single
from step03_kvcache_single.engine import generate as generate_single
from step04_static_batching.request import Request
from step05_paged import engine as step05
from step06_prefix_cache import run as step06_run
from step06_prefix_cache.block_manager import BlockManager, chain_hash
from step06_prefix_cache.engine import EngineConfig, LLMEngine
from step06_prefix_cache.radix_tree import RadixTree
from step06_prefix_cache.sequence import RequestOutput, Sequence, SequenceStatus

TOL = MARGIN_TOL[torch.float32]


def make_seq(tokens, max_new_tokens=8, rid=0) -> Sequence:
    return Sequence(rid, Request(list(tokens), max_new_tokens), torch.Generator(), 0.0)


def collide(parent_key, token_ids):
    """故意很差的哈希：只看第一个 token 的奇偶——大量不同的前缀得到同一个 key。"""
    return token_ids[0] % 2


# ---------- 哈希链与查找：手算的例子 ----------

def cache_sequence(bm: BlockManager, tokens: list[int]) -> Sequence:
    """模拟一个请求走完一生的前半段：查缓存、分块（命中的共享）、"算完"全部 token、把写满的块登记。"""
    seq = make_seq(tokens)
    bm.allocate_seq(seq, bm.match_prefix(seq))
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return seq


def test_hash_chain_and_lookup_by_hand():
    bm = BlockManager(8, block_size=4)
    a = cache_sequence(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).block_table   # 两个满块 + 一个半块
    k0 = chain_hash(None, (1, 2, 3, 4))
    k1 = chain_hash(k0, (5, 6, 7, 8))
    assert bm.cached[a[0]].key == k0 and bm.cached[a[1]].key == k1 and a[2] not in bm.cached
    assert bm.key_to_block == {k0: a[0], k1: a[1]}
    # key 代表整段前缀：同样的 4 个 token 接在别的前缀后面（或在位置 0），key 都不同
    b = cache_sequence(bm, [9, 9, 9, 9, 5, 6, 7, 8]).block_table
    assert b[1] in bm.cached and len({bm.cached[a[1]].key, bm.cached[b[1]].key, chain_hash(None, (5, 6, 7, 8))}) == 3
    # 同样的前缀、更长的请求：两块都命中，后面没有满块了
    m = bm.match_prefix(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert m.blocks == a[:2] and m.next_key is None
    # 恰好 8 个 token：至少要算一个 token，所以最多命中 (8 - 1) // 4 = 1 块。第 1 块含最后一个 token，无论如何
    # 都要重算：没有"等别人算完它再命中"这回事，所以 next_key 为 None（以前这里给出第 1 块的 key，
    # 相同的提示词就会一步只接纳一个，见 test_identical_prompts_of_whole_blocks_take_two_prefill_steps）
    m = bm.match_prefix(make_seq([1, 2, 3, 4, 5, 6, 7, 8]))
    assert m.blocks == a[:1] and m.next_key is None
    # 第二块不同：只命中第 0 块；next_key 是要重新算的那一块
    m = bm.match_prefix(make_seq([1, 2, 3, 4, 9, 9, 9, 9, 0]))
    assert m.blocks == a[:1] and m.next_key == chain_hash(k0, (9, 9, 9, 9))
    # 同样的 token 出现在别的位置：key 是链式的，位置 4..7 的块不能当位置 0..3 用
    m = bm.match_prefix(make_seq([5, 6, 7, 8, 0]))
    assert m.blocks == [] and m.next_key == chain_hash(None, (5, 6, 7, 8))
    # 命中的块按引用计数共享：第三个请求命中 a 的两块（引用计数 2），自己只新分配 1 块，从命中位置开始算
    c = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 11])
    free = bm.num_free_blocks
    bm.allocate_seq(c, bm.match_prefix(c))
    assert c.block_table[:2] == a[:2] and [bm.ref_counts[x] for x in a[:2]] == [2, 2]
    assert bm.num_free_blocks == free - 1 and (c.num_computed_tokens, c.num_cached_tokens, c.num_registered_blocks) == (8, 8, 2)


def test_forced_hash_collision_is_a_miss_not_a_wrong_hit():
    bm = BlockManager(8, block_size=4, hash_fn=lambda parent, tokens: 0)   # 所有块同一个 key
    a = cache_sequence(bm, [1, 2, 3, 4, 1, 2, 3, 4, 5]).block_table
    assert list(bm.cached) == [a[0]]                    # 第 1 块的 key 已被第 0 块占着：不登记，一个 key 只对应一块
    assert bm.match_prefix(make_seq([9, 9, 9, 9, 0])).blocks == []              # key 相同、token 不同
    # 第 1 块的 token 与第 0 块相同、key 也相同：核对"前一块"发现它是位置 0 的块，不是第 0 块的后继
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 1, 2, 3, 4, 0])).blocks == [a[0]]


def test_lru_eviction_takes_empty_blocks_first_then_the_tail_of_the_oldest_prefix():
    bm = BlockManager(5, block_size=2)
    sa = cache_sequence(bm, [1, 2, 3, 4, 5, 6])         # 3 个满块，全部登记
    sb = cache_sequence(bm, [7, 8])
    a, b = list(sa.block_table), list(sb.block_table)
    bm.free_seq(sa)                                     # 从尾到头进 evictable：a[2], a[1], a[0]
    bm.free_seq(sb)
    assert list(bm.evictable) == [a[2], a[1], a[0], b[0]] and list(bm.free_blocks) == [4]
    assert bm.num_free_blocks == 5 and not any(bm.ref_counts)   # 带 key 的空闲块也算空闲
    c = bm.allocate(2)                                  # 空块只有 1 个：再驱逐最久没用的 a[2]（a 的尾巴）
    assert sorted(c) == sorted([4, a[2]]) and bm.num_evictions == 1 and a[2] not in bm.cached
    seq = make_seq([1, 2, 3, 4, 5])
    m = bm.match_prefix(seq)
    assert m.blocks == a[:2]                            # 前两块还在，仍能命中
    assert bm.can_allocate_seq(seq, m)                  # 要 3 块：命中的 2 块（在 evictable 里，也占额度）+ 新的 1 块
    bm.allocate_seq(seq, m)                             # 命中的块从 evictable 取出，不再能被驱逐；新的一块驱逐 b[0]
    assert seq.block_table == a[:2] + b and bm.num_evictions == 2 and not bm.evictable and bm.num_free_blocks == 0
    assert [bm.ref_counts[x] for x in a[:2]] == [1, 1]
    assert not bm.can_allocate_seq(make_seq([7, 8, 9]), bm.match_prefix(make_seq([7, 8, 9])))
    with pytest.raises(RuntimeError):
        bm.allocate(1)


# ---------- 块管理器的不变量：随机的接纳 / 增长 / 抢占后重新接纳 / 释放之后 ----------

def compute(bm: BlockManager, content: dict, seq: Sequence) -> None:
    """"算"完 seq 的全部 token（像一次前向）：写满的块记下它在模拟池里的内容（整段前缀），再登记进缓存。"""
    bs = bm.block_size
    for j in range(seq.num_computed_tokens // bs, seq.num_tokens // bs):
        content[seq.block_table[j]] = tuple(seq.token_ids[:(j + 1) * bs])   # 块 j 的 K/V 取决于位置 0..(j+1)·bs-1
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def check_pool(bm: BlockManager, owners: list[Sequence], content: dict) -> None:
    held = [0] * bm.num_blocks
    for o in owners:
        assert len(set(o.block_table)) == len(o.block_table)
        for b in o.block_table:
            held[b] += 1
    assert bm.ref_counts == held                                   # 引用计数 = 持有它的块表个数
    free, evictable = list(bm.free_blocks), list(bm.evictable)
    in_use = {b for b in range(bm.num_blocks) if held[b]}
    assert len(free) + len(evictable) + len(in_use) == bm.num_blocks   # 三者互斥且覆盖全部：不泄漏、不既空闲又被引用
    assert set(free) | set(evictable) | in_use == set(range(bm.num_blocks))
    assert bm.num_free_blocks == len(free) + len(evictable)
    assert not set(free) & set(bm.cached) and set(evictable) <= set(bm.cached)
    assert {c.key: b for b, c in bm.cached.items()} == bm.key_to_block   # key 唯一，双向一致
    order = {b: i for i, b in enumerate(evictable)}
    for b, c in bm.cached.items():
        assert content[b][-bm.block_size:] == c.token_ids                   # 登记的 token 就是块里存的
        if c.parent is None:
            assert len(content[b]) == bm.block_size                           # 第 0 块只能是位置 0 开始的块
        else:
            assert c.parent in bm.cached                                      # 没有断了父块的缓存块
            assert content[c.parent] == content[b][:-bm.block_size]           # 父块存的正是它前面的前缀
        if b in order and c.parent in order:
            assert order[b] < order[c.parent]                                 # 子块总在父块之前被驱逐


def admit(bm: BlockManager, content: dict, seq: Sequence) -> bool:
    m = bm.match_prefix(seq)
    assert len(m.blocks) <= (seq.num_tokens - 1) // bm.block_size           # 至少留一个 token 要算
    for i, b in enumerate(m.blocks):                                        # 命中的块里存的正是这段前缀的 K/V
        assert content[b] == tuple(seq.token_ids[:(i + 1) * bm.block_size])
    if not bm.can_allocate_seq(seq, m):
        return False
    first = seq.num_cached_tokens is None
    bm.allocate_seq(seq, m)
    assert len(seq.block_table) == bm.blocks_for(seq.num_tokens)
    assert seq.num_computed_tokens == len(m.blocks) * bm.block_size
    assert not first or seq.num_cached_tokens == seq.num_computed_tokens    # 只记第一次接纳的命中
    compute(bm, content, seq)
    return True


alphabet = st.lists(st.integers(0, 2), min_size=1, max_size=9)   # 字母表很小：前缀大量重复
ops = st.lists(st.tuples(st.sampled_from(["admit", "grow", "readmit", "free"]), st.integers(0, 30), alphabet),
               max_size=40)


@pytest.mark.parametrize("hash_fn", [chain_hash, collide], ids=["chain_hash", "forced_collisions"])
@settings(max_examples=250, deadline=None)
@given(num_blocks=st.integers(1, 10), block_size=st.integers(1, 3), ops=ops)
def test_pool_invariants_and_hits_hold_the_right_kv(hash_fn, num_blocks, block_size, ops):
    """不变量见 check_pool。每次命中都检查：命中的块里存的正是这段前缀在这些位置上的 K/V（模拟池里记的是写它时的
    整段前缀）——哈希碰撞时也必须如此。readmit = 抢占（还回全部块）再重新接纳：提示词 + 已生成的部分再查一次缓存。"""
    bm = BlockManager(num_blocks, block_size, hash_fn)
    owners: list[Sequence] = []
    content: dict[int, tuple] = {}
    for op, n, tokens in ops:
        if op == "admit":
            seq = make_seq(tokens)
            if admit(bm, content, seq):
                owners.append(seq)
        elif owners:
            seq = owners[n % len(owners)]
            if op == "grow":                                         # decode 若干 token，写满的块也登记
                for t in tokens:
                    seq.output_ids.append(t)
                    if bm.needs_slot(seq):
                        if not bm.can_allocate(1):
                            seq.output_ids.pop()
                            break
                        bm.append_slot(seq)
                compute(bm, content, seq)
            elif op == "readmit":
                bm.free_seq(seq)
                assert (seq.block_table, seq.num_computed_tokens, seq.num_registered_blocks) == ([], 0, 0)
                if not admit(bm, content, seq):
                    owners.remove(seq)
            else:
                bm.free_seq(owners.pop(n % len(owners)))
        check_pool(bm, owners, content)
    for o in owners:
        bm.free_seq(o)
    check_pool(bm, [], content)
    assert bm.num_free_blocks == num_blocks and not any(bm.ref_counts)


# ---------- 基数树 ----------

def test_radix_tree_by_hand_this_is_the_end():
    """第 06 章的例子，块大小 4、用词当 token：A = "<s> This is the end ." 切成 "|<s> This is the||end .|"。
    B = "<s> This is the end !" 与 A 共享 5 个 token；A 的第二块没写满（写满了也是 "end ." ≠ "end !"），
    块缓存只能用第一块的 4 个 token，基数树能用到 5 个。"""
    bos, this, is_, the, end, dot, bang = 0, 11, 12, 13, 14, 15, 16
    t = RadixTree(capacity_tokens=12)
    assert t.insert([bos, this, is_, the, end, dot]) == 6
    m = t.match_prefix([bos, this, is_, the, end, bang])
    assert m.length == 5 and m.node.tokens == (bos, this, is_, the, end)   # 在边的中间分开：分裂出一个节点
    bm = BlockManager(4, block_size=4)
    cache_sequence(bm, [bos, this, is_, the, end, dot])
    assert len(bm.match_prefix(make_seq([bos, this, is_, the, end, bang])).blocks) * 4 == 4
    assert t.insert([bos, this, is_, the, end, bang]) == 1 and t.num_nodes() == 3 and t.size == 7
    # 容量 12：再放 7 个 token 要腾出 2 个——最久没访问的叶子先走（dot，然后 bang）；公共前缀还在
    assert t.insert([1, 2, 3, 4, 5, 6, 7]) == 7 and t.size == 12 and t.num_evicted_tokens == 2
    assert t.match_prefix([bos, this, is_, the, end, dot]).length == 5


def test_radix_tree_locked_path_is_not_evicted():
    t = RadixTree(capacity_tokens=6)
    t.insert([1, 2, 3])
    node = t.match_prefix([1, 2, 3]).node
    t.lock(node)
    assert t.insert([7, 8, 9, 10]) == 3                 # 锁着的 3 个 token 不能驱逐：只放得下 3 个
    assert t.match_prefix([1, 2, 3]).length == 3
    t.unlock(node)
    t.insert([5, 5, 5])                                  # 现在可以驱逐最久没访问的 [7, 8, 9]
    assert t.match_prefix([7, 8, 9]).length == 0 and t.match_prefix([1, 2, 3]).length == 3
    with pytest.raises(RuntimeError):
        t.unlock(node)


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), max_size=25),
       capacity=st.integers(1, 60))
def test_radix_tree_matches_brute_force_longest_common_prefix(seqs, capacity):
    """容量够时：匹配长度 = 与所有插入过的序列的最长公共前缀；容量不够时：不超过它，树的大小不超过容量，
    树里的每条路径都是某个插入过的序列的前缀。"""
    t = RadixTree(capacity)
    inserted, lossless = [], True        # lossless：至今没有驱逐过、也没有因为装不下而截断过
    for s in seqs:
        best = max((lcp(s, x) for x in inserted), default=0)
        got = t.match_prefix(s).length
        assert got == best if lossless else got <= best
        lossless &= t.insert(s) == len(s) - got and t.num_evicted_tokens == 0
        inserted.append(s)
        assert t.size == sum(len(n.tokens) for n in t._nodes()) <= capacity
    stack = [(t.root, ())]
    while stack:
        node, path = stack.pop()
        path = path + node.tokens
        assert any(tuple(x[:len(path)]) == path for x in inserted) or not path
        stack.extend((c, path) for c in node.children.values())


# ---------- 引擎（随机小模型）：与 step03 / step05 逐 token 一致，命中数手算 ----------

def assert_equal_to_step03(model, requests, outputs, eos_ids, tokenizer=None):
    def logits_fn(ids):
        return model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    for i, (r, got) in enumerate(zip(requests, outputs)):
        ref = generate_single(model, r.prompt_ids, r.max_new_tokens, r.params, eos_ids, r.ignore_eos,
                              stop_strings=r.stop, tokenizer=tokenizer)
        c = compare(f"request {i}", r.prompt_ids, ref, got, logits_fn, TOL)
        assert c.ok, c.describe()


def assert_idle(engine):
    """没有请求在跑时：引用计数全 0，每一块要么是空块、要么是可驱逐的缓存块，两者都算空闲。"""
    bm = engine.block_manager
    assert not any(bm.ref_counts) and bm.num_free_blocks == bm.num_blocks
    assert set(bm.evictable) == set(bm.cached) and sorted([*bm.free_blocks, *bm.evictable]) == list(range(bm.num_blocks))
    assert not engine.scheduler.waiting and not engine.scheduler.running and not engine.has_unfinished_requests()


def engine06(model, num_blocks, block_size, max_batch_size, **kw):
    return LLMEngine(model, EngineConfig(num_blocks, block_size, max_batch_size), **kw)


def test_shared_prefix_hits_by_hand_and_outputs_equal_step03(tiny):
    """块大小 4，共同前缀 10 个 token：第一个请求全算；之后的请求命中 2 块 = 8 个 token。
    第 2、3、4 个请求与第 1 个同一批到达：第一步只接纳第 1 个（它们要算的第一块与它相同），下一步一起命中。"""
    prefix = list(range(10, 20))
    reqs = [Request(prefix + [30 + i, 40 + i], 6, SamplingParams(temperature=0.9, seed=i) if i % 2 else SamplingParams(),
                    ignore_eos=True) for i in range(4)]
    engine = engine06(tiny.model, 32, 4, 4, eos_ids=[1])
    outputs, st = engine.generate(reqs)
    assert st.cached_tokens == [0, 8, 8, 8]
    assert st.prefill_tokens == 12 + 3 * 4 and st.prefill_steps == 2
    assert [(x.prefill, x.rows, x.width, x.tokens) for x in st.steps[:2]] == [(True, 1, 12, 12), (True, 3, 4, 12)]
    assert st.hit_rate == pytest.approx(24 / 48)
    assert_equal_to_step03(tiny.model, reqs, outputs, [1])
    assert_idle(engine)


@pytest.mark.parametrize("block_size, n", [(4, 3), (2, 5)])
@one_arch
def test_identical_prompts_of_whole_blocks_take_two_prefill_steps(tiny, block_size, n):
    """issue 20 的 bug：n 个相同的提示词、长度恰好 2 × 块大小。第一步算第一个；第二步其余 n − 1 个一起命中第 0 块
    （第 1 块含最后一个 token，谁都要自己算，等也白等）——正好 2 次 prefill。以前调度器等"有人算完第 1 块"，
    那一块永远命中不了，于是一步只接纳一个（n 次 prefill）。"""
    prompt = list(range(50, 50 + 2 * block_size))
    reqs = [Request(prompt, 4, SamplingParams(temperature=0.8, seed=i) if i % 2 else SamplingParams(), ignore_eos=True)
            for i in range(n)]
    engine = engine06(tiny.model, 64, block_size, 8)
    outputs, st = engine.generate(reqs)
    assert st.prefill_steps == 2 and [x.rows for x in st.steps[:2]] == [1, n - 1]
    assert st.cached_tokens == [0] + [block_size] * (n - 1)
    assert st.prefill_tokens == 2 * block_size + (n - 1) * block_size
    assert_equal_to_step03(tiny.model, reqs, outputs, [])
    assert_idle(engine)


@one_arch
def test_hit_block_kv_equals_fresh_prefill(tiny):
    """命中的块里存的 K/V（由别的请求、在别的批里写出）与这个提示词单独 prefill 写出的相同（浮点末位以内）。"""
    bs, prompt = 4, list(range(50, 63))
    engine = engine06(tiny.model, 16, bs, 2)
    engine.generate([Request(prompt[:9] + [7, 7, 7], 3), Request(prompt[:12] + [9], 2)])
    blocks = engine.block_manager.match_prefix(make_seq(prompt)).blocks
    assert len(blocks) == 3
    dense = PreallocKVCache(tiny.cfg, len(prompt), "cpu", torch.float32)
    with torch.inference_mode():
        forward_single(tiny.model, dense, prompt, start=0)
    for i, b in enumerate(blocks):
        fresh = dense.kv[:, :, 0, :, i * bs:(i + 1) * bs]            # (layers, 2, H_kv, block_size, D)
        torch.testing.assert_close(engine.kv_cache.pool[:, :, b], fresh, rtol=1e-5, atol=1e-6)


@one_arch
def test_forced_hash_collisions_change_hits_not_outputs(tiny):
    """所有块同一个 key：几乎什么都命中不了，但输出与 step05 完全相同——碰撞只会变成未命中。"""
    rng = random.Random(3)
    prefix = [rng.randrange(2, 256) for _ in range(9)]
    reqs = [Request(prefix + [rng.randrange(2, 256) for _ in range(rng.randint(1, 6))], 8, ignore_eos=True)
            for _ in range(6)]
    ref, _ = step05.LLMEngine(tiny.model, step05.EngineConfig(40, 4, 6)).generate(reqs)
    good, bad = engine06(tiny.model, 40, 4, 6), engine06(tiny.model, 40, 4, 6)
    bad.block_manager.hash_fn = lambda parent, tokens: 0
    out_good, st_good = good.generate(reqs)
    out_bad, st_bad = bad.generate(reqs)
    assert out_good == ref and out_bad == ref
    assert sum(st_good.cached_tokens) == 5 * 8 and sum(st_bad.cached_tokens) <= 5 * 4   # 冲突下最多命中第 0 块
    assert len(bad.block_manager.cached) == 1
    assert_idle(good), assert_idle(bad)


@one_arch
def test_parallel_samples_share_prompt_blocks(tiny):
    """--n 3：三个样本（种子 7、8、9）与分别单独生成相同；第 2、3 个样本命中提示词的全部整块（最后一个 token 要算）。"""
    r = Request(list(range(20, 33)), 10, SamplingParams(temperature=1.0, seed=7), ignore_eos=True)
    samples = r.parallel_samples(3)
    assert [q.params.seed for q in samples] == [7, 8, 9]
    engine = engine06(tiny.model, 20, 4, 3)
    outputs, st = engine.generate(samples)
    assert st.cached_tokens == [0, 12, 12] and st.prefill_steps == 2 and len({tuple(o) for o in outputs}) > 1
    assert_equal_to_step03(tiny.model, samples, outputs, [])
    assert_idle(engine)


@one_arch
def test_kv_waste_counts_shared_blocks_once(tiny):
    """块大小 4：A（10 个 token）与 B（11 个）共享 2 个满块，各生成 3 个 token。
    第 1 步：只 prefill A（B 要算的第一块 A 也要算，等一步）：3 块 12 槽，10 个 token。
    第 2 步：prefill B，命中 2 块：物理块 = 共享 2 + A 的半块 + B 的半块 = 4 块 16 槽，存着 8 + 2 + 3 = 13 个 token
    （step05 的记法会把共享块数两遍：24 槽、21 个 token）。
    第 3 步：两个都 decode 一个 token：还是 4 块 16 槽，8 + 3 + 4 = 15 个 token。"""
    prefix = list(range(60, 68))
    engine = engine06(tiny.model, 10, 4, 2)
    _, st = engine.generate([Request(prefix + [1, 2], 3, ignore_eos=True), Request(prefix + [3, 4, 5], 3, ignore_eos=True)])
    assert (st.num_forwards, st.prefill_steps) == (4, 2) and st.cached_tokens == [0, 8]
    assert [(x.kv_slots_held, x.kv_slots_used) for x in st.steps[:3]] == [(12, 10), (16, 13), (16, 15)]


@one_arch
def test_the_last_forward_of_a_request_counts_in_kv_waste_and_concurrency(tiny):
    """上一个例子的第 4 步：A 写满它的第 3 块（8 + 4），B 的第 13 个 token 进了新的一块 → 5 块 20 槽、
    8 + 4 + 4 + 1 = 17 个 token；这一步两个请求都在批里，这一步之后才结束。"""
    prefix = list(range(60, 68))
    engine = engine06(tiny.model, 10, 4, 2)
    _, st = engine.generate([Request(prefix + [1, 2], 3, ignore_eos=True), Request(prefix + [3, 4, 5], 3, ignore_eos=True)])
    assert (st.steps[3].kv_slots_held, st.steps[3].kv_slots_used, st.steps[3].num_running) == (20, 17, 2)


@one_arch
def test_cache_survives_between_generate_calls(tiny):
    """多轮对话：第二次调用的提示词 = 第一次的提示词 + 回复 + 新问题，命中包括第一次 decode 时写满的块。"""
    engine = engine06(tiny.model, 30, 4, 2)
    p1 = list(range(100, 107))                                  # 7 个 token
    (out1,), _ = engine.generate([Request(p1, 9, ignore_eos=True)])
    p2 = p1 + out1 + [5, 6, 7]                                  # 第一次写进缓存的是 p1 + out1[:-1] = 15 个 token
    (out2,), st = engine.generate([Request(p2, 4, ignore_eos=True)])
    assert st.cached_tokens == [12]                             # 15 个 token 里的 3 个满块，其中 2 块是 decode 时写满的
    assert_equal_to_step03(tiny.model, [Request(p2, 4, ignore_eos=True)], [out2], [])


def test_soak_shared_prefixes_tiny_pool_equals_step03(tiny):
    """随机负载：几组共享前缀 + 随机后缀、贪心 / 带种子采样 / 并行采样混在一起，池子只比最大的请求多一点：
    驱逐、抢占都会发生；每个输出都等于 step03 单独生成，结束后引用计数全为 0。"""
    rng = random.Random(2025)
    prefixes = [[rng.randrange(2, 256) for _ in range(rng.randint(4, 20))] for _ in range(4)]
    requests = []
    for i in range(50):
        params = SamplingParams(temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 20]), seed=i) \
            if rng.random() < 0.4 else SamplingParams()
        r = Request(rng.choice(prefixes) + [rng.randrange(2, 256) for _ in range(rng.randint(0, 8))],
                    rng.randint(1, 16), params, ignore_eos=rng.random() < 0.5)
        requests += r.parallel_samples(2) if i % 10 == 0 else [r]
    engine = engine06(tiny.model, 14, 4, 12, eos_ids=[1])      # 最大的请求要 11 块
    outputs, st = engine.generate(requests)
    assert st.preemptions > 0 and engine.block_manager.num_evictions > 0 and sum(st.cached_tokens) > 0
    assert_equal_to_step03(tiny.model, requests, outputs, [1])
    assert_idle(engine)


# ---------- step API：结束原因、abort、出错之后、可驱逐的块算空闲 ----------

class CharTokenizer:
    """测试用：token i 解码成字母表里的第 i % 26 个字母。"""
    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


@one_arch
def test_step_outputs_finish_reasons_and_cached_tokens(tiny):
    """一步一步地驱动，三个请求共享 8 个 token 的前缀（块大小 4）：第 1 步只有 A（B、C 等它算完第一块），
    第 2 步 B、C 命中 2 块。每项输出带这个请求的 num_cached_tokens；结束原因：EOS → "stop"、
    停止字符串 → "stop"、生成满 → "length"。拼起来的 token 等于 step03 单独生成。"""
    tok, prefix = CharTokenizer(), list(range(30, 38))
    ra, rb, rc = (Request(prefix + [50 + i], 6, ignore_eos=True) for i in range(3))
    ref_a, ref_b = (generate_single(tiny.model, r.prompt_ids, 6, SamplingParams(), (), True) for r in (ra, rb))
    eos = ref_a[1]                                   # A 的第 2 个 token 当 EOS（若它也是第 1 个，就在第 1 个停）
    ra = Request(ra.prompt_ids, 6)
    rb = Request(rb.prompt_ids, 6, ignore_eos=True, stop=(tok.decode(ref_b[2:3]),))
    engine = engine06(tiny.model, 32, 4, 8, tokenizer=tok, eos_ids=[eos])
    a, b, c = (engine.add_request(r) for r in (ra, rb, rc))
    got, reasons, cached = {a: [], b: [], c: []}, {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id not in reasons and len(o.new_token_ids) == 1
            got[o.request_id] += o.new_token_ids
            cached.setdefault(o.request_id, set()).add(o.num_cached_tokens)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
            else:
                assert o.finish_reason is None
    assert cached == {a: {0}, b: {8}, c: {8}}
    assert reasons == {a: "stop", b: "stop", c: "length"}
    assert got[a][-1] == eos and len(got[b]) <= 3 and len(got[c]) == 6
    assert_equal_to_step03(tiny.model, [ra, rb, rc], [got[a], got[b], got[c]], [eos], tok)
    assert_idle(engine)


@one_arch
def test_abort_waiting_and_running_with_shared_blocks(tiny):
    """A、B 共享 2 个满块（引用计数 2）在跑，C 在等（批上限 2）。abort C（等待中）和 A（运行中）：A 独有的半块
    立刻还回来，共享的两块引用计数降到 1、还在 B 的块表里；下一次 step() 报告两个 "abort"，B 照常 decode，
    输出等于 step03。全部结束后引用计数全 0，登记过的块留在缓存里（可驱逐），算作空闲。"""
    prefix = list(range(70, 78))
    ra, rb, rc = (Request(prefix + [90 + i], 6, ignore_eos=True) for i in range(3))
    engine = engine06(tiny.model, 16, 4, 2)
    bm = engine.block_manager
    a, b, c = (engine.add_request(r) for r in (ra, rb, rc))
    seq_a, seq_b, seq_c = (engine.seqs[rid] for rid in (a, b, c))
    assert [o.request_id for o in engine.step()] == [a]               # B 等 A 算完前缀
    assert [o.request_id for o in engine.step()] == [b]               # B 命中 2 块；C 等着（批满）
    shared, own_a = seq_a.block_table[:2], seq_a.block_table[2]
    assert seq_b.block_table[:2] == shared and [bm.ref_counts[x] for x in shared] == [2, 2]
    free = bm.num_free_blocks
    engine.abort(c)
    engine.abort(a)
    assert bm.num_free_blocks == free + 1 and bm.ref_counts[own_a] == 0 and [bm.ref_counts[x] for x in shared] == [1, 1]
    assert engine.scheduler.running == [seq_b] and not engine.scheduler.waiting
    assert (seq_a.status, seq_c.status, seq_a.block_table) == (SequenceStatus.FINISHED, SequenceStatus.FINISHED, [])
    for rid in (a, c, 12345):
        engine.abort(rid)                                              # 已经 abort 过 / 不认识：什么也不做
    outs = engine.step()
    assert outs[:2] == [RequestOutput(c, [], True, "abort"), RequestOutput(a, [], True, "abort")]
    assert [(o.request_id, len(o.new_token_ids), o.finished, o.num_cached_tokens) for o in outs[2:]] == [(b, 1, False, 8)]
    while engine.has_unfinished_requests():
        engine.step()
    assert seq_b.finish_reason == "length"
    assert_equal_to_step03(tiny.model, [rb], [seq_b.output_ids], [])
    assert engine.step() == []
    assert_idle(engine)
    assert set(shared) <= set(bm.evictable)


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "ctrl_c"])
@one_arch
def test_exception_mid_run_frees_every_block_and_keeps_the_cache_valid(tiny, monkeypatch, exc):
    """第 3 次前向抛出异常：那一刻 B、C 与 A 共享前缀块（引用计数 3）。异常从 generate() 原样传出来，之后引用计数
    全 0、每一块都可用；已经登记的块（它们的 K/V 是完整前向写出的）留在缓存里，同一个引擎的下一次 generate()
    命中它们，输出等于 step03。"""
    prefix = list(range(40, 48))
    reqs = [Request(prefix + [60 + i, 61 + i], 6, ignore_eos=True) for i in range(3)]
    engine = engine06(tiny.model, 16, 4, 4)
    bm, forward, seen = engine.block_manager, tiny.model.forward, []

    def failing_forward(*args, **kwargs):
        seen.append((bm.num_blocks - bm.num_free_blocks, max(bm.ref_counts)))
        if len(seen) == 3:
            raise exc
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiny.model, "forward", failing_forward)
    with pytest.raises(type(exc)):
        engine.generate(reqs)
    assert seen == [(3, 1), (5, 3), (5, 3)]              # A 的 3 块；B、C 命中 2 块、各加 1 块
    assert_idle(engine)
    assert len(bm.cached) == 2                           # A 的两个前缀块
    outputs, st = engine.generate(reqs)
    assert st.cached_tokens == [8, 8, 8] and st.prefill_steps == 1
    assert_equal_to_step03(tiny.model, reqs, outputs, [])
    assert_idle(engine)


@one_arch
def test_evictable_cached_blocks_count_as_free(tiny):
    """跑完之后池子里的块多半是"带 key 的空闲块"：num_free_blocks（/metrics 读的"现在能分出去的块"）把它们算进去，
    一个要用满整个池子的新请求照样被接纳（驱逐它们），输出等于 step03。"""
    engine = engine06(tiny.model, 8, 4, 2)
    bm = engine.block_manager
    engine.generate([Request(list(range(10, 22)), 5, ignore_eos=True)])      # 12 + 4 个 token：4 块，写满的都登记
    assert len(bm.evictable) == 4 and len(bm.free_blocks) == 4 and bm.num_free_blocks == 8
    big = Request(list(range(100, 120)), 13, ignore_eos=True)                 # 20 + 12 = 32 个 token：整整 8 块
    outputs, st = engine.generate([big])
    assert st.num_forwards == 13 and bm.num_evictions == 4 and st.cached_tokens == [0]
    assert_equal_to_step03(tiny.model, [big], outputs, [])
    assert_idle(engine)


# ---------- 命令行（进程内，随机小模型 + 真实分词器） ----------

def run_cli(argv, capsys) -> dict:
    """进程内跑 run.py 的生成模式（与命令行同一条路：cli.run_main），断言退出码 0，返回最后一行的 JSON。"""
    with pytest.raises(SystemExit) as e:
        cli.run_main(step06_run.make_parser(), step06_run.main, argv + ["--json"])
    captured = capsys.readouterr()
    assert e.value.code == 0, captured.err[-2000:]
    return json.loads(captured.out.strip().splitlines()[-1])


def test_run_py_no_prefix_cache_is_step05(tiny_tok_dir, capsys):
    """--no-prefix-cache 跑的是 step05 的引擎：同样的输出、同样的前向次数与抢占次数，cached_tokens 全为 0。
    提示词是会命中缓存的（--chat 的对话模板 + 两个相同的提示词 + --n 2）：这里先确认 step06 的引擎在这组请求上
    命中、少算、抢占次数也不同——run.py 若用了 step06 的引擎，这个测试就会失败。"""
    prompts = ["Tell me a joke.", "Tell me a joke.", "What is the capital of France?"]
    argv = ["--model", str(tiny_tok_dir), *[a for p in prompts for a in ("--prompt", p)], "--chat", "--n", "2",
            "--temperature", "0.8", "--seed", "3", "--max-new-tokens", "6", "--ignore-eos",
            "--block-size", "4", "--num-blocks", "30", "--max-batch-size", "4"]
    out = run_cli(argv + ["--no-prefix-cache"], capsys)
    s = cli.open_session(str(tiny_tok_dir), "cpu", "float32")
    requests = [q for p in prompts for q in Request(
        s.encode(p, chat=True), 6, SamplingParams(temperature=0.8, seed=3), ignore_eos=True).parallel_samples(2)]
    ref5, st5 = step05.LLMEngine(s.model, step05.EngineConfig(30, 4, 4)).generate(requests)
    _, st6 = LLMEngine(s.model, EngineConfig(30, 4, 4)).generate(requests)
    # 这组请求分得出两个引擎：step06 命中、少算 prefill；step05 在 30 块里要抢占，step06 共享块、不用抢占
    assert sum(st6.cached_tokens) > 0 and st6.prefill_tokens < st5.prefill_tokens
    assert st5.preemptions > 0 and st6.preemptions != st5.preemptions
    assert [r["output_ids"] for r in out["results"]] == ref5
    assert [r["prompt_ids"] for r in out["results"]] == [q.prompt_ids for q in requests]
    assert [r["cached_tokens"] for r in out["results"]] == [0] * 6
    assert (out["stats"]["forwards"], out["stats"]["preemptions"]) == (st5.num_forwards, st5.preemptions)
    assert out["stats"]["prefill_tokens"] == st5.prefill_tokens and out["stats"]["evictions"] == 0
    with_cache = run_cli(argv, capsys)                                              # 同样的命令去掉 --no-prefix-cache
    assert [r["output_ids"] for r in with_cache["results"]] == ref5
    assert [r["cached_tokens"] for r in with_cache["results"]] == st6.cached_tokens
    assert with_cache["stats"]["forwards"] == st6.num_forwards


def test_run_py_n_samples(tiny_tok_dir, capsys):
    """--n 2：结果按提示词排列、每个带 cached_tokens；第二个样本命中提示词的全部整块；每个样本等于 step03
    用种子 5、6 单独生成。"""
    out = run_cli(["--model", str(tiny_tok_dir), "--prompt", "Write a haiku about the sea.", "--prompt", "Hi",
                   "--n", "2", "--temperature", "0.8", "--seed", "5", "--max-new-tokens", "8", "--ignore-eos",
                   "--block-size", "4"], capsys)
    s = cli.open_session(str(tiny_tok_dir), "cpu", "float32")
    res = out["results"]
    assert [x["prompt"] for x in res] == ["Write a haiku about the sea."] * 2 + ["Hi"] * 2
    for i, p in enumerate(["Write a haiku about the sea.", "Hi"]):
        ids = s.encode(p)
        assert [x["prompt_ids"] for x in res[2 * i:2 * i + 2]] == [ids, ids]
        assert [x["cached_tokens"] for x in res[2 * i:2 * i + 2]] == [0, (len(ids) - 1) // 4 * 4]
        for k, x in enumerate(res[2 * i:2 * i + 2]):
            assert x["output_ids"] == generate_single(s.model, ids, 8, SamplingParams(temperature=0.8, seed=5 + k),
                                                      s.tok.eos_ids, ignore_eos=True)


def test_run_py_bad_n_is_a_user_error(capsys):
    assert "--n" in cli_error(step06_run, ["--prompt", "hi", "--n", "0"], capsys)
