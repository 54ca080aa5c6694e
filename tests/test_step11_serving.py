"""step11：OpenAI 兼容服务器。真实的 openai 客户端（同步与异步）打到 127.0.0.1 的临时端口上的服务器。

- 线上的文本与引擎直接生成的 token 相等：流式拼起来 == 非流式 == engine.generate 的解码；usage 精确；n = 3 的带种子样本；
  停止字符串；结束原因；SSE 的线上格式逐字段检查；
- 并发与断开：32 个流式客户端、四分之一中途断开，其余的全部正确完成，之后每个 KV 块都空闲、/metrics 显示 0 个在跑；
  运行中来的请求加入正在跑的批；非流式客户端断开也会取消；
- 坏输入：30 多种坏请求各自得到正确的 4xx 与 JSON 错误，服务器照常服务；API key；排队上限 503 + Retry-After；
  请求体上限 413；优雅关闭（被取消的流收到 finish_reason "abort"）。

服务器跑在进程内（uvicorn 在一个线程里）；引擎是 test_step11_fake_engine.py 的假引擎（可控的步长，测并发与断开）
或真实的 step05 起的引擎加随机小模型（测逐 token 相等）。
"""
import argparse
import asyncio
import json
import time

import httpx
import openai
import pytest

from common.cli import open_session
from common.compare import MARGIN_TOL, compare
from common.tokenizer import Tokenizer
from step02_sampling.sampler import SamplingParams, draw_margin
from step04_static_batching.request import Request
from step11_serving import protocol as P
from step11_serving.api_server import ServerSettings, build_app
from step11_serving.server_thread import ServerThread
from step11_serving.async_engine import AsyncLLMEngine
from step11_serving.detokenizer import IncrementalDetokenizer
from step11_serving.engines import add_engine_args, build_engine
from test_step11_fake_engine import FakeEngine

MODEL = "tiny"


@pytest.fixture(scope="module")
def tok(tiny_tok_dir):
    return Tokenizer(tiny_tok_dir)


class Served:
    """一个跑着的服务器 + 它的引擎（测试最后直接检查引擎的池子）。"""

    def __init__(self, engine, tok, block_size=4, context_len=2048, shutdown_timeout=5.0, **kw):
        self.engine = engine
        self.aengine = AsyncLLMEngine(engine, tok, kw.pop("max_waiting", 64))
        settings = ServerSettings(MODEL, context_len, tok.hf.vocab_size,
                                  engine.block_manager.num_blocks * block_size, **kw)
        self.app = build_app(self.aengine, tok, settings)
        self.thread = ServerThread(self.app, shutdown_timeout=shutdown_timeout).start()
        self.url = self.thread.url

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)

    def async_client(self):
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_idle(self, timeout=10.0):
        """等引擎循环把最后的取消处理完（断开是异步发现的）。"""
        t0 = time.perf_counter()
        while self.engine.has_unfinished_requests() or self.aengine.num_queued() or self.aengine._live:
            assert time.perf_counter() - t0 < timeout, "the engine did not go idle"
            time.sleep(0.01)

    def pool_is_free(self) -> bool:
        bm = self.engine.block_manager
        return bm.num_free_blocks == bm.num_blocks

    def stop(self):
        self.thread.stop()


@pytest.fixture(scope="module")
def tiny_session(tiny_tok_dir):
    """随机小模型 + 真实分词器：给真实引擎用（与 tok 是同一个分词器目录）。"""
    return open_session(str(tiny_tok_dir), "cpu", "float32")


def real_engine(name: str, session, *flags: str):
    """按服务器同样的路（engines.build_engine，参数从那一步的 EngineConfig 生成）建一个真实引擎。"""
    p = argparse.ArgumentParser()
    add_engine_args(p, name)
    return build_engine(name, session, p.parse_args(["--num-blocks", "256", "--block-size", "4", *flags]))


@pytest.fixture(scope="module")
def fake_server(tok):
    s = Served(FakeEngine(tok, step_s=0.002), tok)
    yield s
    s.stop()


def reference(tok, engine_factory, requests):
    """同一组请求直接交给一个新的同类引擎：每个请求的 token 与解码出的文本。"""
    outs = engine_factory().generate(requests).outputs
    return outs, [tok.decode(o) for o in outs]


