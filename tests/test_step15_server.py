"""step15 挂在 step11 的服务器上（--engine step15）：结构化输出的请求字段。

- 真实的 openai 客户端发 response_format {"type": "json_schema", ...}：流式与非流式都得到满足 schema 的 JSON
  （jsonschema.validate），finish_reason "stop"；流式拼起来 == 非流式；
- vLLM 的 structured_outputs（json / regex / choice / json_object，经 extra_body）：chat 与 completions 都行，n = 2 的
  每个样本各自满足；json_object 没写完的是合法的前缀；
- 坏的约束 400 指名字段，消息里有出错的关键字：schema 里不支持的关键字、写错的正则、两个字段都给、字段的形状不对；
  什么也匹配不了的 schema；
- 别的引擎照旧拒绝这两个字段（400 指名，并说要 --engine step15）；
- /metrics 里每一步铺掩码的时间、铺过掩码的行、jump-forward 的 token，等于引擎自己的 structured_stats。

服务器在进程内（test_step11_serving.py 的 Served），引擎是随机小模型 + 真实分词器的 step15（engines.build_engine）。
"""
import json
import re

import httpx
import jsonschema
import pytest

from common.tokenizer import Tokenizer
from step15_structured_output.structured import StructuredOutputsParams as SO
from test_step11_serving import MODEL, Served, real_engine, tiny_session  # noqa: F401（fixture）

# 长度有上限的 schema：随机小模型在 64 个 token 之内一定写完（枚举、布尔、至多 4 个字符的字符串）
SCHEMA = {"type": "object",
          "properties": {"city": {"enum": ["Paris", "Lima"]}, "ok": {"type": "boolean"},
                         "code": {"type": "string", "maxLength": 4}},
          "required": ["city", "ok", "code"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Where is it? Answer in JSON."}]
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 64, "temperature": 0}
COMP = {"model": MODEL, "prompt": "The answer:", "max_tokens": 64, "temperature": 0}


@pytest.fixture(scope="module")
def tok(tiny_tok_dir):
    return Tokenizer(tiny_tok_dir)


@pytest.fixture(scope="module")
def served(tiny_session, tok):
    engine = real_engine("step15", tiny_session)
    s = Served(engine, tok, block_size=4, structured_output=True, max_logprobs=20)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def served09(tiny_session, tok):
    engine = real_engine("step09", tiny_session)
    s = Served(engine, tok, block_size=4, max_logprobs=20)
    yield s
    s.stop()


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def refused(server, path, body, param, words) -> dict:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    return err


def test_openai_client_response_format_json_schema(served):
    client = served.client()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0,
                                       response_format=RESPONSE_FORMAT)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    parts, reasons = [], []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0,
                                                response_format=RESPONSE_FORMAT, stream=True):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
    assert "".join(parts) == text and reasons[-1] == "stop"
    served.wait_idle()
    assert served.pool_is_free()


@pytest.mark.parametrize("so,check", [
    ({"regex": "[0-9]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[0-9]{2}", t)),
    ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_structured_outputs_extra_field(served, so, check, path):
    body = {**(CHAT if "chat" in path else COMP), "structured_outputs": so, "n": 2, "temperature": 1.0, "seed": 4}
    r = post(served, path, body)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        t = c["message"]["content"] if "chat" in path else c["text"]
        assert c["finish_reason"] == "stop" and check(t), t


def test_json_object_is_a_legal_json_prefix(served, tok):
    """response_format json_object：随机小模型写不完一个对象也没关系，写出来的每个 token 都被语法接受。"""
    r = post(served, "/v1/chat/completions", {**CHAT, "max_tokens": 24, "response_format": {"type": "json_object"},
                                               "return_token_ids": True})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["message"]["content"].startswith("{")
    m = served.engine.grammars.matcher(SO(json_object=True))
    ids = c["token_ids"][:-1] if c["finish_reason"] == "stop" else c["token_ids"]
    assert all(m.accept_token(t) for t in ids)


def test_mask_time_per_step_is_in_the_metrics(served):
    """/metrics 的 llm_structured_output_*：每一步铺掩码的时间一个观测（直方图的次数 = 引擎铺过掩码的步数、和 = 引擎记的
    总时间）、铺过掩码的行、jump-forward 追加的 token——都等于引擎自己的 structured_stats；一个约束请求之后它们都变大。"""
    before = served.metric("llm_structured_output_mask_seconds_count")
    r = post(served, "/v1/chat/completions", {**CHAT, "structured_outputs": {"json": SCHEMA}})
    assert r.status_code == 200, r.text
    served.wait_idle()
    st = served.engine.structured_stats
    assert served.metric("llm_structured_output_mask_seconds_count") == st.mask_steps > before
    assert served.metric("llm_structured_output_mask_seconds_sum") == pytest.approx(st.mask_seconds, rel=1e-9)
    assert served.metric("llm_structured_output_masked_rows_total") == st.masked_rows >= st.mask_steps
    assert served.metric("llm_structured_output_jump_forward_tokens_total") == st.jump_tokens > 0


@pytest.mark.parametrize("extra,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer",
                                                                                          "minimum": 0}}}},
     "response_format", "unsupported keyword 'minimum'"),
    ({"structured_outputs": {"json": {"type": "object", "patternProperties": {}}}}, "structured_outputs",
     "unsupported keyword 'patternProperties'"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "missing ')'"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar", "not supported"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs.jsonn", "unknown field"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice", "list of strings"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "at most one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name",
     "name"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"json": {"type": "string", "enum": [1]}}}, "structured_outputs", "no enum/const value"),
    ({"guided_json": SCHEMA}, "guided_json", "is accepted"),
])
def test_bad_constraints_are_400_naming_the_field(served, extra, param, words):
    refused(served, "/v1/chat/completions", {**CHAT, **extra}, param, words)
    assert not served.engine.has_unfinished_requests()


def test_a_schema_whose_language_is_empty_is_refused(served):
    """自相矛盾的 schema（minLength > maxLength：什么字符串也不满足）：400，指名字段、说出矛盾。"""
    refused(served, "/v1/completions", {**COMP, "structured_outputs": {"json": {"type": "string", "minLength": 5,
                                                                                "maxLength": 2}}},
            "structured_outputs", "minLength 5 is greater than maxLength 2")


def test_other_engines_still_refuse_by_name(served09):
    for extra, param in (({"response_format": RESPONSE_FORMAT}, "response_format"),
                         ({"structured_outputs": {"regex": "a"}}, "structured_outputs")):
        err = refused(served09, "/v1/chat/completions", {**CHAT, **extra}, param, "--engine step15")
        assert param in err["message"]
    assert post(served09, "/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}}).status_code == 200
