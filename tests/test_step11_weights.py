"""step11 的服务器用 step14 的权重（--weights / --activations / --linear ours）：

- api_server.main 的那条路（命令行 → 加载 → 换权重 → 引擎 → uvicorn；只把前台的 serve 换成后台线程里的同一个应用）：
  默认模型、--weights q4_1 的服务器贪心生成的 token 与 float32 的服务器相同（几个提示词、16 个 token）；
- run.py 的生成模式（经过服务器）：--linear ours 与 float32 相同；
- 坏组合：一行 `error:`、退出码 2，消息与 step14 的 run.py 相同（含 --tp/--pp、有损的 --activations q8 配 --compile 点名拒绝）；
- 不要 step14 时服务器不 import 它。
"""
import json
import subprocess
import sys

import openai
import pytest

from conftest import ROOT, cli_error, reuse_real_model, run_py
from step11_serving import api_server
from step11_serving import run as run11

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "1, 2, 3, 4,"]


def serve_and_ask(argv, monkeypatch) -> tuple[list[list[int]], object]:
    """api_server.main(argv)，只把最后的 serve 换成：同一个应用在后台线程里服务，openai 客户端把 PROMPTS 作为一个
    批量 completions 请求发过去（token id，贪心，16 个 token，ignore_eos）。返回 (每个提示词的输出 token, 引擎的模型)。"""
    from step11_serving.server_thread import ServerThread
    got = {}

    def serve(app, sock, shutdown_timeout):
        sock.close()
        thread = ServerThread(app).start()
        try:
            tok = app.state.tok
            client = openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0)
            r = client.completions.create(model=app.state.settings.model_name, prompt=[tok.encode(p) for p in PROMPTS],
                                          max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            got["tokens"] = [c.token_ids for c in sorted(r.choices, key=lambda c: c.index)]
            got["model"] = app.state.aengine.engine.model
        finally:
            thread.stop()
        return 0

    monkeypatch.setattr(api_server, "serve", serve)
    api_server.main(["--port", "0", "--device", "cpu", "--dtype", "float32", "--num-blocks", "64", *argv])
    return got["tokens"], got["model"]


def test_server_with_q4_1_weights_gives_the_fp32_servers_tokens(real, monkeypatch, capsys):
    from step14_weight_quant.linear import BlockEmbedding, BlockLinear
    with reuse_real_model():                                    # float32：复用 real 已经装好的模型
        ref, ref_model = serve_and_ask([], monkeypatch)
    got, model = serve_and_ask(["--weights", "q4_1"], monkeypatch)
    out = capsys.readouterr().out
    assert ref_model is real.model and isinstance(model.embed_tokens, BlockEmbedding)
    assert {m.fmt for m in model.modules() if isinstance(m, BlockLinear)} == {"q4_1", "q8_0"}   # 投影、tie 的 lm_head
    assert "权重 q4_1" in out
    assert all(len(x) == 16 for x in ref) and got == ref


def test_run_py_linear_ours_through_the_server_gives_the_fp32_tokens(real):
    def tokens(*flags):
        r = run_py("step11_serving", *[a for p in PROMPTS[:2] for a in ("--prompt", p)], "--max-new-tokens", "8",
                   "--ignore-eos", "--json", *flags)
        assert r.returncode == 0, r.stderr[-2000:]
        return [res["output_ids"] for res in json.loads(r.stdout.strip().splitlines()[-1])["results"]]
    ref = tokens()
    assert all(len(x) == 8 for x in ref) and tokens("--linear", "ours") == ref


BAD = [
    (["--weights", "q4_1", "--linear", "packed"], "--weights q4_1 runs step14's block kernel: use --linear ours"),
    (["--activations", "q8"], "--activations q8 goes with --weights q4_1"),
    (["--weights", "q8_0", "--activations", "q8"], "--activations q8 goes with --weights q4_1"),
    (["--weights", "q4_1", "--activations", "q8", "--compile"], "--activations q8 has no compiled path"),
    (["--linear", "ours", "--tp", "2"], "drop --tp/--pp"),
    (["--weights", "q8_0", "--pp", "2"], "drop --tp/--pp"),
    (["--weights", "q5_0"], "invalid choice"),
]


@pytest.mark.parametrize("argv, msg", BAD)
def test_server_refuses_bad_combinations_in_one_line(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        api_server.main(["--port", "0", *argv])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and msg in err, err


@pytest.mark.parametrize("argv, msg", [b for b in BAD if "--compile" not in b[0]])
def test_run_py_refuses_bad_combinations_in_one_line(argv, msg, capsys):
    assert msg in cli_error(run11, ["--prompt", "hi", *argv], capsys)


def test_q4_1_needs_the_default_models_gguf(tiny_tok_dir, capsys):
    with pytest.raises(SystemExit) as e:
        api_server.main(["--port", "0", "--model", str(tiny_tok_dir), "--weights", "q4_1"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "GGUF" in err


def test_server_does_not_import_step14_unless_asked():
    """服务器加载模型之前的检查：默认参数时 step14 不被 import，--weights q4_1 时才 import（另起一个进程，
    sys.modules 才是干净的）。"""
    code = ("import sys; from step11_serving import api_server, engines; p = api_server.make_parser(); "
            "engines.add_engine_args(p, 'step10')\n"
            "for argv in ([], ['--weights', 'q4_1']):\n"
            "    api_server.refuse_bad_combinations(p.parse_args(argv))\n"
            "    print(any(m.startswith('step14') for m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["False", "True"], r.stderr[-2000:]
