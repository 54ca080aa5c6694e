"""step03：KV cache。两种缓存与 step02 逐 token 一致（贪心与带种子采样）；每个 decode 步的 logits 等于整段重算；
缓存内容等于 HF transformers 自己的 past_key_values；每层都推进长度的经典 bug 会把结果算错；溢出给出清楚的错误。"""
import json

import pytest
import torch

from common.compare import MARGIN_TOL, compare
from common.errors import UserError
from common.prompts import CHAPTER_PROMPTS, LONG_PROMPT
from conftest import cli_error, one_arch, run_py
from step02_sampling.engine import generate as generate_step02
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single import run as step03_run
from step03_kvcache_single.cache import CACHES, CatKVCache, PreallocKVCache
from step03_kvcache_single.engine import forward, generate

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=7)
TOL = MARGIN_TOL[torch.float32]


def full_logits_fn(model):
    """teacher-forcing 参考：整段重算一次前向 (T, V)。"""
    @torch.inference_mode()
    def fn(ids):
        return model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    return fn


def tiny_prompt(n: int = 12, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 256, (n,), generator=g).tolist()


def step_logits(model, prompt, n, cache) -> tuple[list[int], torch.Tensor]:
    """用给定缓存贪心生成 n 个 token，同时记下每次前向（prefill + n-1 次 decode）的 logits (n, V)。"""
    seen = []
    handle = model.register_forward_hook(lambda m, inp, out: seen.append(out[0, -1].clone()))
    try:
        out = generate(model, prompt, n, GREEDY, ignore_eos=True, cache=cache)
    finally:
        handle.remove()
    return out, torch.stack(seen)


# ---------- 真实模型：与 step02 逐 token 一致 ----------

_REFERENCES: dict = {}


def step02_reference(model, ids: list[int], n: int, params: SamplingParams, eos_ids, ignore_eos: bool) -> list[int]:
    """step02（每步整段重算，慢）的参考输出：两种缓存比的是同一个参考，每组参数只算一次。"""
    key = (id(model), tuple(ids), n, repr(params), tuple(eos_ids), ignore_eos)
    if key not in _REFERENCES:
        _REFERENCES[key] = generate_step02(model, ids, n, params, eos_ids, ignore_eos)
    return list(_REFERENCES[key])


# 一个章节提示词 + 长提示词（run.py 的章节模式在真实模型上比全部四个）。
# 长提示词的第一个贪心 token 就是 EOS：用 ignore_eos 生成满 n 个，才有 n 个 token 可比
REAL_CASES = ([(name, text, chat, 12, False) for name, text, chat in CHAPTER_PROMPTS[:1]]
              + [("long", LONG_PROMPT, False, 3, True)])   # 长提示词每个参考 token 整段重算几百个位置：3 个够了


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("name,text,chat,n,ignore_eos", REAL_CASES, ids=[c[0] for c in REAL_CASES])
def test_greedy_equals_step02_real(real, name, text, chat, n, ignore_eos, cache):
    ids = real.encode(text, chat)
    ref = step02_reference(real.model, ids, n, GREEDY, real.tok.eos_ids, ignore_eos)
    got = generate(real.model, ids, n, GREEDY, real.tok.eos_ids, ignore_eos, cache=cache)
    c = compare(f"{cache}/{name}", ids, ref, got, real.full_logits, TOL)
    assert c.ok and len(got) == n, c.describe()


@pytest.mark.parametrize("cache", list(CACHES))
def test_seeded_sampling_equals_step02_real(real, cache):
    """同样的 logits、同一个 sample()、同一串随机数 → 完全相同的 token（不用近似打平的容差）。"""
    ids = real.encode(CHAPTER_PROMPTS[3][1], chat=True)
    ref = step02_reference(real.model, ids, 12, SEEDED, real.tok.eos_ids, True)
    got = generate(real.model, ids, 12, SEEDED, real.tok.eos_ids, ignore_eos=True, cache=cache)
    assert got == ref
    other = generate(real.model, ids, 12, SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=8),
                     real.tok.eos_ids, ignore_eos=True, cache=cache)
    assert other != ref  # 这组参数确实在抽样（种子不同输出就不同），上面的相等不是贪心造成的


def test_stop_string_like_step02(real):
    ids = real.encode(CHAPTER_PROMPTS[0][1])          # 贪心续写里在第 10 个 token 左右出现第一个逗号
    ref = generate_step02(real.model, ids, 24, GREEDY, real.tok.eos_ids, stop_strings=[","], tokenizer=real.tok)
    got = generate(real.model, ids, 24, GREEDY, real.tok.eos_ids, stop_strings=[","], tokenizer=real.tok)
    assert got == ref and len(got) < 24 and "," in real.tok.decode(got)


