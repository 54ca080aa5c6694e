"""OpenAI 兼容 API 的线上格式：请求体的检查、请求 → 引擎的 Request、响应与流式 chunk 的形状、错误体。

字段与 vLLM 的 OpenAI 服务器（vllm/entrypoints/openai/ 下的 protocol / serving_chat / serving_completion）相同：
- 非流式：{"id", "object": "chat.completion" | "text_completion", "created", "model", "choices": [...], "usage"}；
- 流式（SSE，每个事件一行 `data: <json>` 加一个空行）：每个 chunk 的 id 与 created 相同；chat 先发一个只有
  role 的 chunk，之后是 delta.content，最后一个带 finish_reason；stream_options.include_usage 时再发一个
  choices 为空、带 usage 的 chunk（此前每个 chunk 的 usage 都是 null；vLLM 的扩展 continuous_usage_stats 时
  每个 chunk 都带这个样本到此为止的 usage）；最后是 `data: [DONE]`；
- 错误：{"error": {"message", "type", "param", "code"}}，code 是 HTTP 状态码（vLLM 的做法）；
- logprobs（completions 的 `logprobs: k` 与 `echo`，chat 的 `logprobs: true, top_logprobs: k`）：只有算它们的引擎
  （step09、step10）接受，k 至多 --max-logprobs；线上的形状在 logprobs.py；
- chunk_separator（completions 的扩展字段，只有 --engine step13 接受）：字符串提示词在分隔符处切开，前面每片是一段
  （检索到的文档），最后一片是问题——LMCache 的 blend_special_str 的做法；分词与 step13 的 run.py --chunk-sep 相同；
- 结构化输出（只有 --engine step15 接受，别的引擎 400 指名字段）：OpenAI 的 response_format
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}} 与 {"type": "json_object"}，
  以及 vLLM 的扩展字段 structured_outputs {"json" | "regex" | "choice" | "json_object"}（二者至多给一个）；
  schema 里不支持的关键字、写错的正则 400 说出名字（structured_output）。vLLM 已经删掉的 guided_* 字段只收 null。

数值字段严格按 JSON 类型检查（"0.5" 不是数字、"yes" 不是布尔值），取值范围由 step02 的 SamplingParams.validate
和引擎的 add_request 检查——同一份规则，命令行和 HTTP 给出同样的错误信息。
"""
import inspect
import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from common.errors import UserError
from step02_sampling.sampler import SamplingParams
from step04_static_batching.request import Request
from step13_kv_blend.chunk_cache import build_prompt, split_prompt   # 段标记的分词：与 step13 的 run.py 同一份
from step15_structured_output.structured import StructuredOutputsParams   # 约束：与 step15 的 run.py 同一个类

MAX_N = 16                      # 一个请求最多要几个样本（OpenAI 允许 128；CPU 上 16 已经是好几批）
# 停止字符串的上限。OpenAI 允许 4 个；常见的客户端（对话模板的几个结束标记）偶尔多于 4 个，所以放宽到 16 个、
# 每个至多 256 个字符。每个生成的 token 都要在文本尾巴上找一遍每个停止串：不设上限，一个请求带一万个停止串
# 就能让引擎那一侧和事件循环每个 token 多做一万次查找。
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_JSON_DEPTH = 32             # 请求体的嵌套层数上限（合法的请求不超过 5 层）；更深的嵌套会让解析器递归到栈底
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # /v1/completions 不给 max_tokens 时的默认值（OpenAI 与 vLLM 都是 16）

Number = Annotated[float, Field(strict=True)]   # 接受 JSON 的整数和小数，不接受字符串


class APIError(Exception):
    """变成一个 OpenAI 形状的 JSON 错误响应。"""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class _Model(BaseModel):
    # 不认识的字段拒绝（400，指名字段）而不是悄悄忽略：客户端以为起了作用的参数（例如 best_of），
    # 其实什么也没做，是最难查的一种错。OpenAI 有、这里没实现的字段见 _reject_unsupported：只接受"等于没用"的值
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Model):
    # include_usage 不给时：OpenAI 是 false；只给了 continuous_usage_stats 时随它（vLLM 的 include_usage 默认是 true，
    # 这样 {"continuous_usage_stats": true} 与 vLLM 的结果相同）。见 stream_usage
    include_usage: Optional[StrictBool] = None
    continuous_usage_stats: Optional[StrictBool] = None   # vLLM 的扩展（guidellm 每个请求都发）：每个 chunk 都带 usage
    include_obfuscation: Optional[StrictBool] = None      # OpenAI：delta 里加随机填充；这里没有，只收 null / false


