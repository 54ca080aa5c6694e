"""decode 提速阶梯（bench/decode_speed.py）里每一级精确改动的正确性：在随机小模型上与简单写法比。
速度只由基准测量，这里不计时。"""
import sys

import numpy as np
import pytest
import torch
from conftest import one_arch

from bench.fast_decode import (Int8Linear, SdpaKVCache, StaticKVCache, compiled_decode_step, fuse_projections_,
                               generate_static)
from common.model import Linear, attention
from common.weights import load_model
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single.engine import forward, generate

GREEDY = SamplingParams()


@torch.inference_mode()
def test_fused_projections_equal_separate_matmuls(tiny):
    """融合的 qkv_proj / gate_up_proj 与 common/model.py 分开的投影：logits 一样、贪心 token 一样。
    这台机器上是逐位相等；BLAS 并不保证输出更宽的矩阵对每一列用同样的求和顺序，所以断言只允许舍入级的差别
    （1e-6），拼错顺序、错位之类的真错误会差到 1e-1 量级。"""
    fused = fuse_projections_(load_model(tiny.path, "cpu", torch.float32))
    assert not any(hasattr(layer.self_attn, "q_proj") for layer in fused.layers)   # 真的换掉了
    V = tiny.cfg.vocab_size
    for B, L in [(1, 1), (1, 9), (3, 1), (2, 17)]:                 # decode、prefill、批 decode、批 prefill
        ids = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(B * 100 + L))
        pos = torch.arange(L)[None].expand(B, L)
        torch.testing.assert_close(fused(ids, pos), tiny.model(ids, pos), rtol=0, atol=1e-6)
    ids = list(range(3, 14))
    assert generate(fused, ids, 12, GREEDY, ignore_eos=True) == generate(tiny.model, ids, 12, GREEDY, ignore_eos=True)


def test_sdpa_matches_our_attention():
    """F.scaled_dot_product_attention（enable_gqa）与我们手写的 attention() 在 GQA、因果掩码、decode、
    任意掩码下给出同样的结果（不同内核的求和顺序不同，只能要求舍入级一致）。"""
    g = torch.Generator().manual_seed(0)
    B, H, H_kv, D = 2, 6, 2, 16
    for L, S in [(1, 1), (1, 23), (7, 7), (3, 10)]:
        q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((H, L), (H_kv, S), (H_kv, S)))
        mask = torch.ones(L, S, dtype=torch.bool).tril(diagonal=S - L)
        want = attention(q, k, v)
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sdpa_cache_generates_step03_tokens(tiny):
    """换成 SDPA 注意力的缓存，贪心 token 与 step03 的预分配缓存相同。"""
    ids = list(range(3, 12))
    ref = generate(tiny.model, ids, 12, GREEDY, ignore_eos=True)
    cache = SdpaKVCache(tiny.cfg, len(ids) + 11, "cpu", torch.float32)
    assert generate(tiny.model, ids, 12, GREEDY, ignore_eos=True, cache=cache) == ref


def test_static_cache_decode_equals_step03(tiny):
    """静态形状的 decode（整个缓冲区 + 掩码，张量位置写入）与 step03 的预分配缓存生成同样的 token，
    prompt 长度、生成长度、缓冲区大小、注意力内核各不相同也一样。"""
    from bench.fast_decode import sdpa
    for P, N, max_len, kernel in [(5, 12, None, attention), (11, 20, 64, attention), (11, 20, 64, sdpa)]:
        ids = list(range(3, 3 + P))
        ref = generate(tiny.model, ids, N, GREEDY, ignore_eos=True)
        assert generate_static(tiny.model, ids, N, max_len=max_len, kernel=kernel) == ref


@one_arch
@torch.inference_mode()
def test_static_cache_masks_unwritten_slots(tiny):
    """缓冲区里还没写到的位置往里塞垃圾不改变结果（被掩码遮住）；已写到的位置塞垃圾就会改变（检查能失败）。"""
    cache = StaticKVCache(tiny.cfg, 32, "cpu", torch.float32)
    forward(tiny.model, cache, [5, 6, 7], 0)                        # prefill 之后 pos = 3
    tok = torch.tensor([[8]])

    def step_logits():
        saved = [t.clone() for t in cache.k + cache.v]
        out = tiny.model(tok, cache.pos, cache=cache, last_only=True)
        for t, s in zip(cache.k + cache.v, saved):                  # 撤销本步写入，下一次从同一状态开始
            t.copy_(s)
        return out

    clean = step_logits()
    for t in cache.k + cache.v:                                     # (B, H_kv, max_len, D)
        t[:, :, 10:] = 1e3                                          # 位置 10 以后：尚未写入
    assert torch.equal(step_logits(), clean)
    for t in cache.k:
        t[:, :, 1] = 1e3                                            # 位置 1：已写入、应当被看到
    assert not torch.allclose(step_logits(), clean)


