"""step13：块缓存（chunk_cache.py）与非前缀复用（blend.py）。随机小模型，几秒一个。

两端的恒等式：blend 的 r = 0 与 reuse 逐位相同，r = 1 就是完整 prefill；RoPE 的再旋转与在新位置单独算相同；
concat（位置不修）与完整 prefill 明显不同。块缓存：按 LRU 驱逐，从不驱逐正在用的段。坏输入：一行 UserError 说出字段。
"""
import pytest
import torch

from common.errors import UserError
from step04_static_batching.request import Request
from step12_kv_eviction import engine as step12
from step13_kv_blend import engine as step13
from step13_kv_blend.blend import blend_prefill, check_chunks, check_model, check_ratio, chunk_kv, rerotate
from step13_kv_blend.block_manager import BlockManager
from step13_kv_blend.chunk_cache import ChunkStore, read_kv

from conftest import make_tiny_model_dir, one_arch


@pytest.fixture(autouse=True)
def inference_mode():
    """引擎在 inference_mode 里跑；这里的张量（chunk_kv 的结果）也要在里面改。"""
    with torch.inference_mode():
        yield


def rag_prompt(vocab: int, sizes=(11, 7, 13), suffix: int = 5, seed: int = 1):
    """几段"文档" + 一个"问题"：返回 token id 与各段的 [start, end)。"""
    g = torch.Generator().manual_seed(seed)
    ids, chunks = [], []
    for n in sizes:
        chunks.append((len(ids), len(ids) + n))
        ids += torch.randint(2, vocab, (n,), generator=g).tolist()
    ids += torch.randint(2, vocab, (suffix,), generator=g).tolist()
    return ids, chunks


def reused_kv(model, ids, chunks, rotate: bool):
    """每段单独算（位置 0..n−1，块缓存存的样子），放到它在提示词里的位置；rotate：K 转到新位置。"""
    full = chunk_kv(model, ids)                                    # 只借它的形状
    kv, reused = torch.zeros_like(full), torch.zeros(len(ids), dtype=torch.bool)
    for s, e in chunks:
        c = chunk_kv(model, ids[s:e])                              # (layers, 2, H_kv, n, D)
        if rotate:
            c[:, 0] = rerotate(c[:, 0], s, model)
        kv[:, :, :, s:e], reused[s:e] = c, True
    return kv, reused


def full_prefill(model, ids):
    """完整 prefill 的 K/V（整段单独算就是完整 prefill）与最后一个位置的 logits。"""
    x = torch.tensor([ids])
    logits = model(x, torch.arange(len(ids))[None], last_only=True)[0, 0]
    return chunk_kv(model, ids), logits


def test_rerotate_equals_rope_at_offset(tiny):
    """同一段在位置 0 单独算、K 再转 p，与直接在 p.. 处单独算：每一层的 K 都相同（V 本来就相同）。
    RoPE 的分数只依赖相对距离，所以深层的隐藏状态也不随起点变，差别只有浮点误差。"""
    ids = list(range(3, 40))
    at0 = chunk_kv(tiny.model, ids)
    for p in (1, 17, 300):
        at_p = chunk_kv(tiny.model, ids, start=p)
        moved = rerotate(at0[:, 0], p, tiny.model)
        dk, dv = (moved - at_p[:, 0]).abs().max().item(), (at0[:, 1] - at_p[:, 1]).abs().max().item()
        print(f"{tiny.arch} offset {p}: max |R(p)K_0 - K_p| = {dk:.2e}, max |V_0 - V_p| = {dv:.2e}")
        assert dk < 1e-4 and dv < 1e-4
        assert (at0[:, 0] - at_p[:, 0]).abs().max() > 1e-2        # 不转就不同：这个检查能失败


def test_blend_r0_equals_reuse_exactly(tiny):
    ids, chunks = rag_prompt(tiny.cfg.vocab_size)
    kv, reused = reused_kv(tiny.model, ids, chunks, rotate=True)
    a = blend_prefill(tiny.model, ids, kv, reused, "reuse")
    b = blend_prefill(tiny.model, ids, kv, reused, "blend", ratio=0.0)
    assert b.probe_tokens == len(ids)                              # blend 照样算了检查层（然后一个也没选）
    assert torch.equal(a.kv, b.kv) and torch.equal(a.logits, b.logits)
    assert a.recomputed_tokens == b.recomputed_tokens == 5         # 只有问题部分