class TextPart(_Model):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[TextPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _SamplingRequest(_Model):
    """两个端点共用的字段。默认值与 OpenAI 相同（temperature 1）；top_k / min_p / repetition_penalty / ignore_eos /
    min_tokens / stop_token_ids / include_stop_str_in_output 是 vLLM 加的扩展字段，openai 客户端经 extra_body 发送。"""
    model: Optional[StrictStr] = None
    n: StrictInt = 1
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    # JSON 对象的键总是字符串："50256" → 50256（OpenAI 的写法）；不是整数的键 400
    logit_bias: Optional[dict[int, Number]] = None
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: Optional[list[StrictInt]] = None   # vLLM 的扩展：生成了其中任一个就停（它的 id 在输出里，文本不在）
    min_tokens: Optional[StrictInt] = None             # vLLM 的扩展：这么多个 token 之前 EOS、停止 token、停止串都不算
    include_stop_str_in_output: StrictBool = False     # vLLM 的扩展：返回的文本包含停止串（或停止 token 的文本）
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    return_token_ids: StrictBool = False   # vLLM 的扩展：每个 choice 带上 prompt_token_ids / token_ids（run.py 用它）
    user: Optional[StrictStr] = None       # OpenAI：终端用户的标识，只用于对方的滥用监测；这里接受、不用
    # 结构化输出（--engine step15）：形状在 structured_output 里检查；别的引擎只接受等于没用的值（UNSUPPORTED）
    response_format: object = None
    structured_outputs: object = None
    # 以下没有实现：只接受不改变行为的值（见 UNSUPPORTED），其余 400
    # ---- vLLM 的请求字段（第 11 章第 5 节的字段表逐个说明为什么）----
    truncate_prompt_tokens: Optional[StrictInt] = None   # 只留提示词的最后 k 个 token（-1：上下文长度）
    request_id: Optional[StrictStr] = None               # 响应的 id 是 "chatcmpl-<它>" / "cmpl-<它>"
    safety_identifier: Optional[StrictStr] = None        # OpenAI：与 user 相同，只用于对方的滥用监测；接受、不用
    prompt_cache_key: Optional[StrictStr] = None         # OpenAI：它的缓存路由的提示；前缀缓存只看内容，接受、不用
    use_beam_search: object = None                       # 以下没有实现：只接受等于没用的值（UNSUPPORTED）
    length_penalty: object = None
    skip_special_tokens: object = None
    spaces_between_special_tokens: object = None
    allowed_token_ids: object = None
    bad_words: object = None
    prompt_logprobs: object = None
    logits_processors: object = None
    return_tokens_as_token_ids: object = None
    priority: object = None
    cache_salt: object = None
    kv_transfer_params: object = None
    vllm_xargs: object = None
    guided_json: object = None
    guided_regex: object = None
    guided_choice: object = None
    guided_grammar: object = None
    guided_decoding_backend: object = None
    guided_whitespace_pattern: object = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[StrictInt] = None   # 新版 OpenAI 的名字；优先于 max_tokens
    logprobs: Optional[StrictBool] = None      # true：每个生成的 token 带 logprob（与最可能的 top_logprobs 个）
    top_logprobs: Optional[StrictInt] = None
    chunk_separator: object = None             # 只有 completions 收；这里认识它，为的是 400 时说清楚为什么（chunk_marks）
    # 对话模板的参数（vLLM 的同名字段，同 /tokenize）；chat_template_kwargs 是模板里的变量（例如 enable_thinking）
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    documents: Optional[list[dict[StrictStr, StrictStr]]] = None
    chat_template_kwargs: Optional[dict[StrictStr, object]] = None
    chat_template: object = None               # 以下没有实现：只接受等于没用的值
    echo: object = None
    include_reasoning: object = None
    structural_tag: object = None
    mm_processor_kwargs: object = None
    tools: object = None
    tool_choice: object = None
    parallel_tool_calls: object = None
    functions: object = None
    function_call: object = None
    modalities: object = None
    audio: object = None
    prediction: object = None
    reasoning_effort: object = None
    store: object = None
    metadata: object = None
    service_tier: object = None
    web_search_options: object = None


class CompletionRequest(_SamplingRequest):
    # 一个字符串、一串 token id，或它们的列表（批量：choices 的 index = 第几个提示词 × n + 第几个样本）
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    logprobs: Optional[StrictInt] = None       # k：每个 token 的 logprob 与最可能的 k 个（旧格式）
    echo: Optional[StrictBool] = None          # text 以提示词开头；与 logprobs 一起时提示词的 token 也带 logprob
    chunk_separator: Optional[StrictStr] = None   # 扩展（step13）：提示词在它处切开，前面每片一段、最后一片是问题
    add_special_tokens: StrictBool = True      # vLLM：字符串提示词分词时加不加特殊 token（BOS）；token id 的提示词不动
    best_of: object = None
    suffix: object = None
    prompt_embeds: object = None


def parse_json(raw: bytes) -> dict:
    """请求体 → dict。NaN / Infinity 不是合法 JSON（Python 的 json 默认却接受），这里拒绝。"""
    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")
    too_deep = APIError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        obj = json.loads(raw, parse_constant=no_constants)
    except RecursionError:                  # 几千层的 [[[[…]]]]：解析器递归到栈底
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise APIError(400, "request body must be a JSON object")
    if json_depth(obj) > MAX_JSON_DEPTH:    # 解析得了、但后面的检查（pydantic、模板）还会再递归一遍
        raise too_deep
    return obj


def json_depth(obj) -> int:
    """嵌套层数（不用递归：要量的正是可能深得让递归出错的东西）。"""
    depth, level = 0, [obj]
    while level:
        depth += 1
        level = [c for x in level if isinstance(x, (dict, list)) for c in (x.values() if isinstance(x, dict) else x)
                 if isinstance(c, (dict, list))]
    return depth


def parse_request(cls, obj: dict, structured: bool = False):
    """structured：服务的引擎做结构化输出（step15）——response_format 与 structured_outputs 由 structured_output 检查。"""
    req = validate_body(cls, obj)
    _reject_unsupported(req, STRUCTURED_FIELDS if structured else ())
    return req


def validate_body(cls, obj: dict):
    """请求体 → cls 的实例；类型不对、缺字段、不认识的字段 → 400 指名字段。"""
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"unknown field `{loc}`: this server does not support it", param=loc) from None
        raise APIError(400, f"{loc}: {err['msg']}" if loc else err["msg"],
                       param=str(err["loc"][0]) if err["loc"] else None) from None


