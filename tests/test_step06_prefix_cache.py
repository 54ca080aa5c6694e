"""step06：哈希链与查找（手算）、块池的不变量（性质测试：缓存、共享、驱逐、强制碰撞）、基数树（手算 + 与暴力
最长公共前缀比），以及引擎：命中的前缀、小池子下的驱逐与抢占、随机负载，每个输出都等于 step03 / step05。"""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from step06_prefix_cache.block_pool import PrefixCachingBlockAllocator, chain_hash
from step06_prefix_cache.radix_tree import RadixTree


def collide(parent_key, token_ids):
    """故意很差的哈希：只看第一个 token 的奇偶——大量不同的前缀得到同一个 key。"""
    return token_ids[0] % 2


# ---------- 哈希链与查找：手算的例子 ----------

def cache_sequence(pool: PrefixCachingBlockAllocator, tokens: list[int]) -> list[int]:
    """模拟一个请求：分配块、"算完"全部 token、把写满的块按顺序登记。返回块表。"""
    bs = pool.block_size
    table = pool.allocate(-(-len(tokens) // bs))
    for i in range(len(tokens) // bs):
        pool.cache_block(table[i], table[i - 1] if i else None, tuple(tokens[i * bs:(i + 1) * bs]))
    return table


def test_hash_chain_and_lookup_by_hand():
    pool = PrefixCachingBlockAllocator(8, block_size=4)
    a = cache_sequence(pool, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])          # 两个满块 + 一个半块
    k0 = chain_hash(None, (1, 2, 3, 4))
    k1 = chain_hash(k0, (5, 6, 7, 8))
    assert pool.cached[a[0]].key == k0 and pool.cached[a[1]].key == k1 and a[2] not in pool.cached
    assert pool.key_to_block == {k0: a[0], k1: a[1]}
    # key 代表整段前缀：同样的 4 个 token 接在别的前缀后面（或在位置 0），key 都不同
    b = cache_sequence(pool, [9, 9, 9, 9, 5, 6, 7, 8])
    assert b[1] in pool.cached and len({pool.cached[a[1]].key, pool.cached[b[1]].key, chain_hash(None, (5, 6, 7, 8))}) == 3
    # 同样的前缀、更长的请求：两块都命中，后面没有满块了
    m = pool.longest_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9], max_blocks=2)
    assert m.blocks == a[:2] and m.next_key is None
    # 恰好 8 个 token：至少要算一个 token，所以最多命中 (8 - 1) // 4 = 1 块，第 1 块要重算
    m = pool.longest_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8], max_blocks=1)
    assert m.blocks == a[:1] and m.next_key == k1
    # 第二块不同：只命中第 0 块
    m = pool.longest_cached_prefix([1, 2, 3, 4, 9, 9, 9, 9, 0], max_blocks=2)
    assert m.blocks == a[:1] and m.next_key == chain_hash(k0, (9, 9, 9, 9))
    # 同样的 token 出现在别的位置：key 是链式的，位置 4..7 的块不能当位置 0..3 用
    m = pool.longest_cached_prefix([5, 6, 7, 8, 0], max_blocks=1)
    assert m.blocks == [] and m.next_key == chain_hash(None, (5, 6, 7, 8))


def test_forced_hash_collision_is_a_miss_not_a_wrong_hit():
    pool = PrefixCachingBlockAllocator(8, block_size=4, hash_fn=lambda parent, tokens: 0)   # 所有块同一个 key
    a = cache_sequence(pool, [1, 2, 3, 4, 1, 2, 3, 4, 5])
    assert list(pool.cached) == [a[0]]                  # 第 1 块的 key 已被第 0 块占着：不登记，一个 key 只对应一块
    assert pool.longest_cached_prefix([9, 9, 9, 9, 0], 1).blocks == []             # key 相同、token 不同
    # 第 1 块的 token 与第 0 块相同、key 也相同：核对"前一块"发现它是位置 0 的块，不是第 0 块的后继
    assert pool.longest_cached_prefix([1, 2, 3, 4, 1, 2, 3, 4, 0], 2).blocks == [a[0]]


