"""step11：服务器的可靠性。

- 一个请求的失败只结束它自己（注入：它的增量解码抛出；真实引擎里它的采样抛出）：它得到 SSE 的 error 事件或 500，
  块还回池子，同时在跑的别的请求逐 token 照常完成，服务器照常服务；
- 引擎自己的失败（前向抛出）：每个在等的请求都收到错误，服务器以非零码退出（进程内：ServerThread.exit_code；
  真实进程：子进程的退出码）；/health 在引擎一步卡住太久时报 503；
- 输入有界、有检查：停止串的个数与长度、嵌套层数、n × 提示词数 > --max-waiting、不认识 / 没实现的字段都是 400 指名字段；
  停止串只由服务器在文本尾巴上找一次（引擎拿到的请求不带停止串）；分词与对话模板不在事件循环的线程里跑；
- 投机解码的引擎（ngram、草稿模型）与默认的 step10 引擎在并发 + 采样下经过服务器，与引擎直接生成相同；
- 浸泡：敌意请求与正常请求交错打同一个服务器，之后贪心探针的文本与之前相同，没有在跑 / 在等的请求，每个块都空闲。
"""
import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from common.cli import open_session
from common.compare import MARGIN_TOL, compare
from common.errors import UserError
from common.tokenizer import Tokenizer
from step02_sampling.sampler import SamplingParams, draw_margin
from step04_static_batching.request import Request
from step11_serving import async_engine as AE
from step11_serving import protocol as P
from step11_serving.detokenizer import IncrementalDetokenizer
from step11_serving.engines import add_engine_args, build_engine
from test_step11_fake_engine import FakeEngine
from test_step11_serving import MODEL, Served, chat_ids, real_engine

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tok(tiny_tok_dir):
    return Tokenizer(tiny_tok_dir)


@pytest.fixture(scope="module")
def tiny_session(tiny_tok_dir):
    return open_session(str(tiny_tok_dir), "cpu", "float32")