def chat_ids(tok, text):
    return P.encode_chat(tok, [P.ChatMessage(role="user", content=text)])


# ---------------- 增量解码 ----------------

def test_detokenizer_never_splits_a_character_and_equals_full_decode(tok):
    text = "长城是中国古代的军事防御工程，全长两万多公里。Emoji 😀🎉 也是多字节。"
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok)
    pieces = [det.push([t]) for t in ids] + [det.finish()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
    assert sum(1 for t in ids if tok.decode([t]).endswith("\ufffd")) > 0   # 这段文本里真有半个字的 token


def test_detokenizer_holds_back_a_stop_string_that_spans_tokens(tok):
    ids = tok.encode("abc 长城很长 xyz")
    det = IncrementalDetokenizer(tok, stop=("城很",))
    pieces = [det.push([t]) for t in ids] + [det.finish()]
    assert "".join(pieces) == "abc 长"
    assert not any("城" in p for p in pieces)        # 停止串的开头从没发出去过


# ---------------- 与引擎直接生成相等 ----------------

def check_equal_three_ways(server, tok, factory, temperature=0.0):
    """chat 与 completions：流式拼接 == 非流式 == engine.generate；usage 精确；finish_reason 与 token 一致。"""
    client = server.client()
    prompt_text = "请用一句话介绍长城："
    for chat in (True, False):
        ids = chat_ids(tok, prompt_text) if chat else tok.encode(prompt_text)
        req = Request(ids, 24, SamplingParams(temperature=temperature, seed=3))
        (ref_ids,), (ref_text,) = reference(tok, factory, [req])
        kw = dict(model=MODEL, max_tokens=24, temperature=temperature, seed=3)
        if chat:
            full = client.chat.completions.create(messages=[{"role": "user", "content": prompt_text}], **kw)
            text, reason = full.choices[0].message.content, full.choices[0].finish_reason
            stream = client.chat.completions.create(messages=[{"role": "user", "content": prompt_text}], stream=True,
                                                    stream_options={"include_usage": True}, **kw)
            pieces, usage, sreason = [], None, None
            for c in stream:
                usage = c.usage or usage
                if c.choices:
                    pieces.append(c.choices[0].delta.content or "")
                    sreason = c.choices[0].finish_reason or sreason
        else:
            full = client.completions.create(prompt=prompt_text, **kw)
            text, reason = full.choices[0].text, full.choices[0].finish_reason
            stream = client.completions.create(prompt=prompt_text, stream=True, stream_options={"include_usage": True},
                                               **kw)
            pieces, usage, sreason = [], None, None
            for c in stream:
                usage = c.usage or usage
                if c.choices:
                    pieces.append(c.choices[0].text)
                    sreason = c.choices[0].finish_reason or sreason
        assert "".join(pieces) == text == ref_text, (chat, pieces, text, ref_text)
        expect_reason = "length" if len(ref_ids) == 24 and ref_ids[-1] not in tok.eos_ids else "stop"
        assert reason == sreason == expect_reason
        for u in (full.usage, usage):
            assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), len(ref_ids), len(ids) + len(ref_ids))


def test_fake_engine_stream_equals_full_equals_generate(fake_server, tok):
    check_equal_three_ways(fake_server, tok, lambda: FakeEngine(tok))
    check_equal_three_ways(fake_server, tok, lambda: FakeEngine(tok), temperature=0.9)


@pytest.mark.parametrize("name", ["step05", "step08"])
def test_real_engine_stream_equals_full_equals_generate(name, tiny_session):
    """同样的检查，引擎换成真实的 step05 / step08（随机小模型）：请求一个一个发，批的组成与参考相同，逐 token 相等。"""
    server = Served(real_engine(name, tiny_session), tiny_session.tok)
    try:
        for temperature in (0.0, 0.9):
            check_equal_three_ways(server, tiny_session.tok, lambda: real_engine(name, tiny_session), temperature)
        server.wait_idle()
        assert server.pool_is_free()
    finally:
        server.stop()


