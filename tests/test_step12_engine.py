"""step12 引擎：KV 驱逐的缓存（随机小模型；真实模型只有一个短测试）。

- full 与 step09 逐 token 相同、前向次数相同（分块 prefill、前缀缓存、重算 / 换出抢占、gather、投机都开着）；
  每个策略、两种位置在预算盖得住整个请求时（正好不触发压缩的边界）与 full 相同；
- 留哪些槽：window / sinks 的槽号，h2o 的"最近 + 最重"（分数一样时留靠前的），snapkv 的最大池化投票；
- 内存真的还回来：驱逐时每个请求的块数有上界、不随 token 数增长，比池子还长的请求也跑得完；结束、abort 后全部块回到池子；
- 重新旋转：按槽 o 转过的 key 再转 n − o 等于直接在 n 转；window 策略下 cache 与 text 位置的注意力完全一样
  （相对距离相同），不转就不一样；
- h2o 的分数等于直接算的 softmax（按 KV 组、全部 query 求和）；snapkv 只在 prefill 之后压缩；
- 换出保留槽、num_evicted 与分数，重算把它们清零，都跑完、块全回来；前缀缓存命中后压缩不碰与别人共享的块；分不到新块时推迟压缩；
- 坏输入：每条规则一个 UserError，说出参数名；run.py 在加载模型之前一行 error、退出码 2。
"""
import json

import pytest
import torch

from common.errors import UserError
from common.model import attention, rope_inv_freq
from conftest import cli_error, one_arch, run_py
from step02_sampling.sampler import SamplingParams
from step04_static_batching.request import Request
from step09_speculative import engine as step09
from step12_kv_eviction import engine as step12
from step12_kv_eviction import eviction
from step12_kv_eviction import run as run12
from step13_kv_blend import engine as step13   # step13 从 step12 的文件出发：驱逐的几个修复在两份里相同

GREEDY = SamplingParams()
BASE = dict(num_blocks=64, block_size=4, max_num_batched_tokens=32)
LENGTHS = (5, 40, 70, 9, 23)


def prompts(seed: int = 0, lengths=LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in lengths]


def requests(max_new: int = 30, ps=None, **kw) -> list[Request]:
    return [Request(p, max_new, GREEDY, ignore_eos=True, **kw) for p in (ps or prompts())]


def engine(model, step=step12, **cfg):
    return step.LLMEngine(model, step.EngineConfig(**{**BASE, **cfg}))


def assert_all_free(e) -> None:
    bm = e.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    if e.swap is not None:
        assert e.swap.num_used == 0


# ---- full = step09 ----

_FULL = {}


def full_reference(tiny, prefix_cache: bool = True):
    """requests() 在 full 下的结果（每个小模型、查不查前缀缓存各只跑一次，几个测试共用）。h2o / snapkv 不查前缀缓存
    （engine.py），它们的参照是 prefix_cache=False 的 full：输出相同，共享前缀的请求前向的形状不同。"""
    key = (tiny.arch, prefix_cache)
    if key not in _FULL:
        _FULL[key] = engine(tiny.model, enable_prefix_caching=prefix_cache).generate(requests())
    return _FULL[key]


def test_full_equals_step09(tiny):
    check_full_equals_step09(tiny)


@one_arch
@pytest.mark.parametrize("cfg", [dict(num_blocks=28), dict(num_blocks=28, preempt="swap"),
                                 dict(attention="gather"), dict(spec_method="ngram")],
                         ids=["recompute", "swap", "gather", "ngram"])
def test_full_equals_step09_with_every_feature(tiny, cfg):
    check_full_equals_step09(tiny, **cfg)


def check_full_equals_step09(tiny, **cfg):
    reqs = requests()
    ref = engine(tiny.model, step09, **cfg).generate(reqs)
    e = engine(tiny.model, **cfg)
    out = e.generate(reqs)
    assert out.outputs == ref.outputs
    assert out.stats.num_forwards == ref.stats.num_forwards
    assert out.stats.preemptions == ref.stats.preemptions
    assert e.num_compactions == 0
    assert_all_free(e)


@one_arch
@pytest.mark.parametrize("policy", ["window", "sinks", "h2o", "snapkv", "snapkv-chunked"])
@pytest.mark.parametrize("positions", ["cache", "text"])
def test_budget_covering_the_request_equals_full(tiny, policy, positions):
    """压缩看的是前向之后还在跑的请求的槽数，最多 提示词 + N − 2（算完第 N − 1 个 token 的那次前向采样出最后一个
    token，请求就结束了）。预算 = 它 − 一块 + 1：一次也不压缩，与 full 逐 token 相同；预算再小一个槽就压缩一次
    （下面也验证了，所以边界是真的）。两种 snapkv 只压缩提示词：snapkv 在提示词长于预算时压（边界是最长的提示词），
    snapkv-chunked 在一块 prefill 之后槽数到了 预算 + 一块 时压。抢占与 full 一样用重算（驱逐时默认换出）。"""
    reqs, bs = requests(), BASE["block_size"]
    cover = {"snapkv": max(LENGTHS), "snapkv-chunked": max(LENGTHS) - bs + 1}.get(policy, max(LENGTHS) + 30 - 2 - bs + 1)
    knobs = dict(snapkv_window=8, preempt="recompute") if "snapkv" in policy else dict(preempt="recompute")
    ref = full_reference(tiny, prefix_cache=policy in ("window", "sinks"))
    e = engine(tiny.model, kv_policy=policy, kv_budget=cover, kv_positions=positions, **knobs)
    out = e.generate(reqs)
    assert e.num_compactions == 0
    assert out.outputs == ref.outputs and out.stats.num_forwards == ref.stats.num_forwards
    tight = engine(tiny.model, kv_policy=policy, kv_budget=cover - 1, kv_positions=positions, **knobs)
    tight.generate(reqs)
    assert tight.num_compactions == 1