def sse_events(lines):
    return [json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: {")]


async def stream_lines(c, path, body):
    async with c.stream("POST", path, json={**body, "stream": True}) as r:
        return r.status_code, [line async for line in r.aiter_lines() if line]


# ---------------- 一个请求的失败 ----------------

class PoisonDetokenizer(IncrementalDetokenizer):
    """停止串里有 "POISON" 的请求：第 3 个 token 时增量解码抛出（模拟任何只属于一个请求的后处理错误）。"""

    def push(self, token_ids):
        if "POISON" in self.stop and len(self.ids) >= 2:
            raise RuntimeError("poisoned detokenizer")
        return super().push(token_ids)


def test_one_request_failure_ends_only_that_request(tok, monkeypatch):
    monkeypatch.setattr(AE, "IncrementalDetokenizer", PoisonDetokenizer)
    server = Served(FakeEngine(tok, step_s=0.005, max_batch_size=8), tok)
    try:
        normal = {"prompt": "x", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        poison = {**normal, "stop": ["POISON"]}
        ref = FakeEngine(tok).generate([Request(tok.encode("x"), 40, ignore_eos=True)]).outputs[0]

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
                return await asyncio.gather(
                    *(stream_lines(c, "/v1/completions", normal) for _ in range(3)),
                    stream_lines(c, "/v1/completions", poison), c.post("/v1/completions", json=poison),
                    c.post("/v1/completions", json={**normal, "n": 2}))
        *normals, (pcode, plines), pfull, nfull = asyncio.run(asyncio.wait_for(main(), 60))
        for code, lines in normals:                          # 同一批里的别的请求逐 token 照常完成
            ev = sse_events(lines)
            assert code == 200 and lines[-1] == "data: [DONE]"
            assert "".join(e["choices"][0]["text"] for e in ev) == tok.decode(ref)
            assert ev[-1]["choices"][0]["finish_reason"] == "length"
        assert nfull.status_code == 200 and [c["text"] for c in nfull.json()["choices"]] == [tok.decode(ref)] * 2
        # 失败的那个：流里一个 error 事件再 [DONE]；非流式 500；都说明了原因
        assert pcode == 200 and plines[-1] == "data: [DONE]"
        err = json.loads(plines[-2].removeprefix("data: "))["error"]
        assert err["code"] == 500 and "poisoned" in err["message"]
        assert pfull.status_code == 500 and "poisoned" in pfull.json()["error"]["message"]
        server.wait_idle()
        assert server.pool_is_free() and server.thread.exit_code is None
        assert server.metric('llm_requests_total{finish_reason="error"}') == 2
        assert httpx.get(server.url + "/health").status_code == 200
        r = httpx.post(server.url + "/v1/completions", json={**normal, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        server.stop()


def test_real_engine_sampling_failure_ends_only_that_request(tiny_session, monkeypatch):
    """真实的 step10 引擎：一个请求的采样抛出（注入：种子为 666 的请求）→ 引擎只结束它（finish_reason "error"），
    同一批的贪心请求与没有它时逐 token 相同，块全部还回。"""
    import step10_tensor_parallel.engine as E10
    real_verify = E10.verify

    def verify(rows, prompt, output, proposal, params, generator, eos_ids=()):
        if params.seed == 666:
            raise RuntimeError("injected sampling failure")
        return real_verify(rows, prompt, output, proposal, params, generator, eos_ids)
    s = tiny_session
    ids = chat_ids(s.tok, "讲个笑话")
    ref = real_engine("step10", s).generate([Request(ids, 12, SamplingParams(), ignore_eos=True)]).outputs[0]
    monkeypatch.setattr(E10, "verify", verify)
    server = Served(real_engine("step10", s), s.tok)
    try:
        good = {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        bad = {**good, "temperature": 0.8, "seed": 666}

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                return await asyncio.gather(c.post("/v1/completions", json=good), c.post("/v1/completions", json=bad),
                                            stream_lines(c, "/v1/completions", bad))
        g, b, (_, blines) = asyncio.run(asyncio.wait_for(main(), 120))
        assert g.status_code == 200 and g.json()["choices"][0]["token_ids"] == ref
        assert b.status_code == 500 and "injected sampling failure" in b.json()["error"]["message"]
        assert "injected sampling failure" in blines[-2] and blines[-1] == "data: [DONE]"
        server.wait_idle()
        assert server.pool_is_free() and server.thread.exit_code is None
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


@pytest.mark.parametrize("name", ["step09", "step10"])
def test_engine_finishes_only_the_request_whose_sampling_fails(name, tiny_session, monkeypatch):
    """服务器服务的 step09/10 引擎本身：一个请求的采样抛出、或采出词表外的 id（坏掉的分布）→ 只有它以 "error" 结束
    （RequestOutput.error 带着原因），块还回；同一批的另一个请求与单独生成时逐 token 相同；generate() 把错误抛给调用者。"""
    import importlib
    E = importlib.import_module({"step09": "step09_speculative", "step10": "step10_tensor_parallel"}[name] + ".engine")
    s = tiny_session
    ids = chat_ids(s.tok, "讲个笑话")
    ref = real_engine(name, s).generate([Request(ids, 8, SamplingParams(), ignore_eos=True)]).outputs[0]
    real_verify = E.verify

    def verify(rows, prompt, output, proposal, params, generator, eos_ids=()):
        if params.seed == 666:
            return [rows.shape[-1]]                      # 词表外的 id：以前会在下一步的前向里让整批出错
        if params.seed == 777:
            raise RuntimeError("injected")
        return real_verify(rows, prompt, output, proposal, params, generator, eos_ids)
    monkeypatch.setattr(E, "verify", verify)
    for seed, why in ((666, "outside the vocabulary"), (777, "injected")):
        e = real_engine(name, s)
        good = e.add_request(Request(ids, 8, SamplingParams(), ignore_eos=True))
        bad = e.add_request(Request(ids, 8, SamplingParams(temperature=0.5, seed=seed), ignore_eos=True))
        got, errors = [], []
        while e.has_unfinished_requests():
            for o in e.step():
                got += o.new_token_ids if o.request_id == good else []
                if o.request_id == bad:
                    assert o.finished and o.finish_reason == "error" and not o.new_token_ids
                    errors.append(o.error)
        assert got == ref and len(errors) == 1 and why in str(errors[0])
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
        with pytest.raises(Exception, match=why):
            real_engine(name, s).generate([Request(ids, 8, SamplingParams(temperature=0.5, seed=seed))])


# ---------------- 引擎自己的失败 ----------------

class BrokenForward(FakeEngine):
    """生成了 6 个 token 以后，step()（"前向"）抛出：引擎自己的失败。"""

    def step(self):
        out = super().step()
        if sum(len(s.output_ids) for s in self.scheduler.running) > 6:
            raise RuntimeError("boom")
        return out


def test_engine_failure_answers_everyone_and_stops_the_server(tok):
    server = Served(BrokenForward(tok, step_s=0.005), tok)
    try:
        body = {"prompt": "x", "max_tokens": 50, "temperature": 0, "ignore_eos": True}

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
                return await asyncio.gather(c.post("/v1/completions", json=body), stream_lines(c, "/v1/completions", body))
        full, (_, lines) = asyncio.run(asyncio.wait_for(main(), 30))
        assert full.status_code == 503 and "boom" in full.json()["error"]["message"]
        assert "boom" in lines[-2] and lines[-1] == "data: [DONE]"
        server.thread.thread.join(30)                        # 服务器自己停下（main() 里：进程以 1 退出）
        assert not server.thread.thread.is_alive() and server.thread.exit_code == 1
        assert server.aengine.health_problem().startswith("the engine failed")
        with pytest.raises(httpx.HTTPError):
            httpx.post(server.url + "/v1/completions", json=body)
    finally:
        server.stop()


def test_engine_failure_exits_the_process_nonzero(tiny_tok_dir, tmp_path):
    """真实进程的那条路（api_server.serve，main() 用的就是它）：引擎死了 → 在等的请求得到 503 → 进程退出码 1。"""
    script = tmp_path / "serve_broken.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
        from common.tokenizer import Tokenizer
        from step11_serving.api_server import ServerSettings, bind, build_app, serve
        from step11_serving.async_engine import AsyncLLMEngine
        from test_step11_reliability import BrokenForward
        tok = Tokenizer({str(tiny_tok_dir)!r})
        engine = BrokenForward(tok, step_s=0.005)
        app = build_app(AsyncLLMEngine(engine, tok), tok, ServerSettings("tiny", 2048, tok.hf.vocab_size, 1024))
        sock = bind("127.0.0.1", 0)
        print(sock.getsockname()[1], flush=True)
        sys.exit(serve(app, sock, 2.0))
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        url = f"http://127.0.0.1:{port}"
        t0 = time.time()
        while True:                                          # uvicorn 开始接收之前连接会被拒绝
            try:
                assert httpx.get(url + "/health").status_code == 200
                break
            except httpx.ConnectError:
                assert time.time() - t0 < 60
                time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 50, "temperature": 0,
                                                      "ignore_eos": True}, timeout=30)
        assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
        assert proc.wait(60) == 1
        assert "exiting so that a supervisor restarts" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_health_reports_a_stalled_engine(tok):
    """一步跑了超过 stall_s 秒：/health 503（卡住的进程 supervisor 也要看得见）；这一步完成后又是 200。"""
    engine = FakeEngine(tok, step_s=1.5)
    server = Served(engine, tok)
    server.aengine.stall_s = 0.2
    try:
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("r", httpx.post(
            server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "temperature": 0}, timeout=30)))
        t.start()
        seen, t0 = [], time.time()
        while t.is_alive() and time.time() - t0 < 30:
            h = httpx.get(server.url + "/health")
            seen.append((h.status_code, h.json().get("error", "")))
            time.sleep(0.05)
        t.join()
        assert done["r"].status_code == 200
        assert any(code == 503 and "has not completed a step" in err for code, err in seen), seen
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


# ---------------- 输入有界、有检查 ----------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tok):
    s = Served(FakeEngine(tok, step_s=0.001), tok, max_waiting=8)
    yield s
    s.stop()


def check_refused(server, path, body, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400
    if param is not None:
        assert param.split(".")[-1] in err["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    return err


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {**CHAT, "stop": [f"s{i}" for i in range(10_000)]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "stop": [f"s{i}" for i in range(P.MAX_STOP_STRINGS + 1)]}, "stop"),
    ("/v1/completions", {**COMP, "stop": "x" * (P.MAX_STOP_CHARS + 1)}, "stop"),
    ("/v1/completions", {**COMP, "n": 3, "prompt": ["a", "b", "c"]}, None),          # 9 > --max-waiting 8
])
def test_unbounded_inputs_are_400(server, path, body, param):
    err = check_refused(server, path, body, param)
    if param is None:                                       # 永远进不了队列：不是 503 + Retry-After（客户端会一直重试）
        assert "max-waiting" in err["message"]


def test_stop_list_at_the_bound_is_accepted(server):
    stops = [f"never{i}" + "z" * (P.MAX_STOP_CHARS - 7) for i in range(P.MAX_STOP_STRINGS)]
    assert httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "stop": stops}).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={**COMP, "n": 4, "prompt": ["a", "b"]})   # 8 个：正好
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_deeply_nested_json_is_400(server):
    for depth in (P.MAX_JSON_DEPTH + 1, 100_000):
        raw = '{"model": "tiny", "prompt": "x", "extra": ' + "[" * depth + "]" * depth + "}"
        r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nested deeper" in r.json()["error"]["message"], r.text
    assert P.json_depth({"a": [[{"b": []}]]}) == 5


