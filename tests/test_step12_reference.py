"""step12：掩码模拟（reference.py）本身对不对，以及引擎的真实缓存与它逐位置一致。

对照自己先要站得住（随机小模型，float64）：
- 预算盖住整个序列时，每个策略都等于不带缓存的整段前向（logits），生成的 token 与整段前向逐位的 argmax 一致；
- window + 文本位置 = 手写的带状掩码：每个 query 看得见的 key 区间由"每次前向之后 ≥ B + bs 就留 B"的算术直接写出
  （不跟踪 kept）；block_size = 1 时就是经典的宽 B + 1 的带；
- sinks + 缓存内位置，在 1 层的小模型上逐个 query 手算：看得见的 token 列成表，位置就是表里的下标，
  逐头做 softmax、o_proj、MLP、lm_head；
- 留哪些的两个规则（最近的 + 分数最高的、平局先留下标小的；snapkv 的最大池化）在手写的小例子上。

引擎 vs 模拟（float64 的小模型；一个真实模型的短例子）：每个策略 × 两种位置，预算在 prefill 的块之间和 decode 里
都会触发，块大小 4 / 8，paged 与 gather 两种读法，一批四个长短不同的请求（各自的块从调度器的记录里读出）；
抢占（换出：什么都不变；重算：从头再来，包括 prefill 到一半被抢占）；前缀缓存命中（window / sinks）；默认旋钮。
贪心 token 相同，提示词与生成的每一步的 logprob 在 1e-5 之内（真实模型 1e-3，token 按"相同"的近乎打平规则）。
"""
import math

import pytest
import torch

from common.model import apply_rope
from common.weights import load_model
from conftest import make_tiny_model_dir
from step12_kv_eviction.reference import keep_recent_and_top, keep_sinks, keep_window, simulate, snapkv_pooled

POLICY_POSITIONS = [("window", "cache"), ("window", "text"), ("sinks", "cache"), ("sinks", "text"),
                    ("h2o", "cache"), ("h2o", "text"), ("snapkv", "cache"), ("snapkv", "text"),
                    ("snapkv-chunked", "text")]


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """qwen3（q/k 各有 RMSNorm、GQA 2 组）的随机小模型，float64：对照自己的检查要紧到舍入误差。"""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("ref64"), "qwen3", seed=3)
    return load_model(path, "cpu", torch.float64)


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("ref1l"), "llama", seed=4, num_hidden_layers=1)
    return load_model(path, "cpu", torch.float64)


def ids_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def plain_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]), torch.arange(len(ids))[None])[0].float()


def kv_before_chunks(chunks: list[int], budget: int, bs: int) -> list[int]:
    """每一块开始时缓存里有几个 token：每次前向之后 ≥ budget + bs 就剩 budget 个（设计里的触发规则）。"""
    kv, out = 0, []
    for c in chunks:
        out.append(kv)
        kv += c
        if kv >= budget + bs:
            kv = budget
    return out


def schedule(P: int, chunk: int, max_new: int) -> list[int]:
    return [min(chunk, P - i) for i in range(0, P, chunk)] + [1] * (max_new - 1)


class BandCache:
    """KVCache：不存东西，整段一次前向，掩码直接给（True = 看得见）。"""
    def __init__(self, mask):
        self.mask = mask

    def update(self, layer_idx, k, v):
        return k, v

    def attend(self, layer_idx, q, k, v):
        from common.model import attention
        return attention(q, k, v, self.mask)


@pytest.mark.parametrize("policy,positions", POLICY_POSITIONS + [("full", None)])
def test_budget_covering_everything_is_the_plain_forward(tiny64, policy, positions):
    P, new = 37, 9
    ids = ids_of(P)
    r = simulate(tiny64, ids, policy=policy, positions=positions, budget=None if policy == "full" else P + new,
                 block_size=4, chunk=8, max_new_tokens=new, snapkv_window=8, snapkv_pool=3)
    assert r.num_compactions == 0
    seq = ids + r.output_ids
    ref = plain_logits(tiny64, seq[:-1])
    assert r.logits.shape == ref.shape
    torch.testing.assert_close(r.logits, ref, rtol=0, atol=1e-6)
    assert r.output_ids == ref[P - 1:].argmax(-1).tolist()


