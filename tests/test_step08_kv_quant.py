"""step08：量化 / 反量化的误差界、字节公式对上张量大小、流式量化缓存写进去的码不再变、
换出 / 换入逐位还原且第二层最后为空、质量指标在已知输入上的值；分页引擎：精确模式与 step07 相同、
换出模式与 step03 相同、量化池子的往返误差与字节、量化输出与调度无关、命令行的错误。"""
from types import SimpleNamespace

import pytest
import torch

from common.compare import top2_margin
from common.errors import UserError
from conftest import cli_error, one_arch
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single.cache import PreallocKVCache
from step03_kvcache_single.engine import generate
from step04_static_batching.request import Request
from step05_paged.paged_cache import PagedKVCache
from step07_chunked_prefill.engine import ChunkedPrefillEngine
from step08_kv_quant.dense_cache import QuantKVCache
from step08_kv_quant.engine import KVQuantEngine, num_blocks_for_mib
from step08_kv_quant.paged_quant import QuantPagedKVCache, kv_format
from step08_kv_quant.quality import first_divergence, forced_logits, pool, teacher_forced_quality
from step08_kv_quant.quant import (QuantizedBlocks, QuantScheme, compute_scale, dequantize, fake_quantize,
                                   kv_bytes_per_token, quantize)
from step08_kv_quant.swap import SwapSpace
from step08_kv_quant.swap_cost import SwapVsRecompute, crossover

DATA_GRANULARITIES = ("token", "block", "channel")   # scale 从数据算的粒度


def k_like(n=3, H_kv=2, bs=16, D=32, seed=0) -> torch.Tensor:
    """(n, H_kv, bs, D) 的随机块，像真实的 K：少数通道（3、17）比其余大 20 倍，且带正偏移。"""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H_kv, bs, D, generator=g)
    x[..., [3, 17]] = 20 * x[..., [3, 17]] + 30
    return x


# ---------- 量化的数学 ----------

@pytest.mark.parametrize("granularity", DATA_GRANULARITIES)
def test_int8_round_trip_error_is_at_most_half_a_scale_step(granularity):
    scheme = QuantScheme("int8", granularity)
    x = k_like()
    scale = compute_scale(x, scheme)
    codes = quantize(x, scale, scheme)
    assert codes.dtype == torch.int8 and int(codes.min()) >= -127 and int(codes.max()) <= 127
    err = (dequantize(codes, scale, torch.float32) - x).abs()
    assert bool((err <= scale / 2 * (1 + 1e-5)).all())           # 就近舍入：最多半个台阶，没有截断
    # 每组里绝对值最大的数正好落在 ±127：scale 没有浪费码
    dims = {"token": (-1,), "block": (-2, -1), "channel": (-2,)}[granularity]
    assert bool((codes.abs().amax(dim=dims) == 127).all())


@pytest.mark.parametrize("granularity", DATA_GRANULARITIES)
def test_fp8_error_is_relative(granularity):
    """e4m3 有 3 位尾数：正规数（|x/scale| ≥ 2⁻⁶）的误差 ≤ 2⁻⁴·|x|；更小的次正规数，台阶是 2⁻⁹·scale，误差 ≤ 半个台阶。"""
    scheme = QuantScheme("fp8", granularity)
    x = k_like()
    scale = compute_scale(x, scheme)
    codes = quantize(x, scale, scheme)
    assert codes.dtype == torch.float8_e4m3fn
    err = (dequantize(codes, scale, torch.float32) - x).abs()
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-5)
    assert bool((err <= bound).all())
    assert float(codes.float().abs().max()) == 448.0             # 最大的数映到 e4m3 的最大值


def test_fixed_scale_clips_values_outside_the_range():
    x = torch.tensor([0.3, -200.0, 1000.0]).view(1, 1, 1, 3)
    assert fake_quantize(x, QuantScheme("int8", "tensor", 1.0)).flatten().tolist() == [0.0, -127.0, 127.0]
    assert fake_quantize(x, QuantScheme("fp8", "tensor", 1.0)).flatten().tolist() == [0.3125, -192.0, 448.0]


