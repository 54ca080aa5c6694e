"""step08：量化 / 反量化的误差界与边界情况（零 / 负 / NaN 的固定 scale 被拒绝，算出来的 scale 有下限，NaN / ±inf /
全零的行给有限、有界的码）、字节公式对上张量大小、流式量化缓存写进去的码不再变、换出 / 换入逐位还原、质量指标在已知
输入上的值；分页引擎：精确模式与 step07 逐 token、逐次前向相同，换出模式（含第二层太小时退回重算）与 step03 相同，
量化池子（int8 / fp8 / bfloat16）在有抢占、分块、换出的批里与 step03 + 同样量化的单请求缓存逐 token 相同，
abort 与异常之后池子和第二层的块全部还回来，以及 run.py（生成模式的 token 与参考比较、错误）。"""
import json
import random
from types import SimpleNamespace

import pytest
import torch

from common import cli
from common.clock import VirtualClock
from common.compare import top2_margin
from common.errors import UserError
from common.harness import pool_is_free
from common.tokenizer import Tokenizer
from common.weights import load_model
from conftest import cli_error, one_arch
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single.cache import PreallocKVCache
from step03_kvcache_single.engine import generate
from step04_static_batching.request import Request
from step06_prefix_cache import engine as step06
from step07_chunked_prefill import engine as step07
from step08_kv_quant import run as step08_run
from step08_kv_quant.analysis.dense_cache import QuantizedBlocks, QuantKVCache
from step08_kv_quant.analysis.quality import first_divergence, forced_logits, pool, teacher_forced_quality
from step08_kv_quant.analysis.swap_cost import SwapVsRecompute, crossover
from step08_kv_quant.config import num_blocks_for_budget
from step08_kv_quant.engine import EngineConfig, LLMEngine
from step08_kv_quant.kv_cache import PagedKVCache
from step08_kv_quant.quant import (QMAX, SCALE_FLOOR, QuantScheme, compute_scale, dequantize, fake_quantize,
                                   kv_bytes_per_token, kv_format, quantize)
from step08_kv_quant.sequence import Sequence, SequenceStatus
from step08_kv_quant.swap import SwapSpace

DATA_GRANULARITIES = ("token", "block", "channel")   # scale 从数据算的粒度
LOSSY = ("int8", "fp8")


def k_like(n=3, H_kv=2, bs=16, D=32, seed=0) -> torch.Tensor:
    """(n, H_kv, bs, D) 的随机块，像真实的 K：少数通道（3、17）比其余大 20 倍，且带正偏移。"""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H_kv, bs, D, generator=g)
    x[..., [3, 17]] = 20 * x[..., [3, 17]] + 30
    return x


def error_bound(x: torch.Tensor, scale: torch.Tensor, dtype: str) -> torch.Tensor:
    """一次量化再读回的误差上界：int8 半个台阶；fp8 正规数 2⁻⁴·|x|，次正规数半个台阶 2⁻¹⁰·scale。"""
    b = scale / 2 if dtype == "int8" else torch.maximum(x.abs() * 2**-4, scale * 2**-10)
    return b * (1 + 1e-5)


# ---------- 量化的数学 ----------

@pytest.mark.parametrize("granularity", DATA_GRANULARITIES)
def test_int8_round_trip_error_is_at_most_half_a_scale_step(granularity):
    scheme = QuantScheme("int8", granularity)
    x = k_like()
    scale = compute_scale(x, scheme)
    codes = quantize(x, scale, scheme)
    assert codes.dtype == torch.int8 and int(codes.min()) >= -127 and int(codes.max()) <= 127
    err = (dequantize(codes, scale, torch.float32) - x).abs()
    assert bool((err <= error_bound(x, scale, "int8")).all())    # 就近舍入：最多半个台阶，没有截断
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
    assert bool((err <= error_bound(x, scale, "fp8")).all())
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
    with pytest.raises(ValueError):
        QuantScheme("int8", "token", 1.0)     # 只有 tensor 粒度有固定 scale