@pytest.mark.parametrize("budget,bs,chunk", [(6, 1, 1), (6, 4, 1), (9, 4, 5), (8, 8, 3)])
def test_window_text_positions_is_a_band(tiny64, budget, bs, chunk):
    """window、文本位置：query t（在从 s 开始的那一块里）看得见 [s − kv(s), t]。整段一次前向、用这个带状掩码，
    logits 与模拟相同。bs = 1、chunk = 1 时 kv(s) = min(s, B)：宽 B + 1 的经典滑动窗口。"""
    P, new = 30, 8
    ids = ids_of(P, seed=1)
    r = simulate(tiny64, ids, policy="window", positions="text", budget=budget, block_size=bs, chunk=chunk,
                 max_new_tokens=new)
    assert r.num_compactions > 0
    seq = (ids + r.output_ids)[:-1]
    chunks = schedule(P, chunk, new)
    mask = torch.zeros(len(seq), len(seq), dtype=torch.bool)
    s = 0
    for c, kv in zip(chunks, kv_before_chunks(chunks, budget, bs)):
        for t in range(s, s + c):
            mask[t, s - kv:t + 1] = True
        s += c
    if bs == 1 and chunk == 1:
        assert torch.equal(mask, torch.ones_like(mask).tril() & ~torch.ones_like(mask).tril(-budget - 1))
    band = tiny64(torch.tensor([seq]), torch.arange(len(seq))[None], BandCache(mask))[0].float()
    torch.testing.assert_close(r.logits, band, rtol=0, atol=1e-6)
    assert r.output_ids == band[P - 1:].argmax(-1).tolist()


@pytest.mark.parametrize("sinks,budget,bs,chunk", [(2, 7, 4, 1), (3, 9, 4, 6), (1, 5, 2, 4)])
def test_sinks_cache_positions_by_hand(one_layer, sinks, budget, bs, chunk):
    """sinks、缓存内位置，1 层模型逐个 query 手算：query t 看得见最前面的 sinks 个 + 这一块之前缓存里最近的
    kv(s) − sinks 个 + 这一块里 ≤ t 的；位置 = 在这张表里的下标（query 自己在最后）。"""
    m = one_layer
    P, new = 26, 10
    ids = ids_of(P, seed=2)
    r = simulate(m, ids, policy="sinks", positions="cache", num_sinks=sinks, budget=budget, block_size=bs,
                 chunk=chunk, max_new_tokens=new)
    assert r.num_compactions > 0
    seq = (ids + r.output_ids)[:-1]
    cfg, layer = m.cfg, m.layers[0]
    H, H_kv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = m.embed_tokens(torch.tensor(seq))                                   # (T, E)
    h = layer.input_layernorm(x)
    q = layer.self_attn.q_proj(h).view(-1, H, D)
    k = layer.self_attn.k_proj(h).view(-1, H_kv, D)
    v = layer.self_attn.v_proj(h).view(-1, H_kv, D)
    chunks = schedule(P, chunk, new)
    rows, s = [], 0
    for c, kv in zip(chunks, kv_before_chunks(chunks, budget, bs)):
        kept = list(range(min(sinks, kv))) + list(range(s - (kv - min(sinks, kv)), s))
        for t in range(s, s + c):
            vis = kept + list(range(s, t + 1))
            pos = torch.arange(len(vis))[None]                              # (1, n)：表里的下标
            cos, sin = m.rope(pos, x.dtype)
            kr = apply_rope(k[vis].transpose(0, 1)[None], cos, sin)[0]     # (H_kv, n, D)
            qr = apply_rope(q[t][:, None][None], cos[:, -1:], sin[:, -1:])[0, :, 0]   # (H, D)：位置 n − 1
            heads = []
            for hh in range(H):
                g = hh // (H // H_kv)
                p = torch.softmax(kr[g] @ qr[hh] / math.sqrt(D), dim=0)     # (n,)
                heads.append(p @ v[vis, g])
            y = x[t] + layer.self_attn.o_proj(torch.cat(heads))
            y = y + layer.mlp(layer.post_attention_layernorm(y))
            rows.append(m.lm_head(m.norm(y)).float())
        s += c
    torch.testing.assert_close(r.logits, torch.stack(rows), rtol=0, atol=1e-6)