def test_decode_logits_match_full_recompute_real(real):
    """长提示词（几百个 token）上，每个 decode 步的 logits 与整段重算同一位置的 logits 只差浮点末位。"""
    ids = real.encode(LONG_PROMPT)
    out, got = step_logits(real.model, ids, 4, "prealloc")
    ref = real.full_logits(ids + out[:-1])[len(ids) - 1:]                    # (4, V)
    assert (got - ref).abs().max() < 1e-3


# ---------- 随机小模型（llama / qwen2 / qwen3）----------

@one_arch
def test_tiny_greedy_and_seeded_equal_step02(tiny):
    prompt = tiny_prompt()
    for params in (GREEDY, SEEDED):
        ref = generate_step02(tiny.model, prompt, 16, params, ignore_eos=True)
        for cache in CACHES:
            got = generate(tiny.model, prompt, 16, params, ignore_eos=True, cache=cache)
            if params is SEEDED:
                assert got == ref, cache
            else:
                c = compare(cache, prompt, ref, got, full_logits_fn(tiny.model), TOL)
                assert c.ok, c.describe()


@one_arch
def test_tiny_cat_and_prealloc_identical(tiny):
    """两种缓存存的是同一批数：每一步的 logits 完全相同（不只是 token 相同）。"""
    prompt = tiny_prompt(20, seed=1)
    out_p, logits_p = step_logits(tiny.model, prompt, 24, "prealloc")
    out_c, logits_c = step_logits(tiny.model, prompt, 24, "cat")
    assert out_p == out_c
    assert torch.allclose(logits_p, logits_c, atol=1e-6, rtol=0)


def test_tiny_decode_logits_match_full_recompute(tiny):
    prompt = tiny_prompt(30, seed=2)
    for cache in CACHES:
        out, got = step_logits(tiny.model, prompt, 20, cache)
        ref = full_logits_fn(tiny.model)(prompt + out[:-1])[len(prompt) - 1:]   # (20, V)
        assert (got - ref).abs().max() < 1e-4, cache


def test_tiny_cache_contents_equal_hf_past_key_values(tiny):
    """缓存里第 l 层的 K/V 就是 HF 前向返回的 past_key_values.layers[l].keys / .values（形状 (B, H_kv, S, D)）。"""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tiny.path), dtype=torch.float32).eval()
    prompt = tiny_prompt(10, seed=3)
    cache = PreallocKVCache(tiny.cfg, len(prompt) + 4, "cpu", torch.float32)
    out = generate(tiny.model, prompt, 5, GREEDY, ignore_eos=True, cache=cache)
    seq = prompt + out[:-1]                             # 喂进过模型（写进了缓存）的全部 token
    with torch.inference_mode():
        past = hf(torch.tensor([seq]), use_cache=True).past_key_values
    assert cache.length == len(seq)
    for layer in range(tiny.cfg.num_layers):
        for kv, ref in ((0, past.layers[layer].keys), (1, past.layers[layer].values)):
            assert ref.shape == (1, tiny.cfg.num_kv_heads, len(seq), tiny.cfg.head_dim)   # 只存 H_kv 个头
            assert torch.allclose(cache.kv[layer, kv], ref, atol=1e-5), (layer, kv)



@one_arch
def test_hf_loop_feeding_only_the_new_token_equals_generate(tiny):
    """HF 自己的循环（analysis/hf_loop.py）：第一次送整段提示词，之后每次只送新 token、把缓存传回去，
    与 generate 逐 token 相同，缓存每步长 1。每步送整段 input_ids 的错误写法：同一批位置被重复写进缓存
    （长度 P、P+(P+1)、…），输出与 generate 分道扬镳。"""
    from step03_kvcache_single.analysis.hf_loop import hf_cached_greedy, hf_generate
    from common.hf_reference import load_hf_model
    hf = load_hf_model(tiny.path, "cpu", torch.float32)
    prompt, n = tiny_prompt(12, seed=5), 8
    ref = hf_generate(hf, prompt, n)
    good, good_len = hf_cached_greedy(hf, prompt, n)
    assert good == ref
    assert good_len == [len(prompt) + i for i in range(n)]
    bad, bad_len = hf_cached_greedy(hf, prompt, n, feed_all=True)
    # 第 i 次前向送了 P + i 个 token，全部追加进缓存：累计长度是 P + (P+1) + … + (P+i)
    assert bad_len == [sum(len(prompt) + j for j in range(i + 1)) for i in range(n)]
    assert bad != ref


