"""step14 的内核在 torch.compile 的图里：注册成 PyTorch 算子（kernels.block_matmul_op）的结果与直接的 ctypes 调用
逐位相同；换上块权重的小模型，编译的 decode（perf/compiled_decode.py，--compile 用的那一条）整步一张图、
真的调用了这个算子，贪心与带种子采样的 token 与 eager 相同；run.py 的 --compile 与 --linear ours 一起能用。
编译用真正的 inductor（磁盘缓存见 perf/compiled_decode.py）；只有随机小模型：真实模型编一张图要一分钟以上。
"""
import contextlib
import ctypes
import json

import numpy as np
import pytest
import torch

from common.compare import MARGIN_TOL, compare
from common.weights import load_model
from conftest import make_tiny_model_dir, run_py
from perf import compiled_decode as cd
from step02_sampling.sampler import SamplingParams
from step04_static_batching.request import Request
from step05_paged import engine as step05
from step14_weight_quant import kernels
from step14_weight_quant.formats import QuantTensor, repack_blocks, repack_f32
from step14_weight_quant.linear import BlockEmbedding, BlockLinear, use_block_weights_

gguf = pytest.importorskip("gguf")
from test_step14_kernels import gguf_from_model_dir, random_blocks  # noqa: E402

TOL = MARGIN_TOL[torch.float32]


@pytest.mark.parametrize("fmt", ["f32", "q4_1", "q8_0"])
def test_op_equals_the_ctypes_call(lib, fmt):
    """同一个内核、同样的输入：C++ 注册的算子 step14::block_matmul（这台机器有编译器和 PyTorch 的头文件，必须编得出来）
    与它的 Python 退路 step14::block_matmul_py，都与 ctypes 调用逐位相同，线程数照传；opcheck 查 register_fake 给的
    形状与 dtype 与真实结果一致（编译器靠它推形状）。"""
    N, K = 40, 96                                                # N 不是 16 的倍数：最后一个行组补齐过
    if fmt == "f32":
        packed = repack_f32(torch.randn(K, N))
    else:
        packed = repack_blocks(QuantTensor(fmt, random_blocks(fmt, N, K), N, K))
    code = kernels.FMT_CODE[fmt]
    op = kernels.graph_op()
    assert kernels.graph_op_kind() == "C++", kernels.graph_op_error()
    omp = ctypes.CDLL("libgomp.so.1")       # 进程里已经加载的那一个（PyTorch 带的）：C++ 的算子用它的 omp_get_max_threads()
    for n in (1, 3):
        with torch_threads(n):
            assert omp.omp_get_max_threads() == torch.get_num_threads() == n
    kernels._register_python_op()
    for M in (1, 3, 16):
        x = torch.randn(M, K)
        want = kernels.matmul_unchecked(lib, code, x, packed, N, K)
        for o in (op, torch.ops.step14.block_matmul_py):
            for threads in (1, 2):                              # 线程数跟着 torch.set_num_threads（C++ 里 omp_get_max_threads）
                with torch_threads(threads):
                    got = o(x, packed, code, N, K)
                assert got.shape == (M, N) and torch.equal(got, want), (o, fmt, M, threads)
            torch.library.opcheck(o.default, (x, packed, code, N, K), test_utils=("test_schema", "test_faketensor"))
        got = op(x.t().contiguous().t(), packed, code, N, K)   # 不连续的 x：算子自己先拷成连续
        assert torch.equal(got, want)

    def boom(*a):
        raise AssertionError("eager BlockLinear called the op")
    m = BlockLinear(fmt, packed, K, N)
    assert m.op is op
    m.op = boom                                                 # eager 不经过算子：直接做 ctypes 调用（见 kernels.py）
    x = torch.randn(2, 3, K)
    assert torch.equal(m(x), kernels.matmul_unchecked(lib, code, x.reshape(6, K), packed, N, K).view(2, 3, N))


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory):
    """随机小模型（tie）、它的 Q4_1 GGUF，以及换上这些块的模型（投影 Q4_1，词嵌入与 lm_head 共用 Q8_0）。"""
    d = tmp_path_factory.mktemp("c14")
    model_dir = make_tiny_model_dir(d / "m", "llama", tie_word_embeddings=True)
    gguf_from_model_dir(model_dir, d / "m.gguf")
    model = use_block_weights_(load_model(model_dir, "cpu", torch.float32, "plain"), "q4_1", d / "m.gguf")
    assert isinstance(model.embed_tokens, BlockEmbedding)
    return model


