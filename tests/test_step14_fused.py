"""step14 的 eager 融合路径（fused.py）：C++ 的 RoPE 与 PyTorch 的写法逐位相同，RMSNorm（带残差相加）到舍入相同；
换成 FusedDecoderLayer 的模型（块权重、普通权重、带 qk_norm 的 qwen3）logits 到舍入相同、贪心 token 相同；
真实模型上 --weights q4_1 --fused-ops 的 token 与 float32 模型相同；编译的图里退回 PyTorch 的写法。"""
import json

import pytest
import torch

from common.compare import MARGIN_TOL, compare
from common.model import RMSNorm, apply_rope
from common.weights import load_model
from conftest import make_tiny_model_dir, run_py
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single.engine import generate
from step14_weight_quant.fused import FusedDecoderLayer, rms_norm, rope_, use_fused_ops_
from step14_weight_quant.linear import BlockLinear, use_block_weights_

GREEDY = SamplingParams()
TOL = MARGIN_TOL[torch.float32]


def test_rope_bit_equal_to_pytorch(lib):
    """同一个算式、不合成 FMA：逐位相同。x 也可以是 qkv 输出按列切出来的视图（行距不是 heads·D）。"""
    torch.manual_seed(0)
    B, L, H, H_kv, D = 2, 3, 4, 2, 16
    cos, sin = torch.randn(B, L, D), torch.randn(B, L, D)
    qkv = torch.randn(B, L, (H + 2 * H_kv) * D)
    q, k, _ = qkv.split([H * D, H_kv * D, H_kv * D], dim=-1)
    q, k = q.view(B, L, H, D), k.view(B, L, H_kv, D)
    want_q = apply_rope(q.transpose(1, 2), cos, sin).transpose(1, 2)
    want_k = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)
    before = qkv.clone()
    assert rope_(q, cos, sin) is q and rope_(k, cos, sin) is k                # C++ 路径：原地
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[..., (H + H_kv) * D:], before[..., (H + H_kv) * D:])   # v 没动


def test_rms_norm_with_residual(lib):
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
    x, r = torch.randn(2, 3, 576), torch.randn(2, 3, 576)
    with torch.inference_mode():
        y, h = rms_norm(norm, x.clone())
        assert torch.allclose(y, norm(x), rtol=1e-6, atol=1e-6)
        y, h = rms_norm(norm, x.clone(), residual=r)
        assert torch.equal(h, r + x)                                          # 残差相加：逐位
        assert torch.allclose(y, norm(r + x), rtol=1e-6, atol=1e-6)           # 平方和的顺序不同：到舍入


@pytest.mark.parametrize("arch,weights", [("llama", "f32"), ("llama", "plain"), ("qwen3", "f32")])
def test_tiny_model_same_tokens(tmp_path, lib, arch, weights):
    """块权重时 q/k/v、gate/up 拼成一个 BlockLinear；普通 Linear 时保持分开（只换 RMSNorm 与 RoPE）；qwen3 带 qk_norm。"""
    model_dir = make_tiny_model_dir(tmp_path, arch)
    ref = load_model(model_dir, "cpu", torch.float32)
    model = load_model(model_dir, "cpu", torch.float32, "plain")
    if weights == "f32":
        use_block_weights_(model, "f32")
    use_fused_ops_(model)
    assert all(isinstance(layer, FusedDecoderLayer) for layer in model.layers)
    fused_projections = [len(layer.qkv) == 1 and len(layer.gate_up) == 1 for layer in model.layers]
    assert all(fused_projections) == (weights == "f32")
    if weights == "f32":
        assert isinstance(model.layers[0].qkv[0], BlockLinear)
    prompt = list(range(3, 40, 3))
    ids, pos = torch.tensor([prompt]), torch.arange(len(prompt))[None]
    with torch.inference_mode():
        assert torch.allclose(model(ids, pos), ref(ids, pos), rtol=1e-4, atol=1e-5)
        got = generate(model, prompt, 16, GREEDY, ignore_eos=True)
        want = generate(ref, prompt, 16, GREEDY, ignore_eos=True)
    full = lambda h: ref(torch.tensor([h]), torch.arange(len(h))[None])[0]   # noqa: E731
    c = compare(f"{arch}/{weights}", prompt, want, got, full, TOL)
    assert c.ok, c.describe()


def test_compiled_fused_layer_falls_back_to_pytorch(tmp_path, lib, monkeypatch):
    """torch.compile 追踪 FusedDecoderLayer 时不调 C++ 的小算子（没有注册成算子），一张图、没有断裂，数与 eager 相同。"""
    model = use_fused_ops_(use_block_weights_(
        load_model(make_tiny_model_dir(tmp_path, "llama"), "cpu", torch.float32, "plain"), "f32"))
    layer = model.layers[0]
    x = torch.randn(1, 1, model.cfg.hidden_size)
    cos, sin = model.rope(torch.tensor([[5]]), torch.float32)
    with torch.inference_mode():
        want = layer(x, cos, sin)
        ex = torch._dynamo.explain(layer)(x, cos, sin)
        assert ex.graph_count == 1 and ex.graph_break_count == 0
        got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, cos, sin)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_real_model_q4_1_fused_ops_tokens(real):
    """真实模型、发布的 Q4_1 块、融合路径：step03 的贪心 token 与 float32 模型（默认的 packed）相同。"""
    prompts = [real.tok.encode("The capital of France is")]
    model = use_fused_ops_(use_block_weights_(load_model(real.path, "cpu", torch.float32, "plain"), "q4_1"))
    for ids in prompts:
        want = generate(real.model, ids, 16, GREEDY, ignore_eos=True)
        got = generate(model, ids, 16, GREEDY, ignore_eos=True)
        c = compare(real.tok.decode(ids), ids, want, got, real.full_logits, TOL)
        assert c.ok, c.describe()


def test_run_py_fused_ops(tiny_tok_dir):
    """run.py --fused-ops（step03 与 step09 两条路）：token 与不加时相同。"""
    def tokens(*extra):
        r = run_py("step14_weight_quant", "--prompt", "Hello there", "--model", str(tiny_tok_dir), "--linear", "ours",
                   "--max-new-tokens", "8", "--ignore-eos", "--json", *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        return out["stats"]["engine"], out["results"][0]["output_ids"]
    assert tokens("--fused-ops") == tokens() and tokens()[0] == "step03"
    assert tokens("--fused-ops", "--max-batch-size", "2") == tokens("--max-batch-size", "2")
