"""章节模式的冒烟测试：每一步的 `run.py --quick --json` 在一个带真实分词器的随机小模型上跑通。

真实模型上的章节模式太慢，不放进测试（`make demo` 跑它）；这里用随机小模型走一遍同样的代码路径：
检查、基准、表格、JSON 契约（shared/notes/run-cli.md）和各 issue 要求的 figures 名字。
随机模型不会像真实模型那样自然地输出 EOS，所以只断言 token 一致性的检查（名字里有 equals），
不要求依赖真实模型行为的检查（例如"负载里有以 EOS 结束的请求"）为真。
"""
import json
import shutil
from pathlib import Path

import pytest

from conftest import make_tiny_model_dir, run_py

REQUIRED_FIGURES = {
    "step01_naive": {"tok_per_s", "largest_new_tokens"},
    "step02_sampling": {"sampling_overhead_ms"},
    "step03_kvcache_single": {"speedup_vs_prev", "largest_new_tokens", "decode_tok_s", "hf_decode_tok_s",
                              "ratio_vs_hf", "roofline_fraction", "kv_bytes_per_token"},
    "step04_static_batching": {"throughput_ratio_vs_sequential", "batch_size", "prefill_padding_waste",
                               "decode_idle_waste", "kv_reserved_waste"},
    "step05_paged": {"kv_waste", "throughput_ratio_vs_static", "preemptions", "peak_concurrency_ratio_vs_static",
                     "decode_gather_bytes_per_step", "decode_step_ms_ratio_vs_static"},
    "step06_prefix_cache": {"prefill_tokens_saved_fraction", "ttft_p50_ratio_vs_step05", "throughput_ratio_vs_step05",
                            "multi_turn_hit_rate", "radix_vs_block_matched_tokens_ratio", "evictions"},
    "step07_chunked_prefill": {"tpot_p90_ratio_vs_step06", "max_stall_ratio_vs_step06", "throughput_ratio_vs_step06",
                               "ttft_p50_ratio_vs_step06", "prefill_padding_waste"},
}


@pytest.fixture(scope="module")
def tiny_with_tokenizer(real, tmp_path_factory):
    """随机小模型，但词表、分词器、对话模板与默认模型相同（章节模式的提示词要用它编码）。"""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny_tok"), "llama", vocab_size=real.cfg.vocab_size,
                               max_position_embeddings=2048, eos_token_id=sorted(real.tok.eos_ids)[0])
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real.path / name).exists():
            shutil.copy(real.path / name, path / name)
    return path


@pytest.mark.parametrize("step", list(REQUIRED_FIGURES))
def test_chapter_mode_quick_json(step, tiny_with_tokenizer, tmp_path):
    extra = ["--plot", str(tmp_path / "latency.png")] if step in ("step03_kvcache_single", "step06_prefix_cache",
                                                                  "step07_chunked_prefill") else []
    r = run_py(step, "--quick", "--json", "--model", str(tiny_with_tokenizer), *extra)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["step"] == step and out["device"] == "cpu" and out["dtype"] == "float32"
    assert Path(out["model_path"]).resolve() == tiny_with_tokenizer.resolve()
    assert REQUIRED_FIGURES[step] <= set(out["figures"]), set(out["figures"])
    assert all(isinstance(v, (int, float)) for v in out["figures"].values())
    token_checks = {k: v for k, v in out["checks"].items() if "equals" in k}
    assert token_checks and all(token_checks.values()), token_checks
    # 退出码 0 当且仅当全部检查通过（run-cli.md）
    assert (r.returncode == 0) == all(out["checks"].values())
    if extra:
        assert (tmp_path / "latency.png").stat().st_size > 0