def test_stop_strings_are_matched_once_in_the_server(tok):
    """引擎拿到的请求不带停止串（它不必每个 token 把整段输出重新解码）；服务器在文本尾巴上找到它，结束原因 "stop"，
    token 截在停止串出现的那个 token（与引擎自己判断时相同）。"""
    seen = []

    class Recording(FakeEngine):
        def add_request(self, r):
            seen.append(r.stop)
            return super().add_request(r)
    server = Served(Recording(tok, step_s=0.001), tok)
    try:
        ids = tok.encode("x")
        stop = "小的模"
        ref = FakeEngine(tok).generate([Request(ids, 40, ignore_eos=True, stop=(stop,))]).outputs[0]
        full = FakeEngine(tok).generate([Request(ids, 40, ignore_eos=True)]).outputs[0]
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 40, "temperature": 0,
                                                             "ignore_eos": True, "stop": [stop, "zz"],
                                                             "return_token_ids": True}).json()
        c = r["choices"][0]
        assert c["finish_reason"] == "stop" and c["token_ids"] == ref and len(ref) < 40
        assert c["text"] == tok.decode(full)[:tok.decode(full).index(stop)]
        assert r["usage"]["completion_tokens"] == len(ref)
        assert seen == [()]
        server.wait_idle()
        assert server.pool_is_free()
    finally:
        server.stop()