# OpenAI（与 vLLM）有、这里没实现的字段 → 接受的值：都等于"没用这个功能"（OpenAI 的默认值）。别的值 400 指名字段，
# 而不是 200 却没有效果。best_of 另外还接受等于 n。
UNSUPPORTED = {
    "best_of": (None, 1),
    "response_format": (None, {"type": "text"}), "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False),
    "functions": (None, []), "function_call": (None, "none"), "modalities": (None, ["text"]), "audio": (None,),
    "prediction": (None,), "reasoning_effort": (None,), "store": (None, False), "metadata": (None, {}),
    "service_tier": (None, "auto", "default"), "web_search_options": (None,),
    # vLLM 的扩展
    "use_beam_search": (None, False), "length_penalty": (None, 1), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "allowed_token_ids": (None,), "bad_words": (None, []),
    "prompt_logprobs": (None,), "logits_processors": (None,), "return_tokens_as_token_ids": (None, False),
    "priority": (None, 0), "cache_salt": (None,), "kv_transfer_params": (None,), "vllm_xargs": (None,),
    "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,),
    "structural_tag": (None,), "chat_template": (None,), "include_reasoning": (None, True),
    "mm_processor_kwargs": (None, {}), "prompt_embeds": (None,),
}
CHAT_UNSUPPORTED = {"echo": (None, False)}   # completions 的 echo 实现了；chat 的（把最后一条消息接在回答前面）没有
STRUCTURED_FIELDS = ("response_format", "structured_outputs")   # --engine step15 实现了它们


def _reject_unsupported(req: _SamplingRequest, implemented=()) -> None:
    table = {**UNSUPPORTED, **CHAT_UNSUPPORTED} if isinstance(req, ChatCompletionRequest) else UNSUPPORTED
    for name, allowed in table.items():
        if name not in type(req).model_fields or name in implemented:
            continue
        value = getattr(req, name)
        if name == "best_of" and value == req.n:
            continue
        if not any(_same(value, a) for a in allowed):
            hint = "; structured output needs --engine step15" if name in STRUCTURED_FIELDS else ""
            raise APIError(400, f"{name} is not supported by this server (only {' / '.join(map(_show, allowed))} "
                                f"is accepted: it changes nothing{hint}), got {json.dumps(value)}", param=name)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options can only be given together with stream=true", param="stream_options")
    so = req.stream_options
    if so is not None and so.continuous_usage_stats and so.include_usage is False:   # vLLM 这时悄悄什么 usage 也不发
        raise APIError(400, "stream_options.continuous_usage_stats needs include_usage (leave it out or set it true)",
                       param="stream_options.continuous_usage_stats")
    if so is not None and so.include_obfuscation:
        raise APIError(400, "stream_options.include_obfuscation is not supported by this server (it adds no random "
                            "padding to the chunks): only null / false is accepted",
                       param="stream_options.include_obfuscation")
    if isinstance(req, ChatCompletionRequest):
        check_generation_prompt(req)
    if req.request_id == "":
        raise APIError(400, "request_id must not be empty", param="request_id")
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be between 1 and {MAX_N}, got {req.n}", param="n")