def test_lru_eviction_takes_empty_blocks_first_then_the_tail_of_the_oldest_prefix():
    pool = PrefixCachingBlockAllocator(5, block_size=2)
    a = cache_sequence(pool, [1, 2, 3, 4, 5, 6])        # 3 个满块，全部登记
    b = cache_sequence(pool, [7, 8])
    pool.free(a)                                        # 从尾到头进 evictable：a[2], a[1], a[0]
    pool.free(b)
    assert list(pool.evictable) == [a[2], a[1], a[0], b[0]] and pool.num_free == 5
    c = pool.allocate(2)                                # 空块只有 1 个：再驱逐最久没用的 a[2]（a 的尾巴）
    assert sorted(c) == sorted([4, a[2]]) and pool.num_evictions == 1 and a[2] not in pool.cached
    m = pool.longest_cached_prefix([1, 2, 3, 4, 5, 6, 0], max_blocks=3)
    assert m.blocks == a[:2]                            # 前两块还在，仍能命中
    pool.acquire(m.blocks)                              # 命中：从 evictable 里取出，不再能被驱逐
    assert list(pool.evictable) == [b[0]] and pool.ref_counts[a[0]] == 1
    with pytest.raises(RuntimeError):
        pool.allocate(2)                                # 只剩 b[0] 一块可用


# ---------- 块池的不变量：随机的接纳 / 增长 / 共享 / 释放之后 ----------

class Owner:
    """一个持有块表的"请求"：tokens 是它已经算好 K/V 的 token。"""
    def __init__(self, tokens, table, registered):
        self.tokens, self.table, self.registered = tokens, table, registered