def test_channel_scales_protect_the_small_channels_of_k():
    """K 的离群通道让按 token 的 scale 变大，同一 token 的其余通道被量化得很粗；按通道的 scale 不受影响。"""
    x = k_like()
    small = [c for c in range(x.shape[-1]) if c not in (3, 17)]
    errs = {g: float((fake_quantize(x, QuantScheme("int8", g)) - x)[..., small].abs().mean())
            for g in ("token", "channel")}
    assert errs["channel"] * 5 < errs["token"]


def test_bad_scheme_is_rejected():
    with pytest.raises(ValueError):
        QuantScheme("int4", "token")
    with pytest.raises(ValueError):
        QuantScheme("int8", "row")
    with pytest.raises(ValueError):
        QuantScheme("fp8", "tensor")          # 固定 scale 必须给出


# ---------- 字节公式 = 张量实际大小 ----------

SCHEMES = [None, QuantScheme("int8", "token"), QuantScheme("int8", "block"), QuantScheme("int8", "channel"),
           QuantScheme("fp8", "token"), QuantScheme("fp8", "channel"), QuantScheme("fp8", "tensor", 1.0)]


@pytest.mark.parametrize("k", SCHEMES, ids=lambda s: s.name if s else "none")
@pytest.mark.parametrize("v", SCHEMES[:3], ids=lambda s: s.name if s else "none")
def test_bytes_formula_equals_tensor_sizes(k, v):
    cfg = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=16)
    num_blocks, bs, dtype = 5, 8, torch.bfloat16
    nbytes, constant = 0, 0
    for s in (k, v):
        if s is None:
            nbytes += torch.zeros(cfg.num_layers, num_blocks, cfg.num_kv_heads, bs, cfg.head_dim, dtype=dtype).nbytes
        else:
            store = QuantizedBlocks(s, cfg.num_layers, num_blocks, cfg.num_kv_heads, bs, cfg.head_dim)
            nbytes += store.nbytes
            if s.granularity == "tensor":
                constant += store.scales.nbytes          # 每层一个固定 scale：不随 token 数增长
    assert nbytes == kv_bytes_per_token(cfg, k, v, bs, dtype) * num_blocks * bs + constant


def test_int8_bytes_ratio_on_the_default_model_shape():
    """SmolLM2-135M（30 层、3 个 KV 头、D = 64）：int8 + 每 token 每头一个 float32 scale = (64 + 4) / (64 × 4)。"""
    cfg = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    s = QuantScheme("int8", "token")
    assert kv_bytes_per_token(cfg, s, s, 16, torch.float32) / kv_bytes_per_token(cfg, None, None, 16,
                                                                                  torch.float32) == 68 / 256


# ---------- 流式量化缓存 ----------

def by_position(codes: torch.Tensor) -> torch.Tensor:
    """第 0 层的码 (nb, H_kv, bs, D) → 按位置排 (nb·bs, H_kv, D)。"""
    nb, H_kv, bs, D = codes.shape[1:]
    return codes[0].permute(0, 2, 1, 3).reshape(nb * bs, H_kv, D)


