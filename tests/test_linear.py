"""common/linear.py：打包的线性层（oneDNN，加载时打包一次）与 plain（x @ W）。

什么时候打包（CPU float32；CUDA、其他 dtype、没有 oneDNN 时退回 plain）、打包之后只留一份权重、tie 的嵌入表不受影响、
打包与 plain 的 logits 只差舍入、真实模型上贪心 token 按 common/compare.py 的规则相同（最大 logits 差打印出来）、
torch.compile 能编译打包过的模型、--linear 命令行参数。
"""
import pytest
import torch

from common import cli, linear
from common.compare import MARGIN_TOL, compare
from common.errors import UserError
from common.linear import dense_weight, linear_impl, linears, resolve_linear, use_linear_
from common.prompts import CHAPTER_PROMPTS
from common.weights import load_model
from conftest import make_tiny_model_dir
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single.engine import generate as generate_step03


def logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]     # (T, V)


def test_which_implementation_where(monkeypatch):
    """auto：只有 CPU float32 打包；CUDA（cuBLAS）、bf16 / fp16（oneDNN 的 bf16 打包要 AVX-512，没测过）、
    没有 oneDNN 的 torch 都是 plain。显式 --linear packed 在不能打包的地方是一行 error，不悄悄换掉。"""
    f32, bf16 = torch.float32, torch.bfloat16
    assert resolve_linear("auto", "cpu", f32) == "packed"
    assert resolve_linear("plain", "cpu", f32) == "plain"
    assert resolve_linear("auto", "cuda", bf16) == resolve_linear("auto", "cuda", f32) == "plain"
    assert resolve_linear("auto", "cpu", bf16) == resolve_linear("auto", "cpu", torch.float16) == "plain"
    for device, dtype, why in (("cuda", f32, "CPU"), ("cpu", bf16, "float32 only")):
        with pytest.raises(UserError, match=why):
            resolve_linear("packed", device, dtype)
    with pytest.raises(UserError, match="unknown --linear"):
        resolve_linear("fast", "cpu", f32)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert resolve_linear("auto", "cpu", f32) == "plain"
    assert "oneDNN" in linear.packed_problem("cpu", f32)


def test_bf16_on_cpu_loads_plain(tiny):
    m = load_model(tiny.path, "cpu", torch.bfloat16)
    assert linear_impl(m) == "plain" and m.lm_head.weight.dtype == torch.bfloat16