def test_real_engine_n3_and_token_ids(tiny_session):
    """n = 3 的带种子样本 == step08 引擎的三个种子；return_token_ids 的 token 就是引擎的 token，文本就是它们的解码。"""
    s = tiny_session
    server = Served(real_engine("step08", s), s.tok)
    try:
        ids = chat_ids(s.tok, "讲个笑话")
        p = dict(temperature=0.8, top_p=0.95, top_k=50)
        refs = real_engine("step08", s).generate([Request(ids, 12, SamplingParams(**p, seed=5 + k)) for k in range(3)]).outputs
        r = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "讲个笑话"}], n=3,
                                                    max_tokens=12, temperature=0.8, top_p=0.95, seed=5,
                                                    extra_body={"top_k": 50, "return_token_ids": True})
        for k, c in enumerate(sorted(r.choices, key=lambda c: c.index)):
            cmp = compare(f"n3#{k}", ids, refs[k], c.token_ids, s.full_logits, MARGIN_TOL[s.dtype],
                          draw_margin(SamplingParams(**p, seed=5 + k)))
            assert cmp.ok, cmp.describe()
            assert c.prompt_token_ids == ids and c.message.content == s.tok.decode(c.token_ids)
        assert r.usage.completion_tokens == sum(map(len, refs))
    finally:
        server.stop()


def test_n3_seeded_samples_equal_the_engines(fake_server, tok):
    ids = chat_ids(tok, "讲个笑话")
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    reqs = [Request(ids, 16, SamplingParams(**{**params.__dict__, "seed": 11 + k})) for k in range(3)]
    ref_ids, ref_texts = reference(tok, lambda: FakeEngine(tok), reqs)
    client = fake_server.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "讲个笑话"}], n=3, max_tokens=16, temperature=0.8,
              top_p=0.95, seed=11)
    full = client.chat.completions.create(**kw)
    assert [c.message.content for c in sorted(full.choices, key=lambda c: c.index)] == ref_texts
    assert full.usage.prompt_tokens == len(ids) and full.usage.completion_tokens == sum(map(len, ref_ids))
    texts = ["", "", ""]
    for c in client.chat.completions.create(stream=True, **kw):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == ref_texts
    assert len(set(ref_texts)) > 1                      # 三个种子真的给出了不同的样本


def test_stop_strings_and_finish_reasons(fake_server, tok):
    client = fake_server.client()
    ids = tok.encode("x")
    (ref_ids,), (ref_text,) = reference(tok, lambda: FakeEngine(tok), [Request(ids, 40, ignore_eos=True)])
    stop = "小的模"
    assert stop in ref_text
    cut = ref_text.index(stop)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=40, temperature=0, stop=[stop, "不会出现的"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref_text[:cut] and r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="x", max_tokens=40, temperature=0,
                                                                     stop=stop, stream=True, extra_body={"ignore_eos": True})]
    assert "".join(pieces) == ref_text[:cut]
    # length：正好 max_tokens 个
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    # EOS → stop；ignore_eos → 越过 EOS 继续生成到 max_tokens
    eos_at = next(i for i, t in enumerate(ref_ids) if t in tok.eos_ids)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=40, temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == eos_at + 1
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 40 and r.choices[0].text == ref_text


def test_sse_wire_format(fake_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "你好"}], "max_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", fake_server.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    body_chunks, last = chunks[1:-1], chunks[-1]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert [c["choices"][0]["finish_reason"] for c in body_chunks] == [None] * (len(body_chunks) - 1) + ["length"]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    # 不要 usage 时：没有 usage 字段，也没有那个 choices 为空的 chunk
    body.pop("stream_options")
    with httpx.stream("POST", fake_server.url + "/v1/completions", json={**body, "prompt": "你好"}) as r:
        chunks = [json.loads(e.removeprefix("data: ")) for e in r.read().decode().split("\n\n")[:-2]]
    assert all("usage" not in c and c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)