@pytest.mark.parametrize("k_gran", ["token", "block", "channel"])
def test_stream_quantized_codes_never_change_and_the_partial_block_is_exact(k_gran):
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=2, head_dim=32)
    bs, T = 8, 29
    k = k_like(1, 2, T, 32)                                  # (1, H_kv, T, D)
    v = torch.randn(1, 2, T, 32, generator=torch.Generator().manual_seed(1))
    scheme_k, scheme_v = QuantScheme("int8", k_gran), QuantScheme("fp8", "token")
    group = bs if scheme_k.needs_full_block else 1           # 一个 scale 管几个 token
    cache = QuantKVCache(cfg, T, "cpu", torch.float32, scheme_k, scheme_v, block_size=bs)
    start, history = 0, []
    for n in [11] + [1] * 18:                                # 一次 prefill 11 个，再逐个 decode
        k_all, v_all = cache.update(0, k[:, :, start:start + n], v[:, :, start:start + n])
        cache.advance(n)
        start += n
        done = start // group * group                        # 已经量化进去的位置
        # 已量化的部分 = 按组量化再读回；未满块里的位置是原值
        groups = k[0, :, :done].reshape(2, done // group, group, 32).transpose(0, 1)   # (组数, H_kv, group, D)
        expect = fake_quantize(groups, scheme_k).transpose(0, 1).reshape(2, done, 32)
        assert torch.equal(k_all[0, :, :done], expect)
        assert torch.equal(k_all[0, :, done:start], k[0, :, done:start])
        assert torch.equal(v_all[0], fake_quantize(v[0, :, :start, None], scheme_v)[:, :, 0])
        history.append((done, by_position(cache.stores[0].codes).clone()))
    final = by_position(cache.stores[0].codes)
    for done, codes in history:                              # 每个位置的码写进去之后再没变过
        assert torch.equal(codes[:done], final[:done])


def test_unquantized_dense_cache_equals_step03(tiny):
    """K、V 都不量化时，QuantKVCache 只是换了块状布局：生成的 token 与 teacher-forcing logits 与 step03 完全相同。"""
    m, cfg = tiny.model, tiny.cfg
    ids = [5, 17, 99, 3, 42, 7, 200, 11, 64]
    ref = generate(m, ids, 12, SamplingParams(), ignore_eos=True)
    got = generate(m, ids, 12, SamplingParams(), ignore_eos=True,
                   cache=QuantKVCache(cfg, len(ids) + 11, "cpu", torch.float32, None, None, block_size=4))
    assert got == ref
    seq = ids + ref
    a = forced_logits(m, PreallocKVCache(cfg, len(seq), "cpu", torch.float32), seq, len(ids))
    b = forced_logits(m, QuantKVCache(cfg, len(seq), "cpu", torch.float32, None, None, block_size=4), seq, len(ids))
    assert torch.equal(a, b)


def test_forced_logits_match_a_full_forward(tiny):
    """teacher-forcing 驱动（prefill + 逐个 decode）算的 logits = 整段一次前向的 logits（浮点求和顺序不同，差在末位）。"""
    m, cfg = tiny.model, tiny.cfg
    seq = [5, 17, 99, 3, 42, 7, 200, 11, 64, 1, 2, 3]
    got = forced_logits(m, PreallocKVCache(cfg, len(seq), "cpu", torch.float32), seq, 5)
    with torch.inference_mode():
        full = m(torch.tensor([seq]), torch.arange(len(seq))[None])[0, :-1]
    assert got.shape == full.shape
    assert float((got - full).abs().max()) < 1e-4


def test_quantized_cache_runs_in_step03_generate(tiny):
    m, cfg = tiny.model, tiny.cfg
    ids = [5, 17, 99, 3, 42, 7, 200, 11, 64]
    s = QuantScheme("int8", "channel")
    cache = QuantKVCache(cfg, len(ids) + 11, "cpu", torch.float32, s, QuantScheme("int8", "token"), block_size=4)
    out = generate(m, ids, 12, SamplingParams(), ignore_eos=True, cache=cache)
    assert len(out) == 12 and cache.length == len(ids) + 11


# ---------- 质量指标 ----------

def test_quality_metrics_on_known_logits():
    ref = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 0.5]])
    targets = torch.tensor([0, 1, 2])
    same = teacher_forced_quality(ref, ref.clone(), targets)
    assert (same.top1_agreement, same.mean_abs_dlogit, same.max_abs_dlogit, same.nll_delta_fraction) == (1, 0, 0, 0)
    got = ref.clone()
    got[2, 1] = 2.0                                          # 第 3 个位置 argmax 变了，只改了一个数
    q = teacher_forced_quality(ref, got, targets)
    assert q.top1_agreement == pytest.approx(2 / 3)
    assert q.max_abs_dlogit == 2.0 and q.mean_abs_dlogit == pytest.approx(2 / 9)
    nll = lambda lg: -torch.log_softmax(lg, -1)[range(3), targets].sum()  # noqa: E731
    assert q.nll_delta_fraction == pytest.approx(float((nll(got) - nll(ref)) / nll(ref)))
    both = pool([same, q])
    assert both.positions == 6 and both.top1_agreement == pytest.approx(5 / 6)