def test_held_back_equals_brute_force(tok):
    import random
    rng = random.Random(0)
    for _ in range(300):
        stops = tuple("".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4)))
        d = IncrementalDetokenizer(tok, stops)
        d.text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 10)))
        brute = max([k for s in stops for k in range(1, len(s)) if d.text.endswith(s[:k])], default=0)
        assert d._held_back() == brute, (stops, d.text)


def test_tokenization_runs_off_the_event_loop(tok):
    """对话模板与分词在工作线程里跑（asyncio.to_thread）：事件循环的线程（uvicorn）从不执行它们。"""
    threads = []

    class HF:
        def __init__(self, hf):
            self._hf = hf

        def __getattr__(self, name):
            return getattr(self._hf, name)

        def __call__(self, *a, **kw):
            threads.append(threading.current_thread().name)
            return self._hf(*a, **kw)

    class Tok:
        def __init__(self, t):
            self._t, self.hf = t, HF(t.hf)

        def __getattr__(self, name):
            return getattr(self._t, name)

        def encode(self, *a, **kw):
            threads.append(threading.current_thread().name)
            return self._t.encode(*a, **kw)
    wrapped = Tok(tok)
    server = Served(FakeEngine(tok), wrapped)
    try:
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
        assert httpx.post(server.url + "/v1/completions", json=COMP).status_code == 200
        assert len(threads) >= 2 and "uvicorn" not in threads, threads
    finally:
        server.stop()


# ---------------- 不悄悄忽略：没实现的字段拒绝、指名 ----------------

