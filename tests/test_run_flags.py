"""step05 起每个 run.py 的命令行：引擎参数由那一步自己的 EngineConfig 生成（说明在字段的 metadata 里），
run.py 与 common/cli.py 都不手写它们；run.py 约定里的每个参数都还在（docs/00_overview.md 的"run.py 约定"）。"""
import ast
import dataclasses
import importlib

import pytest

from conftest import ROOT

STEPS = ("step05_paged", "step06_prefix_cache", "step07_chunked_prefill", "step08_kv_quant", "step09_speculative",
         "step10_tensor_parallel", "step12_kv_eviction", "step13_kv_blend", "step14_weight_quant",
         "step15_structured_output")
CONTRACT = {   # 参数 → 引入它的那一步；之后每一步的 run.py 都有
    "--block-size": 5, "--num-blocks": 5, "--max-batch-size": 5, "--attention": 5, "--compile": 5,
    "--no-prefix-cache": 6, "--n": 6, "--max-num-batched-tokens": 7, "--no-chunked-prefill": 7,
    "--kv-dtype": 8, "--preempt": 8, "--spec-method": 9, "--num-spec-tokens": 9, "--ngram-min": 9, "--ngram-max": 9,
    "--draft-model": 9, "--tp": 10, "--pp": 10,
    "--kv-policy": 12, "--kv-budget": 12, "--num-sinks": 12, "--kv-positions": 12, "--h2o-recent": 12,
    "--snapkv-window": 12, "--snapkv-pool": 12, "--max-model-len": 12,
    "--blend": 13, "--recompute-ratio": 13,
    "--weights": 14, "--activations": 14,
    "--regex": 15, "--json-schema": 15, "--choice": 15, "--no-jump-forward": 15,
}
NOT_FROM = {"step12_kv_eviction": {"--tp", "--pp"},   # step12 从 step09 出发：没有 step10 的张量并行
            "step13_kv_blend": {"--tp", "--pp"},      # step13 从 step12 出发
            # step14 不是引擎：run.py 用 step09 的引擎（与 step03 的 generate）跑它的权重
            "step14_weight_quant": {"--tp", "--pp", "--kv-policy", "--kv-budget", "--num-sinks", "--kv-positions",
                                    "--h2o-recent", "--snapkv-window", "--snapkv-pool", "--max-model-len", "--blend",
                                    "--recompute-ratio"},
            # step15 从 step09 出发：没有张量并行、驱逐、块复用，也不换权重（step14 不是引擎）
            "step15_structured_output": {"--tp", "--pp", "--kv-policy", "--kv-budget", "--num-sinks", "--kv-positions",
                                         "--h2o-recent", "--snapkv-window", "--snapkv-pool", "--max-model-len",
                                         "--blend", "--recompute-ratio", "--weights", "--activations"}}
ENGINE_OF = {"step14_weight_quant": "step09_speculative"}   # 没有自己引擎的一步：参数来自哪一步的 EngineConfig
RUN_PY_DEFAULTS = {"spec_method": None}   # run.py 改了默认值的字段：没给时按 --draft-model 推断


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def engine_flags(step: str) -> dict[str, dataclasses.Field]:
    cfg = importlib.import_module(f"{ENGINE_OF.get(step, step)}.engine").EngineConfig
    return {flag_of(f): f for f in dataclasses.fields(cfg) if "help" in f.metadata}


@pytest.mark.parametrize("step", STEPS)
def test_engine_flags_are_generated_from_engine_config(step):
    parser = importlib.import_module(f"{step}.run").make_parser()
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    n = int(step[4:6])
    required = {f for f, since in CONTRACT.items() if since <= n} - NOT_FROM.get(step, set())
    assert required <= set(actions), "a run.py contract flag is missing"
    assert not NOT_FROM.get(step, set()) & set(actions)
    assert not {f for f, since in CONTRACT.items() if since > n} & set(actions), "a later step's flag leaked in"
    generated = engine_flags(step)
    assert {"--num-blocks", "--block-size", "--max-batch-size", "--attention"} <= set(generated)
    for flag, f in generated.items():
        a = actions[flag]
        assert a.help == f.metadata["help"], flag
        assert a.choices == f.metadata.get("choices"), flag
        if f.type is bool or f.type == "bool":
            assert a.default is False and a.nargs == 0, flag         # --no-X：开关
        else:
            default = None if f.default is dataclasses.MISSING else f.default
            assert a.default == RUN_PY_DEFAULTS.get(f.name, default), flag


def hand_written_flags(path) -> list[tuple[int, str]]:
    """源码里 add_argument("--x", …) 的 (行号, "--x")。"""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            out += [(node.lineno, a.value) for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return out


def test_no_engine_flag_is_written_by_hand():
    """EngineConfig 的字段生成的参数，不在那一步的 run.py 里、也不在 common/cli.py 里（任何一步的）再写一遍。
    （step06 的 --no-prefix-cache 不是它的 EngineConfig 的字段：它选 step05 的引擎，是 run.py 自己的开关。）"""
    generated = {step: set(engine_flags(step)) for step in STEPS}
    every = set().union(*generated.values())
    assert len(every) >= 10
    bad = [f"common/cli.py:{line} {flag}" for line, flag in hand_written_flags(ROOT / "common" / "cli.py")
           if flag in every]
    for step in STEPS:
        bad += [f"{step}/run.py:{line} {flag}" for line, flag in hand_written_flags(ROOT / step / "run.py")
                if flag in generated[step]]
    assert not bad, "engine flags written by hand:\n" + "\n".join(bad)