def test_first_divergence_reports_the_exact_models_margin():
    logits = torch.tensor([[0.0, 1.0, 0.7], [3.0, 0.0, 0.0], [0.0, 0.2, 0.25]])
    fn = lambda ids: logits[:len(ids)]  # noqa: E731   "精确模型"：第 i 行是看到 i 个 token 后的 logits
    assert first_divergence([9], [1, 0], [1, 0], fn).position is None
    d = first_divergence([9], [1, 0], [1, 2], fn)
    assert (d.position, d.ref_token, d.got_token) == (1, 0, 2)
    assert d.margin == pytest.approx(top2_margin(logits[1]))


# ---------- 换出 / 换入 ----------

def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t     # fp8 没有 torch.equal：按字节比


def test_swap_out_and_in_restores_blocks_bit_for_bit():
    L, nb, H_kv, bs, D = 2, 8, 2, 4, 16
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(L, 2, nb, H_kv, bs, D, generator=g)                    # step05 的原精度池子：块在第 2 维
    k = QuantizedBlocks(QuantScheme("int8", "channel"), L, nb, H_kv, bs, D)   # 量化池子：块在第 1 维，码 + scale
    v = QuantizedBlocks(QuantScheme("fp8", "token"), L, nb, H_kv, bs, D)
    for layer in range(L):
        k.write_blocks(layer, torch.arange(nb), torch.randn(nb, H_kv, bs, D, generator=g))
        v.write_blocks(layer, torch.arange(nb), torch.randn(nb, H_kv, bs, D, generator=g))
    for tensors, dim in (([pool], 2), (k.tensors() + v.tensors(), 1)):
        space = SwapSpace(tensors, num_cpu_blocks=4, block_dim=dim)
        before = [t.clone() for t in tensors]
        src, dst = [5, 1, 3], [0, 6, 2]
        handle = space.swap_out(src)
        assert space.num_used == 3 and not space.can_swap_out(2)
        for t in tensors:                                                     # 块被别人拿去、覆盖掉
            t.index_fill_(dim, torch.tensor(src), 0) if t.element_size() > 1 else bits(t).index_fill_(dim, torch.tensor(src), 0)
        space.swap_in(handle, dst)
        for t, b in zip(tensors, before):
            for s_, d_ in zip(src, dst):
                assert torch.equal(bits(t.select(dim, d_)), bits(b.select(dim, s_)))
        assert space.num_used == 0                                            # 第二层最后是空的
        assert space.bytes_out == space.bytes_in == 3 * sum(t.select(dim, 0).nbytes for t in tensors)
        with pytest.raises(ValueError):
            space.swap_in(space.swap_out([0]), [1, 2])


def test_crossover_interpolates_between_measured_lengths():
    rows = [SwapVsRecompute(100, 0, 1.0, 1.0, 1.0), SwapVsRecompute(200, 0, 1.0, 1.0, 3.0)]
    assert crossover(rows) == pytest.approx(150.0)         # 差值 1 → -1：中点
    assert crossover(rows[:1]) is None
    assert crossover([SwapVsRecompute(n, 0, 0.1, 0.1, 1.0) for n in (1, 2, 3)]) is None


# ---------- 实验脚本的冒烟测试 ----------

def test_analyze_kv_quick_runs_end_to_end(tiny_tok_dir, tmp_path, capsys):
    """在本进程里跑（省掉一次进程启动与 import）：--quick 的全部五节都走一遍，JSON 里有各节的数。"""
    import json

    from step08_kv_quant import analyze_kv
    png = tmp_path / "mag.png"
    args = analyze_kv.parser().parse_args(["--quick", "--json", "--plot", str(png), "--model", str(tiny_tok_dir)])
    assert analyze_kv.main(args) is True
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["figures"]
    assert {"k_outlier_ratio_median", "rel_error_k_int8_channel", "top1_int8_token_token",
            "nll_delta_fraction_fp8_token_token", "swap_vs_recompute_time_ratio_int8_64"} <= set(figures)
    assert png.stat().st_size > 0


