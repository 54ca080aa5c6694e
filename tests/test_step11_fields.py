"""step11：请求字段。真实客户端发的请求体原样发过来：guidellm（vLLM 项目的压测工具）的 chat 与 completions、
lm-eval 的 local-completions / local-chat-completions；再逐个检查 vLLM 的 OpenAI 协议里的字段的决定
（第 11 章第 5 节的字段表）：实现了的行为与 vLLM 相同，没实现的 400 指名字段，收下不用的不改变输出。

- stream_options.continuous_usage_stats（vLLM 的扩展，guidellm 每个请求都发）：每个 chunk 都带它那个样本的 usage，
  completion_tokens 一个 chunk 一个 chunk往上数，与 token_ids 逐个对上；最后的 usage chunk 是总数；
- 实现了的 vLLM 字段：truncate_prompt_tokens、add_special_tokens、add_generation_prompt / continue_final_message、
  chat_template_kwargs / documents（模板里的变量）、request_id；
- 收下不用的（safety_identifier、prompt_cache_key、user）：输出与不带它们时逐 token 相同。

服务器在进程内（test_step11_serving.py 的 Served），用假引擎；lm-eval 的打分请求要 logprobs，用随机小模型的 step10 引擎。
"""
import json

import httpx
import pytest
from tokenizers.processors import TemplateProcessing

from common.tokenizer import Tokenizer
from test_step11_fake_engine import FakeEngine
from test_step11_serving import MODEL, Served, real_engine, tiny_session  # noqa: F401（fixture）

PROMPT = "请用一句话介绍长城，再说说它有多长。"
MAX = 12

# guidellm 的 ChatCompletionsRequestHandler.format（流式、输出长度固定时）发的请求体：内容是 text 片段的列表
GUIDELLM_CHAT = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                 "max_completion_tokens": MAX, "stop": None, "ignore_eos": True,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]}
# 它的 TextCompletionsRequestHandler.format
GUIDELLM_TEXT = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                 "max_tokens": MAX, "stop": None, "ignore_eos": True, "prompt": PROMPT}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
COMP = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def tok(tiny_tok_dir):
    return Tokenizer(tiny_tok_dir)


@pytest.fixture(scope="module")
def server(tok):
    s = Served(FakeEngine(tok, step_s=0.001), tok)
    yield s
    s.stop()


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=30)


def stream(server, path, body) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, timeout=30) as r:
        raw = r.read().decode()
        assert r.status_code == 200, raw
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