def compute_and_register(pool, content, o: Owner, start: int) -> None:
    """"算" token start..：写满的块记下它在模拟池里的内容（整段前缀），再按顺序登记。"""
    bs = pool.block_size
    for j in range(start // bs, len(o.tokens) // bs):
        content[o.table[j]] = tuple(o.tokens[:(j + 1) * bs])       # 块 j 的 K/V 取决于位置 0..(j+1)·bs-1 的全部 token
    for j in range(o.registered, len(o.tokens) // bs):
        pool.cache_block(o.table[j], o.table[j - 1] if j else None, tuple(o.tokens[j * bs:(j + 1) * bs]))
    o.registered = len(o.tokens) // bs


def check_pool(pool: PrefixCachingBlockAllocator, owners: list[Owner], content: dict) -> None:
    held = [0] * pool.num_blocks
    for o in owners:
        for b in o.table:
            held[b] += 1
    assert pool.ref_counts == held                                   # 引用计数 = 持有它的块表个数
    free, evictable = list(pool.free_blocks), list(pool.evictable)
    in_use = {b for b in range(pool.num_blocks) if held[b]}
    assert len(free) + len(evictable) + len(in_use) == pool.num_blocks   # 三者互斥且覆盖全部：不泄漏、不既空闲又被引用
    assert set(free) | set(evictable) | in_use == set(range(pool.num_blocks))
    assert not set(free) & set(pool.cached) and set(evictable) <= set(pool.cached)
    assert {k: b for b, c in pool.cached.items() for k in [c.key]} == pool.key_to_block   # key 唯一，双向一致
    order = {b: i for i, b in enumerate(evictable)}
    for b, c in pool.cached.items():
        assert content[b][-pool.block_size:] == c.token_ids                   # 登记的 token 就是块里存的
        if c.parent is None:
            assert len(content[b]) == pool.block_size                           # 第 0 块只能是位置 0 开始的块
        else:
            assert c.parent in pool.cached                                      # 没有断了父块的缓存块
            assert content[c.parent] == content[b][:-pool.block_size]           # 父块存的正是它前面的前缀
        if b in order and c.parent in order:
            assert order[b] < order[c.parent]                                   # 子块总在父块之前被驱逐


alphabet = st.lists(st.integers(0, 2), min_size=1, max_size=9)   # 字母表很小：前缀大量重复
ops = st.lists(st.tuples(st.sampled_from(["admit", "grow", "fork", "free"]), st.integers(0, 30), alphabet), max_size=40)


@pytest.mark.parametrize("hash_fn", [chain_hash, collide], ids=["chain_hash", "forced_collisions"])
@settings(max_examples=250, deadline=None)
@given(num_blocks=st.integers(1, 10), block_size=st.integers(1, 3), ops=ops)
def test_pool_invariants_and_hits_hold_the_right_kv(hash_fn, num_blocks, block_size, ops):
    """不变量见 check_pool。另外每次命中都检查：命中的块里存的正是这段前缀在这些位置上的 K/V
    （模拟池里记的是写它时的整段前缀）——哈希碰撞时也必须如此。"""
    pool = PrefixCachingBlockAllocator(num_blocks, block_size, hash_fn)
    owners: list[Owner] = []
    content: dict[int, tuple] = {}
    for op, n, tokens in ops:
        if op == "admit":
            m = pool.longest_cached_prefix(tokens, max_blocks=(len(tokens) - 1) // block_size)
            for i, b in enumerate(m.blocks):
                assert content[b] == tuple(tokens[:(i + 1) * block_size])
            need = -(-len(tokens) // block_size) - len(m.blocks)
            if pool.can_allocate(need + sum(pool.ref_counts[b] == 0 for b in m.blocks)):
                pool.acquire(m.blocks)
                o = Owner(list(tokens), m.blocks + pool.allocate(need), len(m.blocks))
                owners.append(o)
                compute_and_register(pool, content, o, len(m.blocks) * block_size)
        elif owners:
            o = owners[n % len(owners)]
            if op == "grow":                                         # decode 若干 token，写满的块也登记
                start = len(o.tokens)
                o.tokens += tokens
                extra = -(-len(o.tokens) // block_size) - len(o.table)
                if not pool.can_allocate(extra):
                    o.tokens = o.tokens[:start]
                    continue
                o.table += pool.allocate(extra)
                compute_and_register(pool, content, o, start)
            elif op == "fork" and len(o.tokens) % block_size == 0:   # 只共享满块：之后各写各的新块，不需要写时复制
                owners.append(Owner(list(o.tokens), pool.fork(o.table), o.registered))
            elif op == "free":
                pool.free(owners.pop(n % len(owners)).table)
        check_pool(pool, owners, content)
    for o in owners:
        pool.free(o.table)
    check_pool(pool, [], content)
    assert pool.num_free == num_blocks and not any(pool.ref_counts)


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
    pool = PrefixCachingBlockAllocator(4, block_size=4)
    cache_sequence(pool, [bos, this, is_, the, end, dot])
    assert len(pool.longest_cached_prefix([bos, this, is_, the, end, bang], max_blocks=1).blocks) * 4 == 4
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

import json  # noqa: E402

import torch  # noqa: E402

from common.compare import MARGIN_TOL, compare  # noqa: E402
from conftest import run_py  # noqa: E402
from step02_sampling.sampler import SamplingParams  # noqa: E402
from step03_kvcache_single.cache import PreallocKVCache  # noqa: E402
from step03_kvcache_single.engine import forward as forward_single  # noqa: E402
from step03_kvcache_single.engine import generate as generate_single  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402
from step05_paged.engine import PagedEngine  # noqa: E402
from step06_prefix_cache.engine import PrefixCachingEngine  # noqa: E402
from step06_prefix_cache.workload import parallel_samples  # noqa: E402

TOL = MARGIN_TOL[torch.float32]


def assert_equal_to_step03(model, requests, outputs, eos_ids):
    def logits_fn(ids):
        return model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    for i, (r, got) in enumerate(zip(requests, outputs)):
        ref = generate_single(model, r.prompt_ids, r.max_new_tokens, r.params, eos_ids, r.ignore_eos)
        c = compare(f"request {i}", r.prompt_ids, ref, got, logits_fn, TOL)
        assert c.ok, c.describe()


def assert_idle(engine):
    a = engine.allocator
    assert not any(a.ref_counts) and a.num_free == a.num_blocks and set(a.evictable) == set(a.cached)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """只测账目、与架构无关的测试用一个 llama 小模型就够了（tiny 夹具会把测试跑三遍）。"""
    from conftest import make_tiny_model_dir
    from common.weights import load_model
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("llama6"), "llama"), "cpu", torch.float32)


def test_shared_prefix_hits_by_hand_and_outputs_equal_step03(tiny):
    """块大小 4，共同前缀 10 个 token：第一个请求全算；之后的请求命中 2 块 = 8 个 token。
    第 2、3 个请求与第 1 个同一批到达：第一步只接纳第 1 个（它们要算的第一块与它相同），下一步再命中。"""
    prefix = list(range(10, 20))
    reqs = [Request(prefix + [30 + i, 40 + i], 6, SamplingParams(temperature=0.9, seed=i) if i % 2 else SamplingParams(),
                    ignore_eos=True) for i in range(4)]
    engine = PrefixCachingEngine(tiny.model, num_blocks=32, block_size=4, max_batch_size=4)
    outputs, st = engine.generate(reqs, eos_ids=[1])
    assert st.cached_tokens == [0, 8, 8, 8]
    assert st.prefill_tokens == 12 + 3 * 4 and st.prefill_steps == 2
    assert st.hit_rate == pytest.approx(24 / 48)
    assert_equal_to_step03(tiny.model, reqs, outputs, [1])
    assert_idle(engine)


def test_hit_block_kv_equals_fresh_prefill(tiny):
    """命中的块里存的 K/V（由别的请求、在别的批里写出）与这个提示词单独 prefill 写出的相同（浮点末位以内）。"""
    bs, prompt = 4, list(range(50, 63))
    engine = PrefixCachingEngine(tiny.model, num_blocks=16, block_size=bs, max_batch_size=2)
    engine.generate([Request(prompt[:9] + [7, 7, 7], 3), Request(prompt[:12] + [9], 2)])
    blocks = engine.allocator.longest_cached_prefix(prompt, (len(prompt) - 1) // bs).blocks
    assert len(blocks) == 3
    dense = PreallocKVCache(tiny.cfg, len(prompt), "cpu", torch.float32)
    with torch.inference_mode():
        forward_single(tiny.model, dense, prompt, start=0)
    for i, b in enumerate(blocks):
        fresh = dense.kv[:, :, 0, :, i * bs:(i + 1) * bs]            # (layers, 2, H_kv, block_size, D)
        torch.testing.assert_close(engine.cache.pool[:, :, b], fresh, rtol=1e-5, atol=1e-6)


def test_forced_hash_collisions_change_hits_not_outputs(llama):
    """所有块同一个 key：几乎什么都命中不了，但输出与 step05 完全相同——碰撞只会变成未命中。"""
    rng = random.Random(3)
    prefix = [rng.randrange(2, 256) for _ in range(9)]
    reqs = [Request(prefix + [rng.randrange(2, 256) for _ in range(rng.randint(1, 6))], 8, ignore_eos=True)
            for _ in range(6)]
    ref, _ = PagedEngine(llama, 40, 4, 6).generate(reqs)
    good = PrefixCachingEngine(llama, 40, 4, 6)
    bad = PrefixCachingEngine(llama, 40, 4, 6, hash_fn=lambda parent, tokens: 0)
    out_good, st_good = good.generate(reqs)
    out_bad, st_bad = bad.generate(reqs)
    assert out_good == ref and out_bad == ref
    assert sum(st_good.cached_tokens) == 5 * 8 and sum(st_bad.cached_tokens) <= 5 * 4   # 冲突下最多命中第 0 块
    assert bad.allocator.num_cached_blocks == 1
    assert_idle(good), assert_idle(bad)


def test_no_prefix_cache_is_step05_exactly(llama):
    """--no-prefix-cache：同样的输出、同样的前向次数与抢占次数，cached_tokens 全为 0。"""
    rng = random.Random(4)
    prefix = [rng.randrange(2, 256) for _ in range(14)]
    reqs = [Request(prefix + [rng.randrange(2, 256) for _ in range(rng.randint(1, 8))], rng.randint(4, 16),
                    SamplingParams(temperature=0.8, seed=i) if i % 2 else SamplingParams(), ignore_eos=True)
            for i in range(8)]
    out5, st5 = PagedEngine(llama, 14, 4, 8).generate(reqs)
    out6, st6 = PrefixCachingEngine(llama, 14, 4, 8, prefix_caching=False).generate(reqs)
    assert out6 == out5 and (st6.num_forwards, st6.preemptions, st6.prefill_tokens) == (st5.num_forwards, st5.preemptions,
                                                                                  st5.prefill_tokens)
    assert st5.preemptions > 0 and st6.cached_tokens == [0] * 8 and st6.kv_waste == pytest.approx(st5.kv_waste)


def test_parallel_samples_share_prompt_blocks(llama):
    """--n 3：三个样本（种子 7、8、9）与分别单独生成相同；第 2、3 个样本命中提示词的全部整块（最后一个 token 要算）。"""
    r = Request(list(range(20, 33)), 10, SamplingParams(temperature=1.0, seed=7), ignore_eos=True)
    samples = parallel_samples(r, 3)
    assert [q.params.seed for q in samples] == [7, 8, 9]
    engine = PrefixCachingEngine(llama, 20, 4, 3)
    outputs, st = engine.generate(samples)
    assert st.cached_tokens == [0, 12, 12] and len({tuple(o) for o in outputs}) > 1
    assert_equal_to_step03(llama, samples, outputs, [])
    assert_idle(engine)


def test_kv_waste_counts_shared_blocks_once(llama):
    """块大小 4：A（10 个 token）与 B（11 个）共享 2 个满块，各生成 2 个 token。
    第 1 步：只 prefill A（B 要算的第一块 A 也要算，等一步）：3 块 12 槽，10 个 token。
    第 2 步：prefill B，命中 2 块：物理块 = 共享 2 + A 的半块 + B 的半块 = 4 块 16 槽，存着 8 + 2 + 3 = 13 个 token
    （step05 的记法会把共享块数两遍：24 槽、21 个 token）。
    第 3 步：两个都 decode 一个 token：还是 4 块 16 槽，8 + 3 + 4 = 15 个 token。"""
    prefix = list(range(60, 68))
    engine = PrefixCachingEngine(llama, 10, 4, 2)
    _, st = engine.generate([Request(prefix + [1, 2], 2, ignore_eos=True), Request(prefix + [3, 4, 5], 2, ignore_eos=True)])
    assert (st.num_forwards, st.prefill_steps) == (3, 2) and st.cached_tokens == [0, 8]
    assert (st.kv_slot_steps_held, st.kv_slot_steps_used) == (12 + 16 + 16, 10 + 13 + 15)


def test_cache_survives_between_generate_calls(llama):
    """多轮对话：第二次调用的提示词 = 第一次的提示词 + 回复 + 新问题，命中包括第一次 decode 时写满的块。"""
    engine = PrefixCachingEngine(llama, 30, 4, 2)
    p1 = list(range(100, 107))                                  # 7 个 token
    (out1,), _ = engine.generate([Request(p1, 9, ignore_eos=True)])
    p2 = p1 + out1 + [5, 6, 7]                                  # 第一次写进缓存的是 p1 + out1[:-1] = 15 个 token
    (out2,), st = engine.generate([Request(p2, 4, ignore_eos=True)])
    assert st.cached_tokens == [12]                             # 15 个 token 里的 3 个满块，其中 2 块是 decode 时写满的
    assert_equal_to_step03(llama, [Request(p2, 4, ignore_eos=True)], [out2], [])


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
        requests += parallel_samples(r, 2) if i % 10 == 0 else [r]
    engine = PrefixCachingEngine(tiny.model, num_blocks=14, block_size=4, max_batch_size=12)   # 最大的请求要 11 块
    outputs, st = engine.generate(requests, eos_ids=[1])
    assert st.preemptions > 0 and st.evictions > 0 and sum(st.cached_tokens) > 0
    assert_equal_to_step03(tiny.model, requests, outputs, [1])
    assert_idle(engine)


# ---------- 命令行（真实模型） ----------

def test_run_py_n_samples(real):
    """--n 2 --json：结果按提示词排列、带 cached_tokens；第二个样本命中提示词的整块；每个样本等于 step03 用种子
    5、6 单独生成（--no-prefix-cache 的等价性在 test_no_prefix_cache_is_step05_exactly 里测）。"""
    args = ["--prompt", "Write a haiku about the sea.", "--chat", "--n", "2", "--temperature", "0.8", "--seed", "5",
            "--max-new-tokens", "8", "--ignore-eos", "--block-size", "4", "--json"]
    r = run_py("step06_prefix_cache", *args)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])["results"]
    ids = real.encode("Write a haiku about the sea.", chat=True)
    assert [x["prompt_ids"] for x in res] == [ids, ids]
    assert [x["cached_tokens"] for x in res] == [0, (len(ids) - 1) // 4 * 4]
    for k, x in enumerate(res):
        ref = generate_single(real.model, ids, 8, SamplingParams(temperature=0.8, seed=5 + k), real.tok.eos_ids,
                              ignore_eos=True)
        assert x["output_ids"] == ref


def test_run_py_bad_n_is_a_user_error():
    r = run_py("step06_prefix_cache", "--prompt", "hi", "--n", "0")
    assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr
