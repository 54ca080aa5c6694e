"""默认模型的准备是幂等的；每种坏输入都得到一行 `error:` 和退出码 2，而不是 traceback。"""
import json
import shutil

import pytest

from common import prepare
from conftest import make_tiny_model_dir, run_py


def test_prepare_is_idempotent(real):
    """第二次调用直接复用缓存（不重新转换），目录是完整的。"""
    path = prepare.prepare_default_model()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert prepare.prepare_default_model() == path == real.path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert prepare.is_complete(path)
    cfg = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"


def test_incomplete_directory_is_detected(real, tmp_path):
    """"存在"不等于"完整"：缺文件、截断的权重、带量化配置的 config 都会被发现。"""
    for f in prepare.REQUIRED_FILES:
        broken = tmp_path / f"missing-{f}"
        shutil.copytree(real.path, broken)
        (broken / f).unlink()
        assert not prepare.is_complete(broken), f
    truncated = tmp_path / "truncated"
    shutil.copytree(real.path, truncated)
    with open(truncated / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    assert not prepare.is_complete(truncated)


def _error(r):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), "llama")


def _broken_copy(tiny_dir, tmp_path, edit):
    from safetensors.torch import load_file, save_file
    d = tmp_path / "broken"
    shutil.copytree(tiny_dir, d)
    state = load_file(d / "model.safetensors")
    edit(state)
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    return d


def test_empty_prompt():
    assert "empty prompt" in _error(run_py("step01_naive", "--prompt", "", "--max-new-tokens", "4"))


def test_zero_new_tokens():
    assert "max-new-tokens" in _error(run_py("step01_naive", "--prompt", "hi", "--max-new-tokens", "0"))


def test_prompt_longer_than_context(real):
    assert "context" in _error(run_py("step01_naive", "--prompt", "hello " * 9000, "--max-new-tokens", "4"))


def test_missing_model_dir(tmp_path):
    assert "does not exist" in _error(run_py("step01_naive", "--model", str(tmp_path / "nope"), "--prompt", "hi"))


def test_missing_tensor(tiny_dir, tmp_path):
    d = _broken_copy(tiny_dir, tmp_path, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    assert "missing" in _error(run_py("step01_naive", "--model", str(d), "--prompt", "hi"))


def test_wrong_tensor_shape(tiny_dir, tmp_path):
    def edit(s):
        s["model.layers.0.self_attn.k_proj.weight"] = s["model.layers.0.self_attn.k_proj.weight"][:, :-1].contiguous()
    d = _broken_copy(tiny_dir, tmp_path, edit)
    assert "shape" in _error(run_py("step01_naive", "--model", str(d), "--prompt", "hi"))


def test_unknown_architecture(tiny_dir, tmp_path):
    d = tmp_path / "gpt2ish"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    assert "unsupported architecture" in _error(run_py("step01_naive", "--model", str(d), "--prompt", "hi"))


def test_bad_flag_value():
    _error(run_py("step01_naive", "--device", "tpu"))