def refused(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[-1] in err["message"], err
    return err


def tokenize(server, **body) -> list[int]:
    return post(server, "/tokenize", body).json()["tokens"]


# ---------------- continuous_usage_stats：guidellm 的请求体 ----------------

def check_running_usage(chunks, prompt_lens: list[int], n: int, max_tokens: int, chat: bool, token_ids: bool):
    """每个 chunk 的 usage = (它那个样本的提示词, 这个样本到此为止生成的 token)；role chunk 是 0，之后每个 chunk 严格变大
    （发出的 chunk 都带着至少一个新 token），结束的那个 chunk 正好 max_tokens；token_ids 时与已发的 token 个数逐个相等。
    最后一个 chunk：choices 为空，usage 是总数（提示词每个算一次）。"""
    *body, last = chunks
    assert last["choices"] == []
    assert last["usage"]["prompt_tokens"] == sum(prompt_lens)
    assert last["usage"]["completion_tokens"] == len(prompt_lens) * n * max_tokens
    seen = {}                                  # 样本 → 已经发出的 chunk 里的 completion_tokens
    sent = {}                                  # 样本 → token_ids 加起来
    for c in body:
        (choice,) = c["choices"]
        i, u = choice["index"], c["usage"]
        assert set(u) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        assert u["prompt_tokens"] == prompt_lens[i // n] and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        if chat and choice["delta"].get("role") == "assistant":
            assert i not in seen and u["completion_tokens"] == 0
        else:
            assert u["completion_tokens"] > seen.get(i, 0)
            if token_ids:
                sent[i] = sent.get(i, 0) + len(choice["token_ids"])
                assert u["completion_tokens"] == sent[i]
        seen[i] = u["completion_tokens"]
        if choice["finish_reason"] is not None:
            assert choice["finish_reason"] == "length" and u["completion_tokens"] == max_tokens
    assert sorted(seen) == list(range(len(prompt_lens) * n))


def test_guidellm_chat_body_gets_usage_on_every_chunk(server):
    chunks = stream(server, "/v1/chat/completions", GUIDELLM_CHAT)
    prompt = tokenize(server, messages=GUIDELLM_CHAT["messages"])
    check_running_usage(chunks, [len(prompt)], 1, MAX, chat=True, token_ids=False)
    assert len(chunks) > 3 and all(c["usage"] is not None for c in chunks)
    # 两个样本、带 token_ids：每个样本各数各的，与它已发出的 token 逐个相等
    chunks = stream(server, "/v1/chat/completions", {**GUIDELLM_CHAT, "n": 2, "seed": 1, "return_token_ids": True})
    check_running_usage(chunks, [len(prompt)], 2, MAX, chat=True, token_ids=True)


def test_guidellm_completions_body_gets_usage_on_every_chunk(server, tok):
    chunks = stream(server, "/v1/completions", GUIDELLM_TEXT)
    check_running_usage(chunks, [len(tok.encode(PROMPT))], 1, MAX, chat=False, token_ids=False)
    # 两个提示词 × 两个样本：每个 chunk 的 prompt_tokens 是它自己那个提示词的
    prompts = [PROMPT, "Hello"]
    chunks = stream(server, "/v1/completions", {**GUIDELLM_TEXT, "prompt": prompts, "n": 2, "return_token_ids": True})
    check_running_usage(chunks, [len(tok.encode(p)) for p in prompts], 2, MAX, chat=False, token_ids=True)


def test_stream_options_combinations(server):
    body = {**CHAT, "stream": True}
    # 只给 continuous_usage_stats：include_usage 随它（vLLM 的 include_usage 默认 true，结果相同）
    chunks = stream(server, "/v1/chat/completions", {**body, "stream_options": {"continuous_usage_stats": True}})
    assert chunks[-1]["choices"] == [] and all(c["usage"] for c in chunks)
    # 只要 include_usage：chunk 的 usage 是 null（OpenAI 的形状）
    chunks = stream(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and all(c["usage"] is None for c in chunks[:-1])
    # 空的 stream_options：OpenAI 的默认，不要 usage
    chunks = stream(server, "/v1/chat/completions", {**body, "stream_options": {}})
    assert all("usage" not in c and c["choices"] for c in chunks)
    # 要 continuous 又明说不要 usage：vLLM 悄悄什么也不发；这里 400
    refused(server, "/v1/chat/completions",
            {**body, "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats")
    refused(server, "/v1/completions", {**COMP, "stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation")
    assert post(server, "/v1/completions", {**COMP, "stream": True,
                                            "stream_options": {"include_obfuscation": False}}).status_code == 200


# ---------------- lm-eval 的请求体 ----------------

def test_lm_eval_generation_bodies(server):
    """local-completions 与 local-chat-completions 的 generate_until（_create_payload，generate=True）。"""
    r = post(server, "/v1/completions", {"prompt": [[6004, 30, 1012]], "model": MODEL, "max_tokens": 8,
                                         "temperature": 0, "stop": ["\n\n", "Question:"], "seed": 1234})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Q: 2+2?"}], "model": MODEL,
                                              "max_tokens": 8, "temperature": 0, "stop": ["<|im_end|>"], "seed": 1234})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text


def test_lm_eval_loglikelihood_body(tiny_session):
    """local-completions 的打分请求（_create_payload，generate=False）：token id 的批、echo、logprobs 1、max_tokens 1。"""
    s = Served(real_engine("step10", tiny_session), tiny_session.tok, max_logprobs=20)
    try:
        batch = [tiny_session.tok.encode("The capital of France is Paris"), tiny_session.tok.encode("Hi there")]
        r = post(s, "/v1/completions", {"model": MODEL, "prompt": batch, "temperature": 0, "max_tokens": 1,
                                        "logprobs": 1, "seed": 1234, "echo": True})
        assert r.status_code == 200, r.text
        for ids, c in zip(batch, sorted(r.json()["choices"], key=lambda c: c["index"])):
            lp = c["logprobs"]
            assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
            assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    finally:
        s.stop()


# ---------------- 实现了的 vLLM 字段 ----------------

def test_truncate_prompt_tokens_keeps_the_last_k(server, tok):
    ids = tok.encode(PROMPT)
    r = post(server, "/v1/completions", {**COMP, "prompt": PROMPT, "truncate_prompt_tokens": 5, "return_token_ids": True})
    c = r.json()["choices"][0]
    assert c["prompt_token_ids"] == ids[-5:] and r.json()["usage"]["prompt_tokens"] == 5
    r = post(server, "/v1/completions", {**COMP, "prompt": PROMPT, "truncate_prompt_tokens": -1, "return_token_ids": True})
    assert r.json()["choices"][0]["prompt_token_ids"] == ids      # -1：上下文长度（这里比提示词长）
    chat_ids = tokenize(server, messages=CHAT["messages"])
    r = post(server, "/v1/chat/completions", {**CHAT, "truncate_prompt_tokens": 3, "return_token_ids": True})
    assert r.json()["choices"][0]["prompt_token_ids"] == chat_ids[-3:]
    refused(server, "/v1/completions", {**COMP, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens")
    refused(server, "/v1/completions", {**COMP, "truncate_prompt_tokens": 2, "echo": True}, "truncate_prompt_tokens")


def test_add_special_tokens_for_completions_and_chat(tiny_tok_dir):
    """一个会加 BOS 的分词器（默认模型的不加，在它上面这两个字段看不出区别）。"""
    t = Tokenizer(tiny_tok_dir)
    t.hf.backend_tokenizer.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    s = Served(FakeEngine(t), t)
    try:
        def prompt_ids(path, body):
            r = post(s, path, {**body, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["prompt_token_ids"]
        plain = t.hf(PROMPT, add_special_tokens=False).input_ids
        assert prompt_ids("/v1/completions", {**COMP, "prompt": PROMPT}) == [1, *plain]     # 默认 true（同 vLLM）
        assert prompt_ids("/v1/completions", {**COMP, "prompt": PROMPT, "add_special_tokens": False}) == plain
        chat = prompt_ids("/v1/chat/completions", CHAT)            # 默认 false：模板里已经有特殊 token
        assert chat == tokenize(s, messages=CHAT["messages"])
        assert prompt_ids("/v1/chat/completions", {**CHAT, "add_special_tokens": True}) == [1, *chat]
    finally:
        s.stop()


def test_generation_prompt_flags_match_tokenize(server):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The Great Wall is"}]
    for flags in ({"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True}):
        r = post(server, "/v1/chat/completions", {**CHAT, "messages": msgs, **flags, "return_token_ids": True})
        assert r.json()["choices"][0]["prompt_token_ids"] == tokenize(server, messages=msgs, **flags)
    assert tokenize(server, messages=msgs, add_generation_prompt=False, continue_final_message=True) != \
        tokenize(server, messages=msgs, add_generation_prompt=False)
    refused(server, "/v1/chat/completions", {**CHAT, "continue_final_message": True}, "continue_final_message")


def test_chat_template_kwargs_and_documents_reach_the_template(tiny_tok_dir):
    t = Tokenizer(tiny_tok_dir)
    t.hf.chat_template = ("{% if greeting is defined %}{{ greeting }}|{% endif %}"
                          "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                          "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    s = Served(FakeEngine(t), t)
    try:
        r = post(s, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"greeting": "Hi"}, "return_token_ids": True,
                                             "documents": [{"title": "长城", "text": "很长"}]})
        assert r.json()["choices"][0]["prompt_token_ids"] == \
            t.hf("Hi|[长城: 很长]<user>hi<assistant>", add_special_tokens=False).input_ids
        refused(s, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs")
        refused(s, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
                "chat_template_kwargs")
    finally:
        s.stop()


def test_request_id_becomes_the_response_id(server):
    assert post(server, "/v1/chat/completions", {**CHAT, "request_id": "abc-1"}).json()["id"] == "chatcmpl-abc-1"
    chunks = stream(server, "/v1/completions", {**COMP, "stream": True, "request_id": "abc-2"})
    assert {c["id"] for c in chunks} == {"cmpl-abc-2"}
    refused(server, "/v1/completions", {**COMP, "request_id": ""}, "request_id")


def test_identifiers_that_cannot_change_the_output_are_accepted(server):
    """user、safety_identifier、prompt_cache_key 只给提供方的监测与缓存路由用：同一个请求带不带它们，token 相同。"""
    base = {**CHAT, "max_tokens": 10, "return_token_ids": True, "ignore_eos": True}
    want = post(server, "/v1/chat/completions", base).json()["choices"][0]["token_ids"]
    r = post(server, "/v1/chat/completions", {**base, "user": "u1", "safety_identifier": "h(u1)",
                                              "prompt_cache_key": "conv-7"})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text


# ---------------- 没实现的：400 指名字段；等于没用的值收下 ----------------

@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"length_penalty": 0.5}, "length_penalty"),
    ("/v1/completions", {"skip_special_tokens": False}, "skip_special_tokens"),
    ("/v1/chat/completions", {"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ("/v1/completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"bad_words": ["wall"]}, "bad_words"),
    ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"guided_choice": ["yes", "no"]}, "guided_choice"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ("/v1/completions", {"priority": 1}, "priority"),
    ("/v1/chat/completions", {"cache_salt": "s3cret"}, "cache_salt"),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"include_reasoning": False}, "include_reasoning"),
    ("/v1/chat/completions", {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ("/v1/completions", {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("/v1/chat/completions", {"verbosity": "low"}, "verbosity"),              # OpenAI 的新字段：不认识，指名
])
def test_unimplemented_vllm_fields_are_refused_by_name(server, path, extra, param):
    """vLLM 的字段这里认识：400 的消息说出收下的值（"等于没用"的那个）；不认识的字段说 unknown field。"""
    err = refused(server, path, {**(CHAT if "chat" in path else COMP), **extra}, param)
    assert ("unknown field" in err["message"]) == (param == "verbosity")
    assert param == "verbosity" or "is accepted" in err["message"]


def test_default_values_of_unimplemented_vllm_fields_are_accepted(server):
    chat = {"use_beam_search": False, "length_penalty": 1.0, "skip_special_tokens": True, "priority": 0,
            "spaces_between_special_tokens": True, "bad_words": [], "prompt_logprobs": None, "echo": False,
            "include_reasoning": True, "guided_json": None, "cache_salt": None, "return_tokens_as_token_ids": False}
    assert post(server, "/v1/chat/completions", {**CHAT, **chat}).status_code == 200
    r = post(server, "/v1/completions", {**COMP, "use_beam_search": False, "skip_special_tokens": True,
                                         "allowed_token_ids": None, "prompt_embeds": None, "vllm_xargs": None})
    assert r.status_code == 200, r.text