@pytest.mark.parametrize("dtype", LOSSY)
@pytest.mark.parametrize("bad", [0.0, -0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_zero_negative_or_nonfinite_static_scale_is_rejected(dtype, bad):
    """固定 scale 为 0：x / 0 是 ±inf / NaN，读回全是 0；负数把符号翻过来；NaN / inf 毁掉整个池子——都在构造时拒绝。"""
    with pytest.raises(ValueError, match="static_scale"):
        QuantScheme(dtype, "tensor", bad)


@pytest.mark.parametrize("dtype", LOSSY)
@pytest.mark.parametrize("granularity", DATA_GRANULARITIES)
@pytest.mark.parametrize("tiny_value", [1e-40, 1e-45])
def test_computed_scales_have_a_floor(dtype, granularity, tiny_value):
    """一组数小到非正规数（1e-40，以及 float32 最小的非正规数 1e-45：1e-45 / 127 下溢成 0）：scale 不低于 float32 的
    最小正规数，码有限，读回与原值的差在一次量化的误差界内（不会除以 0 得到 inf / NaN）。"""
    scheme = QuantScheme(dtype, granularity)
    x = torch.full((2, 2, 4, 8), tiny_value)
    x[0, 1, 2, 3] = -tiny_value
    scale = compute_scale(x, scheme)
    assert bool((scale >= SCALE_FLOOR).all()) and bool(torch.isfinite(scale).all())
    codes = quantize(x, scale, scheme)
    assert bool(torch.isfinite(codes.float()).all())
    back = dequantize(codes, scale, torch.float32)
    assert bool(torch.isfinite(back).all()) and bool(((back - x).abs() <= error_bound(x, scale, dtype)).all())


@pytest.mark.parametrize("dtype", LOSSY)
@pytest.mark.parametrize("granularity", DATA_GRANULARITIES)
def test_nan_and_inf_give_finite_bounded_codes(dtype, granularity):
    """NaN 的码是 0，±inf 截断到 ±qmax；scale 只看有限的数，所以同组里其余的数照常量化（误差界不变）；读回全部有限、
    |读回| ≤ qmax·scale。"""
    scheme = QuantScheme(dtype, granularity)
    x = k_like(2, 2, 8, 32)
    bad = torch.zeros_like(x, dtype=torch.bool)
    bad[0, 0, 1, 2] = bad[0, 1, 5, 7] = bad[1, 0, 3, 0] = True
    x[0, 0, 1, 2], x[0, 1, 5, 7], x[1, 0, 3, 0] = float("nan"), float("inf"), -float("inf")
    scale = compute_scale(x, scheme)
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    codes = quantize(x, scale, scheme).float()
    assert bool(torch.isfinite(codes).all())
    assert (codes[0, 0, 1, 2], codes[0, 1, 5, 7], codes[1, 0, 3, 0]) == (0, QMAX[dtype], -QMAX[dtype])
    back = dequantize(quantize(x, scale, scheme), scale, torch.float32)
    assert bool(torch.isfinite(back).all()) and bool((back.abs() <= QMAX[dtype] * scale * (1 + 1e-6)).all())
    good = ~bad
    assert bool(((back - x).abs() <= error_bound(x, scale, dtype))[good].all())
    # 和把坏值换成 0 之后算出的 scale 相同：坏值不影响同组的别人
    assert torch.equal(scale, compute_scale(torch.where(good, x, 0.0), scheme))


@pytest.mark.parametrize("dtype", LOSSY)
@pytest.mark.parametrize("granularity", DATA_GRANULARITIES + ("tensor",))
def test_all_zero_rows_round_trip_to_exactly_zero(dtype, granularity):
    scheme = QuantScheme(dtype, granularity, 0.5 if granularity == "tensor" else None)
    x = torch.zeros(2, 2, 4, 8)
    scale = compute_scale(x, scheme)
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    assert torch.equal(fake_quantize(x, scheme), x)


@pytest.mark.parametrize("name", LOSSY)
def test_kv_format_encode_handles_zero_tiny_nan_and_inf_rows(name):
    """引擎写池子用的 KVFormat.encode（每个 (token, 头) 一个 scale）：全零行读回正好 0，非正规数的行 scale 有下限，
    NaN / inf 给有限的码；round_trip 与 encode + decode 逐位相同。"""
    fmt = kv_format(name, torch.float32)
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(5))      # (N, H_kv, D)
    x[0, 0] = 0.0
    x[1, 1] = 1e-40
    x[2, 0, 3], x[2, 1, 0], x[3, 0, 9] = float("nan"), float("inf"), -float("inf")
    x[3, 1] = float("nan")                                                      # 整行 NaN
    codes, scale = fmt.encode(x)
    assert scale.shape == (4, 2, 1) and bool(torch.isfinite(scale).all()) and bool((scale >= SCALE_FLOOR).all())
    assert bool(torch.isfinite(codes.float()).all())
    back = fmt.round_trip(x)
    assert torch.equal(back, fmt.decode(codes, scale, torch.float32)) and bool(torch.isfinite(back).all())
    assert torch.equal(back[0, 0], torch.zeros(16)) and torch.equal(back[3, 1], torch.zeros(16))
    assert bool(((back[1, 1] - x[1, 1]).abs() <= error_bound(x[1, 1], scale[1, 1], name)).all())
    assert float(back[2, 0, 3]) == 0
    assert float(back[2, 1, 0]) == pytest.approx(QMAX[name] * float(scale[2, 1]), rel=1e-6)


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


# ---------- 流式量化缓存（analysis/dense_cache.py） ----------

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


class FakeQuantCache(PreallocKVCache):
    """参考实现：原值全部存着（step03 的预分配缓存），每次读时从原值重新"量化再读回"——token 粒度逐个 (token, 头)；
    block / channel 粒度只量化已写满的块，未满的最后一块给原值。与 QuantKVCache 的"写一次、存码"是两种写法，
    看到的 K/V 应当相同。"""

    def __init__(self, cfg, max_len, schemes, block_size):
        super().__init__(cfg, max_len, "cpu", torch.float32)
        self.schemes, self.bs = schemes, block_size

    def update(self, layer_idx, k, v):
        return tuple(self._read(x, s) for x, s in zip(super().update(layer_idx, k, v), self.schemes))

    def _read(self, x, scheme):                              # x (1, H_kv, S, D)
        if scheme is None:
            return x
        if not scheme.needs_full_block:
            return fake_quantize(x, scheme)                  # token 粒度：scale 沿 D
        _, H_kv, S, D = x.shape
        n = S // self.bs * self.bs
        full = x[0, :, :n].reshape(H_kv, n // self.bs, self.bs, D).transpose(0, 1)    # (nb, H_kv, bs, D)
        q = fake_quantize(full, scheme).transpose(0, 1).reshape(H_kv, n, D)
        return torch.cat([q, x[0, :, n:]], dim=1)[None]


@one_arch
@pytest.mark.parametrize("k_scheme", [QuantScheme("int8", "channel"), QuantScheme("fp8", "block"),
                                      QuantScheme("int8", "token")], ids=lambda s: s.name)
def test_quantized_dense_cache_in_step03_generate_equals_a_fake_quant_reference(tiny, k_scheme):
    """QuantKVCache（存码 + scale）放进 step03 的 generate，贪心输出与参考实现（存原值、读时量化）逐 token 相同，
    teacher-forcing 的 logits 也相同；并且与不量化的输出不同（量化真的起了作用）。"""
    m, cfg = tiny.model, tiny.cfg
    ids = [5, 17, 99, 3, 42, 7, 200, 11, 64]
    schemes, n = (k_scheme, QuantScheme("int8", "token")), 20
    got = generate(m, ids, n, SamplingParams(), ignore_eos=True,
                   cache=QuantKVCache(cfg, len(ids) + n - 1, "cpu", torch.float32, *schemes, block_size=4))
    ref = generate(m, ids, n, SamplingParams(), ignore_eos=True,
                   cache=FakeQuantCache(cfg, len(ids) + n - 1, schemes, 4))
    assert got == ref
    seq = ids + ref
    a = forced_logits(m, QuantKVCache(cfg, len(seq), "cpu", torch.float32, *schemes, block_size=4), seq, len(ids))
    b = forced_logits(m, FakeQuantCache(cfg, len(seq), schemes, 4), seq, len(ids))
    exact = forced_logits(m, PreallocKVCache(cfg, len(seq), "cpu", torch.float32), seq, len(ids))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert float((a - exact).abs().max()) > 1e-6


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
    pool_ = torch.randn(L, 2, nb, H_kv, bs, D, generator=g)                   # 原精度池子：块在第 2 维
    k = QuantizedBlocks(QuantScheme("int8", "channel"), L, nb, H_kv, bs, D)   # 量化存储：块在第 1 维，码 + scale
    v = QuantizedBlocks(QuantScheme("fp8", "token"), L, nb, H_kv, bs, D)
    for layer in range(L):
        k.write_blocks(layer, torch.arange(nb), torch.randn(nb, H_kv, bs, D, generator=g))
        v.write_blocks(layer, torch.arange(nb), torch.randn(nb, H_kv, bs, D, generator=g))
    for tensors, dim in (([pool_], 2), (k.tensors() + v.tensors(), 1)):
        space = SwapSpace(tensors, num_cpu_blocks=4, block_dim=dim)
        before = [t.clone() for t in tensors]
        src, dst = [5, 1, 3], [0, 6, 2]
        handle = space.swap_out(src, 3 * bs)
        assert space.num_used == 3 and not space.can_swap_out(2) and space.tokens_out == [3 * bs]
        for t in tensors:                                                     # 块被别人拿去、覆盖掉
            bits(t).index_fill_(dim, torch.tensor(src), 0)
        space.swap_in(handle, dst)
        for t, b in zip(tensors, before):
            for s_, d_ in zip(src, dst):
                assert torch.equal(bits(t.select(dim, d_)), bits(b.select(dim, s_)))
        assert space.num_used == 0                                            # 第二层最后是空的
        assert space.bytes_out == space.bytes_in == 3 * sum(t.select(dim, 0).nbytes for t in tensors)
        with pytest.raises(ValueError):
            space.swap_in(space.swap_out([0], 1), [1, 2])
        with pytest.raises(RuntimeError):
            space.swap_out([0, 1, 2, 3, 4], 5)                                # 第二层装不下


def test_crossover_interpolates_between_measured_lengths():
    rows = [SwapVsRecompute(100, 0, 1.0, 1.0, 1.0), SwapVsRecompute(200, 0, 1.0, 1.0, 3.0)]
    assert crossover(rows) == pytest.approx(150.0)         # 差值 1 → -1：中点
    assert crossover(rows[:1]) is None
    assert crossover([SwapVsRecompute(n, 0, 0.1, 0.1, 1.0) for n in (1, 2, 3)]) is None


# ---------- 分页引擎 ----------

def engine08(model, num_blocks, block_size=4, max_batch_size=4, budget=16, caching=True, kv_dtype=None,
             preempt="recompute", swap_blocks=None, eos_ids=()):
    return LLMEngine(model, EngineConfig(num_blocks, block_size, max_batch_size, budget, caching, kv_dtype, preempt,
                                         swap_blocks), eos_ids=eos_ids, clock=VirtualClock())


def assert_idle(engine):
    """没有请求还在引擎里；池子的每一块、第二层的每一个槽都空着。"""
    assert pool_is_free(engine) and not engine.has_unfinished_requests()
    s = engine.scheduler
    assert not s.waiting and not s.running and not s.swapped
    if engine.swap is not None:
        assert engine.swap.num_used == 0 and len(set(engine.swap.free_blocks)) == engine.swap.num_blocks


def engine_workload(sampled: bool = True) -> list[Request]:
    """6 个请求：提示词 3–40 个 token，各生成 12–30 个（ignore_eos），奇数号带种子采样。"""
    rng = random.Random(3)
    return [Request([rng.randrange(2, 256) for _ in range(rng.randint(3, 40))], rng.randint(12, 30),
                    SamplingParams(temperature=0.9, top_p=0.95, seed=70 + i) if sampled and i % 2 else SamplingParams(),
                    ignore_eos=True) for i in range(6)]


class RoundedCache(PreallocKVCache):
    """参考：K/V 写进缓存前先转成 dtype 再转回来（--kv-dtype bfloat16 的 float32 模型：池子存 bfloat16）。"""

    def __init__(self, cfg, max_len, dtype):
        super().__init__(cfg, max_len, "cpu", torch.float32)
        self.store_dtype = dtype

    def update(self, layer_idx, k, v):
        return super().update(layer_idx, k.to(self.store_dtype).float(), v.to(self.store_dtype).float())


def step03_outputs(model, requests, kv_dtype=None, eos_ids=()):
    """step03 逐个单独生成；kv_dtype 给出时用同样存法的单请求缓存：int8 / fp8 是 QuantKVCache（K、V 都是 token 粒度，
    与引擎的池子同一种量化），bfloat16 是 RoundedCache。这是与分页引擎无关的另一份实现。"""
    def cache(r):
        n = len(r.prompt_ids) + r.max_new_tokens - 1
        if kv_dtype is None:
            return "prealloc"
        if kv_dtype in LOSSY:
            s = QuantScheme(kv_dtype, "token")
            return QuantKVCache(model.cfg, n, "cpu", torch.float32, s, s, block_size=4)
        return RoundedCache(model.cfg, n, getattr(torch, kv_dtype))
    return [generate(model, r.prompt_ids, r.max_new_tokens, r.params, eos_ids, r.ignore_eos, cache=cache(r))
            for r in requests]


@one_arch
def test_exact_mode_is_step07(tiny):
    """默认（以及 --kv-dtype 等于模型 dtype）：池子就是模型的 dtype、没有 scale；输出与每一次前向都与 step07 的引擎
    （另一份代码）相同，抢占也一样发生；两者都等于 step03。"""
    reqs = engine_workload()
    ref, st7 = step07.LLMEngine(tiny.model, step07.EngineConfig(40, 4, 4, 16), clock=VirtualClock()).generate(reqs)
    assert ref == step03_outputs(tiny.model, reqs)
    for kv_dtype in (None, "float32"):
        e = engine08(tiny.model, 40, 4, 4, 16, kv_dtype=kv_dtype)
        assert e.kv_cache.fmt is None and e.kv_cache.scales is None and e.kv_cache.pool.dtype == torch.float32
        out, st8 = e.generate(reqs)
        assert out == ref
        assert st8.forward_shapes == st7.forward_shapes
        assert [x.decode_tokens for x in st8.steps] == [x.decode_tokens for x in st7.steps]
        assert st8.preemptions == st7.preemptions > 0             # 40 块的池子装不下全部：抢占也一样发生
        assert_idle(e)


@one_arch
def test_swap_mode_equals_step03_with_preemptions(tiny):
    """换出式抢占：每次抢占都换出（第二层与池子一样大），换入的字节与换出的相同，被换出的请求不重算；
    输出与 step03 相同。"""
    reqs = engine_workload()
    e = engine08(tiny.model, 24, 4, 4, 16, preempt="swap")
    out, st = e.generate(reqs)
    assert out == step03_outputs(tiny.model, reqs)
    sw = e.swap
    assert sw.num_swap_out == st.preemptions > 0 and sw.num_swap_in == sw.num_swap_out
    assert sw.bytes_out == sw.bytes_in > 0 and len(sw.tokens_out) == sw.num_swap_out and all(sw.tokens_out)
    # 换回来的 K/V 接着用，一个 token 也不重算：prefill 算的正好是提示词（减去前缀缓存命中的）；重算模式要多算
    assert st.prefill_tokens == st.prompt_tokens - sum(st.cached_tokens)
    _, st_re = engine08(tiny.model, 24, 4, 4, 16).generate(reqs)
    assert st_re.preemptions > 0 and st_re.prefill_tokens > st_re.prompt_tokens - sum(st_re.cached_tokens)
    assert_idle(e)


@one_arch
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_swap_tier_too_small_falls_back_to_recompute(tiny, kv_dtype):
    """第二层只有 1 块：要换出的请求多于 1 块时装不下，退回重算（抢占次数 > 换出次数）；输出仍与 step03（int8 时：
    step03 + 同样量化的单请求缓存）相同；结束后池子的每一块、第二层的那一块都空着。"""
    reqs = engine_workload()
    e = engine08(tiny.model, 24, 4, 4, 16, kv_dtype=kv_dtype, preempt="swap", swap_blocks=1)
    assert e.swap.num_blocks == 1
    out, st = e.generate(reqs)
    assert out == step03_outputs(tiny.model, reqs, kv_dtype)
    assert st.preemptions > e.swap.num_swap_out and e.swap.num_swap_in == e.swap.num_swap_out
    assert_idle(e)


@one_arch
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bfloat16"])
def test_quantized_engine_equals_step03_with_the_same_quantized_cache(tiny, kv_dtype):
    """分页引擎的量化池子（每个 (token, 头) 一个 scale）与 step03 + 同样量化的单请求缓存（analysis/dense_cache.py 的
    QuantKVCache，另一份代码）逐 token 相同——不论批、预算（分块）、抢占（重算或换出，块号不同）怎么安排：
    码只取决于这个 token 自己的 K/V。也与不量化的输出不同（不然这个测试什么也没测）。"""
    reqs = engine_workload()
    ref = step03_outputs(tiny.model, reqs, kv_dtype)
    assert ref != step03_outputs(tiny.model, reqs)
    runs = {"big pool": dict(num_blocks=200, max_batch_size=6, budget=64),
            "budget 5": dict(num_blocks=200, max_batch_size=3, budget=5),
            "recompute": dict(num_blocks=24, max_batch_size=4, budget=16),
            "swap": dict(num_blocks=24, max_batch_size=4, budget=16, preempt="swap")}
    for name, kw in runs.items():
        e = engine08(tiny.model, kv_dtype=kv_dtype, **kw)
        out, st = e.generate(reqs)
        assert out == ref, name
        if name in ("recompute", "swap"):
            assert st.preemptions > 0, name
        if name == "swap":
            assert e.swap.num_swap_out == st.preemptions
        assert_idle(e)


def fill_pool(tiny, fmt_name, T=23, bs=4, k=None, v=None):
    """随机 K/V（带离群通道）经引擎的写路径（plan → AttentionMetadata.update）写进量化池子，
    返回 (池子, 块表, 原 K, 原 V, update 返回的 K, V)。"""
    fmt = kv_format(fmt_name, torch.float32)
    nb = -(-T // bs)
    cache = PagedKVCache(tiny.cfg, nb + 2, bs, "cpu", torch.float32, fmt=fmt)
    table = [nb + 1, *range(nb - 1, 0, -1), 0][:nb]                          # 打乱的物理块
    seq = Sequence(0, Request(list(range(2, 2 + T)), 1), None, 0.0, block_table=table)
    fwd = cache.plan([seq], [T])
    (seg,) = fwd.segments
    H_kv, D = tiny.cfg.num_kv_heads, tiny.cfg.head_dim
    g = torch.Generator().manual_seed(2)
    if k is None:
        k = torch.randn(1, H_kv, T, D, generator=g)                           # (1, H_kv, T, D)
        k[..., [3, 11]] = 20 * k[..., [3, 11]] + 30                           # 像真实的 K：两个离群通道
    if v is None:
        v = torch.randn(1, H_kv, T, D, generator=g)
    k_out, v_out = seg.update(0, k, v)
    return cache, table, k, v, k_out, v_out


def read_pool(cache: PagedKVCache, layer: int, table: list[int], length: int):
    """直接读池子（不经过引擎的读路径）：一个请求前 length 个位置的 (码, scale)，K、V 各 (H_kv, length, ·)。"""
    blocks = torch.tensor(table)
    flat = lambda t: t.transpose(0, 1).flatten(1, 2)[:, :length]   # noqa: E731  (n, H_kv, bs, ·) -> (H_kv, length, ·)
    return [(flat(cache.pool[layer, kv, blocks]), flat(cache.scales[layer, kv, blocks])) for kv in range(2)]


@pytest.mark.parametrize("fmt_name", LOSSY)
@one_arch
def test_quantized_pool_round_trip(tiny, fmt_name):
    cache, table, k, v, k_out, v_out = fill_pool(tiny, fmt_name)
    T = k.shape[2]
    for x, out, (codes, scale) in zip((k[0], v[0]), (k_out[0], v_out[0]), read_pool(cache, 0, table, T)):
        back = dequantize(codes, scale, torch.float32)
        assert torch.equal(out, back)                # 全新的 prefill 返回的，与之后从池子里读回的逐位相同
        assert bool(((back - x).abs() <= error_bound(x, scale, fmt_name)).all())
        assert torch.equal(scale, compute_scale(x, QuantScheme(fmt_name, "token")))   # 每个 (token, 头) 一个 scale


@pytest.mark.parametrize("fmt_name", LOSSY)
@one_arch
def test_zero_tiny_and_nan_rows_through_the_pool(tiny, fmt_name):
    """经引擎的写路径：全零的 token 读回正好 0；1e-40 的 token 的 scale 不低于下限；含 NaN / inf 的 token 码有限、
    NaN 读回 0；同一次前向里别的 token 不受影响（与干净输入时逐位相同）。"""
    H_kv, D, T = tiny.cfg.num_kv_heads, tiny.cfg.head_dim, 9
    g = torch.Generator().manual_seed(4)
    clean_k, v = torch.randn(1, H_kv, T, D, generator=g), torch.randn(1, H_kv, T, D, generator=g)
    k = clean_k.clone()
    k[0, :, 1] = 0.0
    k[0, :, 4] = 1e-40
    k[0, 0, 6, 2], k[0, 1, 6, 5] = float("nan"), float("inf")
    cache, table, *_ , k_out, v_out = fill_pool(tiny, fmt_name, T=T, k=k, v=v)
    (codes, scale), _ = read_pool(cache, 0, table, T)
    back = dequantize(codes, scale, torch.float32)
    assert bool(torch.isfinite(codes.float()).all()) and bool(torch.isfinite(scale).all())
    assert bool(torch.isfinite(k_out).all()) and torch.equal(k_out[0], back)
    assert torch.equal(back[:, 1], torch.zeros(H_kv, D))
    assert bool((scale[:, 4] >= SCALE_FLOOR).all()) and float(back[:, 4].abs().max()) <= 1e-38
    assert float(back[0, 6, 2]) == 0
    assert float(back[1, 6, 5]) == pytest.approx(QMAX[fmt_name] * float(scale[1, 6]), rel=1e-6)
    clean, *_ = fill_pool(tiny, fmt_name, T=T, k=clean_k, v=v)
    (clean_codes, _), _ = read_pool(clean, 0, table, T)
    others = [t for t in range(T) if t not in (1, 4, 6)]
    assert torch.equal(bits(codes[:, others]), bits(clean_codes[:, others]))


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8"])
@one_arch
def test_pool_bytes_formula_equals_tensor_sizes(tiny, kv_dtype):
    e = LLMEngine(tiny.model, EngineConfig(7, 4, kv_dtype=kv_dtype))
    fmt = e.kv_cache.fmt
    per_token = tiny.cfg.kv_bytes_per_token(4) if fmt is None else fmt.bytes_per_token(tiny.cfg, 4)
    assert e.kv_cache.nbytes == (7 + 1) * 4 * per_token                     # 多一块空块
    assert num_blocks_for_budget(tiny.cfg, 4, torch.float32, 1, kv_dtype) == 2**20 // (4 * per_token)


@one_arch
def test_swap_restores_quantized_blocks_bit_for_bit(tiny):
    cache, table, *_ = fill_pool(tiny, "int8")
    tensors = cache.tensors()
    assert len(tensors) == 2                                                # 码 + scale
    space = SwapSpace(tensors, num_cpu_blocks=len(table), block_dim=2)
    before = [t.clone() for t in tensors]
    handle = space.swap_out(table, 23)
    for t in tensors:
        t.zero_()                                                           # 块还给池子、被别人覆盖
    new = list(range(len(table)))
    space.swap_in(handle, new)
    for t, b in zip(tensors, before):
        for old_b, new_b in zip(table, new):
            assert torch.equal(t[:, :, new_b], b[:, :, old_b])
    assert space.num_used == 0


# ---------- 块与第二层的槽在每条路上都还回来 ----------

def spy_schedule(engine) -> list[list[tuple]]:
    """包住调度器（只是观察）：每一步记下 (request_id, 这一步算几个 token, 调度时是否 in_prefill, 被抢占过几次,
    这一步是否算到最后一个 token)。"""
    log, orig = [], engine.scheduler.schedule

    def schedule():
        out = orig()
        log.append([(s.request_id, n, s.in_prefill, s.num_preemptions, s.num_computed_tokens + n == s.num_tokens)
                    for s, n in zip(out.seqs, out.num_new_tokens)])
        return out
    engine.scheduler.schedule = schedule
    return log


@one_arch
def test_abort_of_a_swapped_out_request_frees_its_swap_slots(tiny):
    """一步一步跑换出模式，等到有请求被换出，abort 它：它在第二层的槽立刻还回去，下一步报告 "abort"；
    其余请求照常跑完、输出与 step03 相同，最后池子和第二层都是空的。"""
    reqs = engine_workload()
    e = engine08(tiny.model, 24, 4, 4, 16, preempt="swap")
    ids = [e.add_request(r) for r in reqs]
    seqs = [e.seqs[i] for i in ids]
    while not e.scheduler.swapped:
        e.step()
        assert e.has_unfinished_requests()
    victim = e.scheduler.swapped[0]
    n = len(victim.swap_handle.cpu_blocks)
    used = e.swap.num_used
    assert victim.status is SequenceStatus.SWAPPED and n > 0 and used >= n and victim.block_table == []
    e.abort(victim.request_id)
    assert e.swap.num_used == used - n and victim.swap_handle is None and victim.status is SequenceStatus.FINISHED
    assert victim not in e.scheduler.swapped
    outs = e.step()
    assert [(o.finished, o.finish_reason) for o in outs if o.request_id == victim.request_id] == [(True, "abort")]
    while e.has_unfinished_requests():
        e.step()
    ref = step03_outputs(tiny.model, reqs)
    assert [s.output_ids for s in seqs if s is not victim] == [r for r, s in zip(ref, seqs) if s is not victim]
    assert_idle(e)


@one_arch
@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_abort_mid_chunked_prefill_frees_its_blocks(tiny, preempt):
    a, b = Request([5, 6, 7], 6, ignore_eos=True), Request(list(range(50, 63)), 4, ignore_eos=True)
    e = engine08(tiny.model, 16, 4, max_batch_size=4, budget=5, kv_dtype="int8", preempt=preempt)
    sa, sb = (e.seqs[e.add_request(r)] for r in (a, b))
    e.step()
    e.step()
    assert sb.in_prefill and 0 < sb.num_computed_tokens < 13 and len(sb.block_table) == 4
    e.abort(sb.request_id)
    assert sb.block_table == [] and sb.status is SequenceStatus.FINISHED
    assert e.block_manager.num_free_blocks == 16 - len(sa.block_table)
    assert sum(map(bool, e.block_manager.ref_counts)) == len(sa.block_table)
    while e.has_unfinished_requests():
        e.step()
    assert sa.output_ids == step03_outputs(tiny.model, [a], "int8")[0]
    assert_idle(e)


@one_arch
def test_exception_inside_the_forward_frees_every_block_and_swap_slot(tiny, monkeypatch):
    """模型前向在有请求被换出时抛错：异常原样传出 generate()，之后池子的每一块、第二层的每一个槽都空着；
    同一个引擎接着跑同一组请求，输出与 step03 相同（没有少块、没有漏掉的槽）。"""
    reqs = engine_workload()
    e = engine08(tiny.model, 24, 4, 4, 16, preempt="swap")
    orig, seen = tiny.model.forward, []

    def forward(*args, **kw):
        if e.scheduler.swapped:
            seen.append((e.swap.num_used, sum(map(bool, e.block_manager.ref_counts))))
            raise RuntimeError("boom in the forward")
        return orig(*args, **kw)
    monkeypatch.setattr(tiny.model, "forward", forward)
    with pytest.raises(RuntimeError, match="boom in the forward"):
        e.generate(reqs)
    assert seen and seen[0][0] > 0 and seen[0][1] > 0          # 抛错时第二层和池子里都有东西
    assert_idle(e)
    monkeypatch.undo()
    out, st = e.generate(reqs)
    assert out == step03_outputs(tiny.model, reqs) and st.preemptions > 0
    assert_idle(e)


@one_arch
def test_recompute_ending_in_a_one_token_chunk_is_not_counted_as_decode(tiny):
    """池子 5 块、预算 3、不开前缀缓存：第 2 个请求被抢占，重算时最后一块只剩 1 个 token，和请求 0 的 decode
    排在同一次前向里。这 1 个 token 是重算（prefill）：StepStats.decode_tokens 是 1，不是 2；这一步算作有 prefill。"""
    reqs = [Request(list(range(10 + 30 * i, 10 + 30 * i + p)), n, ignore_eos=True)
            for i, (p, n) in enumerate([(6, 12), (2, 6), (3, 9)])]
    e = engine08(tiny.model, 5, 4, max_batch_size=3, budget=3, caching=False)
    log = spy_schedule(e)
    out, st = e.generate(reqs)
    assert out == step03_outputs(tiny.model, reqs)
    hits = [i for i, step_ in enumerate(log)                   # 重算的最后 1 个 token 与别人的 decode 同一步
            if any(pf and pre and n == 1 and last for _, n, pf, pre, last in step_)
            and any(not pf for _, _, pf, *_ in step_)]
    assert hits, "the workload no longer makes a recompute end with a 1-token chunk next to a decode"
    for i in hits:
        assert st.steps[i].prefill and st.steps[i].tokens == 2 and st.steps[i].decode_tokens == 1
    assert [x.decode_tokens for x in st.steps] == [sum(not pf for _, _, pf, *_ in step_) for step_ in log]
    assert_idle(e)


# ---------- --no-prefix-cache 与对话模板 ----------

@pytest.fixture(scope="module")
def tok_model(tiny_tok_dir):
    """词表、分词器、对话模板与默认模型相同的随机小模型。"""
    return load_model(tiny_tok_dir, "cpu", torch.float32), Tokenizer(tiny_tok_dir)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_no_prefix_cache_admits_a_full_batch_of_chat_prompts_in_one_step(tok_model, kv_dtype):
    """每个 --chat 提示词都以同一段默认系统提示开头。不开前缀缓存：第一步就接纳整批 4 个（曾经每步只接纳一个）；
    开着前缀缓存：第一步只接纳 1 个（其余等着命中它算的块）——说明这些提示词确实共享第一块。"""
    model, tok = tok_model
    prompts = [tok.encode(t, chat=True) for t in ["Hi", "What is 2+2?", "Name a color.", "Tell me a joke."]]
    assert all(p[:16] == prompts[0][:16] for p in prompts)
    reqs = [Request(p, 2, ignore_eos=True) for p in prompts]
    for caching, admitted in ((False, 4), (True, 1)):
        e = engine08(model, 64, 16, max_batch_size=4, budget=512, caching=caching, kv_dtype=kv_dtype)
        for r in reqs:
            e.add_request(r)
        e.step()
        assert len(e.scheduler.running) == admitted and len(e.scheduler.waiting) == 4 - admitted, caching
        assert e.step_stats[0].tokens == sum(map(len, prompts[:admitted])), caching
        while e.has_unfinished_requests():
            e.step()
        assert_idle(e)
    out, st = engine08(model, 64, 16, max_batch_size=4, budget=512, caching=False, kv_dtype=kv_dtype).generate(reqs)
    assert st.prefill_steps == 1 and st.num_forwards == 2 and st.cached_tokens == [0] * 4
    assert out == step03_outputs(model, reqs, kv_dtype)


# ---------- 命令行（进程内，与命令行同一条路：cli.run_main） ----------

def run_json(argv, capsys) -> dict:
    with pytest.raises(SystemExit) as e:
        cli.run_main(step08_run.make_parser(), step08_run.main, argv)
    captured = capsys.readouterr()
    assert e.value.code == 0, captured.err[-2000:]
    return json.loads(captured.out.strip().splitlines()[-1])


PROMPTS = ["Hello there", "The three primary colors are"]


def test_generation_mode_with_int8_and_swap_equals_step03(tiny_tok_dir, tok_model, capsys):
    """--kv-dtype int8 --preempt swap、2 块的池子（两个请求放不下，一定换出）：每个输出与 step03 + 同样量化的
    单请求缓存逐 token 相同。"""
    argv = ["--model", str(tiny_tok_dir), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", "12",
            "--ignore-eos", "--kv-dtype", "int8", "--preempt", "swap", "--num-blocks", "2", "--block-size", "8",
            "--json"]
    out = run_json(argv, capsys)
    assert out["stats"]["kv_dtype"] == "int8" and out["stats"]["swap_outs"] > 0
    reqs = [Request(x["prompt_ids"], 12, ignore_eos=True) for x in out["results"]]
    assert [x["output_ids"] for x in out["results"]] == step03_outputs(tok_model[0], reqs, "int8")


@pytest.mark.parametrize("flags", [[], ["--kv-dtype", "float32"], ["--no-chunked-prefill"]],
                         ids=["default", "float32", "no-chunked-prefill"])
def test_generation_mode_exact_runs_the_previous_steps_engine(tiny_tok_dir, tok_model, capsys, flags):
    """默认 --kv-dtype（以及等于模型 dtype 的 float32）：与 step07 的引擎输出相同、前向次数相同；--no-chunked-prefill：
    与 step06 的引擎相同。预算 4 让 step07 的引擎分块，step06 的不分块，两者的前向次数不同——选错引擎就会失败。"""
    model = tok_model[0]
    argv = ["--model", str(tiny_tok_dir), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", "5",
            "--ignore-eos", "--num-blocks", "64", "--block-size", "4", "--max-batch-size", "4",
            "--max-num-batched-tokens", "4", "--json"] + flags
    out = run_json(argv, capsys)
    reqs = [Request(x["prompt_ids"], 5, ignore_eos=True) for x in out["results"]]
    o7, st7 = step07.LLMEngine(model, step07.EngineConfig(64, 4, 4, 4)).generate(reqs)
    o6, st6 = step06.LLMEngine(model, step06.EngineConfig(64, 4, 4)).generate(reqs)
    assert st7.num_forwards != st6.num_forwards
    ref, st = (o6, st6) if flags == ["--no-chunked-prefill"] else (o7, st7)
    assert [x["output_ids"] for x in out["results"]] == ref == step03_outputs(model, reqs)
    assert out["stats"]["forwards"] == st.num_forwards and out["stats"]["kv_dtype"] == "float32"


def test_bad_kv_dtype_and_preempt_are_errors(capsys):
    assert "--kv-dtype" in cli_error(step08_run, ["--prompt", "hi", "--kv-dtype", "int4"], capsys)
    assert "--preempt" in cli_error(step08_run, ["--prompt", "hi", "--preempt", "drop"], capsys)
    assert "chunked" in cli_error(step08_run, ["--prompt", "hi", "--preempt", "swap", "--no-chunked-prefill"], capsys)
    assert "chunked" in cli_error(step08_run, ["--prompt", "hi", "--kv-dtype", "int8", "--no-chunked-prefill"], capsys)
    with pytest.raises(UserError):
        kv_format("int4", torch.float32)


# ---------- 实验脚本的冒烟测试 ----------

def test_analyze_kv_quick_runs_end_to_end(tiny_tok_dir, tmp_path, capsys):
    """在本进程里跑 --quick（与命令行同一条路）：JSON 里有各节的数，数值是有意义的——字节比等于公式、一致率在 [0, 1]、
    量化误差为正且有限。"""
    import math

    from step08_kv_quant.analysis import analyze_kv
    png = tmp_path / "mag.png"
    with pytest.raises(SystemExit) as e:
        cli.run_main(analyze_kv.parser(), analyze_kv.main,
                     ["--quick", "--json", "--plot", str(png), "--model", str(tiny_tok_dir)])
    captured = capsys.readouterr()
    assert e.value.code == 0, captured.err[-2000:]
    figures = json.loads(captured.out.strip().splitlines()[-1])["figures"]
    assert {"k_outlier_ratio_median", "rel_error_k_int8_channel", "top1_int8_token_token",
            "nll_delta_fraction_fp8_token_token", "swap_vs_recompute_time_ratio_int8_64"} <= set(figures)
    assert all(math.isfinite(x) for x in figures.values())
    assert 0 <= figures["top1_int8_token_token"] <= 1 and figures["rel_error_k_int8_channel"] > 0
    cfg = load_model(tiny_tok_dir, "cpu", torch.float32).cfg
    s = QuantScheme("int8", "token")
    assert figures["bytes_ratio_int8_token_token"] == pytest.approx(
        kv_bytes_per_token(cfg, s, s, 16, torch.float32) / cfg.kv_bytes_per_token(4))
    assert png.stat().st_size > 0
