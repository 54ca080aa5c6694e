"""OpenAI 兼容的 HTTP 服务器（FastAPI + uvicorn），挂在 step05 起任何一步的引擎上。

    python -m step11_serving.api_server [--host 127.0.0.1] [--port 8000] [--model DIR] [--api-key KEY]
        [--engine step10] [--max-waiting 64] [那一步的引擎参数：--num-blocks --block-size --max-batch-size ...]
        [--weights f32|q8_0|q4_1] [--activations f32|q8] [--linear auto|plain|packed|ours]   # step14 的权重与内核

端点：POST /v1/chat/completions、POST /v1/completions（流式 SSE 与非流式）、GET /v1/models、GET /v1/models/{id}、
POST /tokenize、POST /detokenize（vLLM 的形状）、GET /health、GET /version、GET /metrics（Prometheus）、GET /（聊天页面）。
API 里的模型名 = 模型目录的名字。每个响应都带 X-Request-Id（客户端给的原样回去，没给就生成一个），日志里用它认出请求。

每个请求的路：读请求体（有上限）→ 检查字段（protocol.py）→ 分词 → AsyncLLMEngine.add（async_engine.py）→
流式：每个 Delta 变成一个 SSE chunk；非流式：收齐再回。无论响应怎样结束（正常、客户端断开、出错、关闭服务器），
都调用 handle.abort()：还没结束的样本被取消，它们的块在引擎的下一步之前就还回池子。
"""
import argparse
import asyncio
import logging
import secrets
import socket
import sys
import time
import uuid
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.errors import UserError

from . import protocol as P
from .async_engine import STALL_S, AsyncLLMEngine, EngineUnavailable, RequestFailed, RequestHandle, ServerBusy
from .logprobs import ChoiceExtras

STATIC = Path(__file__).resolve().parent / "static"
log = logging.getLogger("step11_serving")


@dataclass
class ServerSettings:
    model_name: str               # API 里的模型名（模型目录的名字）
    context_len: int              # 模型的上下文长度
    vocab_size: int               # 直接给 token id 时检查范围用
    pool_tokens: int              # KV 池子一共能放几个 token（num_blocks × block_size）
    api_key: Optional[str] = None
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1        # 503 时告诉客户端多久以后再试
    max_logprobs: Optional[int] = None   # logprobs 的 k 的上限（vLLM 的 max_logprobs）；None = 引擎不算 logprobs
    chunk_marks: bool = False     # 引擎的 add_request 收段标记吗（step13）：completions 的 chunk_separator
    structured_output: bool = False   # 引擎做结构化输出吗（step15）：response_format、structured_outputs


DEFAULT_MAX_LOGPROBS = 20         # 与 vLLM 的 max_logprobs 默认值相同


def settings_for(session, engine, block_size: int, max_logprobs: int = DEFAULT_MAX_LOGPROBS, **kw) -> ServerSettings:
    from .engines import accepts_chunks, accepts_structured_output, computes_logprobs
    return ServerSettings(Path(session.path).name, session.cfg.max_position_embeddings, session.cfg.vocab_size,
                          engine.block_manager.num_blocks * block_size,
                          max_logprobs=max_logprobs if computes_logprobs(engine) else None,
                          chunk_marks=accepts_chunks(engine), structured_output=accepts_structured_output(engine), **kw)


