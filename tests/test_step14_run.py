"""step14 的 run.py：q4_1（GGUF 的块，激活 float32）经 step03 与 step09 生成的 token 与 float32 模型相同；坏输入一行 error。"""
import json

import pytest

from conftest import cli_error, run_py

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


def tokens(*args):
    r = run_py("step14_weight_quant", *args, "--max-new-tokens", "8", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["stats"]["engine"], [res["output_ids"] for res in out["results"]]


@pytest.mark.parametrize("prompts,engine", [(PROMPTS[:1], "step03"), (PROMPTS, "step09")])
def test_q4_1_gives_the_fp32_models_tokens(real, prompts, engine):
    flags = [a for p in prompts for a in ("--prompt", p)]
    e_ref, ref = tokens(*flags)
    e_got, got = tokens(*flags, "--weights", "q4_1")
    assert e_ref == e_got == engine
    assert got == ref and all(len(x) == 8 for x in ref)


@pytest.mark.parametrize("argv", [
    ["--weights", "q5_0"],
    ["--weights", "f32", "--activations", "q8"],
    ["--weights", "q4_1", "--linear", "packed"],
    ["--linear", "fast"],
])
def test_bad_flags(argv, capsys):
    from step14_weight_quant import run
    cli_error(run, ["--prompt", "hi", *argv], capsys)


def test_q4_1_needs_the_default_models_gguf(tiny_tok_dir, capsys):
    from step14_weight_quant import run
    line = cli_error(run, ["--prompt", "hi", "--weights", "q4_1", "--model", str(tiny_tok_dir)], capsys)
    assert "GGUF" in line