def test_encoder_decoder_cache_self_grows_cross_is_computed_once():
    """编码器–解码器（analysis/encoder_decoder_cache.py，随机小 T5）：自注意力缓存每步长一个位置，
    交叉注意力缓存第一步就是输入长度、之后大小不变、张量不被重算（同一块内存）。"""
    from step03_kvcache_single.analysis.encoder_decoder_cache import decode_with_cache, tiny_t5
    model = tiny_t5()
    c = model.config
    per_pos = 2 * c.num_decoder_layers * c.num_heads * c.d_kv * 4
    rows = decode_with_cache(model, list(range(2, 22)), 5)
    assert [r["self_len"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["self_bytes"] for r in rows] == [i * per_pos for i in range(1, 6)]
    assert {r["cross_len"] for r in rows} == {20} and {r["cross_bytes"] for r in rows} == {20 * per_pos}
    assert len({r["cross_ptr"] for r in rows}) == 1
    # 带缓存的手写循环与 HF generate 的贪心结果相同（缓存用对了）
    with torch.inference_mode():
        gen = model.generate(torch.tensor([list(range(2, 22))]), max_new_tokens=5, min_new_tokens=5,
                             do_sample=False, eos_token_id=None)
    assert gen[0, 1:].tolist() == [r["token"] for r in rows]

# ---------- 经典 bug：每层都推进长度 ----------

class PerLayerAdvanceCache(PreallocKVCache):
    """错误示范：在 update（每层都调用）里推进长度，引擎的 advance 变成空操作。
    第 0 层写进 [0, L)，第 1 层就写进 [L, 2L)……每层的 K/V 落在不同的位置，前面的空位是 0。"""

    def update(self, layer_idx, k, v):
        k_all, v_all = super().update(layer_idx, k, v)
        self.length += k.shape[2]
        return k_all, v_all

    def advance(self, n):
        pass


@torch.inference_mode()
def greedy_with_cache(model, prompt, n, cache) -> tuple[list[int], torch.Tensor]:
    """不经过引擎（也就绕过它的位置检查）：prefill + decode，位置取真实位置，缓存推进交给缓存自己。
    返回 n 个贪心 token 与每次前向的 logits (n, V)。"""
    ids, seen = list(prompt), []
    start, x = 0, list(prompt)
    for _ in range(n):
        pos = torch.arange(start, start + len(x))[None]                        # (1, L)：真实位置
        logits = model(torch.tensor([x]), pos, cache=cache, last_only=True)[0, -1]
        cache.advance(len(x))
        seen.append(logits)
        start += len(x)
        x = [int(logits.argmax())]
        ids += x
    return ids[len(prompt):], torch.stack(seen)


@one_arch
def test_per_layer_advance_corrupts_output(tiny):
    prompt = tiny_prompt(12, seed=4)
    L, n = len(prompt), 8
    good_out, good = greedy_with_cache(tiny.model, prompt, n, PreallocKVCache(tiny.cfg, L + n, "cpu", torch.float32))
    bad_cache = PerLayerAdvanceCache(tiny.cfg, tiny.cfg.num_layers * (L + n), "cpu", torch.float32)
    _, bad = greedy_with_cache(tiny.model, prompt, n, bad_cache)
    ref = full_logits_fn(tiny.model)(prompt + good_out[:-1])[L - 1:]           # (n, V)
    assert (good - ref).abs().max() < 1e-4                                      # 正确的缓存：与整段重算一致
    assert (bad[0] - ref[0]).abs().max() > 1e-2                                 # 每层推进：prefill 的 logits 就错了（误差大了上万倍）
    # 错位的具体样子：第 1 层的 prefill K 不在 [0, L)，而在 [L, 2L)（[0, L) 还是 0）
    assert bad_cache.kv[1, 0, :, :, :L].abs().max() == 0
    assert bad_cache.kv[1, 0, :, :, L:2 * L].abs().max() > 0


def test_per_layer_advance_corrupts_real_tokens(real):
    """真实模型上同一个 bug：30 层各写各的位置，生成的 token 与正确结果不同。"""
    ids = real.encode(CHAPTER_PROMPTS[0][1])
    n = 6
    good, _ = greedy_with_cache(real.model, ids, n, PreallocKVCache(real.cfg, len(ids) + n, "cpu", torch.float32))
    assert good == generate(real.model, ids, n, GREEDY, ignore_eos=True)      # 手写循环本身是对的
    bad_cache = PerLayerAdvanceCache(real.cfg, real.cfg.num_layers * (len(ids) + n), "cpu", torch.float32)
    bad, _ = greedy_with_cache(real.model, ids, n, bad_cache)
    assert bad != good


@one_arch
def test_engine_position_check_catches_per_layer_advance(tiny):
    """引擎按 token 在序列里的下标算位置，并与缓存长度核对：每层推进的缓存在第一次 decode 时就被发现。"""
    cache = PerLayerAdvanceCache(tiny.cfg, 200, "cpu", torch.float32)
    with pytest.raises(ValueError, match=f"positions start at 12 but the cache holds {12 * tiny.cfg.num_layers}"):
        generate(tiny.model, tiny_prompt(12), 4, GREEDY, ignore_eos=True, cache=cache)


@one_arch
def test_cat_cache_detects_wrong_advance(tiny):
    """cat 版每层各存一个张量，长度对不上 advance 的次数时立刻报错，而不是悄悄算错。"""
    cache = CatKVCache(tiny.cfg, 64)
    k = torch.zeros(1, tiny.cfg.num_kv_heads, 3, tiny.cfg.head_dim)
    cache.update(0, k, k)
    cache.advance(3)
    cache.advance(3)          # 多推进了一次
    with pytest.raises(RuntimeError, match="advance"):
        cache.update(0, k[:, :, :1], k[:, :, :1])


# ---------- 形状、视图、复制量、溢出、位置检查 ----------

@one_arch
def test_prealloc_returns_views_and_writes_only_new_positions(tiny):
    cfg = tiny.cfg
    cache = PreallocKVCache(cfg, 10, "cpu", torch.float32)
    k = torch.randn(1, cfg.num_kv_heads, 4, cfg.head_dim)
    v = torch.randn(1, cfg.num_kv_heads, 4, cfg.head_dim)
    k_all, v_all = cache.update(0, k, v)
    assert k_all.shape == (1, cfg.num_kv_heads, 4, cfg.head_dim)
    assert k_all.data_ptr() == cache.kv[0, 0].data_ptr()           # 视图：没有复制
    assert torch.equal(k_all, k) and torch.equal(v_all, v)
    cache.advance(4)
    k1 = torch.randn(1, cfg.num_kv_heads, 1, cfg.head_dim)
    k_all, _ = cache.update(0, k1, k1)
    assert k_all.shape[2] == 5 and torch.equal(k_all[:, :, :4], k) and torch.equal(k_all[:, :, 4:], k1)
    assert cache.bytes_copied == 2 * (k.nbytes + k1.nbytes)         # 只写了新位置


@one_arch
def test_copy_volume_cat_vs_prealloc(tiny):
    """cat 每次前向复制当时的全部 S 个位置；预分配每个位置只写一次。"""
    prompt, n = tiny_prompt(10, seed=5), 12
    kvb = tiny.cfg.kv_bytes_per_token(4)
    caches = {name: cls(tiny.cfg, len(prompt) + n - 1, "cpu", torch.float32) for name, cls in CACHES.items()}
    for cache in caches.values():
        generate(tiny.model, prompt, n, GREEDY, ignore_eos=True, cache=cache)
    P = len(prompt)
    assert caches["prealloc"].bytes_copied == (P + n - 1) * kvb
    assert caches["cat"].bytes_copied == (P + sum(P + j for j in range(1, n))) * kvb
    assert caches["prealloc"].nbytes() == caches["cat"].nbytes() == (P + n - 1) * kvb


def test_kv_bytes_per_token_real(real):
    """SmolLM2-135M（手算，章节里引用的数）：2 × 30 层 × 3 个 KV 头 × 64 × 4 字节（float32）= 46080 字节 = 45 KiB/token。"""
    assert real.cfg.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4 == 46080


def test_kv_bytes_per_token_equals_hf_past_key_values(tiny):
    """公式对照 HF 自己的缓存：HF 前向 T 个 token 之后，past_key_values 里全部 K/V 张量的字节数 = T × 公式。"""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tiny.path), dtype=torch.float32).eval()
    T = 9
    with torch.inference_mode():
        past = hf(torch.tensor([tiny_prompt(T)]), use_cache=True).past_key_values
    hf_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in past.layers)
    assert hf_bytes == T * tiny.cfg.kv_bytes_per_token(4)


