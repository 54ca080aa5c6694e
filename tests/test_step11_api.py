"""step11：真实客户端会发的其余端点与 vLLM 仪表盘读的指标。

- /tokenize、/detokenize（vLLM 的请求 / 响应形状）、/v1/models/{id}、/version：形状，与生成端点一致
  （/tokenize 的 count = 同一段对话的 usage.prompt_tokens），坏输入 400 / 404 指名字段；
- X-Request-Id：给了原样回来、没给生成一个，日志里记下它 ↔ 引擎请求 id；
- /metrics 的 vllm:* 名字：几个请求之后的值与响应的 usage、结束原因逐个相等，结束后 KV 占用为 0；
  抢占次数（真实的 step05 引擎、小池子）与调度器真正抢占的次数相等；投机解码的计数（step09 ngram）与引擎的 spec_stats 相等。

服务器在进程内（test_step11_serving.py 的 Served）；大多数用假引擎，抢占与投机解码用随机小模型的真实引擎。
"""
import logging
import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.cli import open_session
from common.tokenizer import Tokenizer
from step11_serving import protocol as P
from test_step11_fake_engine import FakeEngine
from test_step11_serving import MODEL, Served, real_engine

CHAT = [{"role": "user", "content": "用一句话介绍长城。"}]


@pytest.fixture(scope="module")
def tok(tiny_tok_dir):
    return Tokenizer(tiny_tok_dir)


@pytest.fixture(scope="module")
def server(tok):
    s = Served(FakeEngine(tok, step_s=0.002), tok)
    yield s
    s.stop()


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


def scrape(url: str) -> list:
    """/metrics 按 Prometheus 文本格式解析（解析得了本身就是一项检查）：每个样本 (名字, 标签, 值)。"""
    text = httpx.get(url + "/metrics").text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples, name: str, **labels) -> float:
    found = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


# ---------------- /tokenize、/detokenize、/v1/models/{id}、/version ----------------

def test_tokenize_and_detokenize_have_vllms_shape_and_match_the_generation_endpoints(server, tok):
    r = post(server, "/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 2048 and body["token_strs"] is None
    strs = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()["token_strs"]
    assert strs == tok.hf.convert_ids_to_tokens(body["tokens"])
    assert post(server, "/tokenize", {"prompt": ""}).json()["count"] == 0          # 空文本：0 个 token，不是错误

    chat = post(server, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    assert chat["tokens"] == P.encode_chat(tok, [P.ChatMessage(**m) for m in CHAT])
    usage = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]            # 就是生成端点交给引擎的那些 token
    no_gen = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert len(no_gen) < chat["count"] and chat["tokens"][:len(no_gen)] == no_gen   # 少的只是结尾的生成提示

    assert post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]}).json() == {"prompt": "Hello world"}
    template = post(server, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert "用一句话介绍长城。" in template and "<|im_start|>" in template   # 特殊 token 照样写出来：/tokenize 的逆


def test_tokenize_detokenize_bad_input_is_a_4xx_naming_the_field(server, tok):
    vocab = tok.hf.vocab_size
    cases = [
        ("/tokenize", {}, 400, "prompt"),                                          # 既没有 prompt 也没有 messages
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "messages"),         # 两个都有
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "bogus": 1}, 400, "bogus"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [vocab]}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ]
    for path, body, status, param in cases:
        r = post(server, path, body)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert err["code"] == status and err["param"] == param and err["message"], (path, body, err)
    assert post(server, "/detokenize", {"tokens": [vocab - 1]}).status_code == 200    # 边界上的 id 照常


def test_model_by_id_version_and_api_key(server, tok):
    card = httpx.get(server.url + f"/v1/models/{MODEL}").json()
    assert card == httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["object"] == "model"
    r = httpx.get(server.url + "/v1/models/gpt-4o")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model" and "gpt-4o" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/version").json() == {"version": "step11", "engine": "test_step11_fake_engine"}
    keyed = Served(FakeEngine(tok), tok, api_key="k")
    try:
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            assert post(keyed, path, body).status_code == 401
            assert post(keyed, path, body, headers={"Authorization": "Bearer k"}).status_code == 200
        assert httpx.get(keyed.url + f"/v1/models/{MODEL}").status_code == 401
        assert httpx.get(keyed.url + "/version").status_code == 200          # 与 /health 一样不要 key
    finally:
        keyed.stop()