class AbortOnExitStreamingResponse(StreamingResponse):
    """流式响应无论怎样结束（发完、客户端断开被取消、出错、服务器关闭时被取消），最后都取消这个请求剩下的样本。
    放在响应对象上而不只放在生成器的 finally 里：客户端在第一个 chunk 之前就断开时，生成器可能一次都没被启动。"""

    def __init__(self, handle: RequestHandle, content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.handle = handle

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.abort()


MAX_REQUEST_ID_CHARS = 256


class RequestIdMiddleware:
    """X-Request-Id（vLLM 的 --enable-request-id-headers 的做法）：客户端给了就在响应上原样回给它，没给就生成一个
    （uuid4 的 hex）；处理函数从 request.state.request_id 取，交给异步引擎——日志里"这个 HTTP 请求 ↔ 它的引擎请求 id"
    就靠它对上（引擎的 id 仍是 add_request 给的整数）。只收 1～256 个可见 ASCII 字符：它要进日志，太长的、
    带控制字符的是 400 而不是原样写进去。
    写成纯 ASGI 的一层（只在 http.response.start 里加一个头），而不是 @app.middleware("http")：后者把响应整个包一层，
    流式响应与非流式请求的断开检测（until_done_or_disconnect 听的 http.disconnect）都会受影响。"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = Headers(scope=scope).get("x-request-id")
        if rid is None:
            rid = uuid.uuid4().hex
        elif not (0 < len(rid) <= MAX_REQUEST_ID_CHARS and all("!" <= c <= "~" for c in rid)):
            e = P.APIError(400, f"the X-Request-Id header must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII "
                                f"characters (got {len(rid)} characters)", param="X-Request-Id")
            return await error_response(Request(scope), e)(scope, receive, send)
        scope.setdefault("state", {})["request_id"] = rid
        header = (b"x-request-id", rid.encode("ascii"))

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)
        await self.app(scope, receive, send_with_id)


# ---------- 应用：各个处理函数在模块里，从 request.app.state 取这个服务器的引擎、分词器与设置 ----------

def build_app(aengine: AsyncLLMEngine, tok, s: ServerSettings) -> FastAPI:
    app = FastAPI(title="llm-from-scratch step11", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.aengine, app.state.metrics, app.state.settings = aengine, aengine.metrics, s
    app.state.tok, app.state.started = tok, int(time.time())
    app.add_exception_handler(P.APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)
    app.add_middleware(RequestIdMiddleware)
    aengine.metrics.name_model(s.model_name)      # vllm:* 指标的 model_name 标签
    app.include_router(v1)
    app.include_router(keyed)
    app.include_router(plain)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    aengine = app.state.aengine
    await aengine.start()
    yield
    app.state.clean_shutdown = await aengine.shutdown()    # uvicorn 已停止接收、等过了进行中的响应
    log.info("engine stopped; every KV block free: %s", app.state.clean_shutdown)


# ---------- 错误：一律 OpenAI 形状的 JSON，不带 traceback ----------
def error_response(request: Request, e: P.APIError) -> JSONResponse:
    request.app.state.metrics.rejected.labels(str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def api_error(request: Request, e: P.APIError):
    return error_response(request, e)


async def http_error(request: Request, e: StarletteHTTPException):     # 不存在的路径 404、方法不对 405
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
    return error_response(request, P.APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind))


async def validation_error(request: Request, e: RequestValidationError):
    return error_response(request, P.APIError(400, str(e.errors()[0].get("msg", e))))


async def internal_error(request: Request, e: Exception):
    log.exception("internal error in %s %s", request.method, request.url.path)
    return error_response(request, P.APIError(500, f"internal server error: {type(e).__name__}", "server_error"))


# ---------- 鉴权与请求体 ----------
async def require_api_key(request: Request) -> None:
    key = request.app.state.settings.api_key
    if key is None:
        return
    auth = request.headers.get("authorization", "")
    if not secrets.compare_digest(auth.encode(), f"Bearer {key}".encode()):   # 比较时间与内容无关
        raise P.APIError(401, "invalid or missing API key (send `Authorization: Bearer KEY`)", "authentication_error",
                         headers={"WWW-Authenticate": "Bearer"})


async def read_json(request: Request) -> dict:
    """请求体有上限：先看 Content-Length，再边读边数（分块上传没有 Content-Length）。"""
    limit = request.app.state.settings.max_body_bytes
    too_big = P.APIError(413, f"request body is larger than {limit} bytes")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    return P.parse_json(bytes(body))


def check_model(s: ServerSettings, name: Optional[str]) -> None:
    if name is not None and name != s.model_name:
        raise P.APIError(404, f"the model `{name}` does not exist (this server serves `{s.model_name}`)",
                         "not_found_error", param="model")


def default_max_tokens(s: ServerSettings, ids: list[int]) -> int:
    """chat 不给 max_tokens：一直生成到上下文用完（vLLM 的做法），但不超过池子一个请求最多能放的。"""
    return max(1, min(s.context_len, s.pool_tokens) - len(ids))


# ---------- 提交给异步引擎，返回流式或完整的响应 ----------
async def submit(request: Request, req, inputs: P.EngineInputs, chat: bool, num_prompts: int, arrival: float,
                 echo: Optional[list[str]] = None):
    """echo：completions 的 echo 时每个提示词的文本（choice i 用第 i // n 个）。"""
    aengine, s = request.app.state.aengine, request.app.state.settings
    try:
        handle = await aengine.add(inputs.requests, arrival, request.state.request_id)
    except UserError as e:                      # 引擎的检查：超出上下文、池子放不下、采样参数……
        raise P.APIError(400, str(e)) from None
    except ServerBusy as e:
        raise P.APIError(503, str(e), "server_busy", headers={"Retry-After": str(s.retry_after_s)}) from None
    except EngineUnavailable as e:
        raise P.APIError(503, str(e), "server_error") from None
    shape = P.ResponseShape.new(chat, s.model_name, req.return_token_ids, req.request_id)
    n = req.n
    wants_logprobs = req.logprobs is True if chat else req.logprobs is not None   # completions 的 logprobs: 0 也算
    extras = ChoiceExtras(request.app.state.tok, chat, wants_logprobs, [r.prompt_ids for r in inputs.requests],
                          None if echo is None else [echo[i // n] for i in range(len(inputs.requests))])

    def usage() -> dict:
        cached = sum(handle.cached_tokens[p * n] for p in range(num_prompts))   # 每个提示词的第一个样本
        return P.usage(inputs.prompt_tokens, sum(map(len, handle.token_ids)), cached)

    if req.stream:
        include_usage, continuous = P.stream_usage(req)
        return AbortOnExitStreamingResponse(handle, sse_stream(handle, shape, include_usage, usage, extras, continuous))
    try:
        texts, reasons = await until_done_or_disconnect(request, collect(handle, extras))
    finally:
        handle.abort()
    if texts is None:                           # 客户端已经走了：这个响应没人收
        return Response(status_code=499)
    logprobs = None
    if extras.active:                           # echo 的提示词、logprobs
        texts, logprobs = map(list, zip(*(extras.full(i, t) for i, t in enumerate(texts))))
    return JSONResponse(shape.full(texts, reasons, usage(), handle, logprobs if wants_logprobs else None))


v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])    # 要 API key 的端点
keyed = APIRouter(dependencies=[Depends(require_api_key)])              # 也要、但不在 /v1 下的：vLLM 的 /tokenize、/detokenize
plain = APIRouter()                                                      # 不要的：健康检查、版本、指标、页面


@v1.post("/chat/completions")
async def chat_completions(request: Request):
    arrival = time.perf_counter()
    s = request.app.state.settings
    req = P.parse_request(P.ChatCompletionRequest, await read_json(request), s.structured_output)
    check_model(s, req.model)
    structured = P.structured_output(req, s.structured_output)
    P.chunk_marks(req, request.app.state.tok, s.chunk_marks)          # 给了 chunk_separator：400，说明为什么
    ids = await asyncio.to_thread(P.encode_chat, request.app.state.tok, req.messages,   # 模板与分词不占事件循环
                                  req.add_generation_prompt, req.continue_final_message, req.add_special_tokens,
                                  req.documents, req.chat_template_kwargs)
    prompts = P.truncate_prompts(req, [ids], s.context_len)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    inputs = P.engine_inputs(req, prompts, max_tokens, lambda ids: default_max_tokens(s, ids), s.max_logprobs,
                             structured=structured)
    return await submit(request, req, inputs, True, 1, arrival)


@v1.post("/completions")
async def completions(request: Request):
    arrival = time.perf_counter()
    s = request.app.state.settings
    req = P.parse_request(P.CompletionRequest, await read_json(request), s.structured_output)
    check_model(s, req.model)
    structured = P.structured_output(req, s.structured_output)
    marked = await asyncio.to_thread(P.chunk_marks, req, request.app.state.tok, s.chunk_marks)   # step13 的段标记
    if marked is not None:
        prompts, chunks = marked
    else:
        try:
            prompts = await asyncio.to_thread(P.encode_prompts, request.app.state.tok, req.prompt, s.vocab_size,
                                              req.add_special_tokens)
        except UserError as e:
            raise P.APIError(400, str(e), param="prompt") from None
        chunks = None
    prompts = P.truncate_prompts(req, prompts, s.context_len)
    max_tokens = req.max_tokens if req.max_tokens is not None else P.COMPLETIONS_DEFAULT_MAX_TOKENS
    inputs = P.engine_inputs(req, prompts, max_tokens, lambda ids: default_max_tokens(s, ids), s.max_logprobs,
                             chunks, structured)
    echo = None
    if req.echo:   # 字符串提示词原样带回（与 OpenAI、vLLM 相同），token id 的提示词带回它的解码
        raw = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt
        echo = [r if isinstance(r, str) else request.app.state.tok.decode(ids) for r, ids in zip(raw, prompts)]
    return await submit(request, req, inputs, False, len(prompts), arrival, echo)


def model_card(request: Request) -> dict:
    s = request.app.state.settings
    return {"id": s.model_name, "object": "model", "created": request.app.state.started,
            "owned_by": "llm-from-scratch", "max_model_len": s.context_len}


@v1.get("/models")
async def models(request: Request):
    return {"object": "list", "data": [model_card(request)]}


@v1.get("/models/{model_id:path}")
async def model(request: Request, model_id: str):
    """OpenAI 的"取一个模型"：只有这一个模型，别的名字 404（与生成端点的模型名不对同一句话）。"""
    check_model(request.app.state.settings, model_id)
    return model_card(request)


@keyed.post("/tokenize")
async def tokenize(request: Request):
    """vLLM 的 /tokenize：{"prompt": 文本} 或 {"messages": 对话} → {"count", "max_model_len", "tokens", "token_strs"}。
    默认参数时 tokens 就是生成端点交给引擎的那些（count = 那次请求的 usage.prompt_tokens）。"""
    s, tok = request.app.state.settings, request.app.state.tok
    req = P.parse_tokenize(await read_json(request))
    check_model(s, req.model)
    ids = await asyncio.to_thread(P.tokenize, tok, req)      # 长文本的分词不占事件循环
    return P.tokenize_response(tok, ids, s.context_len, req.return_token_strs)


@keyed.post("/detokenize")
async def detokenize(request: Request):
    """vLLM 的 /detokenize：{"tokens": [id, ...]} → {"prompt": 文本}。"""
    s = request.app.state.settings
    req = P.validate_body(P.DetokenizeRequest, await read_json(request))
    check_model(s, req.model)
    return {"prompt": await asyncio.to_thread(P.detokenize, request.app.state.tok, req.tokens, s.vocab_size)}


@plain.get("/version")
async def version(request: Request):
    """vLLM 的 /version 回 {"version": vLLM 的版本}；我们没有发布版本号：version 是这一章，engine 是挂着的那一步的引擎。"""
    return {"version": "step11", "engine": type(request.app.state.aengine.engine).__module__.partition(".")[0]}


@plain.get("/health")
async def health(request: Request):
    """200 = 能服务。503：引擎死了（进程马上退出）、正在关闭、或引擎一步卡住超过 stall_s 秒——supervisor 据此重启。"""
    problem = request.app.state.aengine.health_problem()
    if problem is None:
        return {"status": "ok"}
    return JSONResponse({"status": "unavailable", "error": problem}, status_code=503)


@plain.get("/metrics")
async def metrics_endpoint(request: Request):
    m = request.app.state.metrics
    return Response(m.render(), media_type=m.content_type)


@plain.get("/")
async def index():
    return FileResponse(STATIC / "index.html")


async def sse_stream(handle: RequestHandle, shape: P.ResponseShape, include_usage: bool, usage,
                     extras: Optional[ChoiceExtras] = None, continuous: bool = False):
    """Delta → SSE chunk。chat 每个样本先发一个只有 role 的 chunk（它的第一个输出到来时，与 vLLM 相同）；
    没有新文本、也没结束的 Delta（例如一个汉字只到了一半）不发，除非客户端要了 token id 或 logprobs。
    extras：echo 的提示词在每个样本的第一个 chunk 里；logprobs 跟着各自的 token。
    include_usage：每个 chunk 的 usage 是 null，最后一个 chunk 带总数；continuous（vLLM 的 continuous_usage_stats）：
    每个 chunk 的 usage 是这个样本的提示词与它到此为止生成的 token 数（role chunk 是 0；没发的 Delta 的 token 也算进去）。"""
    done = [0] * len(handle.requests)          # 每个样本已经生成的 token（从交出来的 Delta 数，不读引擎那一侧）

    def extra(i: int) -> dict:
        if continuous:
            return {"usage": P.usage(len(handle.requests[i].prompt_ids), done[i])}
        return {"usage": None} if include_usage else {}
    started = set()
    try:
        async for d in handle.deltas():
            if shape.chat and d.index not in started:
                started.add(d.index)
                yield P.sse({**shape.role_chunk(d.index), **extra(d.index)})
            done[d.index] += len(d.token_ids)
            text, lps = extras.chunk(d) if extras is not None and extras.active else (d.text, None)
            if (text or d.finish_reason or (shape.with_token_ids and d.token_ids)   # 要 token id 时一个也不能少
                    or (lps is not None and (d.logprobs or d.prompt_logprobs))):  # logprobs 也是
                yield P.sse({**shape.delta_chunk(d.index, text, d.finish_reason, d.token_ids, lps),
                             **extra(d.index)})
        if include_usage:
            yield P.sse(shape.usage_chunk(usage()))
    except (EngineUnavailable, RequestFailed) as e:   # 响应头已经发出，只能在流里报错（vLLM 也这样）
        yield P.sse(error_for(e).body())
    yield P.sse("[DONE]")


def error_for(e: Exception) -> P.APIError:
    """引擎死了 / 正在关闭 → 503；只是这个请求失败了 → 500（服务器照常服务别的请求）。"""
    if isinstance(e, RequestFailed):
        return P.APIError(500, f"this request failed: {e}", "server_error")
    return P.APIError(503, str(e), "server_error")


async def collect(handle: RequestHandle, extras: Optional[ChoiceExtras] = None):
    texts, reasons = [""] * len(handle.requests), [None] * len(handle.requests)
    try:
        async for d in handle.deltas():
            texts[d.index] += d.text
            reasons[d.index] = d.finish_reason or reasons[d.index]
            if extras is not None:
                extras.add(d)
    except (EngineUnavailable, RequestFailed) as e:
        raise error_for(e) from None
    return texts, reasons


async def until_done_or_disconnect(request: Request, work):
    """非流式请求也要发现客户端断开（否则它走了，引擎还替它生成到 max_tokens）：同时等结果和 http.disconnect，
    先来的那个赢。断开时返回 (None, None)。"""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    done_task, listen = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({done_task, listen}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (done_task, listen):
            if not t.done():
                t.cancel()
    if done_task.done() and not done_task.cancelled():
        return done_task.result()
    return None, None


# ---------------- 运行服务器 ----------------

def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn 的优雅关闭（停止接收 → 等进行中的响应最多 timeout_graceful_shutdown 秒 → 取消剩下的任务）中间
    加一步：宽限期到了先在引擎里取消还没完的请求，让它们的客户端收到 finish_reason "abort" 和 [DONE]
    （最多再等 FLUSH_S 秒把这最后的 chunk 发出去），uvicorn 再取消仍没结束的。"""
    FLUSH_S = 2.0

    def __init__(self, app: FastAPI, shutdown_timeout: float, **kw):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=shutdown_timeout + self.FLUSH_S, **kw))
        self.aengine, self.grace = app.state.aengine, shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        async def abort_after_grace():
            await asyncio.sleep(self.grace)
            self.aengine.abort_all()
        drain = asyncio.create_task(abort_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()


def make_parser() -> argparse.ArgumentParser:
    from common.cli import Parser, add_linear_arg, positive_int
    from .engines import DEFAULT_ENGINE, ENGINES, add_weight_args
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="默认只听本机；0.0.0.0 会对整个网络开放（配合 --api-key）")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="本地 HF 目录；默认 SmolLM2-135M-Instruct")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add_linear_arg(p)
    add_weight_args(p)
    p.add_argument("--api-key", default=None, help="给了就要求 Authorization: Bearer KEY（/v1 下的端点）")
    p.add_argument("--engine", default=DEFAULT_ENGINE, choices=list(ENGINES), help=f"服务哪一步的引擎（默认 {DEFAULT_ENGINE}）")
    p.add_argument("--max-waiting", type=positive_int, default=64, help="排队（还没进批）的请求上限，超过回 503")
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, help="请求体上限（字节），超过回 413")
    p.add_argument("--max-logprobs", type=positive_int, default=DEFAULT_MAX_LOGPROBS,
                   help=f"logprobs / top_logprobs 的 k 至多多少（默认 {DEFAULT_MAX_LOGPROBS}，同 vLLM），超过回 400")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, help="关闭时最多等进行中的响应几秒，之后取消它们")
    p.add_argument("--stall-timeout", type=float, default=STALL_S,
                   help="引擎的一步超过这么多秒还没完成，/health 就回 503（让 supervisor 重启卡住的进程）")
    from perf.compiled_decode import add_compile_arg
    add_compile_arg(p, "decode 步用编译好的图（每个批大小桶一张，开始服务前先编译）；只用于一个进程（不和 --tp/--pp 一起）")
    return p


def refuse_bad_combinations(args) -> None:
    """在加载模型、起 worker 之前检查：编译的是一个进程里的 decode；step14 的权重（--weights、--linear ours）
    不和 --compile、--tp/--pp 一起（engines.check_weight_args，规则同 step14 的 run.py）。"""
    from .engines import check_weight_args
    if args.compile is not None and getattr(args, "tp", 1) * getattr(args, "pp", 1) > 1:
        raise UserError("--compile compiles one process's decode: drop --tp/--pp")
    check_weight_args(args)


def main(argv=None) -> None:
    from common.openmp import release_thread_pool
    from perf.compiled_decode import compile_if_asked
    from .engines import DEFAULT_ENGINE, SLIDING_WINDOW_ENGINES, add_engine_args, open_serving_session, serving_engine
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine", default=DEFAULT_ENGINE)
    with ExitStack() as stack:                  # step10 的 --tp/--pp：退出时先停引擎，再收掉 worker 进程
        try:
            parser = make_parser()
            add_engine_args(parser, pre.parse_known_args(argv)[0].engine)   # 参数随 --engine 而不同
            args = parser.parse_args(argv)
            refuse_bad_combinations(args)
            session, weights = open_serving_session(args, sliding_window=args.engine in SLIDING_WINDOW_ENGINES)
            engine = stack.enter_context(serving_engine(args.engine, session, args))
            compile_if_asked(args, engine)     # 开始服务之前编译好每个桶：第一个请求不等编译
            sock = bind(args.host, args.port)
        except UserError as e:
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
            sys.exit(2)
        aengine = AsyncLLMEngine(engine, session.tok, args.max_waiting, stall_s=args.stall_timeout)
        settings = settings_for(session, engine, args.block_size, api_key=args.api_key,
                                max_body_bytes=args.max_body_bytes, max_logprobs=args.max_logprobs)
        app = build_app(aengine, session.tok, settings)
        logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
        if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
            log.warning("listening on %s without --api-key: anyone who can reach this address can use the model",
                        args.host)
        print(f"{settings.model_name}（权重 {'float32' if weights is None else weights + '，step14 的内核'}）用 {args.engine} 的引擎，"
              f"听 http://{args.host}:{sock.getsockname()[1]}（聊天页面就在这个地址；Ctrl-C 优雅关闭）", flush=True)
        # 主线程加载模型时建了自己的 OpenMP 线程池，之后只跑事件循环；不还掉它，引擎线程的池再加进来，libgomp 见线程
        # 比 CPU 多就不再忙等，每个并行区都要睡下 / 叫醒一次，空闲机器上一步慢 1.4–1.7 倍（common/openmp.py，docs/11 第 10 节）
        release_thread_pool()
        code = serve(app, sock, args.shutdown_timeout)
    if code:
        sys.exit(code)


def serve(app: FastAPI, sock: socket.socket, shutdown_timeout: float) -> int:
    """在前台跑 uvicorn 直到 Ctrl-C（返回 0）或引擎死了（返回 1：每个在等的请求都已收到错误，
    进程以非零码退出，由 supervisor 重启——与 vLLM 的 EngineDeadError 相同，不留一个只会回 503 的进程）。"""
    server = DrainingServer(app, shutdown_timeout)
    aengine = app.state.aengine

    def engine_dead(error: BaseException) -> None:
        log.critical("the engine is dead (%s: %s): exiting so that a supervisor restarts the server",
                     type(error).__name__, error)
        server.should_exit = True
    aengine.on_dead = engine_dead
    server.run(sockets=[sock])
    return 1 if aengine.error is not None else 0

if __name__ == "__main__":
    main()