def test_compiled_decode_with_block_weights_equals_eager(lib, tiny_q4_1):
    """perf/compiled_decode.py 的桶 1、2（--compile cpp-wrapper：包装也是 C++；默认模式由下面 run.py 的测试覆盖）：
    step05 引擎 eager 与编译的输出相同（贪心与带种子的采样）；dynamo 每个桶一张图、没有断裂（fullgraph=True：
    有断裂就报错）；图里的矩阵乘确实是 C++ 注册的 step14 算子，每个投影每步一次。"""
    from torch._dynamo.utils import counters
    model = tiny_q4_1
    breaks = sum(counters["graph_break"].values())
    probe = step05.LLMEngine(model, step05.EngineConfig(32, 4, 2))
    cd.use_inductor_cache_dir()
    wrapper = cd.CompiledDecodeModel(model, (1, 2), cd.block_table_width(probe), "cpp-wrapper")
    wrapper.warm_up(probe.kv_cache.pool, progress=False)
    assert sum(counters["graph_break"].values()) == breaks

    rng = np.random.default_rng(1)
    reqs = [Request([int(t) for t in rng.integers(2, 256, n)], new, p, ignore_eos=True)
            for n, new, p in [(5, 14, SamplingParams()), (9, 10, SamplingParams(temperature=0.9, top_k=30, seed=3))]]
    outs = {}
    for kind in ("eager", "compiled"):
        e = step05.LLMEngine(model, step05.EngineConfig(32, 4, 2))
        if kind == "compiled":
            cd.compile_engine(e, compiled=wrapper, progress=False)
            with torch.profiler.profile() as prof:              # 图里调用的算子，剖析器看得见（eager 的 ctypes 调用看不见）
                outs[kind] = e.generate([Request(r.prompt_ids, r.max_new_tokens, r.params, ignore_eos=True)
                                         for r in reqs])
        else:
            outs[kind] = e.generate([Request(r.prompt_ids, r.max_new_tokens, r.params, ignore_eos=True) for r in reqs])
    assert {b: st.calls > 0 for b, st in wrapper.stats.items()} == {1: True, 2: True}
    per_forward = 2 * 7 + 1                                     # 2 层 × 7 个投影 + lm_head
    graph_steps = sum(st.calls for st in wrapper.stats.values())
    op_calls = sum(1 for ev in prof.events() if ev.name == "step14::block_matmul")
    assert op_calls == graph_steps * per_forward               # 编译的步里每个投影一次，都是 C++ 的算子
    full = lambda ids: model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]   # noqa: E731
    for r, a, b in zip(reqs, outs["eager"].outputs, outs["compiled"].outputs):
        c = compare("compiled", r.prompt_ids, a, b, full, TOL)
        assert c.ok, c.describe()


def test_run_py_compile_with_our_kernel(tiny_tok_dir, monkeypatch):
    """run.py --linear ours --compile：step09 的引擎、decode 真的走编译的图（桶 1，每个 decode 步一次），token 与不编译时
    相同。以前这个组合被拒绝；光比 token 查不出"--compile 被接受了却没用上"，所以数图被调用了几次。"""
    graph_steps = []
    run_bucket = cd.CompiledDecodeModel.run_bucket

    def counted(self, Bp, *rest):
        graph_steps.append(Bp)
        return run_bucket(self, Bp, *rest)
    monkeypatch.setattr(cd.CompiledDecodeModel, "run_bucket", counted)

    def tokens(*extra):
        r = run_py("step14_weight_quant", "--prompt", "Hello there", "--model", str(tiny_tok_dir), "--linear", "ours",
                   "--max-batch-size", "1", "--max-new-tokens", "8", "--ignore-eos", "--json", *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["stats"]["engine"] == "step09"
        return out["results"][0]["output_ids"]
    eager = tokens()
    assert graph_steps == []
    assert tokens("--compile") == eager
    assert graph_steps.count(1) >= 1 + 7                        # 预热编译一次 + 8 个 token 里的 7 个 decode 步


def test_run_py_refuses_compile_with_lossy_activations(capsys):
    from conftest import cli_error
    from step14_weight_quant import run
    line = cli_error(run, ["--prompt", "hi", "--weights", "q4_1", "--activations", "q8", "--compile"], capsys)
    assert "--activations q8" in line