# ---------------- X-Request-Id ----------------

def test_x_request_id_is_echoed_or_generated_and_logged_with_the_engine_ids(server, caplog):
    caplog.set_level(logging.INFO, logger="step11_serving")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "n": 2, "temperature": 0.7, "seed": 1}
    r = post(server, "/v1/completions", body, headers={"X-Request-Id": "client-req-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-req-42"
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      headers={"X-Request-Id": "client-req-43"}) as s:
        assert s.headers["x-request-id"] == "client-req-43"
        s.read()

    def logged():
        return {m.group(1): [int(x) for x in m.group(2).split(", ")] for rec in caplog.records
                if (m := re.fullmatch(r"request (\S+): engine request ids \[([0-9, ]+)\]", rec.getMessage()))}
    ids = logged()
    assert len(ids["client-req-42"]) == 2 and len(ids["client-req-43"]) == 2      # n = 2：两个引擎请求
    assert not set(ids["client-req-42"]) & set(ids["client-req-43"])

    generated = [post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).headers["x-request-id"]
                 for _ in range(2)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", g) for g in generated) and generated[0] != generated[1]
    assert all(len(logged()[g]) == 1 for g in generated)
    assert re.fullmatch(r"[0-9a-f]{32}", httpx.get(server.url + "/nope").headers["x-request-id"])   # 错误响应也带
    bad = post(server, "/v1/completions", {"prompt": "hi"}, headers={"X-Request-Id": "x" * 300})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"


# ---------------- /metrics 的 vllm:* ----------------

def wait_for(check, timeout=10.0):
    t0 = time.perf_counter()
    while not check():
        assert time.perf_counter() - t0 < timeout, "condition not reached"
        time.sleep(0.01)


def test_vllm_metrics_equal_what_the_responses_said(tok):
    s = Served(FakeEngine(tok, step_s=0.002), tok)
    try:
        client = s.client()
        usages = [client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0,
                                            extra_body={"ignore_eos": True}).usage]
        stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usages += [c.usage for c in stream if c.usage]
        stopped = client.completions.create(model=MODEL, prompt="xyz", max_tokens=200, temperature=0)
        assert stopped.choices[0].finish_reason == "stop"          # 假引擎的回答表里有 EOS
        usages.append(stopped.usage)
        s.wait_idle()
        m = scrape(s.url)
        lab = {"model_name": MODEL, "engine": "0"}
        prompt = sum(u.prompt_tokens for u in usages)
        generated = sum(u.completion_tokens for u in usages)
        assert value(m, "vllm:prompt_tokens_total", **lab) == prompt
        assert value(m, "vllm:generation_tokens_total", **lab) == generated
        for reason, count in (("length", 2), ("stop", 1), ("abort", 0), ("error", 0)):
            assert value(m, "vllm:request_success_total", finished_reason=reason, **lab) == count
        for name in ("e2e_request_latency", "time_to_first_token", "request_queue_time", "request_prefill_time",
                     "request_decode_time", "request_inference_time"):
            assert value(m, f"vllm:{name}_seconds_count", **lab) == 3, name
        assert value(m, "vllm:request_time_per_output_token_seconds_count", **lab) == \
            sum(u.completion_tokens > 1 for u in usages)
        # 假引擎每步每个请求一个 token：第一个之后每个 token 一个间隔
        assert value(m, "vllm:inter_token_latency_seconds_count", **lab) == generated - 3
        assert value(m, "vllm:time_per_output_token_seconds_count", **lab) == generated - 3   # 旧名字，同样的值
        assert value(m, "vllm:num_preemptions_total", **lab) == 0
        assert value(m, "vllm:spec_decode_num_draft_tokens_total", **lab) == 0
        buckets = [float(x.labels["le"]) for x in m if x.name == "vllm:e2e_request_latency_seconds_bucket"]
        assert max(b for b in buckets if b != float("inf")) >= 1800          # 端到端的桶一直到几十分钟
        # 结束之后：没有在跑、在等的，KV 占用为 0（循环在下一个间隙记快照）
        wait_for(lambda: value(scrape(s.url), "vllm:kv_cache_usage_perc", **lab) == 0)
        m = scrape(s.url)
        assert value(m, "vllm:num_requests_running", **lab) == value(m, "vllm:num_requests_waiting", **lab) == 0
        assert value(m, "vllm:gpu_cache_usage_perc", **lab) == 0
        assert value(m, "llm_generation_tokens_total") == generated          # 原来的名字还在，值不变

        # 中途断开：记为 abort；它发出过的 token 也算在 generation_tokens 里（与 llm_* 的一致）
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/completions", timeout=0.3,
                       json={"prompt": "x", "max_tokens": 1000, "temperature": 0, "ignore_eos": True})
        s.wait_idle()
        wait_for(lambda: value(scrape(s.url), "vllm:request_success_total", finished_reason="abort", **lab) == 1)
        m = scrape(s.url)
        assert value(m, "vllm:generation_tokens_total", **lab) == value(m, "llm_generation_tokens_total") > generated
        assert value(m, "vllm:e2e_request_latency_seconds_count", **lab) == 4
    finally:
        s.stop()