# ---- 留哪些槽 ----

def test_kept_sets_of_each_policy():
    w = eviction.kept_slots("window", 30, 8, 2, 3)
    assert w.shape == (2, 3, 8) and (w == torch.arange(22, 30)).all()
    s = eviction.kept_slots("sinks", 30, 8, 2, 3, sinks=2)
    assert (s == torch.tensor([0, 1, 24, 25, 26, 27, 28, 29])).all()
    # h2o：最后 recent 个全留，其余按分数；分数一样时留槽号小的；每层每个头各自选
    scores = torch.zeros(1, 2, 12)
    scores[0, 0, [3, 7]] = 5.0
    scores[0, 1, [1, 2, 9]] = 1.0        # 槽 9 本来就在最近的 3 个（9..11）里
    h = eviction.kept_slots("h2o", 12, 6, 1, 2, recent=3, scores=scores)
    assert h[0, 0].tolist() == [0, 3, 7, 9, 10, 11]    # 两个重的 + 并列 0 分里槽号最小的 0
    assert h[0, 1].tolist() == [0, 1, 2, 9, 10, 11]
    # snapkv：最大池化（核 3）让高分槽的邻居也得分
    votes = torch.zeros(1, 1, 20)
    votes[0, 0, 10] = 1.0
    v = eviction.kept_slots("snapkv", 20, 7, 1, 1, recent=4, scores=votes, pool_kernel=3)
    assert v[0, 0].tolist() == [9, 10, 11, 16, 17, 18, 19]
    v1 = eviction.kept_slots("snapkv", 20, 7, 1, 1, recent=4, scores=votes, pool_kernel=1)
    assert v1[0, 0].tolist() == [0, 1, 10, 16, 17, 18, 19]


@one_arch
@pytest.mark.parametrize("policy", ["window", "sinks", "h2o"])
def test_blocks_held_stay_flat_and_all_come_back(tiny, policy):
    """一个请求 70 + 60 个 token、预算 16：每次前向之后它最多 预算 + 一块 − 1 个槽，块表不超过
    blocks_for(预算 + 一块 − 1 + 一次前向的 token)；decode 中不超过 blocks_for(预算 + 一块)。池子的账在每一步都对得上。"""
    bs, B, T = 4, 16, 32
    e = engine(tiny.model, kv_policy=policy, kv_budget=B, max_num_batched_tokens=T)
    rid = e.add_request(Request(prompts(lengths=(70,))[0], 60, GREEDY, ignore_eos=True))
    held = []
    while e.has_unfinished_requests():
        outs = e.step()
        seq = e.seqs.get(rid)
        if seq is None:
            assert outs[0].kv_blocks_peak <= -(-(B + bs - 1 + T) // bs)
            break
        assert seq.kv_len <= B + bs - 1
        held.append(len(seq.block_table))
        assert e.block_manager.num_free_blocks + len(seq.block_table) == e.block_manager.num_blocks
        if not seq.in_prefill:
            assert len(seq.block_table) <= -(-(B + bs) // bs)
    assert e.num_compactions >= 60 // bs
    assert max(held[-40:]) <= -(-(B + bs) // bs) < -(-130 // bs)
    assert_all_free(e)


@one_arch
def test_a_request_longer_than_the_pool_runs_under_a_policy(tiny):
    """池子 12 块 × 4 = 48 个槽，请求 70 + 30 个 token：full 拒绝（要 25 块），sinks 预算 16 只要有界的块数，跑得完。
    prefill 每块 16 个：上一块之后压到 16 个槽，再写 16 个 = 32 个槽 = 8 块；decode 中写满 预算 + 一块 = 20 个槽就压缩，
    块表不超过 5 块（结束时也是）。"""
    req = Request(prompts(lengths=(70,))[0], 30, GREEDY, ignore_eos=True)
    with pytest.raises(UserError, match="num-blocks"):
        engine(tiny.model, num_blocks=12, max_num_batched_tokens=16).add_request(req)
    e = engine(tiny.model, num_blocks=12, max_num_batched_tokens=16, kv_policy="sinks", kv_budget=16)
    rid = e.add_request(req)
    seq, held, out = e.seqs[rid], {True: 0, False: 0}, []
    while e.has_unfinished_requests():
        prefill = seq.in_prefill
        for o in e.step():
            out += o.new_token_ids
            end = o.kv_blocks
        held[prefill] = max(held[prefill], len(seq.block_table), seq.peak_blocks if prefill else 0)
    assert len(out) == 30 and held == {True: 8, False: 5} and end <= 5
    assert_all_free(e)


@one_arch
def test_max_model_len_allows_a_longer_context(tiny):
    req = Request(prompts(lengths=(600,))[0], 4, GREEDY, ignore_eos=True)   # 随机小模型的上下文是 512
    with pytest.raises(UserError, match="context"):
        engine(tiny.model, kv_policy="sinks", kv_budget=16).add_request(req)
    e = engine(tiny.model, kv_policy="sinks", kv_budget=16, max_model_len=700)
    assert len(e.generate([req]).outputs[0]) == 4
    assert_all_free(e)


@one_arch
def test_abort_mid_request_frees_everything(tiny):
    e = engine(tiny.model, kv_policy="h2o", kv_budget=16)
    ids = [e.add_request(r) for r in requests()]
    for _ in range(6):
        e.step()
    assert e.num_compactions > 0 and e.block_manager.num_free_blocks < e.block_manager.num_blocks
    for rid in ids:
        e.abort(rid)
    outs = e.step()
    assert {o.request_id for o in outs if o.finish_reason == "abort"} == set(ids)
    assert_all_free(e)


# ---- 重新旋转 ----

def test_rerotation_equals_rotating_at_the_new_slot(tiny):
    """R(n − o)·R(o)·k 与 R(n)·k：同一个 key 在槽 o 转过、挪到槽 n 再转，等于直接在 n 转（float32，最大差 < 5e-4）。"""
    from common.model import RotaryEmbedding, apply_rope
    rope, inv_freq = RotaryEmbedding(tiny.cfg), rope_inv_freq(tiny.cfg)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 2, 50, tiny.cfg.head_dim, generator=g)             # (1, H_kv, n, D) 还没转的 key
    old = torch.randint(100, 1000, (50,), generator=g)
    new = torch.randint(0, 100, (50,), generator=g)
    at_old = apply_rope(k, *rope(old[None], torch.float32))
    at_new = apply_rope(k, *rope(new[None], torch.float32))
    moved = eviction.rerotate(at_old, (new - old).expand(1, 2, 50), inv_freq)
    assert (moved - at_new).abs().max() < 5e-4       # float32 的角度 p·θ 本身差约 p·6e-8 弧度（两边都有）
    assert (at_old - at_new).abs().max() > 0.1                           # 不转就差得远


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """R(position)·x in float64，x (..., n, D)、positions (n,)：rotate_half 的写法，不用 eviction.rerotate。"""
    ang = positions.double()[:, None] * inv_freq.double()                 # (n, D/2)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    x = x.double()
    return x * cos + torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), -1) * sin