def test_compiled_static_decode_equals_eager(tmp_path):
    """torch.compile 过的静态 decode 步（fullgraph，形状不变）与 step03 生成同样的 token，换提示词不重新编译。
    编译要十几秒，只在一种架构上测（qwen3：qk_norm 让图里的算子最多）。"""
    from conftest import make_tiny_model_dir
    path = make_tiny_model_dir(tmp_path / "m", "qwen3")
    model = load_model(path, "cpu", torch.float32)
    fused = fuse_projections_(load_model(path, "cpu", torch.float32))  # 阶梯上编译的是融合后的模型
    from torch._dynamo.testing import CompileCounterWithBackend

    from bench.fast_decode import sdpa
    counter = CompileCounterWithBackend("inductor")                  # 真的用 inductor 编译，同时数编译次数
    step = compiled_decode_step(backend=counter)
    for ids in (list(range(3, 12)), list(range(40, 61))):           # 与阶梯第 4 级相同：融合投影 + SDPA + 编译
        ref = generate(model, ids, 10, GREEDY, ignore_eos=True)
        assert generate_static(fused, ids, 10, step, max_len=64, kernel=sdpa) == ref
    assert counter.frame_count == 1                                  # 只编译了一次


def test_int8_linear_is_within_quantization_error():
    """Int8Linear：每个权重的量化误差不超过它所在输出通道缩放的一半；PyTorch 的 int8 内核与
    "先反量化再用 float32 乘" 一致（说明权重布局和缩放的用法对）。"""
    g = torch.Generator().manual_seed(0)
    lin = Linear(64, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 48, generator=g))
        lin.bias.copy_(torch.randn(48, generator=g))
    q = Int8Linear(lin)
    deq = (q.weight.float() * q.scale[:, None]).t()                  # (out, in) -> (in, out)
    assert ((deq - lin.weight).abs() <= q.scale / 2 + 1e-7).all()
    x = torch.randn(5, 64, generator=g)
    torch.testing.assert_close(q(x), x @ deq + lin.bias, rtol=1e-5, atol=1e-5)


def test_llama_permute_inverts_transformers_gguf_loader():
    """写 F32 GGUF 时对 q/k 行的重排，正好是 transformers 读 GGUF 时那次重排的逆：往返一次回到原矩阵。"""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from perf.llamacpp import llama_permute
    w = np.arange(6 * 16 * 4, dtype=np.float32).reshape(6 * 16, 4)   # 6 个头，D = 16
    for n_head in (6, 2):
        back = LlamaTensorProcessor()._reverse_permute_weights(llama_permute(w, n_head), n_head, n_head)
        assert np.array_equal(back, w)
        assert not np.array_equal(llama_permute(w, n_head), w)


