"""step09 的 analysis/spec_sweep.py（docs/09 练习 7）：在随机小模型上跑通，每个 k 一行、字段齐全、step08 与 step09 的
token 相同；step09 的输出被改坏时，脚本报告不同并以退出码 1 结束。只查结构与正确性，不查计时。"""
import json

import pytest
from conftest import make_tiny_tok_model_dir

from common.cli import open_session
from step09_speculative.analysis import spec_sweep

FIELDS = {"k", "verify_cost", "step08_s", "step09_s", "generated_tokens", "accepted_per_verification",
          "acceptance_rate", "forwards_per_token", "predicted_speedup", "measured_speedup"}


@pytest.fixture(scope="module")
def copycat_dir(tmp_path_factory):
    """默认模型的分词器（make_tiny_tok_model_dir），但输入输出共用嵌入矩阵：随机权重时 logits ≈ 嵌入 · 嵌入，模型一直重复上一个
    token——prompt lookup 于是真的能猜中，step09 真的在验证、接受猜测（不共用时随机模型的输出几乎不重复，一次也不猜）。"""
    return make_tiny_tok_model_dir(tmp_path_factory.mktemp("copycat"), tie_word_embeddings=True)


def test_sweep_gives_one_exact_row_per_k(copycat_dir):
    s = open_session(str(copycat_dir), "cpu", "float32")
    res = spec_sweep.sweep(s, (1, 2), n_prompts=2, n_new=12, repeats=1, context=64, cost_repeats=1)
    assert res["exact"] and res["mismatches"] == []
    assert all(p["accepted_per_verification"] > 0 for p in res["points"])   # 真的猜了、也猜中了
    assert [p["k"] for p in res["points"]] == [1, 2]
    for p in res["points"]:
        assert set(p) == FIELDS
        assert p["verify_cost"] > 0 and p["step08_s"] > 0 and p["step09_s"] > 0
        assert 0 <= p["acceptance_rate"] <= 1 and 0 <= p["accepted_per_verification"] <= p["k"]
        assert 0 < p["forwards_per_token"] <= 1 + 1e-9       # 批 1：每个 token 至多一次目标前向（含 prefill）


def test_different_tokens_exit_1(copycat_dir, monkeypatch, capsys):
    """step09 的引擎多产出一个 token：脚本必须说 token 不同、退出码 1（而不是照样印一张加速表）。"""
    real_engine = spec_sweep.engine

    def corrupting(s, step, *a, **kw):
        e = real_engine(s, step, *a, **kw)
        if step is spec_sweep.step09 and kw.get("spec_method") == "ngram":
            generate = e.generate

            def bad(reqs):
                out = generate(reqs)
                return type(out)([o + [0] for o in out.outputs], out.stats)
            e.generate = bad
        return e
    monkeypatch.setattr(spec_sweep, "engine", corrupting)
    with pytest.raises(SystemExit) as exc:
        from common.cli import run_main
        run_main(spec_sweep.parser(), spec_sweep.main,
                 ["--model", str(copycat_dir), "--quick", "--ks", "1", "--device", "cpu", "--json"])
    assert exc.value.code == 1
    out = capsys.readouterr().out.splitlines()
    assert any("step09 的 token 与 step08 不同" in line for line in out)
    assert json.loads(out[-1])["exact"] is False