@pytest.mark.parametrize("dtype, moves, low, high", [(torch.bfloat16, 100, 1e-2, 1.0), (torch.float32, 1000, 0, 1e-4)])
def test_a_key_rerotated_many_times_drifts_in_a_16_bit_pool(dtype, moves, low, high):
    """docs/12 第 3 节的测量：一个 key 在原文位置 5,000 转好、存进池子，再挪 moves 次（每次往回 1..16 个槽，每次补转后
    按池子的 dtype 舍入），与"从 RoPE 之前的 key 在最后的槽号上转一次"比，相对误差的均值。bfloat16 一次舍入约 1.6e-3，
    挪 100 次就到了几个百分点（所以 16 位的池子存 RoPE 之前的 K）；float32 挪 1000 次也不到 1e-4。"""
    g = torch.Generator().manual_seed(0)
    D, n = 64, 500
    inv_freq = 1.0 / 100000.0 ** (torch.arange(0, D, 2).float() / D)      # SmolLM2 的 rope_theta
    k = torch.randn(n, D, generator=g, dtype=torch.float64) * 3
    pos = torch.full((n,), 5000)
    cur = rotate(k, pos, inv_freq).to(dtype)
    for _ in range(moves):
        delta = -torch.randint(1, 17, (n,), generator=g)
        cur, pos = eviction.rerotate(cur, delta, inv_freq), pos + delta
    once = rotate(k, pos, inv_freq)
    drift = ((cur.double() - once).norm(dim=-1) / once.norm(dim=-1)).mean()
    assert low < drift < high