# ---------- 分页引擎（KVQuantEngine） ----------

def engine_workload(sampled: bool = True) -> list[Request]:
    """6 个请求：提示词 3–40 个 token，各生成 12–30 个（ignore_eos），奇数号带种子采样。"""
    import random
    rng = random.Random(3)
    return [Request([rng.randrange(2, 256) for _ in range(rng.randint(3, 40))], rng.randint(12, 30),
                    SamplingParams(temperature=0.9, top_p=0.95, seed=70 + i) if sampled and i % 2 else SamplingParams(),
                    ignore_eos=True) for i in range(6)]


def test_exact_mode_is_step07(tiny):
    """默认（以及 --kv-dtype 等于模型 dtype）：用的就是 step05 的池子、step07 的调度，输出与每一次前向都与 step07 相同。"""
    reqs = engine_workload()
    ref, st7 = ChunkedPrefillEngine(tiny.model, 40, 4, 4, 16).generate(reqs)
    for kw in ({}, {"kv_dtype": "float32"}):
        e = KVQuantEngine(tiny.model, 40, 4, 4, 16, **kw)
        assert type(e.cache) is PagedKVCache and e.fmt is None
        out, st8 = e.generate(reqs)
        assert out == ref
        assert [(x.prefill, x.rows, x.width, x.tokens) for x in st8.steps] == \
               [(x.prefill, x.rows, x.width, x.tokens) for x in st7.steps]
        assert st8.preemptions == st7.preemptions > 0             # 40 块的池子装不下全部：抢占也一样发生


@one_arch
def test_swap_mode_equals_step03_with_preemptions(tiny):
    reqs = engine_workload()
    refs = [generate(tiny.model, r.prompt_ids, r.max_new_tokens, r.params, (), r.ignore_eos) for r in reqs]
    e = KVQuantEngine(tiny.model, 24, 4, 4, 16, preempt="swap")
    out, st = e.generate(reqs)
    assert out == refs
    assert e.last_swap.swap_outs == st.preemptions > 0 and e.last_swap.swap_ins == e.last_swap.swap_outs
    assert e.last_swap.bytes_out == e.last_swap.bytes_in > 0
    assert e.swap.num_used == 0 and not any(e.allocator.ref_counts)   # 两层最后都是空的


@one_arch
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bfloat16"])
def test_quantized_output_does_not_depend_on_scheduling(tiny, kv_dtype):
    """token 粒度的码只取决于这个 token 的 K/V：换预算（分块不同）、换出再换入（块号不同），输出都不变。"""
    reqs = engine_workload()
    base, _ = KVQuantEngine(tiny.model, 200, 4, 6, 64, kv_dtype=kv_dtype).generate(reqs)
    small, _ = KVQuantEngine(tiny.model, 200, 4, 3, 5, kv_dtype=kv_dtype).generate(reqs)
    e = KVQuantEngine(tiny.model, 24, 4, 4, 16, kv_dtype=kv_dtype, preempt="swap")
    swapped, st = e.generate(reqs)
    assert small == base and swapped == base and st.preemptions > 0
    assert e.swap.num_used == 0