def test_packed_holds_one_copy_and_matches_plain(tiny):
    """默认（CPU float32）打包：每个 Linear 只有 .packed（weight 为 None），参数字节与 plain 相同（没有第二份）；
    打包的权重还原回来逐位相同；logits 与 plain 只差舍入。三种架构（qwen2 的 bias 也走同一条路）。"""
    packed, plain = tiny.model, load_model(tiny.path, "cpu", torch.float32, "plain")
    assert linear_impl(packed) == "packed" and linear_impl(plain) == "plain"
    assert all(m.weight is None and m.packed is not None for m in linears(packed))
    assert sum(p.nbytes for p in packed.parameters()) == sum(p.nbytes for p in plain.parameters())
    for a, b in zip(linears(packed), linears(plain)):
        assert torch.equal(dense_weight(a), b.weight)
    ids = torch.randint(0, tiny.cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    diff = (logits(packed, ids) - logits(plain, ids)).abs().max().item()
    assert diff < 1e-5, f"{tiny.arch}: max |Δlogits| packed vs plain = {diff}"


def test_switching_back_and_forth_is_exact(tiny):
    """use_linear_ 换回 plain 再打包：权重逐位不变，logits 与一开始的逐位相同。"""
    m = load_model(tiny.path, "cpu", torch.float32)
    ids = list(range(2, 30))
    before = logits(m, ids)
    use_linear_(m, "plain")
    assert linear_impl(m) == "plain" and torch.equal(m.lm_head.weight, dense_weight(tiny.model.lm_head))
    use_linear_(m, "packed")
    assert torch.equal(logits(m, ids), before)


def test_tied_embedding_is_not_packed(tmp_path):
    """tie 的模型：lm_head 是嵌入表转置的副本，打包它不碰 embed_tokens.weight（查表照旧、数值不变）。"""
    from safetensors import safe_open
    d = make_tiny_model_dir(tmp_path, "llama", tie_word_embeddings=True)
    with safe_open(d / "model.safetensors", framework="pt") as sf:
        emb = sf.get_tensor("model.embed_tokens.weight")
    m = load_model(d, "cpu", torch.float32)
    assert linear_impl(m) == "packed"
    assert not m.embed_tokens.weight.is_mkldnn and torch.equal(m.embed_tokens.weight, emb)
    assert torch.equal(dense_weight(m.lm_head), emb.t())
    plain = load_model(d, "cpu", torch.float32, "plain")
    assert (logits(m, [5, 6, 7]) - logits(plain, [5, 6, 7])).abs().max() < 1e-5


def test_compile_works_on_packed_weights(tiny):
    """torch.compile（inductor）编译打包过的模型：图里的矩阵乘是 llm_from_scratch::packed_linear 算子。
    不包这一层时 inductor 降 mkldnn._linear_pointwise 会 LoweringException。"""
    from perf.compiled_decode import compile_problem
    if compile_problem("cpu"):
        pytest.skip(compile_problem("cpu"))
    import torch._dynamo
    torch._dynamo.reset()
    m = tiny.model
    ids, pos = torch.tensor([[3, 4, 5, 6]]), torch.arange(4)[None]
    with torch.inference_mode():
        eager = m(ids, pos)
        compiled = torch.compile(m, fullgraph=True, dynamic=False)(ids, pos)
    assert (compiled - eager).abs().max() < 1e-5


def test_linear_flag(tiny, capsys):
    """--linear plain / packed / auto 从命令行一直传到加载的模型；不能打包的组合是一行 error。"""
    p = cli.make_parser("x")
    assert p.parse_args([]).linear == "auto"
    for flag, impl in (("plain", "plain"), ("packed", "packed"), ("auto", "packed")):
        args = p.parse_args(["--model", str(tiny.path), "--device", "cpu", "--linear", flag])
        assert linear_impl(load_model(tiny.path, "cpu", torch.float32, args.linear)) == impl
    args = p.parse_args(["--model", str(tiny.path), "--device", "cpu", "--dtype", "bfloat16", "--linear", "packed"])
    with pytest.raises(UserError, match="float32 only"):
        cli.load_session(args)
    with pytest.raises(SystemExit):
        p.parse_args(["--linear", "fast"])
    assert "--linear" in capsys.readouterr().err


def test_real_model_packed_vs_plain(real):
    """真实模型：打包与 plain 的 logits 差（打印出来），以及 step03（KV cache，decode 每步 M = 1）的贪心 token
    按 compare 的规则相同（分歧只允许出现在参考 top-2 差 < 1e-3 的近乎打平处，并按名字报告）。"""
    plain = load_model(real.path, "cpu", torch.float32, "plain")
    assert linear_impl(real.model) == "packed"
    worst = 0.0
    prompts = [CHAPTER_PROMPTS[0], CHAPTER_PROMPTS[3]]   # 一个续写、一个套对话模板的：两个够了（打包与提示词内容无关）
    for name, text, chat in prompts:
        ids = real.encode(text, chat)
        diff = (logits(real.model, ids) - logits(plain, ids)).abs().max().item()
        worst = max(worst, diff)
        ref = generate_step03(plain, ids, 24, SamplingParams())
        got = generate_step03(real.model, ids, 24, SamplingParams())
        c = compare(f"packed vs plain, {name}", ids, ref, got, lambda h: logits(plain, h), MARGIN_TOL[torch.float32])
        print(c.describe())
        assert c.ok, c.describe()
    print(f"max |Δlogits| packed vs plain over {len(prompts)} prompts: {worst:.2e}")
    assert worst < 2e-4          # 与 test_model 对 HF 的界相同：两种求和顺序，末位不同


def test_profiler_counts_packed_matmuls(tiny):
    """common/bench.py 的 profile_steps（step03 的剖析、bench/decode_speed.py 的"算子/步"与"矩阵乘 ms"）把打包的
    矩阵乘当成顶层算子和矩阵乘来数：同一次前向，packed 与 plain 的算子数相同（x @ W 是 aten::matmul，
    packed 是 mkldnn::_linear_pointwise），packed 的矩阵乘事件就是那个算子。"""
    from common.bench import MATMUL_OPS, profile_steps
    ids, pos = torch.tensor([[3, 4, 5, 6]]), torch.arange(4)[None]
    plain = load_model(tiny.path, "cpu", torch.float32, "plain")
    with torch.inference_mode():
        p, q = profile_steps(lambda: tiny.model(ids, pos), 1), profile_steps(lambda: plain(ids, pos), 1)
    assert p.ops == q.ops
    assert "mkldnn::_linear_pointwise" in MATMUL_OPS and "mkldnn::_linear_pointwise" in p.table