def test_models_health_metrics(fake_server):
    m = httpx.get(fake_server.url + "/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == MODEL
    assert httpx.get(fake_server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(fake_server.url + "/metrics").text
    for name in ("llm_num_requests_running", "llm_num_requests_waiting", "llm_kv_blocks_used", "llm_kv_blocks_total",
                 "llm_time_to_first_token_seconds_bucket", "llm_time_per_output_token_seconds_bucket",
                 "llm_prefix_cache_hit_rate", "llm_generation_tokens_total"):
        assert name in text
    page = httpx.get(fake_server.url + "/")
    assert page.status_code == 200 and "从零实现" in page.text
    assert httpx.get(fake_server.url + "/static/chat.js").status_code == 200


# ---------------- 并发、断开、加入正在跑的批 ----------------

@pytest.mark.parametrize("kind", ["fake", "step08"])
def test_32_concurrent_streams_quarter_disconnect(kind, tok, tiny_session):
    """32 个流式客户端同时来，8 个读到第 3 个 chunk 就关连接。其余 24 个的 token 与引擎直接生成的相同（真实引擎：
    批的组成不同，按 near-tie 规则比较），之后池子全空、/metrics 显示 0 个在跑。"""
    s = tiny_session
    if kind == "fake":
        make = lambda: FakeEngine(tok, step_s=0.002, max_batch_size=8, num_blocks=200)   # noqa: E731
    else:
        make = lambda: real_engine("step08", s, "--max-batch-size", "8")                 # noqa: E731
    server = Served(make(), tok)
    try:
        prompts = [f"第 {i} 个问题：{'长城' * (i % 5)}" for i in range(32)]
        n_new = 40 if kind == "fake" else 24
        reqs = [Request(chat_ids(tok, p), n_new, SamplingParams(temperature=0.7, seed=i), ignore_eos=True)
                for i, p in enumerate(prompts)]
        ref_ids, _ = reference(tok, make, reqs)
        leave = set(range(0, 32, 4))                       # 8 个客户端读到第 3 个 chunk 就断开
        generated_before = server.metric("llm_generation_tokens_total")

        async def one(client, i):
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompts[i]}], max_tokens=n_new, temperature=0.7,
                seed=i, stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
            ids, text, n = [], "", 0
            async for c in stream:
                n += 1
                ids += getattr(c.choices[0], "token_ids", None) or []    # 只有 role 的第一个 chunk 没有
                text += c.choices[0].delta.content or ""
                if i in leave and n == 3:
                    await stream.close()                   # 关掉连接：服务器要发现并取消它
                    return None
            return ids, text

        async def main():
            async with server.async_client() as client:
                return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), 120)

        results = asyncio.run(main())
        for i, res in enumerate(results):
            assert (res is None) == (i in leave)
            if res is not None:
                ids, text = res
                assert text == tok.decode(ids)
                if kind == "fake":
                    assert ids == ref_ids[i], i
                else:
                    c = compare(f"#{i}", reqs[i].prompt_ids, ref_ids[i], ids, s.full_logits, MARGIN_TOL[s.dtype],
                                draw_margin(reqs[i].params))
                    assert c.ok, c.describe()
        server.wait_idle()
        assert server.pool_is_free()
        assert server.metric("llm_num_requests_running") == 0 and server.metric("llm_kv_blocks_used") == 0
        assert server.metric("llm_num_requests_waiting") == 0
        aborted = server.metric('llm_requests_total{finish_reason="abort"}')
        assert aborted + server.metric('llm_requests_total{finish_reason="length"}') == 32
        # 断开的请求确实提前停了（假引擎每步 2 ms，一定来得及；真实小模型的一步更快，至少要有取消发生）
        assert aborted == len(leave) if kind == "fake" else aborted >= 1
        assert server.metric("llm_generation_tokens_total") - generated_before < 32 * n_new
        assert server.aengine.peak_running == 8             # 批是满的：连续批处理真的在工作
    finally:
        server.stop()


def test_request_joins_the_running_batch(fake_server):
    """A 正在流式生成时 B 到来：B 的第一个 token 出来之后，A 还在继续出 token（两个在同一个批里，而不是一个接一个）。"""
    async def main():
        async with fake_server.async_client() as client:
            kw = dict(model=MODEL, max_tokens=60, temperature=0, stream=True, extra_body={"ignore_eos": True})
            a = await client.completions.create(prompt="A", **kw)
            events = []
            it = a.__aiter__()
            for _ in range(5):
                await it.__anext__()
            b = await client.completions.create(prompt="B", **{**kw, "max_tokens": 3})

            async def drain(name, stream):
                async for _ in stream:
                    events.append(name)
            await asyncio.gather(drain("A", it), drain("B", b))
            return events
    events = asyncio.run(asyncio.wait_for(main(), 30))
    first_b = events.index("B")
    assert "A" in events[first_b:], events


