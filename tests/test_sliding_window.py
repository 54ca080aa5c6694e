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


# ---- step12：引擎里的滑动窗口层（gather 的带状掩码；每层都滑动时还掉窗口外的整块）----

from step04_static_batching.request import Request  # noqa: E402
from step12_kv_eviction import engine as step12  # noqa: E402

PROMPTS = [[7, 3], [11, 5, 9, 2, 200, 31, 8, 8, 40], [(13 * i) % 250 + 2 for i in range(23)]]   # 短于、越过、几倍于窗口
MAX_NEW = 20


@pytest.fixture(scope="module")
def hf_out(sw):
    """HF 的贪心生成（每个提示词单独一次）：要对照的参照。"""
    path, _, _ = sw
    hf = load_hf_model(path, "cpu", torch.float32)
    return [hf_greedy(hf, p, MAX_NEW, [1], ignore_eos=True) for p in PROMPTS]


def step12_engine(model, **cfg):
    return step12.LLMEngine(model, step12.EngineConfig(**{**dict(num_blocks=64, block_size=4), **cfg}))


def assert_all_free(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == engine.config.num_blocks and all(c == 0 for c in bm.ref_counts)


@pytest.mark.parametrize("cfg", [
    dict(),                                                      # 整段 prefill（窗口在提示词里就被越过）
    dict(max_num_batched_tokens=4, max_batch_size=2),            # 分块 prefill：一块 4 个，每块都跨着窗口
    dict(max_num_batched_tokens=7, max_batch_size=3, enable_prefix_caching=False),
], ids=["whole", "chunk4", "chunk7"])
def test_step12_equals_hf_generate(sw, hf_out, cfg):
    path, model, _ = sw
    engine = step12_engine(model, **cfg)
    assert engine.kv_cache.attention == "gather"                 # 内核没有窗口：滑动窗口模型走 gather
    out = engine.generate([Request(p, MAX_NEW, ignore_eos=True) for p in PROMPTS]).outputs
    assert out == hf_out
    assert_all_free(engine)


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_step12_preemption_keeps_hf_tokens(sw, hf_out, preempt):
    """池子小到三个请求挤不下（每层都滑动时一个请求最多 4 块，池子 5 块；否则池子 12 块），被抢占的请求重算
    （窗口外的块从头再还一遍）或换出再换回。"""
    path, model, windows = sw
    engine = step12_engine(model, num_blocks=5 if None not in windows else 12, preempt=preempt,
                           max_num_batched_tokens=8)
    out, stats = engine.generate([Request(p, MAX_NEW, ignore_eos=True) for p in PROMPTS])
    assert out == hf_out and stats.preemptions > 0
    assert_all_free(engine)


@pytest.mark.parametrize("sw", ["qwen2_all", "mistral"], indirect=True)
def test_step12_prefix_cache_hit_then_window(sw, hf_out):
    """第二个请求命中第一个登记的前缀块（窗口之前，块还是 token 前缀），之后照样滑走、还块，输出仍与 HF 相同。"""
    path, model, _ = sw
    hf = load_hf_model(path, "cpu", torch.float32)
    shared = PROMPTS[2][:12]
    ps = [shared + [3, 4], shared + [9]]
    engine = step12_engine(model, max_batch_size=1, max_num_batched_tokens=16)
    seqs = [engine.seqs[engine.add_request(Request(p, MAX_NEW, ignore_eos=True))] for p in ps]
    evicted = 0
    while engine.has_unfinished_requests():
        engine.step()
        evicted = max(evicted, seqs[1].num_evicted)      # 结束时清零：在途中看
    assert [s.output_ids for s in seqs] == [hf_greedy(hf, p, MAX_NEW, [1], ignore_eos=True) for p in ps]
    assert seqs[1].num_cached_tokens == 12 and evicted > 0
    assert_all_free(engine)


@pytest.mark.parametrize("sw", ["mistral"], indirect=True)
def test_step12_prefix_hit_longer_than_the_window_is_capped(sw):
    """每层都滑动（W = 5，块 4）：一个请求两次前向之间最多留 W − 1 + 一块 − 1 = 7 个槽，每次前向 16 个：add_request
    按 ⌈23 / 4⌉ = 6 块检查，池子就给 6 块。A（17 个 token）登记了 4 个满块，B 的前 16 个 token 与它相同：全用 16 个
    命中的槽，第一块 prefill 要 8 块，池子再空也放不下（修之前：空批，plan 抛 ValueError）。命中的只用到 命中 + 16 ≤ 6 块
    的那几块（8 个 token），B 的输出仍与 HF 相同，块全回来。"""
    path, model, _ = sw
    hf = load_hf_model(path, "cpu", torch.float32)
    x = PROMPTS[2][:17]
    b = x[:16] + [(11 * i) % 250 + 2 for i in range(30)]
    engine = step12_engine(model, num_blocks=6, max_num_batched_tokens=16)
    assert engine.generate([Request(x, 1, ignore_eos=True)]).outputs == [hf_greedy(hf, x, 1, [1], ignore_eos=True)]
    out = engine.generate([Request(b, MAX_NEW, ignore_eos=True)])
    assert out.outputs == [hf_greedy(hf, b, MAX_NEW, [1], ignore_eos=True)] and out.stats.cached_tokens == [8]
    assert_all_free(engine)


def test_step12_blocks_stay_bounded_when_every_layer_slides(sw):
    """一个 30 + 40 个 token 的请求（输出与 HF 相同）：每层都滑动时，块数不超过 (最大窗口 − 1 + 一块 − 1 + 一次前向的 token) 的块数，
    与长度无关；有一层全注意力时一块也不还（那一层要看全部 key）。"""
    path, model, windows = sw
    bs, M = 4, 8
    engine = step12_engine(model, block_size=bs, max_num_batched_tokens=M)
    prompt = [(7 * i) % 250 + 2 for i in range(30)]
    rid = engine.add_request(Request(prompt, 40, ignore_eos=True))
    peak, last, engine_out = 0, None, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            engine_out += o.new_token_ids
            if o.finished:
                last = o
        if rid in engine.seqs:
            peak = max(peak, len(engine.seqs[rid].block_table))
    hf = load_hf_model(path, "cpu", torch.float32)
    assert engine_out == hf_greedy(hf, prompt, 40, [1], ignore_eos=True)
    total_blocks = -(-(30 + 40 - 1) // bs)
    if None in windows:
        assert last.kv_blocks_peak == total_blocks
    else:
        bound = -(-(max(windows) - 1 + bs - 1 + M) // bs)
        assert peak <= bound and last.kv_blocks_peak <= bound < total_blocks
    assert_all_free(engine)


@pytest.mark.parametrize("sw", ["mistral"], indirect=True)
def test_step12_speculative_decoding_with_a_window(sw):
    """prompt lookup 的猜测在窗口模型上照样验证：贪心输出与 HF 相同，确实接受过猜测，还块后块数仍有界。"""
    path, model, _ = sw
    hf = load_hf_model(path, "cpu", torch.float32)
    prompt = [5, 6, 7, 8] * 6
    engine = step12_engine(model, spec_method="ngram")
    out = engine.generate([Request(prompt, 30, ignore_eos=True)]).outputs
    assert out == [hf_greedy(hf, prompt, 30, [1], ignore_eos=True)]
    assert engine.spec_stats.accepted > 0
    assert_all_free(engine)


@pytest.mark.parametrize("sw", ["mistral"], indirect=True)
def test_step12_refuses_an_eviction_policy_on_a_window_model(sw):
    path, model, _ = sw
    with pytest.raises(UserError, match="kv-policy full"):
        step12_engine(model, kv_policy="window", kv_budget=8)


@pytest.fixture(scope="module")
def sw_tok_dir(tmp_path_factory):
    """mistral 的随机小模型（窗口 6），词表、分词器与默认模型相同：给 run.py 用。"""
    import shutil

    from common.config import eos_token_ids
    from common.prepare import prepare_default_model
    real_dir = prepare_default_model()
    path = make_tiny_model_dir(tmp_path_factory.mktemp("sw_tok"), "mistral", sliding_window=6,
                               vocab_size=ModelConfig.from_dir(real_dir).vocab_size, max_position_embeddings=2048,
                               eos_token_id=sorted(eos_token_ids(real_dir))[0])
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real_dir / name).exists():
            shutil.copy(real_dir / name, path / name)
    return path


def test_step12_run_py_generates_hf_tokens_with_bounded_blocks(sw_tok_dir):
    import json

    from conftest import run_py
    r = run_py("step12_kv_eviction", "--model", str(sw_tok_dir), "--prompt", "Once upon a time, in a land far away",
               "--max-new-tokens", "30", "--ignore-eos", "--block-size", "4", "--max-num-batched-tokens", "8",
               "--device", "cpu", "--dtype", "float32", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])["results"][0]
    hf = load_hf_model(sw_tok_dir, "cpu", torch.float32)
    assert res["output_ids"] == hf_greedy(hf, res["prompt_ids"], 30, [], ignore_eos=True)
    assert res["kv_blocks_peak"] <= -(-(6 - 1 + 4 - 1 + 8) // 4) < -(-(len(res["prompt_ids"]) + 29) // 4)


@pytest.mark.parametrize("argv, msg", [
    (["--no-chunked-prefill"], "--no-chunked-prefill"),
    (["--kv-policy", "window", "--kv-budget", "16"], "--kv-policy full"),
])
def test_step12_run_py_refuses_what_cannot_keep_the_window(sw_tok_dir, argv, msg, capsys):
    line = cli_error(importlib.import_module("step12_kv_eviction.run"),
                     ["--model", str(sw_tok_dir), "--prompt", "hi", "--device", "cpu", *argv], capsys)
    assert msg in line


def test_window_of_one_equals_hf_forward(tmp_path):
    """极端但合法的 W = 1：每个位置只看自己。对照 HF 的前向（整段重算的 logits），而不是 HF 的 generate——
    它的滑动窗口缓存只留最后 sliding_window − 1 个 token，写成切片 [-W + 1:]，W = 1 时是 [-0:]，即全部留下，
    decode 时窗口不起作用（transformers 5.x 的 DynamicSlidingWindowLayer）。step12 的引擎：0 个旧 key 要留，
    每次前向之后整块整块地还。"""
    path = make_tiny_model_dir(tmp_path, "mistral", sliding_window=1)
    model, hf = load_model(path, "cpu", torch.float32), load_hf_model(path, "cpu", torch.float32)
    ids = PROMPTS[2][:12]
    with torch.inference_mode():
        torch.testing.assert_close(model(torch.tensor([ids]), torch.arange(12)[None])[0], hf_logits(hf, ids),
                                   rtol=1e-4, atol=1e-5)
    engine = step12_engine(model, max_num_batched_tokens=8, max_batch_size=3)
    out, stats = engine.generate([Request(p, 16, ignore_eos=True) for p in PROMPTS])
    assert out == [generate(model, p, 16, ignore_eos=True) for p in PROMPTS]
    assert max(stats.kv_blocks_peak) <= -(-(0 + 3 + 8) // 4)    # 不满一块的旧槽 + 一次前向的 8 个（提示词要 10 块）
    assert_all_free(engine)


@pytest.mark.parametrize("sw", ["mistral"], indirect=True)
def test_compile_keeps_a_window_model_eager(sw):
    """--compile 编的是 paged 内核的 decode；窗口模型走 gather，引擎保持 eager，并说明为什么。"""
    from perf.compiled_decode import compile_engine
    path, model, _ = sw
    msgs = []
    assert compile_engine(step12_engine(model), log=msgs.append) is False
    assert "sliding-window" in msgs[0]


def test_server_serves_a_window_model_with_step12(sw_tok_dir, capsys):
    """step11 的 run.py（提示词经过服务器）：--engine step12 加载窗口模型，输出与 HF 的贪心相同；默认引擎（step10）拒绝。"""
    import json

    from common import cli
    from step11_serving import run as run11
    argv = ["--model", str(sw_tok_dir), "--prompt", "Once upon a time, in a land far away", "--max-new-tokens", "16",
            "--ignore-eos", "--device", "cpu", "--dtype", "float32", "--json"]
    assert "step12_kv_eviction" in cli_error(run11, argv, capsys)
    with pytest.raises(SystemExit) as e:
        cli.run_main(run11.make_parser(argv + ["--engine", "step12"]), run11.main, argv + ["--engine", "step12",
                                                                                          "--block-size", "4"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out[-2000:]
    res = json.loads(out.strip().splitlines()[-1])["results"][0]
    hf = load_hf_model(sw_tok_dir, "cpu", torch.float32)
    assert res["output_ids"] == hf_greedy(hf, res["prompt_ids"], 16, [], ignore_eos=True)