@pytest.mark.parametrize("path,body,param", [
    # 实现了的字段：越界、类型不对的值 400 指名字段（取值检查是 step02 的 SamplingParams.validate）
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": -2.01}, "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 100.5}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/completions", {**COMP, "suffix": "end"}, "suffix"),
    ("/v1/completions", {**COMP, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {**COMP, "stop_token_ids": 5}, "stop_token_ids"),
    ("/v1/completions", {**COMP, "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {**COMP, "min_tokens": 1.5}, "min_tokens"),
    ("/v1/completions", {**COMP, "include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ("/v1/completions", {**COMP, "best_of": 3}, "best_of"),
    ("/v1/completions", {**COMP, "echo": True, "max_tokens": 0}, "max_tokens"),   # 假引擎不算 prompt logprobs
    ("/v1/completions", {**COMP, "logprobs": 2}, "logprobs"),                      # 假引擎不算 logprobs
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": False}, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "no_such_field": 1}, "no_such_field"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages.0.name"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True, "per_token": True}},
     "stream_options.per_token"),
])
def test_unimplemented_fields_are_refused_by_name(server, path, body, param):
    check_refused(server, path, body, param)


@pytest.mark.parametrize("extra", [
    {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"}},
    {"logit_bias": None, "tools": None, "tool_choice": "none", "user": "alice", "seed": 3, "n": 2, "logprobs": False},
    {"store": False, "metadata": {}, "top_logprobs": 0, "parallel_tool_calls": True},
])
def test_default_values_of_unimplemented_fields_are_accepted(server, extra):
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/completions", json={**COMP, "best_of": 2, "n": 2, "echo": False, "suffix": None})
    assert r.status_code == 200, r.text


# ---------------- --draft-model ----------------

def test_server_spec_method_draft_needs_and_uses_draft_model(tiny_tok_dir, tiny_session):
    from step11_serving.api_server import make_parser
    p = make_parser()
    add_engine_args(p, "step10")
    base = ["--num-blocks", "64", "--block-size", "4"]
    e = build_engine("step10", tiny_session, p.parse_args([*base, "--spec-method", "draft", "--draft-model",
                                                           str(tiny_tok_dir)]))
    assert type(e.proposer).__name__ == "DraftModelProposer"
    with pytest.raises(UserError, match="--draft-model"):
        build_engine("step10", tiny_session, p.parse_args([*base, "--spec-method", "draft"]))
    with pytest.raises(UserError, match="--spec-method draft"):
        build_engine("step10", tiny_session, p.parse_args([*base, "--draft-model", str(tiny_tok_dir)]))


# ---------------- 投机解码与默认引擎：并发 + 采样 ----------------

@pytest.mark.parametrize("name,flags", [
    ("step10", ()),
    ("step09", ("--spec-method", "ngram")),
    ("step10", ("--spec-method", "draft", "--draft-model", "TINY")),
])
def test_batched_sampling_through_the_server_equals_the_engine(name, flags, tiny_tok_dir, tiny_session):
    """6 个并发请求（贪心与带种子的采样、一个带停止串）经过服务器 == 同类引擎直接生成（批的组成不同：near-tie 规则）。"""
    s = tiny_session
    flags = [str(tiny_tok_dir) if f == "TINY" else f for f in flags]
    make = lambda: real_engine(name, s, "--max-batch-size", "4", *flags)   # noqa: E731
    server = Served(make(), s.tok)
    try:
        prompts = [chat_ids(s.tok, f"第 {i} 个问题：{'长城' * i}") for i in range(6)]
        temps = [0.0, 0.8, 0.0, 1.0, 0.7, 0.0]
        reqs = [Request(p, 16, SamplingParams(temperature=t, seed=i), ignore_eos=True) for i, (p, t) in
                enumerate(zip(prompts, temps))]
        ref = make().generate(reqs).outputs
        k = next(k for k in range(10, 2, -1) if "\ufffd" not in s.tok.decode(ref[5][:k]))
        stop = s.tok.decode(ref[5][:k])[-2:]                # 贪心输出中间的两个字符

        async def one(c, i):
            body = {"prompt": prompts[i], "max_tokens": 16, "temperature": temps[i], "seed": i, "ignore_eos": True,
                    "return_token_ids": True, **({"stop": stop} if i == 5 else {})}
            r = await c.post("/v1/completions", json=body)
            return r.json()["choices"][0]

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                return await asyncio.gather(*(one(c, i) for i in range(6)))
        got = asyncio.run(asyncio.wait_for(main(), 300))
        for i, ch in enumerate(got[:5]):
            cmp = compare(f"#{i}", prompts[i], ref[i], ch["token_ids"], s.full_logits, MARGIN_TOL[s.dtype],
                          draw_margin(reqs[i].params))
            assert cmp.ok, cmp.describe()
            assert ch["text"] == s.tok.decode(ch["token_ids"])
        ids5 = got[5]["token_ids"]
        cmp = compare("stop", prompts[5], ref[5][:len(ids5)], ids5, s.full_logits, MARGIN_TOL[s.dtype])
        assert cmp.ok, cmp.describe()
        full5 = s.tok.decode(ids5)                           # 截在停止串出现的 token；文本到停止串之前为止
        assert got[5]["finish_reason"] == "stop" and stop in full5 and stop not in s.tok.decode(ids5[:-1])
        assert got[5]["text"] == full5[:full5.index(stop)]
        server.wait_idle()
        assert server.pool_is_free()
        assert server.aengine.peak_running >= 2                 # 真的在批里一起跑
    finally:
        server.stop()


# ---------------- 浸泡 ----------------

def test_soak_hostile_and_normal_requests(tiny_session):
    """敌意请求（极端采样值、超长停止串列表、深嵌套 JSON、不认识的字段、中途断开、注定失败的采样）与正常请求交错打
    同一个 step10 服务器；之后贪心探针的文本与之前逐字相同，/metrics 没有在跑 / 在等的请求，每个 KV 块都空闲。"""
    s = tiny_session
    server = Served(real_engine("step10", s, "--max-batch-size", "4"), s.tok, max_waiting=64)
    C, K = "/v1/chat/completions", "/v1/completions"
    probe = {"model": MODEL, "messages": [{"role": "user", "content": "讲个笑话"}], "max_tokens": 12, "temperature": 0}
    try:
        def probe_text():
            r = httpx.post(server.url + C, json=probe, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]
        before = probe_text()
        normal = {"prompt": "长城", "max_tokens": 8, "temperature": 0.8, "seed": 1}
        hostile = [
            (K, {**normal, "temperature": 1e-40}), (K, {**normal, "temperature": 1e6}), (K, {**normal, "top_p": 1e-30}),
            (K, {**normal, "min_p": 1.0}), (K, {**normal, "repetition_penalty": 1e30}),
            (K, {**normal, "repetition_penalty": 1e-30}), (K, {**normal, "top_k": 10**9}),
            (K, {**normal, "temperature": 5e-324, "stream": True}),
            (K, {**normal, "stop": ["x"] * 10_000}), (K, {**normal, "presence_penalty": 2}),
            (K, {**normal, "no_such_field": {"a": 1}}), (K, {**normal, "n": 16, "prompt": ["a"] * 5}),
            (C, b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
        ]

        async def send(c, path, body):
            kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
                {"json": body}
            if isinstance(body, dict) and body.get("stream"):
                return (await stream_lines(c, path, body))[0]
            return (await c.post(path, **kw)).status_code

        async def disconnect(c):
            async with c.stream("POST", K, json={**normal, "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    break                                    # 读到第一行就关连接

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                jobs = []
                for path, body in hostile:
                    jobs += [send(c, path, body), send(c, K, normal), disconnect(c)]
                return await asyncio.gather(*jobs, return_exceptions=True)
        results = asyncio.run(asyncio.wait_for(main(), 300))
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors
        codes = [r for r in results if r is not None]
        assert all(c in (200, 400, 500) for c in codes), codes     # 没有 503：引擎从没死，也没有人被挤掉
        assert server.thread.exit_code is None and httpx.get(server.url + "/health").status_code == 200
        assert probe_text() == before
        server.wait_idle()
        assert server.pool_is_free()
        assert server.metric("llm_num_requests_running") == 0 and server.metric("llm_num_requests_waiting") == 0
        assert server.metric("llm_kv_blocks_used") == 0
    finally:
        server.stop()
