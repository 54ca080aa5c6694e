"""滑动窗口注意力（模型的一部分，不是驱逐策略）：配置的解析与 HF 的配置类一致，不用缓存的前向与 HF 的 logits、
贪心生成一致（序列比窗口长），step03–11 的引擎加载时拒绝这种模型（它们的缓存没有窗口）。"""
import importlib

import pytest
import torch

from common.config import ModelConfig
from common.errors import UserError
from common.hf_reference import hf_greedy, hf_logits, load_hf_model
from common.model import causal_mask
from common.weights import load_model
from conftest import cli_error, make_tiny_model_dir
from step01_naive.engine import generate

W = 5   # 窗口比测试的序列短得多：大部分 query 都有 key 落在窗口外

# 随机小模型（3 层，便于分出全注意力层与滑动层）：名字 → (架构, 配置覆盖, 期望的每层窗口)
SW_MODELS = {
    "qwen2_all": ("qwen2", dict(use_sliding_window=True, sliding_window=W, max_window_layers=0), (W, W, W)),
    "qwen2_split": ("qwen2", dict(use_sliding_window=True, sliding_window=W, max_window_layers=2), (None, None, W)),
    "mistral": ("mistral", dict(sliding_window=W), (W, W, W)),
    "ministral": ("ministral", dict(sliding_window=W, layer_types=["sliding_attention", "full_attention",
                                                                   "sliding_attention"]), (W, None, W)),
}


@pytest.fixture(scope="module", params=list(SW_MODELS))
def sw(request, tmp_path_factory):
    arch, overrides, windows = SW_MODELS[request.param]
    path = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), arch, num_hidden_layers=3, **overrides)
    return path, load_model(path, "cpu", torch.float32), windows


def test_layer_windows_follow_the_config(sw):
    path, model, windows = sw
    assert model.cfg.layer_windows == windows and model.cfg.sliding
    assert [layer.self_attn.window for layer in model.layers] == list(windows)


def _hf_windows(arch, c):
    """HF 的配置类自己算出的每层窗口（layer_types + sliding_window；mistral 每层都用 sliding_window）。"""
    from transformers import AutoConfig
    hf = AutoConfig.for_model(**c)
    if arch == "mistral":
        return (hf.sliding_window,) * hf.num_hidden_layers
    return tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)


@pytest.mark.parametrize("arch, fields", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=2)),
    ("qwen2", dict(use_sliding_window=True, max_window_layers=1)),            # 窗口取 HF 的缺省 4096
    ("qwen2", dict(use_sliding_window=True, sliding_window=7)),                # max_window_layers 缺省 28 > 层数：都不滑
    ("qwen2", dict(use_sliding_window=False, sliding_window=7, max_window_layers=0)),   # 没开：都不滑
    ("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=0,
                   layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"])),
    ("qwen3", dict(use_sliding_window=True, sliding_window=9, max_window_layers=3)),
    ("mistral", dict(sliding_window=7)),
    ("mistral", dict()),                                                       # 缺省 4096，每层
    ("mistral", dict(sliding_window=None)),                                    # Mistral 7B v0.2 起：没有窗口
    ("ministral", dict(sliding_window=7)),
    ("ministral", dict(sliding_window=7, layer_types=["sliding_attention", "full_attention"] * 2)),
])
def test_config_rules_equal_hf_config_classes(arch, fields):
    c = dict(model_type=arch, vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=2, **fields)
    assert ModelConfig.from_dict(c).layer_windows == _hf_windows(arch, c)


def test_llama_ignores_sliding_fields_like_hf():
    c = dict(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=2, use_sliding_window=True, sliding_window=4)
    assert ModelConfig.from_dict(c).layer_windows == (None, None)


