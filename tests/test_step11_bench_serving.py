"""step11_serving/bench_serving.py（基准本身只测量；这里测它的负载和读数，不计时）：

- 命令行那条路（__main__）：--quick 在带真实分词器的随机小模型上跑完，只有我们的服务器（llama-server 一侧只支持
  默认模型；没装 llama-server 时打印一行原因），JSON 里有每一档的吞吐与提示词缓存命中率；
- 负载公平：整次运行里每段对话的开场白两两不同；同一档跑第二次时，第一轮的提示词只命中所有对话共用的前缀，
  不会整段命中上一次的同一段对话（改动之前会）；
- 命中数的读法：我们的 usage.prompt_tokens_details.cached_tokens、llama-server 流式回答最后的 timings.cache_n；
- 装了 llama-server 时：它的回答真的带命中数（没装时跳过并打印原因）。
"""
import asyncio
import json
import runpy
import sys

import httpx
import pytest

from conftest import ROOT
from step11_serving import bench_serving as B
from test_step11_serving import Served, real_engine, tiny_session, tok  # noqa: F401  (模块级夹具)


def llama_server_or_none():
    return B.LLAMA_SERVER if B.LLAMA_SERVER.is_file() else None


def test_cli_quick_runs_with_our_server(tiny_tok_dir, monkeypatch, capsys):
    """bench_serving.py 的 __main__（runpy 在本进程里按 __main__ 执行那个文件，与命令行同一段代码，省掉再起一个
    Python、再 import 一遍 torch；服务器照常是子进程）：--quick --json，并发 1 和 8（并发 8 那一档的请求之后还直接
    交给 engine.generate()）。小模型不是默认模型，所以只有我们的服务器。退出码 0；JSON 里每一档的吞吐、每一档与
    整个负载的提示词缓存命中率都在、在 [0, 1] 里；断开浸泡之后 0 个出错、池子全空。"""
    if llama_server_or_none() is None:
        print(f"\nllama-server not installed ({B.LLAMA_SERVER}; bash bench/llama_server/build.sh): "
              "only our server is measured (with a tiny model it would be left out anyway)")
    monkeypatch.setattr(sys, "argv", ["bench_serving.py", "--quick", "--json", "--model", str(tiny_tok_dir),
                                      "--concurrency", "1,8", "--threads", "1"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")                       # 服务器子进程
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "step11_serving" / "bench_serving.py"), run_name="__main__")
    stdout = capsys.readouterr().out
    assert e.value.code == 0, stdout[-3000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    fig = out["figures"]
    for c in (1, 8):
        assert fig[f"ours_tok_s_c{c}"] > 0
        assert 0 <= fig[f"ours_prompt_cache_hit_rate_c{c}"] <= 1
    assert 0 < fig["ours_prompt_cache_hit_rate"] <= 1             # 系统提示词与多轮历史总会命中一些
    assert not any(k.startswith("llama_server_") for k in fig)
    assert fig["disconnect_soak_broken"] == 0 and fig["disconnect_soak_kv_blocks_used_after"] == 0
    assert fig["server_overhead_vs_offline"] > 0
    assert "提示词缓存命中" in stdout


def test_every_conversation_of_a_run_has_its_own_opening():
    """默认完整运行（并发 1/4/8/16 各 2c 段对话、3 轮）加预热：175 句开场白两两不同，每一档拿到的句数对；
    组合用完之后（> 256 段）仍然两两不同；种子固定，两个服务器、两次运行拿到同一组。"""
    warm, sched = B.schedule_openings([2, 8, 16, 32], 3)
    every = [warm] + [o for ops in sched.values() for o in ops]
    assert len(every) == 1 + 3 * 58 and len(set(every)) == len(every)
    assert [len(sched[rep, k]) for rep in range(3) for k in range(4)] == [2, 8, 16, 32] * 3
    assert len(set(B.conversation_openings(600))) == 600
    assert B.conversation_openings(10) == B.conversation_openings(10)


def test_repeating_a_level_hits_only_the_shared_prefix(tok, tiny_session):  # noqa: F811
    """同一档（并发 1、2 段对话、每段 2 轮）按 schedule_openings 跑两轮，服务器是真实的 step08 引擎（前缀缓存开着，
    块大小 4）。第二轮里每段对话第一句的提示词，命中的不超过所有第一句共用的前缀（系统提示词 + 对话模板 + 开场白
    之前的部分）：上一轮的对话没有被原样重放。每段对话的第二句命中它自己的历史（多于共用前缀）：命中数真的读到了。"""
    s = Served(real_engine("step08", tiny_session), tok)
    try:
        _, sched = B.schedule_openings([2], 2)
        runs = []
        for rep in range(2):
            rec = []
            res, _ = asyncio.run(B.run_level(s.url, 1, 2, 2, 4, rec, sched[rep, 0]))
            runs.append((res, rec))                     # 并发 1：结果与发出的请求同样顺序（对话 0 的两句、对话 1 的两句）
    finally:
        s.stop()
    firsts = [B.encode_messages(tok, msgs) for _, rec in runs for msgs in rec if len(msgs) == 2]
    assert len(firsts) == 4
    shared = min(next((i for i, (a, b) in enumerate(zip(firsts[0], f)) if a != b), len(f)) for f in firsts[1:])
    res2, rec2 = runs[1]
    for r, msgs in zip(res2, rec2):
        assert r.cached_tokens is not None and r.prompt_tokens == len(B.encode_messages(tok, msgs))
        if len(msgs) == 2:                              # 第一句
            assert r.cached_tokens <= shared, (r.cached_tokens, shared, r.prompt_tokens)
        else:                                           # 第二句：系统提示 + 第一句 + 回答 + 追问
            assert r.cached_tokens > shared
    assert 0 < B.hit_rate(res2) < 1


def test_prompt_cache_hits_reads_both_servers_fields():
    """我们的服务器：usage.prompt_tokens_details.cached_tokens；llama-server：流式回答最后一个 chunk 的
    timings.cache_n（usage 里没有 details 时）；0 是"没命中"，不是"没报"；两边都没报时 None，不算进命中率。"""
    ours = {"prompt_tokens": 120, "completion_tokens": 16, "prompt_tokens_details": {"cached_tokens": 96}}
    assert B.prompt_cache_hits(ours, None) == 96
    plain_usage = {"prompt_tokens": 120, "completion_tokens": 16, "total_tokens": 136}
    assert B.prompt_cache_hits(plain_usage, {"cache_n": 101, "prompt_n": 19}) == 101
    assert B.prompt_cache_hits({"prompt_tokens_details": {"cached_tokens": 0}}, {"cache_n": 5}) == 0
    assert B.prompt_cache_hits(plain_usage, None) is None and B.prompt_cache_hits(None, {"cache_n": True}) is None
    assert B.hit_rate([B.Result(0.1, None, 1, 100, 50), B.Result(0.1, None, 1, 100, None)]) == 0.5
    assert B.hit_rate([B.Result(0.1, None, 1, 100, None)]) is None


def test_chat_request_reads_llama_server_stream_timings():
    """chat_request 读一段 llama-server 样子的流（内容 chunk，之后 choices 为空、带 usage 与 timings 的最后一个
    chunk）：token 数取 usage，命中数取 timings.cache_n；没有 usage 时提示词 token = prompt_n + cache_n。"""
    def stream(final: dict) -> bytes:
        chunks = [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in ("Hel", "lo", "!")]
        chunks.append({"choices": [], **final})
        return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"

    async def ask(final: dict):
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=stream(final)))
        async with httpx.AsyncClient(transport=transport) as client:
            return await B.chat_request(client, "http://llama", [{"role": "user", "content": "hi"}], 3)

    timings = {"cache_n": 40, "prompt_n": 8, "predicted_n": 3}
    res, text = asyncio.run(ask({"usage": {"prompt_tokens": 48, "completion_tokens": 3}, "timings": timings}))
    assert text == "Hello!" and (res.tokens, res.prompt_tokens, res.cached_tokens) == (3, 48, 40)
    res, _ = asyncio.run(ask({"timings": timings}))
    assert (res.tokens, res.prompt_tokens, res.cached_tokens) == (3, 48, 40)