def check_generation_prompt(req) -> None:
    """continue_final_message 接着写最后一条消息，add_generation_prompt 另起一条回答：两个都要是矛盾的（vLLM 也 400）。"""
    if req.add_generation_prompt and req.continue_final_message:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")


def stream_usage(req: _SamplingRequest) -> tuple[bool, bool]:
    """→ (最后发一个 choices 为空、带总 usage 的 chunk, 每个 chunk 都带它那个样本到此为止的 usage)。
    vLLM 的 serving_chat / serving_completion 相同：continuous 只在 include_usage 时起作用（这里 include_usage
    不给时随 continuous_usage_stats；明说 false 又要 continuous 的，_reject_unsupported 已经 400）。"""
    so = req.stream_options
    if so is None:
        return False, False
    continuous = bool(so.continuous_usage_stats)
    return (continuous if so.include_usage is None else so.include_usage), continuous


def _same(value, allowed) -> bool:
    """JSON 值相等：0 与 0.0 相同，但 false 不等于 0、null 只等于 null。"""
    if allowed is None or isinstance(allowed, bool) or isinstance(value, bool):
        return value is allowed
    return value == allowed


def _show(v) -> str:
    return json.dumps(v)


@dataclass
class ServedRequest(Request):
    """服务器的请求：引擎的 Request（step04）加上只有文本那一侧（async_engine 的增量解码器）用的选项；引擎不看它们。"""
    include_stop_str_in_output: bool = False   # 文本里保留停止串（或结束它的那个停止 token 的文本），同 vLLM
    chunks: Optional[tuple] = None             # 例外：段标记，async_engine 给了才作为 add_request 的第二个参数交给引擎
    structured_output: Optional[StructuredOutputsParams] = None   # 例外：约束，async_engine 给了才交给引擎（step15）


@dataclass
class EngineInputs:
    """一个 HTTP 请求变成的引擎请求：len(prompts) × n 个 Request，顺序就是 choices 的 index。"""
    requests: list[Request]
    prompt_tokens: int           # usage.prompt_tokens：每个提示词算一次（n 个样本共用同一个提示词）


def encode_chat(tok, messages: list[ChatMessage], add_generation_prompt: bool = True, continue_final_message: bool = False,
                add_special_tokens: bool = False, documents: Optional[list[dict]] = None,
                template_kwargs: Optional[dict] = None) -> list[int]:
    """按模型自己的对话模板把整段对话排成 token（与 `--chat` 相同：模板里已经有特殊 token，不再加）。
    其余参数是 vLLM 的 ChatCompletionRequest / TokenizeChatRequest 的同名字段，默认值与它相同。
    documents 与 template_kwargs（chat_template_kwargs）成为模板里的变量：模板不用它们时什么也不变（同 vLLM）。"""
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    if not tok.hf.chat_template:
        raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
    template_kwargs = template_kwargs or {}
    own = {"messages", *inspect.signature(tok.hf.apply_chat_template).parameters}   # tokenize、chat_template……
    if clash := sorted(own & set(template_kwargs)):
        raise APIError(400, f"chat_template_kwargs: {', '.join(clash)} cannot be set here (not a template variable"
                            f"{'; a template sent by the client is refused, as vLLM does' if 'chat_template' in clash else ''})",
                       param="chat_template_kwargs")
    conv = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    try:
        text = tok.hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message, documents=documents,
                                          **template_kwargs)
    except Exception as e:   # 模板自己的 raise_exception（例如角色顺序不对）
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
    return tok.hf(text, add_special_tokens=add_special_tokens).input_ids


def truncate_prompts(req: _SamplingRequest, prompts: list[list[int]], context_len: int) -> list[list[int]]:
    """truncate_prompt_tokens（vLLM 的扩展）：每个提示词只留最后 k 个 token（vLLM 从左边截）；-1 = 上下文长度。"""
    k, name = req.truncate_prompt_tokens, "truncate_prompt_tokens"
    if k is None:
        return prompts
    if k == -1:
        k = context_len
    if k < 1:
        raise APIError(400, f"{name} must be >= 1 (or -1: the model's context length), got {k}", param=name)
    if getattr(req, "echo", False) is True or getattr(req, "chunk_separator", None) is not None:
        raise APIError(400, f"{name} cannot be combined with echo or chunk_separator (the echoed text and the chunks "
                            f"are cut from the whole prompt)", param=name)
    return [ids[-k:] for ids in prompts]


