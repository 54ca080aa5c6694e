"""step13：块缓存（chunk_cache.py）与非前缀复用（blend.py）。随机小模型，几秒一个。

参考 K/V 来自 HF transformers（不是我们写的前向）：段单独算 = HF 在那几个位置上的前向，完整 prefill = HF 的整段前向，
concat / reuse 的问题部分 = HF 接着拼好的缓存往下算。两端的恒等式：blend 的 r = 0 与 reuse 逐位相同，r = 1 就是完整
prefill；中间的 r 离完整 prefill 比 reuse 近。RoPE 的再旋转与在新位置单独算相同；concat（位置不修）与完整 prefill
明显不同。块缓存：按 LRU 驱逐，从不驱逐正在用的段，失效的段不留在表里。引擎：拼段的 prefill 记在这一步的 token 预算里，
出错只结束那一个请求。坏输入：一行 UserError 说出字段。
"""
import math

import pytest
import torch

from common.errors import UserError
from common.hf_reference import hf_greedy, load_hf_model
from step04_static_batching.request import Request
from step13_kv_blend import blend as blend_mod
from step13_kv_blend import engine as step13
from step13_kv_blend.blend import (CHECK_LAYER, blend_prefill, check_chunks, check_model, check_ratio, chunk_kv,
                                   rerotate)
from step13_kv_blend.block_manager import BlockManager
from step13_kv_blend.chunk_cache import ChunkStore, read_kv

from conftest import make_tiny_model_dir, one_arch


@pytest.fixture(autouse=True)
def inference_mode():
    """引擎在 inference_mode 里跑；这里的张量（chunk_kv 的结果）也要在里面改。"""
    with torch.inference_mode():
        yield


_HF: dict = {}


def hf_of(tiny):
    """同一个小模型的 HF transformers 版本（每个架构加载一次）。"""
    if tiny.path not in _HF:
        _HF[tiny.path] = load_hf_model(tiny.path, "cpu", torch.float32)
    return _HF[tiny.path]


def hf_forward(hf, ids, start: int = 0, past=None):
    """HF 前向 ids（位置 start..，接在缓存 past (layers, 2, H_kv, S, D) 后面：start 必须 = S）→
    (缓存里全部的 K/V (layers, 2, H_kv, S + n, D)，最后一个位置的 logits (V,))。"""
    from transformers import DynamicCache
    cache = DynamicCache(config=hf.config)
    if past is not None:
        assert past.shape[3] == start
        for layer, kv in enumerate(past):
            cache.update(kv[0][None].clone(), kv[1][None].clone(), layer)
    out = hf(torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None], cache=cache, use_cache=True)
    kv = torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers])
    return kv, out.logits[0, -1].float()


def rag_prompt(vocab: int, sizes=(11, 7, 13), suffix: int = 5, seed: int = 1):
    """几段"文档" + 一个"问题"：返回 token id 与各段的 [start, end)。"""
    g = torch.Generator().manual_seed(seed)
    ids, chunks = [], []
    for n in sizes:
        chunks.append((len(ids), len(ids) + n))
        ids += torch.randint(2, vocab, (n,), generator=g).tolist()
    ids += torch.randint(2, vocab, (suffix,), generator=g).tolist()
    return ids, chunks


def reused_kv(hf, ids, chunks, rotate: bool):
    """每段单独算（HF），放到它在提示词里的位置：rotate 时就在那几个位置上算（reuse / blend 该拿到的），
    否则在位置 0..（块缓存存的样子，concat 原样拼上的）。没有段的位置是 0。"""
    kv, reused = None, torch.zeros(len(ids), dtype=torch.bool)
    for s, e in chunks:
        c, _ = hf_forward(hf, ids[s:e], start=s if rotate else 0)            # (layers, 2, H_kv, e − s, D)
        if kv is None:
            kv = torch.zeros(*c.shape[:3], len(ids), c.shape[4])
        kv[:, :, :, s:e], reused[s:e] = c, True
    return kv, reused


def full_prefill(hf, ids):
    """完整 prefill（HF）的 K/V 与最后一个位置的 logits。"""
    return hf_forward(hf, ids)


def test_rerotate_equals_rope_at_offset(tiny):
    """同一段在位置 0 单独算、K 再转 p，与 HF 直接在 p.. 处算：每一层的 K 都相同（V 本来就相同）。
    RoPE 的分数只依赖相对距离，所以深层的隐藏状态也不随起点变，差别只有浮点误差。"""
    ids = list(range(3, 40))
    at0 = chunk_kv(tiny.model, ids)
    for p in (1, 17, 300):
        at_p, _ = hf_forward(hf_of(tiny), ids, start=p)
        moved = rerotate(at0[:, 0], p, tiny.model)
        dk, dv = (moved - at_p[:, 0]).abs().max().item(), (at0[:, 1] - at_p[:, 1]).abs().max().item()
        print(f"{tiny.arch} offset {p}: max |R(p)K_0 - K_p| = {dk:.2e}, max |V_0 - V_p| = {dv:.2e}")
        assert dk < 1e-4 and dv < 1e-4
        assert (at0[:, 0] - at_p[:, 0]).abs().max() > 1e-2        # 不转就不同：这个检查能失败