@pytest.mark.parametrize("fields, msg", [
    (dict(model_type="mistral", sliding_window=0), "sliding_window"),
    (dict(model_type="mistral", sliding_window="8"), "sliding_window"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, layer_types=["full_attention"]), "layer_types"),
    (dict(model_type="ministral", sliding_window=4, layer_types=["local", "global"]), "layer_types"),
    (dict(model_type="ministral", sliding_window=None, layer_types=["sliding_attention"] * 2), "no sliding window"),
])
def test_bad_window_fields_are_user_errors(fields, msg):
    c = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, **fields)
    with pytest.raises(UserError, match=msg):
        ModelConfig.from_dict(c)


def test_window_mask_is_a_band():
    """query i（绝对位置 S-L+i）看 key j 当且仅当 i - W < j <= i：连自己共 W 个。"""
    m = causal_mask(5, 5, "cpu", window=2).int().tolist()
    assert m == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert causal_mask(2, 6, "cpu", window=3).int().tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert torch.equal(causal_mask(4, 4, "cpu", window=4), causal_mask(4, 4, "cpu"))   # 窗口盖住整段：就是因果掩码


def test_no_cache_forward_equals_hf(sw):
    """40 个 token（窗口的 8 倍）：每个位置的 logits 与 HF 相同；窗口确实起作用（与全注意力的同一权重不同）。"""
    path, model, windows = sw
    hf = load_hf_model(path, "cpu", torch.float32)
    ids = torch.randint(2, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        ours = model(torch.tensor([ids]), torch.arange(40)[None])[0]
    torch.testing.assert_close(ours, hf_logits(hf, ids), rtol=1e-4, atol=1e-5)
    for layer in model.layers:                     # 同一份权重去掉窗口：前 W 个位置不变，之后不同
        layer.self_attn.window = None
    try:
        with torch.inference_mode():
            full = model(torch.tensor([ids]), torch.arange(40)[None])[0]
    finally:
        for layer, w in zip(model.layers, windows):
            layer.self_attn.window = w
    torch.testing.assert_close(full[:W], ours[:W])
    assert not torch.allclose(full[W:], ours[W:], atol=1e-3)


def test_step01_greedy_equals_hf_generate(sw):
    """step01（每步整段重算）贪心生成 24 个 token，提示词 9 个：窗口在提示词里、在生成中都被越过。"""
    path, model, _ = sw
    hf = load_hf_model(path, "cpu", torch.float32)
    prompt = [3, 17, 42, 9, 77, 3, 120, 64, 5]
    assert generate(model, prompt, 24, ignore_eos=True) == hf_greedy(hf, prompt, 24, [1], ignore_eos=True)


# step03–11 的 KV cache 保存并注意每一个 key：加载时拒绝，一行错误指向 step12
REFUSING = ["step03_kvcache_single", "step04_static_batching", "step05_paged", "step06_prefix_cache",
            "step07_chunked_prefill", "step08_kv_quant", "step09_speculative", "step10_tensor_parallel",
            "step11_serving"]


@pytest.mark.parametrize("sw", ["qwen2_split"], indirect=True)     # 只有一层滑动也拒绝
@pytest.mark.parametrize("step", REFUSING)
def test_cached_engines_refuse_sliding_window_models(step, sw, capsys):
    path, _, _ = sw
    line = cli_error(importlib.import_module(f"{step}.run"), ["--model", str(path), "--prompt", "hi"], capsys)
    assert "sliding-window" in line and "step12_kv_eviction" in line and "--engine step12" in line


@pytest.mark.parametrize("sw", ["mistral"], indirect=True)
def test_server_refuses_sliding_window_models(sw, capsys):
    from step11_serving import api_server
    path, _, _ = sw
    with pytest.raises(SystemExit) as e:
        api_server.main(["--model", str(path), "--port", "0"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "step12_kv_eviction" in err


def test_models_without_a_window_still_load(tiny):
    """没开窗口的模型照常加载（检查只看 layer_windows）。"""
    from common.cli import check_sliding_window
    assert not tiny.cfg.sliding
    check_sliding_window(tiny.cfg, tiny.path)