@one_arch
def test_cache_positions_in_a_bf16_pool_rotate_each_key_once(tiny, monkeypatch):
    """bfloat16 的池子、window、cache 位置、块 1：算完 预算 + 1 个 token 以后每次前向之后都压缩，留下的 key 每次挪一个槽，
    最后一次前向时最老的 key 已经挪了 100 多次。注意力拿到的 key（第 0 层：只取决于 token 本身）应当是 RoPE 之前的 key
    在它的槽号上转一次（差一次 bfloat16 舍入，相对 1e-2 之内）；压缩时补转、每次舍入的做法在这里漂了百分之几。"""
    from common.weights import load_model
    from step12_kv_eviction import gather
    model = load_model(tiny.path, "cpu", torch.bfloat16)
    B, P, new = 120, 8, 260
    e = step12.LLMEngine(model, step12.EngineConfig(num_blocks=200, block_size=1, max_num_batched_tokens=16,
                                                     kv_policy="window", kv_budget=B,
                                                     kv_positions="cache", attention="gather"))
    ids = prompts(lengths=(P,))[0]
    rid = e.add_request(Request(ids, new, GREEDY, ignore_eos=True))
    seq = e.seqs[rid]
    while len(seq.output_ids) < new - 1:
        e.step()
    evicted, S, tokens = seq.num_evicted, seq.kv_len, list(seq.token_ids)
    assert e.num_compactions > 100 and evicted > 100
    seen, attention = [], gather.attention
    monkeypatch.setattr(gather, "attention",   # read_buf 每层复用：拷一份
                        lambda q, k, v, mask: seen.append((q.clone(), k.clone())) or attention(q, k, v, mask))
    e.step()                                                              # 最后一次前向：槽 0..S−1 + 新 token 在槽 S
    q0, k0 = seen[0][0][0, :, 0].double(), seen[0][1][0, :, :S + 1].double()   # 第 0 层 (H, D)、(H_kv, S + 1, D)
    rec = Recorder()                                                      # 位置全是 0：RoPE 是恒等变换
    with torch.inference_mode():
        model(torch.tensor([tokens]), torch.zeros(1, len(tokens), dtype=torch.long), rec)
    inv_freq = rope_inv_freq(tiny.cfg)
    want_k = rotate(rec.k[0][0, :, evicted:evicted + S + 1], torch.arange(S + 1), inv_freq)   # (H_kv, S + 1, D)
    want_q = rotate(rec.q[0][0, :, -1:], torch.tensor([S]), inv_freq)[:, 0]                  # (H, D)：新 token 在槽 S
    err = (k0 - want_k).norm(dim=-1) / want_k.norm(dim=-1)                # (H_kv, S + 1)
    assert err.max() < 1e-2, f"max relative error {err.max():.2e}"
    assert ((q0 - want_q).norm(dim=-1) / want_q.norm(dim=-1)).max() < 1e-2


def logprobs_run(e, reqs):
    """一步一步跑，收下每个请求每个新 token 的 logprob。"""
    ids = [e.add_request(r) for r in reqs]
    toks, lps = {i: [] for i in ids}, {i: [] for i in ids}
    while e.has_unfinished_requests():
        for o in e.step():
            toks[o.request_id] += o.new_token_ids
            lps[o.request_id] += [lp.logprob for lp in o.logprobs or ()]
    return [toks[i] for i in ids], [lps[i] for i in ids]


def max_position_run(e, reqs):
    """logprobs_run，再记下喂给 RoPE 的最大位置。"""
    plan, seen = e.kv_cache.plan, [0]

    def recording_plan(*a, **kw):
        fwd = plan(*a, **kw)
        seen[0] = max(seen[0], int(fwd.positions.max()))
        return fwd
    e.kv_cache.plan = recording_plan
    return logprobs_run(e, reqs), seen[0]


@one_arch
def test_window_with_cache_positions_equals_text_positions(tiny, monkeypatch):
    """window 留的是连续的最近 B 个 token：query 到每个 key 的距离按槽号与按原文位置算都一样，RoPE 只看距离，
    所以两种位置的 logprob 相同（到浮点误差）。两个对照说明 cache 位置真的开着：喂给 RoPE 的位置不超过槽数
    （预算 + 一块 − 1 + 一次前向的 token），text 位置一直涨到请求的长度；压缩时不重新旋转 key 就不相同。"""
    reqs, B, bs, T = requests(max_new=40, logprobs=1), 12, BASE["block_size"], BASE["max_num_batched_tokens"]
    text, text_max = max_position_run(engine(tiny.model, kv_policy="window", kv_budget=B, kv_positions="text"), reqs)
    e = engine(tiny.model, kv_policy="window", kv_budget=B, kv_positions="cache")
    cache, cache_max = max_position_run(e, reqs)
    assert e.num_compactions > 10
    assert cache_max < B + bs - 1 + T < text_max == max(LENGTHS) + 40 - 2
    assert cache[0] == text[0]
    assert max(abs(a - b) for x, y in zip(cache[1], text[1]) for a, b in zip(x, y)) < 1e-4
    monkeypatch.setattr(step12, "rotation_deltas", lambda kept: torch.zeros_like(kept))   # 挪了槽、不转
    stale = logprobs_run(engine(tiny.model, kv_policy="window", kv_budget=B, kv_positions="cache"), reqs)
    assert max(abs(a - b) for x, y in zip(stale[1], text[1]) for a, b in zip(x, y)) > 1e-3


@one_arch
@pytest.mark.parametrize("policy, positions", [("sinks", "cache"), ("h2o", "text")])
def test_gather_path_equals_the_paged_kernel_under_eviction(tiny, policy, positions):
    """--attention gather（按槽的掩码、按槽读块）与分页内核在压缩过的缓存上给出同样的 token。"""
    reqs = requests()
    cfg = dict(kv_policy=policy, kv_budget=16, kv_positions=positions)
    paged = engine(tiny.model, **cfg)
    out = paged.generate(reqs).outputs
    assert paged.num_compactions > 10
    assert engine(tiny.model, attention="gather", **cfg).generate(reqs).outputs == out


# ---- 分数 ----