def test_nonstream_client_disconnect_aborts(tok):
    server = Served(FakeEngine(tok, step_s=0.01), tok)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", timeout=0.3,
                       json={"prompt": "x", "max_tokens": 1000, "temperature": 0, "ignore_eos": True})
        server.wait_idle()
        assert server.pool_is_free()
        assert server.metric('llm_requests_total{finish_reason="abort"}') == 1
        assert server.metric("llm_generation_tokens_total") < 1000
    finally:
        server.stop()


# ---------------- 坏输入与限制 ----------------

def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(fake_server):
    url = fake_server.url
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    comp = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    C, K = "/v1/chat/completions", "/v1/completions"
    cases = [   # (路径, 请求体（dict 或原始字节）, 期望的状态码)
        (C, b"{not json", 400), (C, b"[1, 2]", 400), (C, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400),
        (C, b"", 400), (C, {**chat, "model": "gpt-4"}, 404), (C, {"model": MODEL}, 400), (C, {**chat, "messages": []}, 400),
        (C, {**chat, "messages": [{"role": "robot", "content": "x"}]}, 400),
        (C, {**chat, "messages": [{"role": "user", "content": 5}]}, 400), (C, {**chat, "messages": "hi"}, 400),
        (C, {**chat, "max_tokens": -1}, 400), (C, {**chat, "max_tokens": 0}, 400), (C, {**chat, "max_tokens": 10**6}, 400),
        (C, {**chat, "max_tokens": "10"}, 400), (C, {**chat, "max_completion_tokens": 1.5}, 400),
        (C, {**chat, "temperature": -0.5}, 400), (C, {**chat, "temperature": "hot"}, 400), (C, {**chat, "top_p": 0}, 400),
        (C, {**chat, "top_p": 1.5}, 400), (C, {**chat, "top_k": -3}, 400), (C, {**chat, "min_p": 2}, 400),
        (C, {**chat, "repetition_penalty": 0}, 400), (C, {**chat, "seed": -1}, 400), (C, {**chat, "n": 0}, 400),
        (C, {**chat, "n": 1000}, 400), (C, {**chat, "stop": [""]}, 400), (C, {**chat, "stop": 7}, 400),
        (C, {**chat, "stream": "yes"}, 400), (C, {**chat, "stream_options": {"include_usage": True}}, 400),
        (C, {**chat, "ignore_eos": "no"}, 400), (C, {**chat, "logprobs": True}, 400),
        (K, {**comp, "prompt": ""}, 400), (K, {"model": MODEL}, 400), (K, {**comp, "prompt": [10**9]}, 400),
        (K, {**comp, "prompt": "长" * 3000}, 400), (K, {**comp, "prompt": []}, 400), (K, {**comp, "echo": "yes"}, 400),
        ("/v1/nope", comp, 404),
    ]
    assert len(cases) >= 30
    http = httpx.Client(base_url=url)
    for path, body, status in cases:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = http.post(path, headers={"content-type": "application/json"}, **kw)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["code"] == status and err["type"], err
        assert "Traceback" not in r.text
    r = http.get(C)
    http.close()
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    # 坏请求一个也没进引擎，服务器照常服务
    ok = fake_server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens >= 1
    fake_server.wait_idle()
    assert fake_server.pool_is_free()
    # 真实客户端看到的是它自己的异常类型，带着我们的消息
    with pytest.raises(openai.BadRequestError, match="top_p"):
        fake_server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=0)


def test_api_key(tok):
    server = Served(FakeEngine(tok), tok, api_key="s3cret")
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.get(server.url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        assert server.client(api_key="s3cret").models.list().data[0].id == MODEL
        assert httpx.get(server.url + "/health").status_code == 200      # 健康检查不要 key
    finally:
        server.stop()


def test_waiting_queue_bound_gives_503_with_retry_after(tok):
    server = Served(FakeEngine(tok, step_s=0.01, max_batch_size=1), tok, max_waiting=2)
    try:
        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
                body = {"prompt": "x", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(8)))
        rs = asyncio.run(main())
        codes = sorted(r.status_code for r in rs)
        assert codes.count(200) >= 2 and 503 in codes, codes    # 排队的上限是 2：至少那 2 个被接下
        busy = next(r for r in rs if r.status_code == 503)
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "server_busy"
        server.wait_idle()
        assert server.pool_is_free()
    finally:
        server.stop()