def encode_prompts(tok, prompt, vocab_size: int, add_special_tokens: bool = True) -> list[list[int]]:
    """/v1/completions 的 prompt → 每个提示词的 token id。直接给 token id 时要检查范围：越界的 id 会让嵌入层
    在引擎的 step 里出错，连累同一批的所有请求。add_special_tokens 只管字符串提示词（同 vLLM）。"""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):   # Tokenizer.encode 对空串抛 UserError
            ids = tok.encode(p) if add_special_tokens else tok.hf(p, add_special_tokens=False).input_ids
        else:
            ids = list(p)
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if not all(0 <= t < vocab_size for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        out.append(ids)
    return out


def chunk_marks(req, tok, accepts_chunks: bool) -> Optional[tuple[list[list[int]], list[tuple]]]:
    """chunk_separator → (每个提示词的 token id, 每个提示词的段)；没给时 None（照常用 encode_prompts）。
    分词与 step13 的 run.py --chunk-sep 相同（step13_kv_blend.chunk_cache 的 split_prompt / build_prompt）：
    每段单独分词、不加特殊 token、首尾相接，分隔符不进提示词。不能用的情形 400，指名 chunk_separator。"""
    sep = req.chunk_separator
    if sep is None:
        return None
    name = "chunk_separator"

    def refuse(why: str):
        raise APIError(400, f"{name}: {why}", param=name)
    if isinstance(req, ChatCompletionRequest):
        refuse("only /v1/completions with a string prompt can mark chunks: the chat template wraps the messages "
               "(its opening before the first chunk, its closing after the question), so the text the client sent "
               "is not the prompt the chunks would be cut from")
    if not accepts_chunks:
        refuse("this server's engine does not reuse chunks (serve with --engine step13)")
    if not isinstance(sep, str) or not sep:
        refuse("must be a non-empty string")
    raw = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if not raw:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if not all(isinstance(p, str) for p in raw):
        refuse("needs the prompt as text (a string or a list of strings), not token ids: the chunks are cut "
               "at the separator in the text")
    if req.echo:
        refuse("cannot be combined with echo (the model never sees the separators that the echoed text would contain)")
    ids, chunks = [], []
    for p in raw:
        try:
            parts = split_prompt(p, sep, ("prompt", name))
            i, c = build_prompt(tok, parts[:-1], parts[-1], chat=False)
        except UserError as e:
            raise APIError(400, str(e), param=name) from None
        ids.append(i)
        chunks.append(tuple(c))
    return ids, chunks


def structured_output(req: _SamplingRequest, accepts: bool) -> Optional[StructuredOutputsParams]:
    """response_format（OpenAI）或 structured_outputs（vLLM 的扩展）→ 引擎的约束；都没给（或 {"type": "text"}）时 None。
    accepts：服务的引擎做结构化输出（step15）；不做时 parse_request 已经按 UNSUPPORTED 拒绝了别的值。
    形状不对、两个都给、schema 里不支持的关键字、写错的正则：400 指名字段（消息里有关键字的名字）。"""
    rf, so = req.response_format, req.structured_outputs
    if not accepts or (rf is None or rf == {"type": "text"}) and so is None:
        return None
    if so is not None and rf is not None and rf != {"type": "text"}:
        raise APIError(400, "give at most one of response_format and structured_outputs", param="structured_outputs")
    if so is not None:
        params, name = _structured_outputs(so), "structured_outputs"
    else:
        params, name = _response_format(rf), "response_format"
    try:
        params.check()
    except UserError as e:
        raise APIError(400, str(e), param=name) from None
    return params


def _response_format(rf) -> StructuredOutputsParams:
    """OpenAI 的 response_format：{"type": "json_object"}，或 {"type": "json_schema", "json_schema": {"name": ..., "schema":
    {...}, "strict": ..., "description": ...}}（vLLM 同样接受 schema 不写、按任意 JSON 处理；这里要 schema：不写就说清楚）。"""
    name = "response_format"
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, f'{name} must be {{"type": "text" | "json_object" | "json_schema", ...}}, got '
                            f"{json.dumps(rf)}", param=name)
    if rf["type"] == "json_object":
        if set(rf) != {"type"}:
            raise APIError(400, f"{name}: json_object takes no other field, got {sorted(set(rf) - {'type'})}", param=name)
        return StructuredOutputsParams(json_object=True)
    js = rf.get("json_schema")
    if set(rf) != {"type", "json_schema"} or not isinstance(js, dict):
        raise APIError(400, f'{name}: json_schema needs exactly {{"type": "json_schema", "json_schema": {{...}}}}',
                       param=name)
    unknown = set(js) - {"name", "schema", "strict", "description"}
    if unknown:
        raise APIError(400, f"{name}.json_schema: unknown field {sorted(unknown)[0]!r}", param=f"{name}.json_schema")
    if not isinstance(js.get("name"), str) or not re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", js["name"]):
        raise APIError(400, f"{name}.json_schema.name must match [a-zA-Z0-9_-]{{1,64}} (OpenAI's rule)",
                       param=f"{name}.json_schema.name")
    if not isinstance(js.get("schema"), dict):
        raise APIError(400, f"{name}.json_schema.schema must be a JSON schema object", param=f"{name}.json_schema.schema")
    if not isinstance(js.get("strict", False), (bool, type(None))) or not isinstance(js.get("description", ""), (str, type(None))):
        raise APIError(400, f"{name}.json_schema: strict must be a boolean and description a string", param=name)
    # strict 不改变什么：这里的 schema 本来就按 strict 的意思做（没写 additionalProperties 时只生成声明过的属性，schema.py）
    return StructuredOutputsParams(json=js["schema"])