class Recorder:
    """整段一次前向、不分页：记下每层的 q 与 k（已做 RoPE），注意力照常（因果）。"""
    mask = None

    def __init__(self):
        self.q, self.k = {}, {}

    def attend(self, layer_idx, q, k, v):
        self.q[layer_idx], self.k[layer_idx] = q, k
        return attention(q, k, v)


@pytest.mark.parametrize("attn", ["paged", "gather"])
def test_h2o_scores_equal_a_direct_softmax(tiny, attn):
    """分块 prefill（每块 8 个）+ 几步 decode、没有压缩：每个槽的分数 = 整段因果注意力里，它从全部 query、
    同一 KV 组的全部 query 头得到的概率之和（这里直接用 einsum 算，不用 eviction.attention_scores）。"""
    check_h2o_scores(tiny.model, dict(attention=attn), 1e-4)


@one_arch
def test_h2o_scores_in_a_bf16_pool_with_cache_positions(tiny):
    """同上，bfloat16 + cache 位置：池子里是 RoPE 之前的 K，打分前 q 与 K 要按槽号转（没压缩过，槽号就是原文位置）。
    转了差约 2e-4；不转差约 2e-2。"""
    from common.weights import load_model
    e = check_h2o_scores(load_model(tiny.path, "cpu", torch.bfloat16), dict(kv_positions="cache"), 2e-3)
    assert e.kv_cache.pre_rope