@pytest.mark.parametrize("linear", ["auto", "plain"])
def test_bench_runs_without_llama_cpp(linear, tiny_tok_dir, monkeypatch, capsys):
    """既没装 llama-cpp-python（模拟：import llama_cpp 失败）、也没有 llama-server 时，bench/decode_speed.py 跑完
    自己的阶梯和编译的批处理部分、打印安装命令、正常退出（退出码 0），JSON 里每一项检查都通过
    （第 0 级 plain 与 packed 两行、之后每一级的 token 与 plain 的 step03 相同；编译的引擎与 eager 相同、检查负载用到了
    每个桶、有抢占和前缀命中），剖析过的几级有矩阵乘与其余开销的拆分，批处理部分的数字都在。
    --linear auto（学习者拿到的 packed）与 --linear plain（改动之前）各跑一次：阶梯的快路与编译的批处理部分从两种权重都建得起来。
    为了快：带宽与 GEMV 表用小替身，torch.compile 换成 eager（编译由上面的测试和 test_compiled_decode.py 覆盖）。"""
    import json

    from bench import decode_speed
    from common import cli
    from perf import llamacpp
    monkeypatch.setitem(sys.modules, "llama_cpp", None)            # 之后 import llama_cpp 抛 ImportError
    monkeypatch.setattr(llamacpp, "server_binary", lambda: None)
    assert not llamacpp.available() and llamacpp.backend() is None
    monkeypatch.setattr(decode_speed, "memory_bandwidth", lambda device: 20e9)
    monkeypatch.setattr(decode_speed, "gemv_table", lambda threads: [])
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    with pytest.raises(SystemExit) as e:
        cli.run_main(decode_speed.make_parser(), decode_speed.run,
                     ["--model", str(tiny_tok_dir), "--quick", "--threads", "1", "--json", "--linear", linear])
    out = capsys.readouterr().out
    assert e.value.code == 0, out[-3000:]
    assert llamacpp.INSTALL in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["checks"] and all(result["checks"].values()), result["checks"]
    rung0 = list(decode_speed.RUNG0.values())                        # plain 与 packed 两行，都与 step03 比过
    assert set(rung0) | {decode_speed.COMPILED_RUNG} <= set(result["checks"])
    assert {"compiled_greedy_equals_eager", "compiled_sampled_equals_eager",
            "compiled_check_covers_every_bucket_preemption_prefix_hits"} <= set(result["checks"])
    figures = result["figures"]
    impl = "packed" if linear == "auto" else "plain"                  # 这台机器能打包（test_linear.py）
    assert figures["linear"] == figures["compiled_linear"] == impl
    assert "ratio_vs_llamacpp_f32[step03]" not in figures and "compiled_decode_ratio_vs_llamacpp_f32" not in figures
    for name in rung0 + ["1 + 融合 QKV、gate/up", decode_speed.COMPILED_RUNG]:
        assert figures[f"ops_per_step[{name}]"] > 0, name
        assert 0 < figures[f"matmul_share[{name}]"] and figures[f"matmul_ms[{name}]"] > 0, name
        assert f"other_ms[{name}]" in figures and f"tok_s[{name}]" in figures, name
    assert figures["packed_speedup[step03]"] > 0
    # step14 的块内核（ours_engines）：小模型没有 GGUF，只有 float32 的四行；eager 里的 ctypes 调用也剖析得到
    ours = [n for n in result["checks"] if n.startswith("ours f32")]
    assert len(ours) == 4, ours
    for name in ours:
        assert figures[f"ops_per_step[{name}]"] > 0 and figures[f"matmul_ms[{name}]"] > 0, name
    for name in ("compiled_step_speedup_b8", "compiled_throughput_ratio_b8_vs_eager", "compiled_graphs",
                 "compile_rss_mib", "decode_step_ms_b1[eager]", "engine_tok_s_b8[compiled]"):
        assert name in figures, name
    # packed 时批处理部分再并排 plain 权重的 eager；plain 时没有这一列
    assert ("packed_step_speedup_b8" in figures) == (impl == "packed")
    assert ("decode_step_ms_b1[eager@plain]" in figures) == (impl == "packed")


def test_llama_server_backend_drives_completion_and_reads_tokens_and_timings(monkeypatch, tmp_path):
    """LlamaServer 的请求体与对返回的解读（不启动真的服务器：替换掉进程和 HTTP 这两层）：token id 作 prompt、
    贪心、ignore_eos、return_tokens、不复用 KV；每个 decode 步 = predicted_ms / (predicted_n − 1)。"""
    from perf import llamacpp
    sent = {}

    def post(self, route, body):
        sent[route] = body
        return {"tokens": [7, 8, 9, 10], "timings": {"prompt_ms": 12.0, "predicted_n": 4, "predicted_ms": 30.0}}
    monkeypatch.setattr(llamacpp.LlamaServer, "__init__", lambda self, *a, **k: None)
    monkeypatch.setattr(llamacpp.LlamaServer, "_post", post)
    r = llamacpp.LlamaServer(tmp_path / "m.gguf", 2).greedy([1, 2, 3], 4)
    assert sent["/completion"] == {"prompt": [1, 2, 3], "n_predict": 4, "temperature": 0, "top_k": 1,
                                   "ignore_eos": True, "return_tokens": True, "cache_prompt": False}
    assert r.tokens == [7, 8, 9, 10] and r.prefill_s == pytest.approx(0.012)
    assert r.decode_s == pytest.approx([0.01] * 3)
    assert llamacpp.until_eos([5, 6, 1, 7], [1]) == [5, 6] and llamacpp.until_eos([5, 6], [1]) == [5, 6]