def test_body_size_limit(tok):
    server = Served(FakeEngine(tok), tok, max_body_bytes=1000)
    try:
        big = {"model": MODEL, "prompt": "x" * 2000}
        r = httpx.post(server.url + "/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        def chunks():                                   # 没有 Content-Length 的分块上传也要拦住
            yield json.dumps(big).encode()
        r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        server.stop()


def test_graceful_shutdown_frees_everything(tok):
    server = Served(FakeEngine(tok, step_s=0.01), tok, shutdown_timeout=0.5)
    client = httpx.Client(base_url=server.url, timeout=30)
    short = {"prompt": "x", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    endless = {**short, "max_tokens": 1000}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            async def stream(body):
                got = []
                try:
                    async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                        async for line in r.aiter_lines():
                            got.append(line)
                except httpx.HTTPError:
                    got.append("<cut>")
                return got
            tasks = [asyncio.create_task(stream(b)) for b in (short, endless)]
            await asyncio.sleep(0.2)                        # 两个都已经开始
            await asyncio.to_thread(server.stop)            # 等同 Ctrl-C
            return await asyncio.gather(*tasks)

    short_lines, endless_lines = asyncio.run(main())

    def reasons(lines):
        return [json.loads(x.removeprefix("data: "))["choices"][0]["finish_reason"] for x in lines
                if x.startswith("data: {")]
    assert [x for x in short_lines if x][-1] == "data: [DONE]"                     # 宽限期内完成的照常完成
    assert reasons(short_lines)[-1] == "length"
    # 超过宽限的被取消：还在听的客户端收到 finish_reason "abort" 再 [DONE]（生成远没到 1000 个 token）
    assert [x for x in endless_lines if x][-1] == "data: [DONE]", endless_lines[-3:]
    assert reasons(endless_lines)[-1] == "abort" and len(reasons(endless_lines)) < 1000
    assert server.app.state.clean_shutdown and server.pool_is_free() and not server.engine.has_unfinished_requests()
    with pytest.raises(httpx.HTTPError):
        client.post("/v1/completions", json=short)          # 关闭之后不再接收
    client.close()


# 引擎出错（一个请求的失败 / 引擎自己的失败）的测试在 test_step11_reliability.py


# ---------------- 引擎登记表 ----------------

@pytest.mark.parametrize("name", ["step05", "step06", "step07", "step08", "step12", "step13", "step15"])
def test_every_registered_engine_builds_with_its_own_flags(name, tiny_session):
    """--engine stepNN 的参数就是那一步 EngineConfig 的字段（默认值取自 EngineConfig）；num_blocks 不给时按那一步的预算换算。"""
    import dataclasses

    from step11_serving.engines import ENGINES, engine_module
    assert name in ENGINES
    mod = engine_module(name)
    p = argparse.ArgumentParser()
    add_engine_args(p, name)
    e = build_engine(name, tiny_session, p.parse_args(["--max-batch-size", "3"]))
    fields = {f.name for f in dataclasses.fields(mod.EngineConfig)}
    assert e.config.max_batch_size == 3 and e.config.num_blocks > 0
    assert all(getattr(e.config, f) == getattr(mod.EngineConfig(num_blocks=1), f)
               for f in fields - {"num_blocks", "max_batch_size"})
    if "enable_prefix_caching" in fields:                 # 与 run.py 同名：--no-prefix-cache
        assert build_engine(name, tiny_session, p.parse_args(["--no-prefix-cache"])).config.enable_prefix_caching is False


def test_step12_eviction_engine_is_served(tiny_session):
    """--engine step12 --kv-policy sinks：经过服务器的贪心输出 == 同样配置的引擎直接生成（提示词与输出都超出预算，
    一路在驱逐），logprobs 照样有；结束后每一块都回到池子。策略参数错了在建引擎时就报错，错误里有参数名。"""
    from common.errors import UserError
    s = tiny_session
    flags = ("--kv-policy", "sinks", "--kv-budget", "16", "--num-sinks", "4")
    prompts = [chat_ids(s.tok, "长城" * (10 + 7 * i)) for i in range(3)]
    assert all(len(p) > 20 for p in prompts)
    ref = real_engine("step12", s, *flags).generate([Request(p, 24, SamplingParams(), ignore_eos=True)
                                                     for p in prompts]).outputs
    server = Served(real_engine("step12", s, *flags), s.tok, max_logprobs=5)
    try:
        async def one(c, p):
            r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                                      "return_token_ids": True, "logprobs": 1})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                return await asyncio.gather(*(one(c, p) for p in prompts))
        got = asyncio.run(asyncio.wait_for(main(), 300))
        for i, ch in enumerate(got):
            cmp = compare(f"#{i}", prompts[i], ref[i], ch["token_ids"], None, MARGIN_TOL[s.dtype])
            assert cmp.ok, cmp.describe()
            assert len(ch["logprobs"]["token_logprobs"]) == 24
        assert server.engine.num_compactions > 0                  # 真的驱逐过
        server.wait_idle()
        assert server.pool_is_free()
    finally:
        server.stop()
    for bad, name in ((("--kv-policy", "sinks"), "--kv-budget"), (("--num-sinks", "4"), "--num-sinks"),
                      (("--kv-policy", "h2o", "--kv-budget", "16", "--spec-method", "ngram"), "--spec-method")):
        with pytest.raises(UserError, match=name):
            real_engine("step12", s, *bad)