@pytest.fixture(scope="module")
def tiny_session(tiny_tok_dir):
    return open_session(str(tiny_tok_dir), "cpu", "float32")


def test_preemptions_are_the_schedulers(tiny_session, tok):
    """step05 的引擎、8 块 × 4 个 token 的池子：同一个提示词的两个样本各要长到 17 个 token（5 块），一起放不下，
    调度器抢占。vllm:num_preemptions_total 等于调度器真正调用 _preempt 的次数。"""
    engine = real_engine("step05", tiny_session, "--num-blocks", "8")
    preempted = []
    original = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), original(seq))[1]
    s = Served(engine, tok)
    try:
        r = post(s, "/v1/completions", {"prompt": [5, 6, 7, 8, 9, 10], "n": 2, "max_tokens": 12, "temperature": 0,
                                        "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
        s.wait_idle()
        m = scrape(s.url)
        assert len(preempted) > 0
        assert value(m, "vllm:num_preemptions_total", model_name=MODEL) == len(preempted)
        assert value(m, "vllm:generation_tokens_total", model_name=MODEL) == 24
    finally:
        s.stop()


def test_speculative_counts_are_the_engines(tiny_session, tok):
    """step09 的 ngram 投机解码（prompt lookup）：第二个请求的提示词里有第一个请求的回答（提示词 + 回答 + 同一个提示词），
    回答又出现时 n-gram 在提示词里找得到，于是有东西可猜。验证次数、猜测 token、被接受的 token 与引擎自己的
    spec_stats 相等（服务器停下之后读引擎，不与引擎线程抢）。"""
    engine = real_engine("step09", tiny_session, "--spec-method", "ngram")
    s = Served(engine, tok)
    try:
        prompt = [5, 6, 7, 8] * 4
        body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        answer = post(s, "/v1/completions", {"prompt": prompt, **body}).json()["choices"][0]["token_ids"]
        assert post(s, "/v1/completions", {"prompt": prompt + answer + prompt, **body}).status_code == 200
        s.wait_idle()
        m = scrape(s.url)
    finally:
        s.stop()
    stats = engine.spec_stats
    assert stats.proposed > 0
    assert value(m, "vllm:spec_decode_num_drafts_total", model_name=MODEL) == stats.verifications
    assert value(m, "vllm:spec_decode_num_draft_tokens_total", model_name=MODEL) == stats.proposed
    assert value(m, "vllm:spec_decode_num_accepted_tokens_total", model_name=MODEL) == stats.accepted
    assert value(m, "vllm:generation_tokens_total", model_name=MODEL) == 32