def test_llama_server_rows_are_f32_and_the_shipped_q4_1(monkeypatch, tmp_path, capsys):
    """llama-server 后端的几行（不启动服务器：open_llamacpp 换成替身）：F32 与包里自带的 Q4_1（-m 就是 find_gguf()
    那个文件），只有 F32 与我们逐 token 比；它们给不出 logits，不进质量表；没有 Q8_0 文件时打印一行原因，有了就多一行。"""
    import contextlib

    from bench import decode_speed
    from common.prepare import find_gguf
    from perf import llamacpp
    opened = []

    class FakeServer:
        kv_bytes = 4

        def __init__(self, path):
            self.path = path

        def greedy(self, ids, n):
            return llamacpp.LlamaCppRun([1] * n, 0.01, [0.01] * (n - 1))

    @contextlib.contextmanager
    def fake_open(path, threads, n_ctx):
        opened.append(path)
        yield FakeServer(path)

    shipped = find_gguf()
    files = {"F32": shipped, "Q4_1": shipped}          # F32 的文件换成包里的：这里只看选了哪几个文件、怎么命名
    monkeypatch.setattr(llamacpp, "gguf_files", lambda model_dir: dict(files))
    monkeypatch.setattr(llamacpp, "open_llamacpp", fake_open)
    s = type("S", (), {"path": tmp_path, "cfg": type("C", (), {"kv_bytes_per_token": lambda self, b: 10 * b})()})()
    with contextlib.ExitStack() as stack:
        rows = decode_speed.llama_engines("llama-server", s, 2, 64, stack)
    assert list(rows) == ["F32", "Q4_1"] and opened == [shipped, shipped]
    assert rows["F32"].name == "llama.cpp F32（llama-server）" and rows["F32"].exact
    assert rows["Q4_1"].name == "llama.cpp Q4_1（llama-server，包里自带的文件）" and not rows["Q4_1"].exact
    assert all(e.logits is None for e in rows.values())
    assert "Q8_0" in capsys.readouterr().out
    files["Q8_0"] = shipped
    with contextlib.ExitStack() as stack:
        rows = decode_speed.llama_engines("llama-server", s, 2, 64, stack)
    assert "Q8_0" in rows and "Q8_0" not in capsys.readouterr().out
    assert decode_speed.tokens_only_verdict([5, 6, 7], [5, 6, 7], [0]) == "有损：前 3 个相同"
    assert decode_speed.tokens_only_verdict([5, 6, 0, 9], [5, 8, 3, 3], [0]) == "有损：第 1 个起不同"


def test_ours_summary_ratios():
    """step14 的几行对同一份文件的 llama.cpp：float32 权重对 F32、Q4_1 对 Q4_1 的 tokens/s 之比（> 1 = 我们快）；
    没有对应的 llama.cpp 行时不报。"""
    from bench import decode_speed
    llama = {"F32": decode_speed.Engine("llama.cpp F32", None, None, True, None),
             "Q4_1": decode_speed.Engine("llama.cpp Q4_1", None, None, False, None)}
    step_s = {"ours f32（step03）": 0.020, "ours q4_1（step03）": 0.010, "ours q4_1 + 融合小算子（step03）": 0.004,
              "llama.cpp F32": 0.030, "llama.cpp Q4_1": 0.005}
    f = decode_speed.ours_summary(step_s, llama)
    assert f["ratio_vs_llamacpp_f32[ours f32（step03）]"] == 1.5
    assert f["ratio_vs_llamacpp_q4_1[ours q4_1（step03）]"] == 0.5
    assert f["ratio_vs_llamacpp_q4_1[ours q4_1 + 融合小算子（step03）]"] == 1.25
    assert "ratio_vs_llamacpp_f32[ours q4_1（step03）]" not in f
    assert decode_speed.ours_summary(step_s, {}) == {}


def test_llama_server_runs_the_shipped_q4_1_file():
    """真的 llama-server（没有时跳过并说明）在包里自带的 Q4_1 GGUF 上贪心生成：要几个给几个，计时读得出来。"""
    from common.prepare import find_gguf
    from perf import llamacpp
    if llamacpp.server_binary() is None:
        pytest.skip("llama-server not built (bash bench/llama_server/build.sh)")
    ll = llamacpp.LlamaServer(find_gguf(), 2, 128)
    try:
        r = ll.greedy([1, 504, 3458, 314, 253], 8)
    finally:
        ll.close()
    assert len(r.tokens) == 8 and len(r.decode_s) == 7 and all(d > 0 for d in r.decode_s)


def test_llama_quantize_binary_makes_a_q8_0_gguf(tmp_path, monkeypatch):
    """没有 llama-cpp-python 时，Q8_0 由与 llama-server 一起编出来的 llama-quantize 从 F32 GGUF 量化（没有时跳过）：
    gguf_files 给出 Q8_0 的文件，投影都是 Q8_0；坏的输入文件给出带它输出的错误，不留下半个文件。"""
    from common.prepare import default_model_dir
    from perf import llamacpp
    if llamacpp.quantize_binary() is None:
        pytest.skip("llama-quantize not built (bash bench/llama_server/build.sh)")
    monkeypatch.setattr(llamacpp, "available", lambda: False)
    files = llamacpp.gguf_files(default_model_dir())
    types = llamacpp.tensor_types(files["Q8_0"])
    assert "Q8_0" in types and "Q4_1" not in types, types
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(RuntimeError, match="llama-quantize failed"):
        llamacpp.quantize(bad, tmp_path / "bad-q8.gguf", "Q8_0")
    assert not (tmp_path / "bad-q8.gguf").exists() and not (tmp_path / "bad-q8.tmp").exists()