DOCS = ("Freedonia's capital is Fredville.\n", "Sylvania exports cheese and tin.\n")


def test_step13_chunk_separator_is_served(tiny_session):
    """--engine step13 --blend reuse + completions 的 chunk_separator：服务器在分隔符处切开提示词，每段单独分词
    （不加特殊 token）、首尾相接，分隔符不进提示词；贪心输出 == 同一个 step13 引擎直接拿到同样的 id 与段。
    第二个请求换了文档的顺序：两段都从块缓存命中。结束后每一块都回到池子。"""
    from step11_serving.api_server import settings_for
    s = tiny_session
    sep, question = " # # ", "What does Sylvania export?"
    orders = (DOCS, DOCS[::-1])

    def marked(docs):                               # 不经 step13 的函数，按约定自己拼：(ids, 段)
        ids, chunks = [], []
        for d in docs:
            d_ids = s.tok.hf(d, add_special_tokens=False).input_ids
            chunks.append((len(ids), len(ids) + len(d_ids)))
            ids += d_ids
        return ids + s.tok.hf(question, add_special_tokens=False).input_ids, chunks

    ref_engine = real_engine("step13", s, "--blend", "reuse")
    refs = [ref_engine.generate([Request(ids, 8, SamplingParams(), ignore_eos=True)], [chunks]).outputs[0]
            for ids, chunks in map(marked, orders)]
    assert ref_engine.chunk_store.hits == 2
    engine = real_engine("step13", s, "--blend", "reuse")
    assert settings_for(s, engine, 4).chunk_marks and not settings_for(s, real_engine("step12", s), 4).chunk_marks
    server = Served(engine, s.tok, chunk_marks=True, max_logprobs=5)
    try:
        for k, docs in enumerate(orders):
            r = httpx.post(server.url + "/v1/completions", timeout=120, json={
                "prompt": sep.join([*docs, question]), "chunk_separator": sep, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "logprobs": 1})
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            assert ch["prompt_token_ids"] == marked(docs)[0]
            assert ch["token_ids"] == refs[k]
            assert len(ch["logprobs"]["token_logprobs"]) == 8
            assert (engine.chunk_store.stored, engine.chunk_store.hits) == (2, 2 * k)   # 第二次：两段都命中
        server.wait_idle()
        assert server.pool_is_free()
    finally:
        server.stop()