def test_blend_r0_equals_reuse_exactly(tiny):
    ids, chunks = rag_prompt(tiny.cfg.vocab_size)
    kv, reused = reused_kv(hf_of(tiny), ids, chunks, rotate=True)
    a = blend_prefill(tiny.model, ids, kv, reused, "reuse")
    b = blend_prefill(tiny.model, ids, kv, reused, "blend", ratio=0.0)
    assert b.probe_tokens == 0                                     # 一个也不选：检查段不跑
    assert torch.equal(a.kv, b.kv) and torch.equal(a.logits, b.logits)
    assert a.recomputed_tokens == b.recomputed_tokens == 5         # 只有问题部分
    small = blend_prefill(tiny.model, ids, kv, reused, "blend", ratio=0.03)   # 0.03 × 31 不到 1 个：也一个不选
    assert small.probe_tokens == 0 and torch.equal(small.kv, a.kv)
    assert blend_mod.blend_cost(len(ids), int(reused.sum()), "blend", 0.0, tiny.cfg.num_layers) == 5


def test_blend_r1_equals_full_prefill(tiny):
    ids, chunks = rag_prompt(tiny.cfg.vocab_size)
    kv, reused = reused_kv(hf_of(tiny), ids, chunks, rotate=True)
    full_kv, full_logits = full_prefill(hf_of(tiny), ids)
    r = blend_prefill(tiny.model, ids, kv, reused, "blend", ratio=1.0)
    assert r.recomputed_tokens == len(ids) and r.probe_tokens == len(ids)
    print(f"{tiny.arch}: r=1 vs full: KV {(r.kv - full_kv).abs().max():.2e}, logits {(r.logits - full_logits).abs().max():.2e}")
    torch.testing.assert_close(r.kv, full_kv, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(r.logits, full_logits, rtol=1e-4, atol=1e-5)
    assert r.logits.argmax() == full_logits.argmax()


def test_blend_intermediate_r_moves_toward_full_prefill(tiny):
    """中间的 r：选中的 token 在第 0 层到检查层与完整 prefill（HF）的 K/V 相同——它们的输入只经过第 0 层的注意力，
    而第 0 层复用的 K/V 转过位置就是精确的；这个 2 层的小模型上就是全部层。没选中的保持复用的。所以 r 越大，
    整个请求的 K/V 离完整 prefill 越近，每一档都比 reuse 近。"""
    hf = hf_of(tiny)
    ids, chunks = rag_prompt(tiny.cfg.vocab_size)
    kv, reused = reused_kv(hf, ids, chunks, rotate=True)
    full_kv, _ = full_prefill(hf, ids)
    L = CHECK_LAYER + 1
    err = [(blend_prefill(tiny.model, ids, kv, reused, "reuse").kv - full_kv).norm().item()]
    for ratio in (0.2, 0.5, 0.8):
        res = blend_prefill(tiny.model, ids, kv, reused, "blend", ratio=ratio)
        sel, keep = res.selected, reused & ~res.selected
        assert sel[~reused].all() and int((sel & reused).sum()) == math.floor(ratio * int(reused.sum()))
        torch.testing.assert_close(res.kv[:L, :, :, sel], full_kv[:L, :, :, sel], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res.kv[:, :, :, keep], kv[:, :, :, keep], rtol=0, atol=0)   # 没选中的：复用的原样
        err.append((res.kv - full_kv).norm().item())
    print(f"{tiny.arch}: |KV - full| for reuse, r = 0.2, 0.5, 0.8: {err}")
    assert all(a > b for a, b in zip(err, err[1:]))


def test_reuse_and_concat_differ_from_full(tiny):
    """reuse 缺跨段注意力（第 1 层起就不同），concat 连位置也错了：都与完整 prefill 不同，concat 错得更多。
    第一段从位置 0 开始、前面没有别的：它的 K/V 与完整 prefill 的相同（这就是前缀缓存精确的原因）。"""
    ids, chunks = rag_prompt(tiny.cfg.vocab_size)
    full_kv, full_logits = full_prefill(hf_of(tiny), ids)
    out = {}
    for mode in ("concat", "reuse"):
        kv, reused = reused_kv(hf_of(tiny), ids, chunks, rotate=(mode == "reuse"))
        out[mode] = blend_prefill(tiny.model, ids, kv, reused, mode)
        s, e = chunks[0]
        torch.testing.assert_close(out[mode].kv[..., s:e, :], full_kv[..., s:e, :], rtol=1e-4, atol=1e-5)
    err = {m: (r.kv - full_kv).abs().max().item() for m, r in out.items()}
    print(f"{tiny.arch}: max KV error vs full: {err}")
    assert err["reuse"] > 1e-3 and err["concat"] > err["reuse"]
    assert not torch.allclose(out["concat"].logits, full_logits, atol=1e-3)


@one_arch
@pytest.mark.parametrize("deviation_on, layer_kv", [("k", 0), ("v", 1)])
def test_blend_selects_by_deviation(tiny, deviation_on, layer_kv):
    """选中的是检查层偏差最大的：给一段复用的 K（或 V）故意加大误差，按同一个比较时，r 小到只选几个时选中的全在那一段。"""
    ids, chunks = rag_prompt(tiny.cfg.vocab_size)
    kv, reused = reused_kv(hf_of(tiny), ids, chunks, rotate=True)
    s, e = chunks[1]
    kv[CHECK_LAYER, layer_kv, :, s:e] += 5.0
    r = blend_prefill(tiny.model, ids, kv, reused, "blend", ratio=0.2, deviation_on=deviation_on)
    picked = r.selected[:-5].nonzero()[:, 0]
    assert len(picked) == int(0.2 * 31) and ((picked >= s) & (picked < e)).all()


def test_blend_ratio_rounds_the_written_decimal(tiny):
    """⌊r × 复用数⌋ 按写出来的 r 算：0.29 × 100 个复用的 token 选 29 个（二进制浮点里 0.29 * 100 = 28.999…）。"""
    ids, chunks = rag_prompt(tiny.cfg.vocab_size, sizes=(50, 50), suffix=5)
    kv, reused = reused_kv(hf_of(tiny), ids, chunks, rotate=True)
    assert 0.29 * 100 < 29
    for ratio, want in ((0.29, 29), (0.57, 57), (0.15, 15), (1.0, 100)):
        assert blend_prefill(tiny.model, ids, kv, reused, "blend", ratio=ratio).recomputed_tokens == want + 5


# ---- 块缓存 ----
def small_store(num_blocks=6, bs=4):
    bm = BlockManager(num_blocks, bs)
    pool = torch.zeros(2, 2, num_blocks + 1, 1, bs, 3)             # (layers, 2, blocks + 1, H_kv, bs, D)
    return bm, ChunkStore(bm, pool)


def kv_of(n, value):
    return torch.full((2, 2, 1, n, 3), float(value))


def test_chunk_store_roundtrip_and_key_is_position_free():
    bm, store = small_store()
    a = store.put([5, 6, 7, 8, 9], kv_of(5, 1) + torch.arange(5.0)[:, None])
    assert a is not None and len(a.blocks) == 2 and all(bm.ref_counts[b] == 1 for b in a.blocks)
    torch.testing.assert_close(store.read(a), kv_of(5, 1) + torch.arange(5.0)[:, None])
    store.release(a)
    assert all(bm.ref_counts[b] == 0 for b in a.blocks) and bm.num_free_blocks == 6   # 没人用：可以驱逐
    again = store.lookup((5, 6, 7, 8, 9))                           # 同样的 token：命中（key 与位置无关）
    assert again is a and store.hits == 1
    assert store.lookup([5, 6, 7, 8]) is None                       # 少一个 token：另一段
    store.release(again)


def test_chunk_store_evicts_lru_never_in_use():
    bm, store = small_store()                                      # 6 块，每段 2 块
    A = store.put(range(10, 18), kv_of(8, 1))
    store.release(A)
    B = store.put(range(20, 28), kv_of(8, 2))
    store.release(B)
    C = store.put(range(30, 38), kv_of(8, 3))                       # C 一直在用
    assert store.lookup(range(10, 18)) is A                         # A 又被用了：现在 B 最久没用
    D = store.put(range(40, 48), kv_of(8, 4))                       # 池子满：只能驱逐没人用的 B
    assert D is not None and store.lookup(range(20, 28)) is None
    for e, v in ((A, 1), (C, 3), (D, 4)):                           # 在用的段一个字节都没动
        torch.testing.assert_close(store.read(e), kv_of(8, v))
    assert store.put(range(50, 58), kv_of(8, 5)) is None            # 全在用：存不下，也不驱逐任何在用的
    store.release(A)
    store.release(C)                                                # A 先放下：A 最久没用
    assert bm.allocate(1) and store.lookup(range(10, 18)) is None   # 普通的分配（请求要块）也按同一条 LRU 驱逐
    E = store.lookup(range(30, 38))
    assert E is C
    torch.testing.assert_close(read_kv(store.pool, C.blocks, 8), kv_of(8, 3))
    store.release(C)
    store.release(D)
    with pytest.raises(RuntimeError):
        store.release(D)


def test_chunk_store_partly_evicted_chunk_is_freed_whole():
    bm, store = small_store()
    A = store.put(range(10, 18), kv_of(8, 1))
    store.release(A)
    bm.allocate(5)                                                  # 空块 4 个 + 驱逐 A 的最后一块
    assert store.lookup(range(10, 18)) is None                      # A 缺了一块：失效
    assert len(bm.free_blocks) == 1 and not bm.evictable            # 它剩下的那块直接回到空闲链表


def test_chunk_store_forgets_evicted_chunks():
    """LRU 驱逐了段的块，表里也不再留它：一直存新段（服务器一直跑），条目数不超过池子的块数，留下的段都完整。"""
    bm, store = small_store()                                      # 6 块，每段 2 块：最多 3 段
    for i in range(40):
        e = store.put(range(100 + 8 * i, 108 + 8 * i), kv_of(8, i))
        store.release(e)
    assert len(store.entries) == 3 and all(store._valid(e) for e in store.entries.values())
    assert {e.token_ids[0] for e in store.entries.values()} == {100 + 8 * i for i in (37, 38, 39)}   # 最近的三段
    assert store.lookup(range(100, 108)) is None
    store.release(store.lookup(range(412, 420)))
    bm.allocate(6)                                                 # 请求要块把段全挤掉：下次存段时表里只剩新的那一段
    bm.free(list(range(6)))
    e = store.put(range(900, 904), kv_of(4, 1))
    assert list(store.entries.values()) == [e]


# ---- 坏输入 ----
@pytest.mark.parametrize("chunks, match", [
    ([(0, 5), (4, 8)], r"chunks\[1\].*overlap"),
    ([(4, 8), (0, 3)], r"chunks\[1\].*overlap"),
    ([(3, 3)], r"chunks\[0\].*start < end"),
    ([(-1, 3)], r"chunks\[0\]"),
    ([(0, 11)], r"chunks\[0\].*longer than the prompt \(10 tokens\)"),
    ([(0, 2, 3)], r"chunks\[0\] must be a pair"),
    (["ab"], r"chunks\[0\] must be a pair"),
])
def test_bad_chunk_marks(chunks, match):
    with pytest.raises(UserError, match=match):
        check_chunks(chunks, 10)


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan"), "0.3", True])
def test_bad_ratio(ratio):
    with pytest.raises(UserError, match="recompute_ratio"):
        check_ratio(ratio)


def test_blend_refuses_a_one_layer_model(tmp_path):
    from common.weights import load_model
    model = load_model(make_tiny_model_dir(tmp_path, num_hidden_layers=1), "cpu", torch.float32)
    with pytest.raises(UserError, match="more than 1 layer"):
        check_model(model)
    with pytest.raises(UserError, match="more than 1 layer"):    # 引擎构造时就查
        step13.LLMEngine(model, step13.EngineConfig(16, 4, blend="reuse"))


# ---- 引擎 ----


def rag_requests(vocab, n_docs=4, doc_len=(9, 23), q_len=6, n_req=3, seed=3, max_new=8):
    """共享同一组"文档"、顺序各不相同的几个请求：token id、各自的段、问题。"""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(2, vocab, (int(torch.randint(*doc_len, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n_docs)]
    reqs, marks = [], []
    for r in range(n_req):
        order = torch.randperm(n_docs, generator=g).tolist()[:3]
        ids, chunks = [], []
        for d in order:
            chunks.append((len(ids), len(ids) + len(docs[d])))
            ids += docs[d]
        ids += torch.randint(2, vocab, (q_len,), generator=g).tolist()
        reqs.append(Request(ids, max_new, ignore_eos=True))
        marks.append(chunks)
    return reqs, marks


def run13(model, reqs, marks, **cfg):
    eng = step13.LLMEngine(model, step13.EngineConfig(**{**dict(num_blocks=64, block_size=4,
                                                               max_num_batched_tokens=32), **cfg}))
    return eng, eng.generate(reqs, marks).outputs


def all_blocks_back(eng):
    bm = eng.block_manager
    assert all(r == 0 for r in bm.ref_counts) and bm.num_free_blocks == bm.num_blocks


def shared_prefix_requests(vocab: int, max_new: int = 8):
    """四篇文档 A B C D（13、10、9、11 个 token）：请求 1 = A B C 问题，请求 2 = A C D 问题（开头同是 A），
    请求 3 = B A C 问题（也有 A 和 C，但开头不同）。"""
    g = torch.Generator().manual_seed(5)
    A, B, C, D = (torch.randint(2, vocab, (n,), generator=g).tolist() for n in (13, 10, 9, 11))
    reqs, marks = [], []
    for docs in ((A, B, C), (A, C, D), (B, A, C)):
        ids, chunks = [], []
        for d in docs:
            chunks.append((len(ids), len(ids) + len(d)))
            ids += d
        ids += torch.randint(2, vocab, (6,), generator=g).tolist()
        reqs.append(Request(ids, max_new, ignore_eos=True))
        marks.append(chunks)
    return reqs, marks


def test_engine_none_and_prefix_are_exact(tiny):
    """none 与 prefix 都精确：贪心 token 与 HF transformers 的 generate 相同。prefix 真的用了前缀缓存：请求 2 命中
    请求 1 开头那篇 A 的整块（13 个 token 里的 12 个，块大小 4），A 之后那块（A 的最后一个 token + C 的开头）不命中——
    C 请求 1 也算过，可那时它前面是 B；请求 3 也有 A 和 C，开头不同，一块也不命中。none 一块也不读，块缓存都不碰。"""
    reqs, marks = shared_prefix_requests(tiny.cfg.vocab_size)
    hf = hf_of(tiny)
    ref = [hf_greedy(hf, r.prompt_ids, r.max_new_tokens, [], ignore_eos=True) for r in reqs]
    for mode, cached in (("none", [0, 0, 0]), ("prefix", [0, 12, 0])):
        eng = step13.LLMEngine(tiny.model, step13.EngineConfig(64, 4, max_batch_size=1, max_num_batched_tokens=32,
                                                               blend=mode))
        res = eng.generate(reqs, marks)              # 一次一个：请求 1 的块登记好了，请求 2 才来查
        assert res.outputs == ref, mode
        assert res.stats.cached_tokens == cached, mode
        assert len(eng.chunk_store) == 0 and eng.chunk_store.misses == 0
    eng, out = run13(tiny.model, reqs, None, blend="blend")      # 没标段的请求：照 step12（完整 prefill + 前缀缓存）
    assert out == ref and len(eng.chunk_store) == 0


@one_arch
def test_engine_blend_ends(tiny):
    """引擎里：r = 1 与完整 prefill 的贪心 token 相同，r = 0 与 reuse 相同；段存一次、之后命中；块全部还回来，
    拼出来的 K/V 没有登记进前缀缓存。"""
    reqs, marks = rag_requests(tiny.cfg.vocab_size)
    _, full = run13(tiny.model, reqs, marks, blend="none")
    eng, r1 = run13(tiny.model, reqs, marks, blend="blend", recompute_ratio=1.0)
    assert r1 == full
    assert eng.chunk_store.stored == 4 and eng.chunk_store.hits == 9 - 4     # 3 个请求 × 3 段，4 篇不同的文档
    all_blocks_back(eng)
    assert all(r.key not in eng.block_manager.key_to_block or eng.block_manager.cached[b] is r
               for e in eng.chunk_store.entries.values() for b, r in zip(e.blocks, e.records))
    prefix_blocks = [b for b, r in eng.block_manager.cached.items()
                     if all(r is not x for e in eng.chunk_store.entries.values() for x in e.records)]
    assert prefix_blocks == []                                       # 拼出来的请求一块也没登记进前缀缓存
    eng = step13.LLMEngine(tiny.model, step13.EngineConfig(64, 4, max_num_batched_tokens=32, blend="reuse"))
    res = eng.generate(reqs, marks)
    reuse = res.outputs
    assert res.stats.reused_tokens == [sum(e - s for s, e in m) for m in marks]   # 段里的 token 全部复用、一个没重算
    assert res.stats.recomputed_tokens == [0] * len(reqs)
    _, r0 = run13(tiny.model, reqs, marks, blend="blend", recompute_ratio=0.0)
    assert r0 == reuse
    _, concat = run13(tiny.model, reqs, marks, blend="concat")
    assert concat != full


@one_arch
@pytest.mark.parametrize("mode, ratio", [("concat", None), ("reuse", None), ("blend", 0.3)])
def test_engine_writes_the_blended_kv(tiny, mode, ratio):
    """引擎的拼段 prefill 写进请求块里的 K/V，与 HF transformers 独立算出的相同（第一个请求把段存进去，第二个换了
    顺序、全部命中）：
    - concat / reuse：各段由 HF 单独算（concat 在位置 0..，reuse 在它在提示词里的位置），问题部分由 HF 接着这份缓存往下算；
    - blend：2 层的模型上，选中的 token 与问题部分就是 HF 完整 prefill 的（见 test_blend_intermediate_r_moves_toward_full_prefill），
      其余是段单独算的；选中的是检查层上 HF 完整 prefill 的 K 与段单独算的 K 差得最多的 ⌊r × 复用数⌋ 个。"""
    assert tiny.cfg.num_layers == CHECK_LAYER + 1
    hf = hf_of(tiny)
    reqs, marks = rag_requests(tiny.cfg.vocab_size, n_req=2)
    eng = step13.LLMEngine(tiny.model, step13.EngineConfig(64, 4, max_num_batched_tokens=64, max_batch_size=1,
                                                           blend=mode, recompute_ratio=ratio))
    for req, chunks in zip(reqs, marks):
        rid = eng.add_request(req, chunks)
        seq = eng.seqs[rid]
        eng.step()                                               # 接纳：拼段的 prefill + 最后一个提示词 token
        n = len(req.prompt_ids) - 1
        ids, P = req.prompt_ids[:n], chunks[-1][1]               # 段首尾相接从 0 到 P，之后是问题
        got = read_kv(eng.kv_cache.pool, seq.block_table, n)
        alone, reused = reused_kv(hf, ids, chunks, rotate=(mode != "concat"))
        if mode == "blend":
            want, _ = full_prefill(hf, ids)
            dev = ((want[CHECK_LAYER, 0] - alone[CHECK_LAYER, 0]) ** 2).sum(dim=(0, 2))     # (n,)
            dev[~reused] = -math.inf
            top = math.floor(ratio * int(reused.sum()))
            order = dev.sort(descending=True)
            assert order.values[top - 1] - order.values[top] > 1e-3 * order.values[0]   # 第 top 与 top + 1 名不打平
            keep = reused.clone()
            keep[order.indices[:top]] = False
            want[:, :, :, keep] = alone[:, :, :, keep]
        else:
            want, _ = hf_forward(hf, ids[P:], start=P, past=alone[:, :, :, :P])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        while eng.has_unfinished_requests():
            eng.step()
    assert eng.chunk_store.hits == sum(map(len, marks)) - len({c for r, m in zip(reqs, marks) for c in
                                                               (tuple(r.prompt_ids[s:e]) for s, e in m)})
    all_blocks_back(eng)


@one_arch
@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_engine_chunk_store_under_memory_pressure(tiny, preempt):
    """池子小：存的段被请求要的块挤掉（同一条 LRU），请求被抢占（重算时再拼一次，换出时带着拼好的 K/V），
    输出与池子够大时相同，块一个不少地还回来。预算 64：一步接纳得下几个拼段的请求，池子才挤得满。"""
    reqs, marks = rag_requests(tiny.cfg.vocab_size, n_docs=6, n_req=6, max_new=24)
    _, ref = run13(tiny.model, reqs, marks, blend="reuse")
    eng = step13.LLMEngine(tiny.model, step13.EngineConfig(30, 4, max_batch_size=3, max_num_batched_tokens=64,
                                                           blend="reuse", preempt=preempt))
    res = eng.generate(reqs, marks)
    assert res.outputs == ref
    assert res.stats.preemptions > 0 and eng.block_manager.num_evictions > 0
    all_blocks_back(eng)


def meter(monkeypatch, model) -> dict:
    """数真正算了多少，不看引擎自己的账：单独算的段（chunk_kv）每个 token 走全部层；blend_prefill 重算的 token 走全部层、
    检查段的 token 走前 CHECK_LAYER 层。layer_tokens 按"token × 层"数；charge 按引擎的折算（检查段 ⌈n·CHECK_LAYER / L⌉）。"""
    L, work = model.cfg.num_layers, {"layer_tokens": 0, "charge": 0, "blends": 0}
    chunk_kv0, blend_prefill0 = blend_mod.chunk_kv, step13.blend_prefill

    def chunk_kv_counted(model, token_ids, start=0):
        work["layer_tokens"] += L * len(token_ids)
        work["charge"] += len(token_ids)
        return chunk_kv0(model, token_ids, start)

    def blend_prefill_counted(*args, **kwargs):
        res = blend_prefill0(*args, **kwargs)
        work["layer_tokens"] += L * res.recomputed_tokens + CHECK_LAYER * res.probe_tokens
        work["charge"] += res.recomputed_tokens + -(-res.probe_tokens * CHECK_LAYER // L)
        work["blends"] += 1
        return res

    monkeypatch.setattr(blend_mod, "chunk_kv", chunk_kv_counted)
    monkeypatch.setattr(step13, "blend_prefill", blend_prefill_counted)
    return work


def metered_steps(eng, work):
    """一步一步跑完：每一步 (这一步的 StepStats，算了多少 token × 层（前向 + 拼段），其中拼段的折算，做了几个拼段，输出)。"""
    L = eng.model.cfg.num_layers
    while eng.has_unfinished_requests():
        before, steps = dict(work), eng.num_steps
        outs = eng.step()
        if eng.num_steps == steps:                 # 只交了 abort / 出错的结果，没有前向
            continue
        st = eng.step_stats[-1]
        yield (st, L * st.tokens + work["layer_tokens"] - before["layer_tokens"], work["charge"] - before["charge"],
               work["blends"] - before["blends"], outs)


def warm_chunks(eng, reqs, marks):
    for r, m in zip(reqs, marks):
        for s, e in m:
            eng.chunk_store.release(eng.chunk_store.put(r.prompt_ids[s:e], chunk_kv(eng.model, r.prompt_ids[s:e])))


@one_arch
def test_engine_blend_prefill_counts_against_the_budget(tiny, monkeypatch):
    """几个拼段的请求在别的请求 decode 时一起到达：每一步（前向 + 接纳时拼段的 prefill）算的不超过 token 预算——
    拼段的 prefill 一步一个地做，decode 不被几个拼段的 prefill 一起卡住。"算了多少"由 chunk_kv / blend_prefill 的调用
    数出来（meter），引擎的账（BlendStepStats.blend_tokens）与它一致。"""
    budget, L = 64, tiny.cfg.num_layers
    reqs, marks = rag_requests(tiny.cfg.vocab_size, n_req=3, max_new=4)
    eng = step13.LLMEngine(tiny.model, step13.EngineConfig(128, 4, max_num_batched_tokens=budget, blend="blend",
                                                           recompute_ratio=0.2))
    warm_chunks(eng, reqs, marks)                  # 每个请求只剩问题部分、选中的与检查段：一个放得进预算，三个放不进
    work = meter(monkeypatch, tiny.model)
    plain = eng.add_request(Request(list(range(2, 22)), 30, ignore_eos=True))
    while not eng.seqs[plain].output_ids:
        eng.step()
    for r, m in zip(reqs, marks):
        eng.add_request(r, m)
    blend_steps = 0
    for st, layer_tokens, charge, blends, _ in metered_steps(eng, work):
        assert layer_tokens <= L * budget
        assert st.blend_tokens == charge and st.tokens + st.blend_tokens <= budget
        if blends:
            blend_steps += 1
            assert blends == 1 and st.decode_tokens >= 1       # 同一步里那个 decode 照常
    assert blend_steps == 3 and work["blends"] == 3
    all_blocks_back(eng)


@one_arch
def test_engine_oversized_blend_runs_alone(tiny, monkeypatch):
    """拼段 prefill 比整个预算还大（块缓存是冷的：三段都要单独算）：它分不开，所以等到这一步什么别的都不做时才接纳
    （先来先服务：正在 decode 的请求先做完），那一步只算它和它的最后一个提示词 token。输出与单独跑它时相同。"""
    budget, L = 32, tiny.cfg.num_layers
    reqs, marks = rag_requests(tiny.cfg.vocab_size, n_req=1, max_new=4)
    _, alone = run13(tiny.model, reqs, marks, blend="reuse")
    eng = step13.LLMEngine(tiny.model, step13.EngineConfig(128, 4, max_num_batched_tokens=budget, blend="reuse"))
    work = meter(monkeypatch, tiny.model)
    plain = eng.add_request(Request(list(range(2, 22)), 12, ignore_eos=True))
    while not eng.seqs[plain].output_ids:
        eng.step()
    rid = eng.add_request(reqs[0], marks[0])
    out = []
    for st, layer_tokens, charge, blends, outs in metered_steps(eng, work):
        out += [t for o in outs if o.request_id == rid for t in o.new_token_ids]
        if blends:
            assert plain not in eng.seqs                        # decode 的请求已经做完
            assert st.tokens == 1 and st.decode_tokens == 0 and st.blend_tokens == charge > budget
            assert layer_tokens > L * budget
        else:
            assert layer_tokens <= L * budget
    assert work["blends"] == 1 and out == alone[0]
    all_blocks_back(eng)


@one_arch
@pytest.mark.parametrize("where", ["reuse_chunks", "blend_prefill", "write_kv"])
def test_engine_blend_error_ends_only_its_request(tiny, monkeypatch, where):
    """拼段的 prefill 出错（注入：第二个拼段请求的 reuse_chunks / blend_prefill / write_kv 抛异常）：只有它以 error 结束、
    带着那个异常，别的请求照常生成、与没出错时相同；块一个不少地还回来，块缓存里的段没人还持有。"""
    reqs, marks = rag_requests(tiny.cfg.vocab_size, n_req=3)
    reqs, marks = reqs + [Request(list(range(2, 22)), 8, ignore_eos=True)], marks + [None]
    cfg = step13.EngineConfig(64, 4, max_num_batched_tokens=32, blend="blend", recompute_ratio=0.3)
    ref = step13.LLMEngine(tiny.model, cfg).generate(reqs, marks).outputs
    eng = step13.LLMEngine(tiny.model, cfg)
    original, calls = getattr(step13, where), []

    def failing(*args, **kwargs):
        calls.append(where)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return original(*args, **kwargs)

    monkeypatch.setattr(step13, where, failing)
    rids = [eng.add_request(r, m) for r, m in zip(reqs, marks)]
    got, ends = {rid: [] for rid in rids}, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
            if o.finished:
                ends[o.request_id] = (o.finish_reason, o.error)
    reason, error = ends[rids[1]]
    assert reason == "error" and str(error) == "injected" and got[rids[1]] == []
    for i in (0, 2, 3):
        assert ends[rids[i]] == ("length", None) and got[rids[i]] == ref[i]
    all_blocks_back(eng)
    assert all(e.users == 0 for e in eng.chunk_store.entries.values())


@one_arch
def test_engine_deviation_on_v(tiny):
    """--deviation-on v 传到了 blend：块缓存里一段第 1 层的 V 故意加大误差，按 V 比较时引擎选中重算的全在这一段（写进
    请求块里的那几列 V 被新算的盖掉），按 K（默认）比较时不是。"""
    reqs, marks = rag_requests(tiny.cfg.vocab_size, n_req=1)
    req, chunks = reqs[0], marks[0]
    n, (s, e) = len(req.prompt_ids) - 1, chunks[1]
    top = math.floor(0.2 * sum(b - a for a, b in chunks))
    replaced = {}
    for dev in ("v", None):
        eng = step13.LLMEngine(tiny.model, step13.EngineConfig(64, 4, max_num_batched_tokens=128, blend="blend",
                                                               recompute_ratio=0.2, deviation_on=dev))
        for a, b in chunks:
            kv = chunk_kv(tiny.model, req.prompt_ids[a:b])
            if a == s:
                kv[CHECK_LAYER, 1] += 5.0
                stored_v = kv[CHECK_LAYER, 1].clone()           # V 不转位置：复用的就是存着的
            eng.chunk_store.release(eng.chunk_store.put(req.prompt_ids[a:b], kv))
        rid = eng.add_request(req, chunks)
        eng.step()
        got = read_kv(eng.kv_cache.pool, eng.seqs[rid].block_table, n)
        replaced[dev] = int(((got[CHECK_LAYER, 1, :, s:e] - stored_v).abs().amax(dim=(0, 2)) > 1.0).sum())
    assert top <= e - s and replaced["v"] == top and replaced[None] < top
    assert step13.EngineConfig(64, 4, blend="blend").deviation == "k"


@pytest.mark.parametrize("cfg, match", [
    (dict(blend="blend", kv_policy="window", kv_budget=16), "--blend blend cannot be combined with --kv-policy window"),
    (dict(blend="reuse", recompute_ratio=0.3), "--recompute-ratio is only used with --blend blend"),
    (dict(blend="blend", recompute_ratio=1.5), "recompute_ratio must be in"),
    (dict(blend="prefix", enable_prefix_caching=False), "--blend prefix needs the prefix cache"),
    (dict(blend="concat", kv_dtype="int8"), "--blend concat needs the model's dtype"),
    (dict(blend="mix"), "unknown --blend"),
    (dict(blend="reuse", deviation_on="v"), "--deviation-on is only used with --blend blend"),
    (dict(blend="blend", deviation_on="q"), "unknown --deviation-on 'q'"),
])
def test_engine_config_errors(cfg, match):
    with pytest.raises(UserError, match=match):
        step13.EngineConfig(64, 4, **cfg).validate()


@one_arch
def test_engine_bad_chunk_marks(tiny):
    eng = step13.LLMEngine(tiny.model, step13.EngineConfig(64, 4, blend="blend"))
    with pytest.raises(UserError, match=r"chunks\[1\].*overlap"):
        eng.add_request(Request(list(range(2, 20)), 4), [(0, 8), (6, 12)])
    with pytest.raises(UserError, match=r"chunks\[0\].*longer than the prompt"):
        eng.add_request(Request(list(range(2, 20)), 4), [(0, 30)])
    with pytest.raises(UserError, match="prompt_logprobs"):
        eng.add_request(Request(list(range(2, 20)), 4, prompt_logprobs=1), [(0, 8)])
    assert not eng.has_unfinished_requests()


# ---- run.py ----
def test_run_py_generation_modes(tiny_tok_dir):
    import json

    from conftest import run_py
    base = ["--model", str(tiny_tok_dir), "--doc", "Freedonia's capital is Fredville.\n",
            "--doc", "Sylvania exports cheese and tin.\n", "--prompt", "What does Sylvania export?",
            "--prompt", "Name the capital.", "--rotate-docs", "--max-new-tokens", "6", "--ignore-eos", "--json",
            "--num-blocks", "64"]
    res = {}
    for mode in (["none"], ["blend", "--recompute-ratio", "1"]):
        r = run_py("step13_kv_blend", *base, "--blend", *mode)
        assert r.returncode == 0, r.stderr[-2000:]
        res[mode[0]] = json.loads(r.stdout.strip().splitlines()[-1])
    outs = {m: [x["output_ids"] for x in j["results"]] for m, j in res.items()}
    assert outs["none"] == outs["blend"]
    b = res["blend"]["results"]
    lens = [[e - s for s, e in x["chunks"]] for x in b]
    assert b[0]["chunks"][0][0] == 0 and lens[0] == lens[1][::-1]      # --rotate-docs：第二个提示词的文档顺序反过来
    assert res["blend"]["stats"]["chunks_stored"] == 2 and res["blend"]["stats"]["chunk_hits"] == 2
    assert all(x["reused_tokens"] == 0 for x in res["none"]["results"])
    assert all(x["reused_tokens"] == 0 and x["recomputed_tokens"] > 0 for x in b)   # r = 1：段里全部重算
    plain = ["--model", str(tiny_tok_dir), "--prompt", "Sylvania exports cheese.", "--max-new-tokens", "6",
             "--ignore-eos", "--json", "--num-blocks", "64"]
    a, c = run_py("step12_kv_eviction", *plain), run_py("step13_kv_blend", *plain, "--blend", "none")
    assert a.returncode == c.returncode == 0, (a.stderr[-1000:], c.stderr[-1000:])
    ja, jc = (json.loads(x.stdout.strip().splitlines()[-1]) for x in (a, c))
    assert [x["output_ids"] for x in ja["results"]] == [x["output_ids"] for x in jc["results"]]
    assert [x["kv_blocks"] for x in ja["results"]] == [x["kv_blocks"] for x in jc["results"]]


@pytest.mark.parametrize("extra, match", [
    (["--doc", "a", "--blend", "blend", "--kv-policy", "window", "--kv-budget", "32", "--spec-method", "none"], "--blend blend cannot be combined"),
    (["--doc", "a", "--blend", "blend", "--recompute-ratio", "2"], "recompute_ratio must be in"),
    (["--doc", "a", "--recompute-ratio", "0.5"], "--recompute-ratio is only used with --blend blend"),
    (["--doc", "a", "--deviation-on", "v"], "--deviation-on is only used with --blend blend"),
    (["--doc", "a", "--chunk-sep", "#"], "either with --doc or with --chunk-sep"),
    (["--chunk-sep", "#"], "must split it into non-empty chunks"),
    (["--doc", "a", "--blend", "reuse", "--no-chunked-prefill"], "drop --no-chunked-prefill"),
])
def test_run_py_errors(tiny_tok_dir, capsys, extra, match):
    from conftest import cli_error

    import step13_kv_blend.run as run
    line = cli_error(run, ["--model", str(tiny_tok_dir), "--prompt", "q?", *extra], capsys)
    assert match in line