@pytest.mark.parametrize("cls", list(CACHES.values()), ids=list(CACHES))
@one_arch
def test_overflow_is_a_clear_error(tiny, cls):
    cfg = tiny.cfg
    cache = cls(cfg, 5, "cpu", torch.float32)
    k = torch.zeros(1, cfg.num_kv_heads, 4, cfg.head_dim)
    cache.update(0, k, k)
    cache.advance(4)
    with pytest.raises(UserError, match=r"KV cache overflow: 4 cached \+ 2 new tokens exceeds max_len 5"):
        cache.update(0, k[:, :, :2], k[:, :, :2])
    with pytest.raises(UserError, match="overflow"):
        cache.advance(2)
    # 生成时缓存太小：在写出界之前就报错
    small = cls(cfg, 8, "cpu", torch.float32)
    with pytest.raises(UserError, match="overflow"):
        generate(tiny.model, tiny_prompt(6), 10, GREEDY, ignore_eos=True, cache=small)


@one_arch
def test_positions_are_checked_against_cache(tiny):
    cache = PreallocKVCache(tiny.cfg, 16, "cpu", torch.float32)
    with torch.inference_mode():
        forward(tiny.model, cache, tiny_prompt(5), 0)
        with pytest.raises(ValueError, match="cache holds 5"):
            forward(tiny.model, cache, [3], 4)   # 位置 4 已经在缓存里了：应当是 5