def test_blend_r1_equals_full_prefill(tiny):
    ids, chunks = rag_prompt(tiny.cfg.vocab_size)
    kv, reused = reused_kv(tiny.model, ids, chunks, rotate=True)
    full_kv, full_logits = full_prefill(tiny.model, ids)
    r = blend_prefill(tiny.model, ids, kv, reused, "blend", ratio=1.0)
    assert r.recomputed_tokens == len(ids)
    print(f"{tiny.arch}: r=1 vs full: KV {(r.kv - full_kv).abs().max():.2e}, logits {(r.logits - full_logits).abs().max():.2e}")
    torch.testing.assert_close(r.kv, full_kv, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(r.logits, full_logits, rtol=1e-4, atol=1e-5)
    assert r.logits.argmax() == full_logits.argmax()
    # 中间的 r：只重算一部分，介于两者之间；重算的 token 正是选中的那些
    mid = blend_prefill(tiny.model, ids, kv, reused, "blend", ratio=0.5)
    assert mid.recomputed_tokens == 5 + int(0.5 * 31)
    assert mid.selected[-5:].all()


def test_reuse_and_concat_differ_from_full(tiny):
    """reuse 缺跨段注意力（第 1 层起就不同），concat 连位置也错了：都与完整 prefill 不同，concat 错得更多。
    第一段从位置 0 开始、前面没有别的：它的 K/V 与完整 prefill 的相同（这就是前缀缓存精确的原因）。"""
    ids, chunks = rag_prompt(tiny.cfg.vocab_size)
    full_kv, full_logits = full_prefill(tiny.model, ids)
    out = {}
    for mode in ("concat", "reuse"):
        kv, reused = reused_kv(tiny.model, ids, chunks, rotate=(mode == "reuse"))
        out[mode] = blend_prefill(tiny.model, ids, kv, reused, mode)
        s, e = chunks[0]
        torch.testing.assert_close(out[mode].kv[..., s:e, :], full_kv[..., s:e, :], rtol=1e-4, atol=1e-5)
    err = {m: (r.kv - full_kv).abs().max().item() for m, r in out.items()}
    print(f"{tiny.arch}: max KV error vs full: {err}")
    assert err["reuse"] > 1e-3 and err["concat"] > err["reuse"]
    assert not torch.allclose(out["concat"].logits, full_logits, atol=1e-3)


@one_arch
def test_blend_selects_by_deviation(tiny):
    """选中的是检查层偏差最大的：给一段的复用 K 故意加大误差，r 小到只选几个时选中的全在那一段。"""
    ids, chunks = rag_prompt(tiny.cfg.vocab_size)
    kv, reused = reused_kv(tiny.model, ids, chunks, rotate=True)
    s, e = chunks[1]
    kv[1, 0, :, s:e] += 5.0
    r = blend_prefill(tiny.model, ids, kv, reused, "blend", ratio=0.2)
    picked = r.selected[:-5].nonzero()[:, 0]
    assert len(picked) == int(0.2 * 31) and ((picked >= s) & (picked < e)).all()


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


def test_engine_none_and_prefix_equal_step12(tiny):
    reqs, marks = rag_requests(tiny.cfg.vocab_size)
    ref = step12.LLMEngine(tiny.model, step12.EngineConfig(64, 4, max_num_batched_tokens=32)).generate(reqs).outputs
    for mode in ("none", "prefix"):
        eng, out = run13(tiny.model, reqs, marks, blend=mode)
        assert out == ref, mode
        assert len(eng.chunk_store) == 0
    eng, out = run13(tiny.model, reqs, None, blend="blend")      # 没标段的请求：照 step12
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
    """引擎的拼段 prefill（块缓存读出、转位置、选择性重算、写进请求的块）与直接调用 blend.py 得到的 K/V 相同：
    第一个请求把段存进去（未命中），第二个请求换了顺序、全部命中。"""
    reqs, marks = rag_requests(tiny.cfg.vocab_size, n_req=2)
    eng = step13.LLMEngine(tiny.model, step13.EngineConfig(64, 4, max_num_batched_tokens=64, max_batch_size=1,
                                                           blend=mode, recompute_ratio=ratio))
    for req, chunks in zip(reqs, marks):
        rid = eng.add_request(req, chunks)
        seq = eng.seqs[rid]
        eng.step()                                               # 接纳：拼段的 prefill + 最后一个提示词 token
        n = len(req.prompt_ids) - 1
        got = read_kv(eng.kv_cache.pool, seq.block_table, n)
        kv, reused = reused_kv(tiny.model, req.prompt_ids[:n], chunks, rotate=(mode != "concat"))
        want = blend_prefill(tiny.model, req.prompt_ids[:n], kv, reused, mode, ratio or 0.0).kv
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        while eng.has_unfinished_requests():
            eng.step()
    assert eng.chunk_store.hits == sum(map(len, marks)) - len({c for r, m in zip(reqs, marks) for c in
                                                               (tuple(r.prompt_ids[s:e]) for s, e in m)})
    all_blocks_back(eng)


@one_arch
@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_engine_chunk_store_under_memory_pressure(tiny, preempt):
    """池子小：存的段被请求要的块挤掉（同一条 LRU），请求被抢占（重算时再拼一次，换出时带着拼好的 K/V），
    输出与池子够大时相同，块一个不少地还回来。"""
    reqs, marks = rag_requests(tiny.cfg.vocab_size, n_docs=6, n_req=6, max_new=24)
    _, ref = run13(tiny.model, reqs, marks, blend="reuse")
    eng = step13.LLMEngine(tiny.model, step13.EngineConfig(30, 4, max_batch_size=3, max_num_batched_tokens=32,
                                                           blend="reuse", preempt=preempt))
    res = eng.generate(reqs, marks)
    assert res.outputs == ref
    assert res.stats.preemptions > 0 and eng.block_manager.num_evictions > 0
    all_blocks_back(eng)


@pytest.mark.parametrize("cfg, match", [
    (dict(blend="blend", kv_policy="window", kv_budget=16), "--blend blend cannot be combined with --kv-policy window"),
    (dict(blend="reuse", recompute_ratio=0.3), "--recompute-ratio is only used with --blend blend"),
    (dict(blend="blend", recompute_ratio=1.5), "recompute_ratio must be in"),
    (dict(blend="prefix", enable_prefix_caching=False), "--blend prefix needs the prefix cache"),
    (dict(blend="concat", kv_dtype="int8"), "--blend concat needs the model's dtype"),
    (dict(blend="mix"), "unknown --blend"),
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
    (["--doc", "a", "--chunk-sep", "#"], "either with --doc or with --chunk-sep"),
    (["--chunk-sep", "#"], "must split it into non-empty chunks"),
    (["--doc", "a", "--blend", "reuse", "--no-chunked-prefill"], "drop --no-chunked-prefill"),
])
def test_run_py_errors(tiny_tok_dir, capsys, extra, match):
    from conftest import cli_error

    import step13_kv_blend.run as run
    line = cli_error(run, ["--model", str(tiny_tok_dir), "--prompt", "q?", *extra], capsys)
    assert match in line