def test_llama_server_reports_its_prompt_cache_hits(tmp_path):
    """真的 llama-server（bench/llama_server/build.sh 编的；没有时跳过并打印原因），默认模型的 F32 GGUF，与基准同样的
    命令行：两段各两句的对话，每个回答都带命中数，第二句复用了这段对话的历史。"""
    binary = llama_server_or_none()
    if binary is None:
        reason = f"llama-server not installed ({B.LLAMA_SERVER}; bash bench/llama_server/build.sh)"
        print(f"\nSKIP llama-server prompt-cache test: {reason}")
        pytest.skip(reason)
    from common.prepare import default_model_dir
    from perf.llamacpp import gguf_files
    f32 = gguf_files(default_model_dir())["F32"]
    port = B.free_port()
    srv = B.Server("llama-server", B.llama_server_cmd(binary, f32, 2, 2, port), {}, tmp_path / "llama.log", port)
    try:
        _, sched = B.schedule_openings([2], 1)
        res, _ = asyncio.run(B.run_level(srv.url, 1, 2, 2, 8, None, sched[0, 0]))
    finally:
        srv.stop()
    assert all(r.cached_tokens is not None and r.prompt_tokens > 0 for r in res), res
    assert res[1].cached_tokens > 0 and res[3].cached_tokens > 0


def test_weights_q4_1_serves_the_shipped_file_on_both_sides(tmp_path, monkeypatch, capsys):
    """--weights q4_1（不起真的服务器：Server 换成记下命令行的替身，llama-server 那一个记下后就中止）：我们的服务器带
    --weights q4_1，llama-server 的 -m 是包里自带的 Q4_1 GGUF（不是 F32 的），表头说出两边各服务什么、文件里的张量类型。"""
    from common.prepare import find_gguf
    started = {}

    class Stop(Exception):
        pass

    class FakeServer:
        def __init__(self, name, cmd, env, log, port, ready_timeout=300):
            started[name] = cmd
            if name == "llama-server":
                raise Stop

        def stop(self):
            pass

    monkeypatch.setattr(B, "Server", FakeServer)
    args = B.make_parser().parse_args(["--quick", "--weights", "q4_1", "--llama-server", sys.executable])
    with pytest.raises(Stop):
        B.main(args)
    out = capsys.readouterr().out
    ours = started["ours"]
    assert ours[ours.index("--weights") + 1] == "q4_1"
    llama = started["llama-server"]
    assert llama[llama.index("-m") + 1] == str(find_gguf()) and find_gguf().name.endswith("Q4_1.gguf")
    assert "--weights q4_1" in out and f"llama-server {find_gguf().name}（Q4_1 ×" in out


@pytest.mark.parametrize("argv, msg", [
    (["--weights", "q4_1", "--model", "TINY"], "GGUF"),
])
def test_bad_weights_flags_are_one_error_line(argv, msg, tiny_tok_dir, monkeypatch, capsys):
    """坏组合在起任何服务器之前一行 error、退出码 2（规则与 step14 的 run.py、服务器相同）。"""
    argv = [str(tiny_tok_dir) if a == "TINY" else a for a in argv]
    monkeypatch.setattr(sys, "argv", ["bench_serving.py", "--quick", *argv])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "step11_serving" / "bench_serving.py"), run_name="__main__")
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and msg in err, err