@one_arch
def test_generate_rejects_used_cache_and_unknown_name(tiny):
    cache = PreallocKVCache(tiny.cfg, 16, "cpu", torch.float32)
    generate(tiny.model, tiny_prompt(5), 3, GREEDY, cache=cache)
    with pytest.raises(ValueError, match="empty cache"):
        generate(tiny.model, tiny_prompt(5), 3, GREEDY, cache=cache)
    with pytest.raises(ValueError, match="unknown cache"):
        generate(tiny.model, tiny_prompt(5), 3, GREEDY, cache="paged")


# ---------- 命令行 ----------

def test_run_py_generation_mode_equals_step02(real):
    prompt = "Once upon a time, in a small village by the sea,"
    r = run_py("step03_kvcache_single", "--prompt", prompt, "--max-new-tokens", "8", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])["results"][0]
    assert res["prompt_ids"] == real.encode(prompt)
    ref = generate_step02(real.model, res["prompt_ids"], 8, GREEDY, real.tok.eos_ids, ignore_eos=True)
    c = compare("cli", res["prompt_ids"], ref, res["output_ids"], real.full_logits, TOL)
    assert c.ok and len(res["output_ids"]) == 8, c.describe()


@pytest.mark.parametrize("args", [["--temperature", "-1"], ["--cache", "paged"], ["--top-p", "0"],
                                  ["--prompt", "hi", "--plot", "x.png"]])
def test_run_py_bad_input_exits_2(args, capsys):
    cli_error(step03_run, args, capsys)


def test_cat_cache_peak_is_one_layer_above_the_end_with_gc_off():
    """analysis/cache_allocations.py 量的峰值（分配器自己的账，gc 关着）：cat 版每一步替换掉的旧张量由引用计数当场释放，
    峰值只比结束时多一个新建的 K（最后一层、最长的那个）；如果旧张量要等 gc（或者被别处引用着），峰值会堆到累计分配的量级。
    预分配版只分配一次。第 03 章"分配器看到的"一节引用这几个数。"""
    from types import SimpleNamespace

    from step03_kvcache_single.analysis import cache_allocations as ca
    if ca.MALLINFO2 is None:
        pytest.skip("needs glibc's mallinfo2() to read the allocator's books")
    cfg = SimpleNamespace(num_layers=4, num_kv_heads=4, head_dim=64)
    prompt, steps = 16, 128
    one_k = (prompt + steps - 1) * cfg.num_kv_heads * cfg.head_dim * 4          # 最后一步一层的 K（float32）
    cat = ca.measure("CatKVCache", cfg, prompt, steps, "cpu")
    assert cat["allocations"] == steps * 2 * cfg.num_layers
    assert cat["final"] == 2 * cfg.num_layers * one_k
    assert 0 <= cat["peak"] - cat["final"] < 2 * one_k, cat
    assert cat["allocated"] > 20 * cat["peak"]               # 累计分配远大于峰值：不是"攒着等 gc"
    pre = ca.measure("PreallocKVCache", cfg, prompt, steps, "cpu")
    assert pre["allocations"] == 1 and pre["peak"] - pre["final"] < one_k