def test_step13_chunk_separator_refusals(tiny_session, fake_server):
    """chunk_separator 不能用的地方各自 400，指名字段并说出原因（旧代码对这个字段只说"不认识"）。"""
    s = tiny_session
    server = Served(real_engine("step13", s, "--blend", "blend"), s.tok, chunk_marks=True)
    ok = {"prompt": "doc one # # doc two # # question?", "chunk_separator": " # # ", "max_tokens": 2}
    cases = [
        ("/v1/completions", {**ok, "prompt": [1, 2, 3]}, "not token ids"),
        ("/v1/completions", {**ok, "prompt": [[1, 2, 3]]}, "not token ids"),
        ("/v1/completions", {**ok, "chunk_separator": ""}, "non-empty string"),
        ("/v1/completions", {**ok, "chunk_separator": 7}, "string"),
        ("/v1/completions", {**ok, "prompt": "no separator here"}, "must split it into non-empty chunks"),
        ("/v1/completions", {**ok, "prompt": "doc one # #  # # question?"}, "must split it into non-empty chunks"),
        ("/v1/completions", {**ok, "prompt": "doc one # # "}, "must split it into non-empty chunks"),
        ("/v1/completions", {**ok, "prompt": ["doc # # q?", "no separator"]}, "must split it into non-empty chunks"),
        ("/v1/completions", {**ok, "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": ok["prompt"]}],
                                  "chunk_separator": " # # "}, "chat template"),
    ]
    try:
        for path, body, why in cases:
            r = httpx.post(server.url + path, json=body, timeout=60)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "chunk_separator", (body, r.text)
            assert why in err["message"] and "unknown field" not in err["message"], (body, err)
        # 引擎自己的检查（这里：超出上下文）照常 400；一批两个字符串提示词可以
        r = httpx.post(server.url + "/v1/completions", json={**ok, "max_tokens": 100000}, timeout=60)
        assert r.status_code == 400, r.text
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={**ok, "prompt": [ok["prompt"], "doc two # # doc one # # question?"], "ignore_eos": True})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        assert server.engine.chunk_store.hits == 2
        server.wait_idle()
        assert server.pool_is_free()
    finally:
        server.stop()
    r = httpx.post(fake_server.url + "/v1/completions", json=ok, timeout=60)      # 别的引擎：段标记没人用
    assert r.status_code == 400 and r.json()["error"]["param"] == "chunk_separator", r.text
    assert "--engine step13" in r.json()["error"]["message"]


def test_step10_tensor_parallel_engine_is_served(tiny_tok_dir):
    """--engine step10 --tp 2：服务器进程就是 rank 0，另一个 rank 是它起的子进程；经过服务器的贪心输出与
    一个进程的引擎逐 token 相同（all-reduce 改变求和顺序：近似打平的规则见 common/compare.py），关闭后 worker 一个不剩。"""
    import multiprocessing
    from step11_serving.engines import serving_engine
    s = open_session(str(tiny_tok_dir), "cpu", "float32")
    p = argparse.ArgumentParser()
    add_engine_args(p, "step10")
    ids = chat_ids(s.tok, "讲个笑话")
    ref = real_engine("step10", s).generate([Request(ids, 12, SamplingParams(), ignore_eos=True)]).outputs[0]
    with serving_engine("step10", s, p.parse_args(["--num-blocks", "64", "--block-size", "4", "--tp", "2"])) as engine:
        assert engine.parallel is not None and engine.parallel.world_size == 2
        server = Served(engine, s.tok)
        try:
            r = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                                   extra_body={"ignore_eos": True, "return_token_ids": True})
            got = r.choices[0].token_ids
        finally:
            server.stop()
    full = open_session(str(tiny_tok_dir), "cpu", "float32")
    c = compare("tp2", ids, ref, got, full.full_logits, MARGIN_TOL[full.dtype])
    assert c.ok, c.describe()
    assert not multiprocessing.active_children()


def test_compiled_engine_is_served_and_equals_eager(tiny_session):
    """--compile：服务器的引擎换成编译好的 decode（批上限 1：一个桶、一张图），step() 在服务器的引擎线程里调用它；
    流式 == 非流式 == eager 引擎直接生成（贪心与带种子的采样）。"""
    from perf.compiled_decode import compile_if_asked
    engine = real_engine("step10", tiny_session, "--max-batch-size", "1")
    compile_if_asked(argparse.Namespace(compile="default", tp=1, pp=1), engine)
    from perf.compiled_decode import CompiledDecodeModel
    assert isinstance(engine.model, CompiledDecodeModel)
    server = Served(engine, tiny_session.tok)
    try:
        for temperature in (0.0, 0.9):
            check_equal_three_ways(server, tiny_session.tok,
                                   lambda: real_engine("step10", tiny_session, "--max-batch-size", "1"), temperature)
        server.wait_idle()
        assert server.pool_is_free() and sum(s.calls for s in engine.model.stats.values()) > 0
    finally:
        server.stop()


def test_compile_with_tp_is_one_error_line(tiny_tok_dir, capsys):
    from step11_serving import api_server
    with pytest.raises(SystemExit) as e:
        api_server.main(["--model", str(tiny_tok_dir), "--tp", "2", "--compile", "--port", "0"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: --compile") and len(err.splitlines()) == 1