def check_h2o_scores(model, cfg: dict, atol: float):
    e = engine(model, kv_policy="h2o", kv_budget=200, max_num_batched_tokens=8, **cfg)
    rid = e.add_request(Request(prompts(lengths=(21,))[0], 10, GREEDY, ignore_eos=True))
    seq = e.seqs[rid]
    while len(seq.output_ids) < 6:
        e.step()
    S = seq.kv_len
    assert S == seq.num_computed_tokens == 21 + 5
    rec = Recorder()
    with torch.inference_mode():
        model(torch.tensor([seq.token_ids[:S]]), torch.arange(S)[None], rec)
    H, H_kv, D = model.cfg.num_heads, model.cfg.num_kv_heads, model.cfg.head_dim
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    for layer in range(model.cfg.num_layers):
        q = rec.q[layer][0].view(H_kv, H // H_kv, S, D)                   # (H_kv, G, S, D)
        k = rec.k[layer][0]                                               # (H_kv, S, D)
        s = torch.einsum("hgqd,hkd->hgqk", q.float(), k.float()) / D ** 0.5
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        assert torch.allclose(seq.kv_scores[layer, :, :S], p.sum(dim=(1, 2)), atol=atol)
        assert (seq.kv_scores[layer, :, S:] == 0).all()
    return e


@pytest.mark.parametrize("voters", [1, 2, 6])
def test_attention_scores_use_only_the_last_voters(voters):
    """6 个 query 在槽 4..9（10 个槽里最后 6 个），4 个 query 头、2 个 KV 头。逐个 query、逐个头手算：query i 在槽 4 + i，
    softmax 只在槽 0..4+i 上取；最后 voters 个 query 的概率按 KV 组加起来。"""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 6, 8, generator=g), torch.randn(2, 10, 8, generator=g)
    want = torch.zeros(2, 10, dtype=torch.float64)
    for h in range(4):
        for i in range(6 - voters, 6):
            slot = 4 + i
            s = (k[h // 2, :slot + 1].double() @ q[h, i].double()) / 8 ** 0.5   # (slot + 1,)
            want[h // 2, :slot + 1] += torch.softmax(s, dim=0)
    got = eviction.attention_scores(q, k, voters)
    assert got.shape == (2, 10)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


@one_arch
@pytest.mark.parametrize("step", [step12, step13], ids=["step12", "step13"])
@pytest.mark.parametrize("policy, compactions, peak", [("snapkv", 1, 70), ("snapkv-chunked", 3, 56)])
def test_snapkv_compacts_only_the_prompt(tiny, policy, compactions, peak, step):
    """提示词 70、每块 32、预算 24：snapkv 在算完整个提示词之后压缩一次（prefill 时整个提示词都在池子里：块表到过
    ⌈70 / 4⌉ 块）；snapkv-chunked 每块之后各压缩一次（32、56、30 个槽 → 24，块表最多 ⌈56 / 4⌉ 块）。
    decode 的 token 都只往后写。"""
    e = engine(tiny.model, step, kv_policy=policy, kv_budget=24, snapkv_window=8)
    rid = e.add_request(Request(prompts(lengths=(70,))[0], 30, GREEDY, ignore_eos=True))
    seq = e.seqs[rid]
    while len(seq.output_ids) < 29:
        e.step()
    assert e.num_compactions == compactions and seq.num_evicted == 70 - 24 and seq.kv_len == 24 + 28
    assert seq.peak_blocks == -(-peak // 4)
    while e.has_unfinished_requests():
        e.step()
    assert_all_free(e)


@one_arch
@pytest.mark.parametrize("P, compacted", [(20, False), (21, True), (23, True)])
def test_snapkv_compresses_a_prompt_just_over_the_budget(tiny, P, compacted):
    """预算 20、块 4：提示词长于预算就压缩（SnapKV 的代码：提示词不短于容量就压），[B, B + 一块) 里的也压，压到正好 B。"""
    e = engine(tiny.model, kv_policy="snapkv", kv_budget=20, snapkv_window=8)
    rid = e.add_request(Request(prompts(lengths=(P,))[0], 4, GREEDY, ignore_eos=True))
    seq = e.seqs[rid]
    e.step()                                       # 整个提示词一块（每次前向 32 个）
    assert (e.num_compactions, seq.kv_len, seq.num_evicted) == ((1, 20, P - 20) if compacted else (0, P, 0))
    while e.has_unfinished_requests():
        e.step()
    assert_all_free(e)


@one_arch
def test_snapkv_admission_holds_the_whole_prompt(tiny):
    """snapkv 在 prefill 时留着整个提示词：70 个 token 要 ⌈70 / 4⌉ = 18 块，12 块的池子拒绝它（预算再小也一样）；
    18 块的池子跑得完、正好用到 18 块。snapkv-chunked 每块之后就压缩：12 块够。"""
    req = Request(prompts(lengths=(70,))[0], 4, GREEDY, ignore_eos=True)
    cfg = dict(kv_budget=16, snapkv_window=8, max_num_batched_tokens=16)
    with pytest.raises(UserError, match="num-blocks"):
        engine(tiny.model, num_blocks=12, kv_policy="snapkv", **cfg).add_request(req)
    e = engine(tiny.model, num_blocks=18, kv_policy="snapkv", **cfg)
    out = e.generate([req])
    assert out.stats.kv_blocks_peak == [18] and len(out.outputs[0]) == 4 and e.num_compactions == 1
    assert_all_free(e)
    e = engine(tiny.model, num_blocks=12, kv_policy="snapkv-chunked", **cfg)
    assert len(e.generate([req]).outputs[0]) == 4 and e.num_compactions > 1
    assert_all_free(e)


# ---- 抢占、前缀缓存 ----

@one_arch
@pytest.mark.parametrize("preempt", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["sinks", "h2o"])
def test_preemption_under_a_policy(tiny, policy, preempt):
    """池子 14 块、5 个请求：抢占一定发生。换出的请求回来时槽数、num_evicted、分数都与换出时相同（K/V 原样搬回）；
    重算的请求从头再来（num_evicted 清零）。都跑完，块全回来。"""
    e = engine(tiny.model, num_blocks=14, kv_policy=policy, kv_budget=16, preempt=preempt)
    ids = [e.add_request(r) for r in requests()]
    out, away, back, preempted = {i: [] for i in ids}, {}, [], []
    preempt_one = e.scheduler._preempt
    e.scheduler._preempt = lambda seq: preempted.append(seq.num_evicted) or preempt_one(seq)
    if e.swap is not None:
        swap_in = e.swap.swap_in

        def checked_swap_in(handle, blocks):   # 调度器换入的是 swapped 的队头
            seq = e.scheduler.swapped[0]
            evicted, kv_len, scores = away.pop(seq.request_id)
            assert (seq.num_evicted, seq.kv_len) == (evicted, kv_len)
            assert scores is None or torch.equal(seq.kv_scores, scores)
            back.append(evicted)
            return swap_in(handle, blocks)
        e.swap.swap_in = checked_swap_in
    while e.has_unfinished_requests():
        for o in e.step():
            out[o.request_id] += o.new_token_ids
        for seq in e.scheduler.swapped:         # 换出之后、换入之前的样子
            away.setdefault(seq.request_id, (seq.num_evicted, seq.kv_len, None if seq.kv_scores is None
                                             else seq.kv_scores.clone()))
        for seq in e.scheduler.waiting:
            assert seq.num_evicted == 0 and seq.kv_scores is None
    assert not e.scheduler.swapped and not away
    assert any(back) == (preempt == "swap")      # 换出过已经压缩过的请求
    assert any(preempted) and e.num_compactions > 0   # 抢占过已经压缩过的请求
    assert [len(out[i]) for i in ids] == [30] * 5
    assert_all_free(e)


@one_arch
def test_prefix_hit_then_compaction_leaves_the_sharer_alone(tiny):
    """A 的前 32 个 token 登记进前缀缓存、A 还拿着它们时 B 命中（共享这些块），同一步两人都压缩：
    A 的输出与没有别人共享时（关掉前缀缓存、单独跑）逐 token 相同；B 确实命中了，块全回来。"""
    shared = prompts(lengths=(32,))[0]
    a = Request(shared + prompts(seed=1, lengths=(18,))[0], 20, GREEDY, ignore_eos=True)
    b = Request(shared + prompts(seed=2, lengths=(30,))[0], 20, GREEDY, ignore_eos=True)
    cfg = dict(kv_policy="sinks", kv_budget=40)
    alone = engine(tiny.model, enable_prefix_caching=False, **cfg).generate([a]).outputs[0]
    e = engine(tiny.model, **cfg)
    out = e.generate([a, b])
    assert out.stats.cached_tokens == [0, 32]
    assert out.outputs[0] == alone
    assert e.num_compactions >= 2
    assert_all_free(e)


@one_arch
def test_compaction_waits_when_no_fresh_blocks(tiny, monkeypatch):
    """分不到新块（这里让 can_replace 第一次说不够）：这一次不压缩、记一笔，下一次前向之后再压缩；请求照常跑完。"""
    e = engine(tiny.model, kv_policy="window", kv_budget=16)
    real, calls = e.block_manager.can_replace, []

    def once_no(table, n):
        calls.append(n)
        return len(calls) > 1 and real(table, n)
    monkeypatch.setattr(e.block_manager, "can_replace", once_no)
    out = e.generate(requests(ps=prompts(lengths=(10,)), max_new=30))
    assert e.num_compactions_skipped == 1 and e.num_compactions >= 2
    assert len(out.outputs[0]) == 30
    assert_all_free(e)


@one_arch
@pytest.mark.parametrize("step", [step12, step13], ids=["step12", "step13"])
@pytest.mark.parametrize("policy", ["window", "sinks"])
def test_a_prefix_hit_longer_than_the_budget_is_capped(tiny, policy, step):
    """预算 8、块 4、每次前向 16 个、池子 7 块（add_request 按 预算 + 一块 − 1 + 一次前向 = 27 个槽检查过）。
    A（17 个 token）登记了 4 个满块；B 的前 16 个 token 与 A 相同。全用这 16 个命中的槽，第一块 prefill 要 16 + 16 = 32 个槽、
    8 块，池子再空也放不下（修之前：调度器交出空批，plan 抛 ValueError）。命中的只用到 命中 + 16 ≤ 7 块的那几块
    （12 个 token），其余照常重算：B 跑完，块全回来。"""
    x = prompts(lengths=(17,))[0]
    e = engine(tiny.model, step, num_blocks=7, max_num_batched_tokens=16, kv_policy=policy, kv_budget=8)
    assert len(e.generate([Request(x, 1, GREEDY, ignore_eos=True)]).outputs[0]) == 1
    out = e.generate([Request(x[:16] + prompts(seed=1, lengths=(30,))[0], 20, GREEDY, ignore_eos=True)])
    assert len(out.outputs[0]) == 20 and out.stats.cached_tokens == [12]
    assert_all_free(e)


@one_arch
@pytest.mark.parametrize("step", [step12, step13], ids=["step12", "step13"])
def test_a_request_that_can_never_be_admitted_ends_with_an_error(tiny, monkeypatch, step):
    """块数的上界算少了时（这里让块管理器对 12 个 token 的请求一直说"放不下"）：运行集合空了、池子全空也接纳不了它，它以
    finish_reason "error" 结束，错误说出原因；别的请求照常跑完，不抛异常、不空转，块全回来。generate 把这个错误抛给调用者。"""
    e = engine(tiny.model, step, kv_policy="window", kv_budget=16)
    real = e.block_manager.can_allocate_seq
    monkeypatch.setattr(e.block_manager, "can_allocate_seq",
                        lambda seq, match, slots=None: len(seq.request.prompt_ids) != 12 and real(seq, match, slots))
    ids = [e.add_request(r) for r in requests(ps=prompts(lengths=(9, 12)), max_new=5)]
    done = {}
    for _ in range(20):
        done.update({o.request_id: o for o in e.step() if o.finished})
        if not e.has_unfinished_requests():
            break
    assert not e.has_unfinished_requests()
    assert done[ids[0]].finish_reason == "length" and done[ids[1]].finish_reason == "error"
    assert isinstance(done[ids[1]].error, UserError) and "cannot be scheduled" in str(done[ids[1]].error)
    assert_all_free(e)
    with pytest.raises(UserError, match="cannot be scheduled"):
        e.generate(requests(ps=prompts(lengths=(9, 12)), max_new=5))
    assert_all_free(e)


@one_arch
@pytest.mark.parametrize("step", [step12, step13], ids=["step12", "step13"])
def test_an_evicting_policy_preempts_by_swapping(tiny, step):
    """抢占默认：full 重算（= step09），驱逐策略换出（重算要把整段历史再 prefill 一遍）；--preempt 给了就照它。
    小池子里每次抢占都是换出，都跑完，块全回来。"""
    assert engine(tiny.model, step).swap is None
    assert engine(tiny.model, step, kv_policy="window", kv_budget=16, preempt="recompute").swap is None
    e = engine(tiny.model, step, num_blocks=14, kv_policy="window", kv_budget=16)
    out = e.generate(requests())
    assert out.stats.preemptions > 0 and e.swap.num_swap_out == out.stats.preemptions
    assert [len(o) for o in out.outputs] == [30] * 5
    assert_all_free(e)


# ---- 坏输入 ----

@pytest.mark.parametrize("kw, flag", [
    (dict(kv_policy="sinks"), "--kv-budget"),
    (dict(kv_budget=64), "--kv-budget"),
    (dict(kv_positions="cache"), "--kv-positions"),
    (dict(kv_policy="sinks", kv_budget=19), "--num-sinks"),                  # < 4 + 16
    (dict(kv_policy="sinks", kv_budget=24, num_sinks=9), "--num-sinks"),     # < 9 + 16
    (dict(kv_policy="window", kv_budget=15), "--block-size"),
    (dict(kv_policy="h2o", kv_budget=15), "--block-size"),
    (dict(kv_policy="h2o", kv_budget=32, h2o_recent=32), "--h2o-recent"),
    (dict(kv_policy="snapkv", kv_budget=31), "--snapkv-window"),            # < 32：只压缩一次，放得下窗口就行
    (dict(kv_policy="snapkv-chunked", kv_budget=47), "--snapkv-window"),    # < 32 + 16：每块都压缩
    (dict(kv_policy="snapkv-chunked", kv_budget=64, snapkv_pool=4), "--snapkv-pool"),
    (dict(kv_policy="snapkv", kv_budget=64, snapkv_pool=4), "--snapkv-pool"),
    (dict(kv_policy="window", kv_budget=32, num_sinks=2), "--num-sinks"),
    (dict(kv_policy="sinks", kv_budget=32, h2o_recent=2), "--h2o-recent"),
    (dict(kv_policy="h2o", kv_budget=32, snapkv_window=8), "--snapkv-window"),
    (dict(kv_policy="h2o", kv_budget=32, snapkv_pool=3), "--snapkv-pool"),
    (dict(kv_policy="window", kv_budget=32, preempt="swapout"), "--preempt"),
    (dict(kv_policy="sinks", kv_budget=32, spec_method="ngram"), "--spec-method"),
    (dict(kv_policy="h2o", kv_budget=32, kv_dtype="int8"), "--kv-dtype"),
    (dict(kv_policy="lru", kv_budget=32), "--kv-policy"),
    (dict(kv_policy="window", kv_budget=32, kv_positions="slot"), "--kv-positions"),
    (dict(kv_policy="window", kv_budget=0), "--kv-budget"),
    (dict(max_model_len=0), "--max-model-len"),
])
def test_bad_eviction_config(kw, flag):
    with pytest.raises(UserError) as e:
        step12.EngineConfig(num_blocks=64, **kw).validate()
    assert flag in str(e.value)


@pytest.mark.parametrize("argv, flag", [
    (["--kv-policy", "sinks"], "--kv-budget"),
    (["--kv-budget", "64"], "--kv-budget"),
    (["--kv-policy", "window", "--kv-budget", "32", "--num-sinks", "2"], "--num-sinks"),
    (["--kv-policy", "h2o", "--kv-budget", "32", "--spec-method", "ngram"], "--spec-method"),
    (["--kv-policy", "h2o", "--kv-budget", "32", "--kv-dtype", "int8"], "--kv-dtype"),
    (["--kv-policy", "sinks", "--kv-budget", "64", "--no-chunked-prefill"], "--no-chunked-prefill"),
])
def test_run_py_refuses_bad_flags_before_loading_the_model(argv, flag, capsys, tmp_path):
    """--model 指向一个不存在的目录：报的是参数的错，说明检查在加载模型之前。"""
    line = cli_error(run12, ["--prompt", "hi", "--model", str(tmp_path / "nowhere"), *argv], capsys)
    assert flag in line


def test_run_py_json_reports_kv_blocks(tiny_tok_dir):
    r = run_py("step12_kv_eviction", "--prompt", "Once upon a time", "--prompt", "Hello", "--model", str(tiny_tok_dir),
               "--max-new-tokens", "40", "--ignore-eos", "--kv-policy", "sinks", "--kv-budget", "12",
               "--num-sinks", "4", "--block-size", "4", "--device", "cpu", "--dtype", "float32", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for res in out["results"]:
        # 提示词短于 预算 + 一块：槽数最多到 16（压缩前写满第 4 块），full 要 ⌈(提示词 + 39) / 4⌉ ≥ 10 块
        assert len(res["prompt_ids"]) < 12 + 4 and len(res["output_ids"]) == 40
        assert res["kv_blocks"] <= res["kv_blocks_peak"] == -(-(12 + 4) // 4)
    assert out["stats"]["compactions"] > 0


# ---- 真实模型（一个短测试）----

def test_real_model_full_equals_step09_and_a_covering_budget_equals_full(real):
    ids = [real.tok.encode("The capital of France is"), real.tok.encode("def fibonacci(n):")]
    reqs = [Request(i, 16, GREEDY, ignore_eos=True) for i in ids]
    cfg = dict(num_blocks=32, block_size=16)
    ref = step09.LLMEngine(real.model, step09.EngineConfig(**cfg)).generate(reqs)
    full = step12.LLMEngine(real.model, step12.EngineConfig(**cfg)).generate(reqs)
    assert full.outputs == ref.outputs and full.stats.num_forwards == ref.stats.num_forwards
    # 预算正好盖住（块 4：最长的请求前向之后最多 提示词 + 14 个槽，预算 = 它 − 4 + 1）：一次也不压缩、走驱逐的分块分配，
    # 与 step09 相同；再小一个槽就压缩（边界是真的）
    bs, longest = 4, max(len(i) for i in ids) + 16 - 2
    e = step12.LLMEngine(real.model, step12.EngineConfig(**cfg | dict(block_size=bs), kv_policy="sinks",
                                                         kv_budget=longest - bs + 1))
    assert e.generate(reqs).outputs == ref.outputs and e.num_compactions == 0
    e = step12.LLMEngine(real.model, step12.EngineConfig(**cfg | dict(block_size=bs), kv_policy="sinks",
                                                         kv_budget=longest - bs))
    e.generate(reqs)
    assert e.num_compactions >= 1