STRUCTURED_OUTPUTS_DEFAULTS = {   # vLLM 的 StructuredOutputsParams 里这里没实现的字段：只收等于没用的值
    "grammar": (None,), "structural_tag": (None,), "whitespace_pattern": (None,), "disable_fallback": (None, False),
    "disable_any_whitespace": (None, False, True), "disable_additional_properties": (None, False, True),
}


def _structured_outputs(so) -> StructuredOutputsParams:
    """vLLM 的 structured_outputs：{"json": schema | "json 文本"} / {"regex": "..."} / {"choice": [...]} /
    {"json_object": true}，恰好一种。disable_any_whitespace、disable_additional_properties 收 true 也收 false：
    这里的 JSON 本来就是紧凑的、只有声明过的属性（schema.py），两个值的结果相同。"""
    name = "structured_outputs"
    if not isinstance(so, dict):
        raise APIError(400, f"{name} must be an object, got {json.dumps(so)}", param=name)
    for k, v in so.items():
        if k in STRUCTURED_OUTPUTS_DEFAULTS:
            if not any(_same(v, a) for a in STRUCTURED_OUTPUTS_DEFAULTS[k]):
                raise APIError(400, f"{name}.{k} is not supported by this server, got {json.dumps(v)}",
                               param=f"{name}.{k}")
        elif k not in ("json", "regex", "choice", "json_object"):
            raise APIError(400, f"unknown field `{name}.{k}`", param=f"{name}.{k}")
    json_schema, regex, choice = so.get("json"), so.get("regex"), so.get("choice")
    json_object = so.get("json_object")
    if json_object not in (None, True, False):
        raise APIError(400, f"{name}.json_object must be a boolean", param=f"{name}.json_object")
    if regex is not None and not isinstance(regex, str):
        raise APIError(400, f"{name}.regex must be a string", param=f"{name}.regex")
    if choice is not None and not (isinstance(choice, list) and all(isinstance(c, str) for c in choice)):
        raise APIError(400, f"{name}.choice must be a list of strings", param=f"{name}.choice")
    if json_schema is not None and not isinstance(json_schema, (dict, str)):
        raise APIError(400, f"{name}.json must be a JSON schema (an object, or its JSON text)", param=f"{name}.json")
    given = [k for k, v in (("json", json_schema), ("regex", regex), ("choice", choice)) if v is not None]
    given += ["json_object"] if json_object else []
    if len(given) != 1:
        raise APIError(400, f"{name} needs exactly one of json, regex, choice, json_object; got "
                            f"{', '.join(given) or 'none'}", param=name)
    return StructuredOutputsParams(json=json_schema, regex=regex, choice=None if choice is None else tuple(choice),
                                   json_object=bool(json_object))


def sampling_params(req: _SamplingRequest) -> SamplingParams:
    """OpenAI 的默认值（temperature 1、top_p 1）；top_k 的 -1 是 vLLM 的"不限制"，我们的是 0。"""
    top_k = req.top_k if req.top_k is not None else 0
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_k=0 if top_k == -1 else top_k,
        top_p=1.0 if req.top_p is None else float(req.top_p),
        min_p=0.0 if req.min_p is None else float(req.min_p),
        repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
        seed=req.seed,
        presence_penalty=0.0 if req.presence_penalty is None else float(req.presence_penalty),
        frequency_penalty=0.0 if req.frequency_penalty is None else float(req.frequency_penalty),
        logit_bias={t: float(b) for t, b in (req.logit_bias or {}).items()},
        min_tokens=req.min_tokens or 0,
        stop_token_ids=tuple(req.stop_token_ids or ()))
    try:
        params.validate()   # 词表范围（logit_bias、stop_token_ids 的 id）由引擎的 add_request 再查一次：这里不知道词表
    except UserError as e:   # validate 的消息以字段名开头：把它填进 param
        name = str(e).split(" ", 1)[0].rstrip(":")
        raise APIError(400, str(e), param=name if name in type(req).model_fields else None) from None
    return params