def test_selection_rules_by_hand():
    assert keep_window(10, 4).tolist() == [6, 7, 8, 9]
    assert keep_sinks(10, 5, 2).tolist() == [0, 1, 7, 8, 9]
    s = torch.tensor([5., 1, 5, 3, 0, 2, 9])                                 # 最后 2 个一定留；其余取最高的 2 个
    assert keep_recent_and_top(s, 4, 2).tolist() == [0, 2, 5, 6]
    s = torch.tensor([1., 3, 3, 0, 3, 7, 7])                                 # 三个 3 平局：先留下标小的
    assert keep_recent_and_top(s, 4, 2).tolist() == [1, 2, 5, 6]
    vote = torch.tensor([0., 5, 0, 0, 0, 0, 1, 9, 9])                       # 窗口 2、核 3：前 7 个池化，边上不补值
    assert snapkv_pooled(vote, 2, 3).tolist() == [5., 5, 5, 0, 0, 1, 1, 0, 0]


# ---- 引擎的真实缓存 vs 掩码模拟 ----
# 一批几个长短不同的请求一起跑引擎（分块 prefill 的块怎么切取决于同批的别人：从调度器的记录里读出来），
# 每个请求再单独跑一遍模拟，用同样的块。比：贪心 token 逐个相同；提示词每个位置的 logprob、生成时每一步的 logprob
# 都 allclose。float64 的小模型：两边的差只有引擎 logits 的 float32 与重新旋转的 float32（约 1e-7），
# 驱逐留错一个 token、位置错一位，差的是 1e-2 以上。

def run_engine(model, prompts, max_new, prompt_logprobs=0, **cfg):
    """引擎跑一批；每个请求返回 (输出, 提示词 logprobs, 每步 logprobs, 各次前向 (算前已算的 token 数, 已有输出数, 这次算几个))。"""
    from step02_sampling.sampler import SamplingParams
    from step04_static_batching.request import Request
    from step12_kv_eviction.engine import EngineConfig, LLMEngine
    eng = LLMEngine(model, EngineConfig(**{**dict(num_blocks=128, block_size=4, max_num_batched_tokens=16), **cfg}))
    sched: dict[int, list] = {}
    schedule = eng.scheduler.schedule

    def recording_schedule():
        out = schedule()
        for seq, n in zip(out.seqs, out.num_new_tokens):
            sched.setdefault(seq.request_id, []).append((seq.num_computed_tokens, len(seq.output_ids), n))
        return out
    eng.scheduler.schedule = recording_schedule
    preempt, eng.preemptions = eng.scheduler._preempt, 0

    def counting_preempt(seq):
        eng.preemptions += 1
        preempt(seq)
    eng.scheduler._preempt = counting_preempt
    rids = [eng.add_request(Request(p, max_new, SamplingParams(), ignore_eos=True, logprobs=0,
                                    prompt_logprobs=prompt_logprobs))
            for p in prompts]
    got = {r: ([], None, []) for r in rids}
    while eng.has_unfinished_requests():
        for o in eng.step():
            out, plps, lps = got[o.request_id]
            out += o.new_token_ids
            lps += [x.logprob for x in o.logprobs]
            if o.prompt_logprobs is not None:
                got[o.request_id] = (out, [x.logprob for x in o.prompt_logprobs[1:]], lps)
            eng.cached_tokens = max(getattr(eng, "cached_tokens", 0), o.num_cached_tokens)
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    return eng, [(*got[r], sched[r]) for r in rids]


