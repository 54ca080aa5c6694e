"""step11 的 run.py（进程内，走与命令行同一条路 cli.run_main）：

- 章节模式 --quick --json 在带真实分词器的随机小模型上：每个检查都通过，JSON 约定与各 figures 的名字；
- 生成模式：提示词经过服务器，输出 token 与 step08 引擎直接生成的相同（--n 2 的种子 S, S+1），JSON 与前几步同样的形状；
- 坏输入：一行 `error: ...`、退出码 2。
"""
import json

import pytest

from common import cli
from conftest import cli_error
from step02_sampling.sampler import SamplingParams
from step04_static_batching.request import Request
from step11_serving import run as run11
from test_step11_serving import real_engine, tiny_session  # noqa: F401  (模块级夹具)


def run_main(argv, capsys) -> tuple[int, dict]:
    with pytest.raises(SystemExit) as e:
        cli.run_main(run11.make_parser(argv), run11.main, argv)
    out = capsys.readouterr().out
    return e.value.code, json.loads(out.strip().splitlines()[-1])


def test_chapter_mode_quick_all_checks_pass(tiny_tok_dir, capsys):
    code, out = run_main(["--quick", "--json", "--model", str(tiny_tok_dir)], capsys)
    assert out["step"] == "step11_serving" and out["device"] == "cpu" and out["dtype"] == "float32"
    failed = [k for k, ok in out["checks"].items() if not ok]
    assert not failed and code == 0, failed
    assert {"served_tokens_equal_engine_generate", "stream_equals_full_equals_decode", "usage_exact",
            "n3_seeded_samples_equal_engine", "disconnect_frees_every_block", "bad_requests_get_4xx_json",
            "multi_turn_prefix_cache_hits", "clean_shutdown_every_block_free"} <= set(out["checks"])
    assert {"server_overhead_vs_offline", "disconnect_soak_clients", "disconnect_soak_disconnected",
            "disconnect_soak_completed", "disconnect_soak_kv_blocks_used_after", "multi_turn_hit_rate"} <= set(out["figures"])


def test_generation_mode_through_the_server_equals_the_engine(tiny_tok_dir, tiny_session, capsys):  # noqa: F811
    s = tiny_session
    prompts = ["你好", "The sky is"]
    argv = ["--model", str(tiny_tok_dir), "--json", "--max-new-tokens", "6", "--n", "2", "--temperature", "0.8",
            "--seed", "3", "--num-blocks", "256", "--block-size", "4"] + [a for p in prompts for a in ("--prompt", p)]
    code, out = run_main(argv, capsys)
    assert code == 0
    ids = [s.encode(p) for p in prompts]
    reqs = [Request(i, 6, SamplingParams(temperature=0.8, seed=3 + k)) for i in ids for k in range(2)]
    ref = real_engine("step08", s).generate(reqs).outputs
    assert [r["prompt"] for r in out["results"]] == [p for p in prompts for _ in range(2)]
    assert [r["prompt_ids"] for r in out["results"]] == [r.prompt_ids for r in reqs]
    assert [r["output_ids"] for r in out["results"]] == ref      # 同批、同顺序到达：逐 token 相同
    assert all(r["text"] == s.tok.decode(r["output_ids"]) and "cached_tokens" in r for r in out["results"])


@pytest.mark.parametrize("argv, msg", [
    (["--prompt", ""], "empty prompt"),
    (["--prompt", "x", "--max-new-tokens", "5000"], "context"),
    (["--prompt", "x", "--stop", ""], "--stop"),
    (["--prompt", "x", "--top-p", "0"], "top_p"),
    (["--engine", "step99"], "invalid choice"),
])
def test_bad_input_is_one_error_line(argv, msg, tiny_tok_dir, capsys):
    line = cli_error(run11, ["--model", str(tiny_tok_dir), *argv], capsys)
    assert msg in line
