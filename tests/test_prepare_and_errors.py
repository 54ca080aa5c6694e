"""默认模型的准备是幂等的；"完整"检查抓得住每种残缺；每种坏输入都得到一行 `error:` 和退出码 2，而不是 traceback；
极端但合法的采样参数照常生成词表内的 token。

目录检查用一个小模型目录（几 MB）而不是复制 538 MB 的默认模型；坏输入在进程内跑 run.py 的 main（cli.run_main，
与命令行同一条路）。只有一个测试真的启动进程：确认 traceback 到不了用户的终端。
"""
import json
import shutil

import pytest

from common import prepare
from conftest import cli_error, run_py
from step01_naive import run as step01_run


def test_prepare_is_idempotent(real):
    """第二次调用直接复用缓存（不重新转换），目录是完整的。"""
    path = prepare.prepare_default_model()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert prepare.prepare_default_model() == path == real.path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert prepare.is_complete(path)
    cfg = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"


# ---------- "存在"不等于"完整" ----------

@pytest.fixture
def model_copy(tiny_tok_dir, tmp_path):
    """一个完整的小模型目录（与默认模型同样的文件）的副本，测试可以随意弄坏它。"""
    d = tmp_path / "model"
    shutil.copytree(tiny_tok_dir, d)
    assert prepare.is_complete(d)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def edit_weights(d, edit):
    from safetensors.torch import load_file, save_file
    state = load_file(d / "model.safetensors")
    edit(state)
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("name", prepare.REQUIRED_FILES)
def test_missing_file_is_incomplete(model_copy, name):
    (model_copy / name).unlink()
    assert not prepare.is_complete(model_copy)


def test_truncated_weights_are_incomplete(model_copy):
    with open(model_copy / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    assert not prepare.is_complete(model_copy)


def test_quantized_config_is_incomplete(model_copy):
    """转换时去掉了 GGUF 带来的量化标记；还带着它的目录是转换到一半的产物。"""
    edit_config(model_copy, quantization_config={"quant_method": "gguf"})
    assert not prepare.is_complete(model_copy)


def test_unparsable_config_is_incomplete(model_copy):
    (model_copy / "config.json").write_text("{")
    assert not prepare.is_complete(model_copy)


def drop_tensor(s):
    s.pop("model.layers.1.mlp.up_proj.weight")


def shrink_tensor(s):
    s["model.layers.0.self_attn.k_proj.weight"] = s["model.layers.0.self_attn.k_proj.weight"][:, :-1].contiguous()


@pytest.mark.parametrize("edit", [drop_tensor, shrink_tensor], ids=["missing", "misshapen"])
def test_bad_tensor_is_incomplete(model_copy, edit):
    edit_weights(model_copy, edit)
    assert not prepare.is_complete(model_copy)


# ---------- 坏输入：一行 `error: ...`，退出码 2 ----------

def error_line(argv, capsys) -> str:
    return cli_error(step01_run, argv, capsys)


def test_empty_prompt(capsys):
    assert "empty prompt" in error_line(["--prompt", "", "--max-new-tokens", "4"], capsys)


@pytest.mark.parametrize("value", ["0", "-3", "abc"])
def test_bad_max_new_tokens(capsys, value):
    assert "max-new-tokens" in error_line(["--prompt", "hi", "--max-new-tokens", value], capsys)


def test_bad_flag_value(capsys):
    assert "--device" in error_line(["--device", "tpu"], capsys)


def test_prompt_longer_than_context(tiny_tok_dir, capsys):
    """小模型的上下文是 2048：3000 个 "hello" 编码后超出。"""
    line = error_line(["--model", str(tiny_tok_dir), "--prompt", "hello " * 3000, "--max-new-tokens", "4"], capsys)
    assert "context of 2048 tokens" in line


def test_missing_model_dir(tmp_path, capsys):
    assert "does not exist" in error_line(["--model", str(tmp_path / "nope"), "--prompt", "hi"], capsys)


@pytest.mark.parametrize("edit, message", [(drop_tensor, "missing"), (shrink_tensor, "shape")],
                         ids=["missing", "misshapen"])
def test_bad_tensor(model_copy, capsys, edit, message):
    edit_weights(model_copy, edit)
    assert message in error_line(["--model", str(model_copy), "--prompt", "hi"], capsys)


def test_unknown_architecture(model_copy, capsys):
    edit_config(model_copy, model_type="gpt2")
    assert "unsupported architecture" in error_line(["--model", str(model_copy), "--prompt", "hi"], capsys)


def test_no_traceback_reaches_the_terminal(model_copy):
    """真正的进程：加载坏权重的错误从深处抛出，用户看到的仍只有一行 `error:`、退出码 2，stdout 为空。"""
    edit_weights(model_copy, drop_tensor)
    r = run_py("step01_naive", "--model", str(model_copy), "--prompt", "hi", timeout=300, subprocess_=True)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "missing" in r.stderr and r.stdout == ""


# ---------- 极端但合法的采样参数：退出码 0，token 都在词表里 ----------

EXTREME_ARGS = [
    ["--temperature", "1e-40"], ["--repetition-penalty", "1e-40", "--temperature", "0.8"],
    ["--repetition-penalty", "1e6", "--temperature", "0.8"], ["--top-p", "1e-30", "--temperature", "0.8"],
    ["--temperature", "1e6"], ["--temperature", "5e-324", "--repetition-penalty", "1e-300"],
    ["--temperature", "1e-5", "--repetition-penalty", "1e-40", "--frequency-penalty", "-2", "--presence-penalty", "-2",
     "--min-tokens", "3", "--stop-token-id", "0"],
]
# step02（逐个生成）、step05（批处理的引擎）、step09（投机解码：草稿模型用同一个小模型，草稿与验证都走抽样）
EXTREME_STEPS = {"step02_sampling": [], "step05_paged": ["--num-blocks", "4"],
                 "step09_speculative": ["--num-blocks", "4", "--num-spec-tokens", "2", "--draft-model", "{model}"]}


def generated_ids(step, model, extra) -> list[int]:
    argv = ["--prompt", "hi there, how are you doing today?", "--max-new-tokens", "3", "--ignore-eos",
            "--model", str(model), "--seed", "1"] + [a.format(model=model) for a in EXTREME_STEPS[step]] + extra
    r = run_py(step, *argv, "--json", threads=1)   # 提示词长一些：重复惩罚才会碰到 logit 为正的 token
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["results"][0]["output_ids"]


@pytest.mark.parametrize("extreme", EXTREME_ARGS, ids=" ".join)
@pytest.mark.parametrize("step", list(EXTREME_STEPS))
def test_run_py_extreme_sampling_values(step, extreme, tiny_tok_dir):
    """SamplingParams.validate 接受的极端值（温度 1e-40 / 1e6、重复惩罚 1e-40 / 1e6、top-p 1e-30）：run.py 照常结束，
    token 都在词表里（以前温度 1e-40 得到 NaN 分布、抽出 id V，下一次前向在 embedding 里 IndexError）；
    温度低于 SAMPLING_EPS 就是贪心：与 --temperature 0 相同。"""
    out = generated_ids(step, tiny_tok_dir, extreme)
    vocab = json.loads((tiny_tok_dir / "config.json").read_text())["vocab_size"]
    assert len(out) == 3 and all(0 <= t < vocab for t in out)
    if extreme == ["--temperature", "1e-40"]:
        assert out == generated_ids(step, tiny_tok_dir, ["--temperature", "0"])