def lives(steps):
    """一个请求的前向记录按"生命"切开：[(当时已有的输出数, 各块 prefill 的大小)]。已算的 token 数往回走 = 被抢占后
    重来（重算）。一生的第一块前面命中前缀缓存的 token 并进第一块：它们的 K/V 是别的请求在没驱逐过的缓存里、
    从位置 0 起整段因果地算出来的，与模拟在第一块里算出的相同。"""
    out, end = [], None
    for computed, n_out, n in steps:
        if end is None or computed < end:
            out.append((n_out, [computed + n]))
        else:
            out[-1][1].append(n)
        end = computed + n
    return out


NEAR_TIE = 1e-5   # 模拟里挑选的相对余量小于它：引擎的 float32 分数可能挑得不同，这样的例子不能用来比


def check_against_reference(model, prompts, max_new, atol=1e-5, prompt_logprobs=0, must_evict=True, **cfg):
    """引擎跑一批，每个请求的每一生（重算式抢占后从头再来）各用它那一生的块跑一遍模拟，逐项比较。
    一生在 prefill 中途被抢占：模拟只算到那里（它算过的提示词位置的 logprob 就是引擎报告的：引擎不重复报告）。"""
    knobs = {k: cfg[k] for k in ("num_sinks", "h2o_recent", "snapkv_window", "snapkv_pool") if k in cfg}
    eng, results = run_engine(model, prompts, max_new, prompt_logprobs, **cfg)
    assert eng.num_compactions_skipped == 0
    compactions = 0
    for prompt, (out, plps, lps, steps) in zip(prompts, results):
        ls = lives(steps)
        want_plps = []
        for (n_out, sizes), end in zip(ls, [n for n, _ in ls[1:]] + [max_new]):   # 这一生产出 out[n_out:end]
            ids = prompt + out[:n_out]             # 重算的那一生：提示词 = 原提示词 + 当时已有的输出
            chunks = []
            while sum(chunks) < len(ids) and len(chunks) < len(sizes):
                chunks.append(sizes[len(chunks)])
            P = sum(chunks)                        # < len(ids)：这一生在 prefill 中途被抢占
            assert P <= len(ids) and all(n == 1 for n in sizes[len(chunks):])
            assert P == len(ids) or end == n_out
            sim = simulate(model, ids[:P], policy=cfg["kv_policy"], budget=cfg["kv_budget"],
                           positions=cfg.get("kv_positions"), block_size=cfg.get("block_size", 4), chunk=chunks,
                           max_new_tokens=end - n_out, **knobs)
            compactions += sim.num_compactions
            assert sim.selection_margin > NEAR_TIE, f"近乎平局的挑选（相对余量 {sim.selection_margin:.1e}）：换一个种子"
            assert out[n_out:end] == sim.output_ids, (prompt, n_out, out[n_out:end], sim.output_ids)
            lp = torch.log_softmax(sim.logits.double(), dim=-1)
            rows = torch.arange(len(want_plps), max(len(want_plps), min(P, len(prompt) - 1)))   # 还没报告过的提示词位置
            want_plps += lp[rows, torch.tensor(prompt)[rows + 1]].tolist()
            want = lp[P - 1 + torch.arange(end - n_out), torch.tensor(sim.output_ids, dtype=torch.long)]
            torch.testing.assert_close(torch.tensor(lps[n_out:end], dtype=torch.float64), want, rtol=0, atol=atol)
        if prompt_logprobs is not None:
            torch.testing.assert_close(torch.tensor(plps, dtype=torch.float64),
                                       torch.tensor(want_plps, dtype=torch.float64), rtol=0, atol=atol)
    assert compactions > 0 or not must_evict
    return eng, results


BATCH = [ids_of(n, seed=10 + n) for n in (5, 23, 41, 60)]   # 5：只在 decode 里驱逐；60：prefill 的块之间就驱逐


# 每个策略两种位置各一次；块大小 4 / 8、paged / gather 在两种位置之间轮换（每种位置两种块大小、两种读法都有）
ENGINE_CASES = [(p, pos) + ((4, "paged") if (i + (pos == "text")) % 2 == 0 else (8, "gather"))
                for i, p in enumerate(("window", "sinks", "h2o", "snapkv")) for pos in ("cache", "text")]