def logprob_counts(req: _SamplingRequest, max_tokens: Optional[int],
                   max_logprobs: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    """→ 引擎 Request 的 (logprobs, prompt_logprobs)，None = 不要。completions：`logprobs: k`，echo 时提示词也要；
    echo 且 max_tokens 0 时只 prefill，引擎要 prompt_logprobs 才有事可做（没要 logprobs 时按 0 算，响应里不带）。
    chat：`logprobs: true` 与 `top_logprobs: k`（默认 0）。max_logprobs None：服务的引擎不算 logprobs。"""
    if isinstance(req, ChatCompletionRequest):
        name, k, prompt = "top_logprobs", (req.top_logprobs or 0) if req.logprobs else None, None
        if not req.logprobs and req.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        name, k = "logprobs", req.logprobs
        prompt = k if req.echo else None
        if max_tokens == 0 and prompt is None:
            prompt = 0
    if k is not None and k < 0:
        raise APIError(400, f"{name} must be >= 0, got {k}", param=name)
    if max_logprobs is None and (k is not None or prompt is not None):
        which = "logprobs" if k is not None else "max_tokens"
        raise APIError(400, f"{which}: this server's engine does not compute logprobs (serve with --engine step09, "
                            f"step10, step12, step13 or step15)", param=which)
    if k is not None and k > max_logprobs:
        raise APIError(400, f"{name} must be at most {max_logprobs} (the server's --max-logprobs), got {k}", param=name)
    return k, prompt


def engine_inputs(req: _SamplingRequest, prompts: list[list[int]], max_tokens: Optional[int],
                  default_max_tokens, max_logprobs: Optional[int] = None, chunks: Optional[list] = None,
                  structured: Optional[StructuredOutputsParams] = None) -> EngineInputs:
    """max_tokens 为 None 时用 default_max_tokens(prompt_ids)（chat：一直生成到上下文或池子放不下为止）。
    n 个样本的种子是 S, S+1, ..., S+n-1（Request.parallel_samples，与 step06 起 run.py 的 --n 相同），
    所以与引擎直接生成的样本逐 token 相同。max_logprobs：logprobs 的 k 的上限（None = 引擎不算 logprobs）。
    chunks：每个提示词的段标记（chunk_marks 给的；n 个样本共用）。structured：每个请求的约束（structured_output 给的）。"""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(not s for s in stop):
        raise APIError(400, "stop strings must not be empty", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"a stop string can have at most {MAX_STOP_CHARS} characters", param="stop")
    echo = bool(getattr(req, "echo", False))
    if max_tokens is not None and (max_tokens < 0 or (max_tokens == 0 and not echo)):
        raise APIError(400, f"max_tokens must be > 0{' (0 only with echo: true)' if hasattr(req, 'echo') else ''}, "
                            f"got {max_tokens}", param="max_tokens")
    logprobs, prompt_logprobs = logprob_counts(req, max_tokens, max_logprobs)
    params = sampling_params(req)
    requests = []
    for k, ids in enumerate(prompts):
        n_new = max_tokens if max_tokens is not None else default_max_tokens(ids)
        requests += ServedRequest(ids, n_new, params, ignore_eos=req.ignore_eos, stop=stop, logprobs=logprobs,
                                  prompt_logprobs=prompt_logprobs,
                                  include_stop_str_in_output=req.include_stop_str_in_output,
                                  chunks=None if chunks is None else chunks[k],
                                  structured_output=structured).parallel_samples(req.n)
    return EngineInputs(requests, sum(len(ids) for ids in prompts))


# ---------------- 响应 ----------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int] = None) -> dict:
    """cached_tokens None：不带 prompt_tokens_details（continuous_usage_stats 的每个 chunk，同 vLLM）。"""
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    return u if cached_tokens is None else {**u, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(obj) -> str:
    """一个 SSE 事件。ensure_ascii=False：中文按 UTF-8 原样发出，不变成 \\uXXXX。"""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class ResponseShape:
    """chat 与 completions 两个端点在线上只差这几处。"""
    chat: bool
    id: str
    model: str
    created: int
    with_token_ids: bool = False

    @classmethod
    def new(cls, chat: bool, model: str, with_token_ids: bool = False,
            request_id: Optional[str] = None) -> "ResponseShape":
        """request_id：请求体的 request_id（vLLM 的扩展），给了就用它作响应的 id。"""
        prefix = "chatcmpl" if chat else "cmpl"
        rid = f"{prefix}-{request_id}" if request_id else new_id(prefix)
        return cls(chat, rid, model, int(time.time()), with_token_ids)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # 流式
    def role_chunk(self, index: int) -> dict:
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def delta_chunk(self, index: int, text: str, finish_reason: Optional[str], token_ids: list[int],
                    logprobs: Optional[dict] = None) -> dict:
        if self.chat:
            choice = {"index": index, "delta": {"content": text} if text else {}}
        else:
            choice = {"index": index, "text": text}
        extra = {"token_ids": token_ids} if self.with_token_ids else {}
        return self._chunk({**choice, "logprobs": logprobs, "finish_reason": finish_reason, **extra})

    def _chunk(self, choice: dict) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def usage_chunk(self, u: dict) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [], "usage": u}

    # 非流式
    def full(self, texts: list[str], finish_reasons: list[str], u: dict, handle=None, logprobs=None) -> dict:
        """handle：with_token_ids 时从它取每个样本的提示词 / 输出 token 和前缀缓存命中数（num_cached_tokens 是我们的扩展）。
        logprobs：每个 choice 的 logprobs（logprobs.py 的形状），None = 没要。"""
        choices = []
        for i, (t, f) in enumerate(zip(texts, finish_reasons)):
            body = {"message": {"role": "assistant", "content": t}} if self.chat else {"text": t}
            c = {"index": i, **body, "logprobs": logprobs[i] if logprobs else None, "finish_reason": f}
            if self.with_token_ids:
                c.update(prompt_token_ids=handle.requests[i].prompt_ids, token_ids=handle.token_ids[i],
                         num_cached_tokens=handle.cached_tokens[i])
            choices.append(c)
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices, "usage": u}