def fill_pool(tiny, fmt_name, T=23, bs=4):
    """随机 K/V（带离群通道）经 QuantPagedForward.update 写进量化池子，返回 (池子, 块表, 原 K, 原 V, update 返回的 K, V)。"""
    from step05_paged.sequence import Sequence
    fmt = kv_format(fmt_name, torch.float32)
    nb = -(-T // bs)
    cache = QuantPagedKVCache(tiny.cfg, nb + 2, bs, "cpu", torch.float32, fmt)
    seq = Sequence(Request(list(range(2, 2 + T)), 1), None, block_table=[nb + 1, *range(nb - 1, 0, -1), 0][:nb])
    fwd = cache.plan([seq])
    H_kv, D = tiny.cfg.num_kv_heads, tiny.cfg.head_dim
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, H_kv, T, D, generator=g)                               # (1, H_kv, T, D)
    k[..., [3, 11]] = 20 * k[..., [3, 11]] + 30                               # 像真实的 K：两个离群通道
    v = torch.randn(1, H_kv, T, D, generator=g)
    k_out, v_out = fwd.update(0, k, v)
    return cache, seq.block_table, k, v, k_out, v_out


@pytest.mark.parametrize("fmt_name", ["int8", "fp8"])
@one_arch
def test_quantized_pool_round_trip(tiny, fmt_name):
    cache, table_, k, v, k_out, v_out = fill_pool(tiny, fmt_name)
    T = k.shape[2]
    (k_back, k_scale), (v_back, v_scale) = cache.read_tokens(0, table_, T)
    # 全新的 prefill 返回的，与之后从池子里读回的逐位相同
    assert torch.equal(k_out[0], k_back) and torch.equal(v_out[0], v_back)
    for x, back, scale in ((k[0], k_back, k_scale), (v[0], v_back, v_scale)):
        err = (back - x).abs()
        if fmt_name == "int8":
            assert bool((err <= scale / 2 * (1 + 1e-5)).all())                # 最多半个台阶
        else:
            assert bool((err <= torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-5)).all())


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8"])
@one_arch
def test_pool_bytes_formula_equals_tensor_sizes(tiny, kv_dtype):
    e = KVQuantEngine(tiny.model, 7, 4, kv_dtype=kv_dtype)
    assert e.pool_nbytes == (7 + 1) * 4 * e.bytes_per_token()                # 多一块空块
    assert num_blocks_for_mib(tiny.cfg, 4, torch.float32, e.fmt, 1) == 2**20 // (4 * e.bytes_per_token())


@one_arch
def test_swap_restores_quantized_blocks_bit_for_bit(tiny):
    cache, table_, *_ = fill_pool(tiny, "int8")
    tensors = cache.tensors()
    space = SwapSpace(tensors, num_cpu_blocks=len(table_), block_dim=2)
    before = [t.clone() for t in tensors]
    handle = space.swap_out(table_)
    for t in tensors:
        t.zero_()                                                           # 块还给池子、被别人覆盖
    new = list(range(len(table_)))
    space.swap_in(handle, new)
    for t, b in zip(tensors, before):
        for old_b, new_b in zip(table_, new):
            assert torch.equal(t[:, :, new_b], b[:, :, old_b])
    assert space.num_used == 0


def test_bad_kv_dtype_and_preempt_are_errors(capsys):
    from step08_kv_quant import run
    assert "--kv-dtype" in cli_error(run, ["--prompt", "hi", "--kv-dtype", "int4"], capsys)
    assert "--preempt" in cli_error(run, ["--prompt", "hi", "--preempt", "drop"], capsys)
    assert "chunked" in cli_error(run, ["--prompt", "hi", "--preempt", "swap", "--no-chunked-prefill"], capsys)
    with pytest.raises(UserError):
        kv_format("int4", torch.float32)


def test_generation_mode_with_int8_and_swap(tiny_tok_dir, capsys):
    import json

    from common import cli
    from step08_kv_quant import run
    argv = ["--model", str(tiny_tok_dir), "--prompt", "Hello there", "--prompt", "The three primary colors are",
            "--max-new-tokens", "12", "--ignore-eos", "--kv-dtype", "int8", "--preempt", "swap", "--num-blocks", "2",
            "--block-size", "8", "--json"]
    with pytest.raises(SystemExit) as e:
        cli.run_main(run.make_parser(), run.main, argv)
    assert e.value.code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [len(r["output_ids"]) for r in out["results"]] == [12, 12]
    assert out["stats"]["kv_dtype"] == "int8" and out["stats"]["swap_outs"] > 0