ENGINE_CASES += [("snapkv-chunked", "text", 4, "gather")]


@pytest.mark.parametrize("policy,positions,bs,attention", ENGINE_CASES)
def test_engine_equals_reference(tiny64, policy, positions, bs, attention):
    knobs = dict(num_sinks=2) if policy == "sinks" else dict(snapkv_window=8, snapkv_pool=3) if "snapkv" in policy else {}
    check_against_reference(tiny64, BATCH, 14, kv_policy=policy, kv_positions=positions, kv_budget=2 * bs + 4,
                            block_size=bs, attention=attention, **knobs)


@pytest.mark.parametrize("preempt", ["swap", "recompute"])
@pytest.mark.parametrize("policy,positions", [("h2o", "text"), ("sinks", "cache"), ("window", "cache")])
def test_preemption_against_reference(tiny64, policy, positions, preempt):
    """小池子里抢占。换出：槽、num_evicted、分数原样回来，输出与没被抢占的模拟相同；重算：从头再 prefill
    （提示词 + 当时已有的输出，策略一块一块重新作用）——对照是以那一串为提示词的模拟。不开前缀缓存：
    重算时命中自己登记过的前缀块，第一块就不是从 0 算起（h2o 的分数也少了那些 query 的）。"""
    eng, results = check_against_reference(
        tiny64, BATCH, 24, kv_policy=policy, kv_positions=positions, kv_budget=12, num_blocks=9, preempt=preempt,
        enable_prefix_caching=False, **(dict(num_sinks=2) if policy == "sinks" else {}))
    assert eng.preemptions > 0
    if preempt == "recompute":
        assert any(len(lives(steps)) > 1 for *_, steps in results)


@pytest.mark.parametrize("preempt", ["swap", "recompute"])
def test_snapkv_preemption_against_reference(tiny64, preempt):
    """snapkv 只压缩一次，留哪些只看整个提示词（与怎么分块无关），decode 只追加。换出：槽与票原样回来；重算：调度器让
    重新 prefill 的一块停在原提示词的末尾，在那里重新投票、压缩一次，之后已生成的 token 照常追加。两种都等于一次
    没被抢占、提示词一整块的模拟：每个请求的贪心 token、提示词与每一步的 logprob。"""
    B, w, pool = 12, 8, 3
    eng, results = run_engine(tiny64, BATCH, 24, kv_policy="snapkv", kv_budget=B, snapkv_window=w, snapkv_pool=pool,
                              num_blocks=18, preempt=preempt, enable_prefix_caching=False)
    assert eng.preemptions > 0 and eng.num_compactions_skipped == 0
    if preempt == "recompute":   # 压缩过、已经生成了 token 又被重算的请求：重新 prefill 的几块在原提示词的末尾停了一下
        assert any(n_out > 0 and len(prompt) > B for prompt, (*_, steps) in zip(BATCH, results)
                   for n_out, _ in lives(steps)[1:])
    for prompt, (out, plps, lps, steps) in zip(BATCH, results):
        sim = simulate(tiny64, prompt, policy="snapkv", budget=B, snapkv_window=w, snapkv_pool=pool, block_size=4,
                       max_new_tokens=24)
        assert sim.num_compactions == (len(prompt) > B) and sim.selection_margin > NEAR_TIE
        assert out == sim.output_ids
        lp = torch.log_softmax(sim.logits.double(), dim=-1)
        P = len(prompt)
        want = lp[torch.arange(P - 1 + 24), torch.tensor(prompt[1:] + out)]
        torch.testing.assert_close(torch.tensor(plps + lps, dtype=torch.float64), want, rtol=0, atol=1e-5)


# ---- snapkv：提示词最后 w 个 token 投票（论文的规则），与直接算的比 ----