# ---------------- /tokenize、/detokenize（vLLM 的形状） ----------------

class TokenizeCompletionRequest(_Model):
    """vLLM 的 TokenizeCompletionRequest：prompt 按 /v1/completions 的分法（默认加特殊 token，与那个端点相同）。"""
    model: Optional[StrictStr] = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Model):
    """vLLM 的 TokenizeChatRequest：messages 按 /v1/chat/completions 的分法（对话模板 + 生成提示）。"""
    model: Optional[StrictStr] = None
    messages: list[ChatMessage]
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False   # 最后一条消息不结束，模型接着写它（不能与 add_generation_prompt 同时为真）
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Model):
    model: Optional[StrictStr] = None
    tokens: list[StrictInt]


def parse_tokenize(obj: dict) -> Union[TokenizeCompletionRequest, TokenizeChatRequest]:
    """有 prompt 是一段文本，有 messages 是一段对话；两个都有、都没有都是 400（指名字段），而不是猜一个。"""
    if ("prompt" in obj) == ("messages" in obj):
        raise APIError(400, "give exactly one of `prompt` (a text) or `messages` (a chat)",
                       param="messages" if "prompt" in obj else "prompt")
    req = validate_body(TokenizeChatRequest if "messages" in obj else TokenizeCompletionRequest, obj)
    if isinstance(req, TokenizeChatRequest):
        check_generation_prompt(req)
    return req


def tokenize(tok, req: Union[TokenizeCompletionRequest, TokenizeChatRequest]) -> list[int]:
    """与生成端点交给引擎的 token 相同（默认参数时）：usage.prompt_tokens 就是这里的 count。空文本是 0 个 token。"""
    if isinstance(req, TokenizeChatRequest):
        return encode_chat(tok, req.messages, req.add_generation_prompt, req.continue_final_message,
                           req.add_special_tokens)
    return tok.hf(req.prompt, add_special_tokens=req.add_special_tokens).input_ids


def tokenize_response(tok, ids: list[int], max_model_len: int, with_strs: bool) -> dict:
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": tok.hf.convert_ids_to_tokens(ids) if with_strs else None}


def detokenize(tok, ids: list[int], vocab_size: int) -> str:
    """token id → 文本，特殊 token 照样写出来（/tokenize 的逆：对话模板的标记也回来）。越界的 id 是 400 而不是 500。"""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise APIError(400, f"tokens[{i}] = {t} is not a token id: ids are in [0, {vocab_size})", param="tokens")
    try:
        return tok.hf.decode(ids, skip_special_tokens=False)
    except Exception as e:   # 在模型词表里、分词器却没有的 id（词表补齐的那几行）
        raise APIError(400, f"the tokenizer cannot decode these ids: {e}", param="tokens") from None