def snapkv_direct_keep(model, ids: list[int], budget: int, window: int, pool: int) -> list[list[list[int]]]:
    """不用引擎也不用 reference.py：整段提示词一次普通的前向，记下每层的 q、k（已做 RoPE，原文位置），最后 window 个
    query 的因果注意力概率（float64，逐个 query 头）按 KV 组加起来就是票；前 P − window 个 token 的票做核 pool 的
    最大池化（出界的不算），取最高的 budget − window 个（平局先取靠前的，用 Python 的 sorted），加上最后 window 个。
    返回 [层][KV 头] → 留下的 token 下标（升序）。"""
    from common.model import attention
    qs, ks = {}, {}

    class Record:
        mask = None

        def attend(self, layer_idx, q, k, v):
            qs[layer_idx], ks[layer_idx] = q[0].double(), k[0].double()
            return attention(q, k, v)
    P = len(ids)
    with torch.inference_mode():
        model(torch.tensor([ids]), torch.arange(P)[None], Record())
    cfg = model.cfg
    G, D, n = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, P - window
    out = []
    for layer in range(cfg.num_layers):
        heads = []
        for g in range(cfg.num_kv_heads):
            vote = torch.zeros(P, dtype=torch.float64)
            for h in range(g * G, (g + 1) * G):
                for t in range(P - window, P):
                    vote[:t + 1] += torch.softmax(ks[layer][g, :t + 1] @ qs[layer][h, t] / math.sqrt(D), dim=0)
            pooled = [max(vote[max(0, j - pool // 2):j + pool // 2 + 1]) for j in range(n)]
            top = sorted(range(n), key=lambda j: (-pooled[j], j))[:budget - window]
            heads.append(sorted(top) + list(range(n, P)))
        out.append(heads)
    return out


SNAP = dict(budget=20, window=8, pool=3)   # 提示词 37、每块 16：16、16、5——最后一块比观察窗口短，投票的 query 分在两块


def test_reference_snapkv_keeps_what_the_last_prompt_queries_vote_for(tiny64):
    ids = ids_of(37, seed=30)
    want = snapkv_direct_keep(tiny64, ids, **SNAP)
    sim = simulate(tiny64, ids, policy="snapkv", budget=SNAP["budget"], snapkv_window=SNAP["window"],
                   snapkv_pool=SNAP["pool"], block_size=4, chunk=16, max_new_tokens=3)
    assert sim.num_compactions == 1 and sim.selection_margin > NEAR_TIE
    got = [[sim.kept[layer, g, :37].nonzero()[:, 0].tolist() for g in range(tiny64.cfg.num_kv_heads)]
           for layer in range(tiny64.cfg.num_layers)]
    assert got == want


def test_engine_snapkv_keeps_what_the_last_prompt_queries_vote_for(tiny64):
    """引擎分三块算这个提示词，压缩一次：留下的槽（每层、每个 KV 头）就是直接算的。修之前的引擎在第二块之后就按第二块
    自己的最后 8 个 query 压缩、最后一块再压一次：问题（最后一块）的 query 从来没投过它想要的票。"""
    from step12_kv_eviction.engine import EngineConfig, LLMEngine
    ids = ids_of(37, seed=30)
    eng = LLMEngine(tiny64, EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=16, kv_policy="snapkv",
                                         kv_budget=SNAP["budget"], snapkv_window=SNAP["window"],
                                         snapkv_pool=SNAP["pool"]))
    kept, compact = [], eng.kv_cache.compact
    eng.kv_cache.compact = lambda old, new, k, deltas=None: kept.append(k.tolist()) or compact(old, new, k, deltas)
    from step02_sampling.sampler import SamplingParams
    from step04_static_batching.request import Request
    eng.generate([Request(ids, 3, SamplingParams(), ignore_eos=True)])
    assert kept == [snapkv_direct_keep(tiny64, ids, **SNAP)]


@pytest.mark.parametrize("policy,knobs", [("snapkv", dict(kv_budget=40)),                      # 默认窗口 32、池化核 7
                                          ("h2o", dict(kv_budget=20, h2o_recent=3)),
                                          ("sinks", dict(kv_budget=24)),                       # 默认 4 个 sink、cache 位置
                                          ("window", dict(kv_budget=8))])
def test_single_long_request_default_knobs(tiny64, policy, knobs):
    """一个长请求、大块（一次前向 64 个 token）、block_size 8，旋钮多用默认值。"""
    check_against_reference(tiny64, [ids_of(150, seed=7)], 12, kv_policy=policy, block_size=8,
                            max_num_batched_tokens=64, **knobs)


def test_real_model_engine_equals_reference(real):
    """真实模型（float32、C++ 分页内核 vs 模拟里 common/model.py 的注意力），120 个 token 的英文、预算 64、
    一次前向 32 个 token：prefill 的块之间驱逐两次（decode 里的驱逐由上面的小模型测试覆盖，这里省时间）。
    sinks（cache 位置）与 h2o（text 位置）。贪心 token 按"相同"的规则比（分歧只在参考 top-2 差 < 1e-3 处接受）；
    logprob 的容差 1e-3（实测两边差约 5e-5：float32 的内核与矩阵乘顺序不同）。"""
    import pydoc_data.topics

    from common.compare import MARGIN_TOL, compare
    text = " ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))[:2000]
    ids = real.tok.encode(text)[:120]
    for policy, positions in (("sinks", "cache"), ("h2o", "text")):
        _, [(out, plps, lps, steps)] = run_engine(real.model, [ids], 8, kv_policy=policy, kv_positions=positions,
                                                  kv_budget=64, block_size=16, max_num_batched_tokens=32, num_blocks=32)
        chunks = [n for _, _, n in steps][:4]
        sim = simulate(real.model, ids, policy=policy, positions=positions, budget=64, block_size=16, chunk=chunks,
                       max_new_tokens=8)
        assert sum(chunks) == len(ids) and sim.num_compactions == 2
        c = compare(policy, ids, sim.output_ids, out, lambda h: sim.logits[:len(h)], MARGIN_TOL[torch.float32])
        # h2o 的挑选余量在真实模型上可以很小，引擎的 float32 分数在那里可能挑得不同：失败时一并报告
        assert c.ok, f"{c.describe()}; reference selection margin {sim.selection_margin:.1e}"
        n = len(out) if c.equal else c.position
        lp = torch.log_softmax(sim.logits.double(), dim=-1)
        want = lp[torch.arange(len(ids) - 1 + n), torch.tensor(ids[1:] + out[:n])]
        torch.testing.assert_close(torch.tensor(plps + lps[:n], dtype=torch.float64), want, rtol=0, atol=1e-3,
                                   msg=lambda m: f"{policy}: {m}; reference selection margin {sim.selection_margin:.1e}")


@pytest.mark.parametrize("policy,positions", [("window", "text"), ("sinks", "cache"), ("h2o", "text"), ("snapkv", "text")])
def test_prefix_cache_hit_against_reference(tiny64, policy, positions):
    """前缀缓存命中（不要 prompt logprobs 的请求才读前缀缓存）：第二个请求的前 16 个 token 命中第一个请求在第一次
    驱逐之前登记的块；对照里它们就是第一块的一部分。h2o / snapkv 的分数要每个 query 自己的注意力，命中的 token
    没算过 query：引擎对这两种策略不查前缀缓存（engine.py），结果与"从头算"的模拟相同，而不随缓存里碰巧有什么而变。"""
    prefix = ids_of(32, seed=20)
    prompts = [prefix + ids_of(20, seed=21), prefix + ids_of(11, seed=22), ids_of(30, seed=23)]
    knobs = dict(num_sinks=2) if policy == "sinks" else dict(snapkv_window=4, snapkv_pool=3) if policy == "snapkv" else {}
    eng, _ = check_against_reference(tiny64, prompts, 16, prompt_logprobs=None, kv_policy=policy,
                                     kv_positions=positions, kv_budget=12, **knobs)
    assert (eng.cached_tokens > 0) == (policy in ("window", "sinks"))
