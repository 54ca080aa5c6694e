"""GET /metrics：Prometheus 文本格式（prometheus-client），名字与含义仿 vLLM 的 `vllm:*` 指标。

状态类（gauge）每一步之后由引擎循环记一次快照（引擎不是线程安全的，抓取 /metrics 的请求不去碰它）；
计数和直方图在请求结束时记。每个服务器一个 CollectorRegistry：同一进程里起几个服务器（测试）互不干扰。
"""
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)

disable_created_metrics()   # 不要每个计数器旁边的 *_created 时间戳（vLLM 也关掉了它们）

# 秒；CPU 上的小模型 TTFT 从几毫秒（短提示词、空闲）到几秒（长提示词、排队）
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("llm_num_requests_running", "requests in the engine's running batch", registry=r)
        self.waiting = Gauge("llm_num_requests_waiting", "requests waiting to be admitted (engine queue + not yet added)",
                             registry=r)
        self.kv_blocks_total = Gauge("llm_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.kv_blocks_used = Gauge("llm_kv_blocks_used", "KV blocks that cannot be handed out now", registry=r)
        self.kv_usage = Gauge("llm_kv_cache_usage_ratio", "used / total KV blocks", registry=r)
        self.prompt_tokens = Counter("llm_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("llm_generation_tokens", "tokens generated", registry=r)
        self.prefix_cache_queries = Counter("llm_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                            registry=r)
        self.prefix_cache_hits = Counter("llm_prefix_cache_hits", "prompt tokens served from the prefix cache",
                                         registry=r)
        self.prefix_cache_hit_rate = Gauge("llm_prefix_cache_hit_rate", "hits / queries since start", registry=r)
        self.requests = Counter("llm_requests", "finished requests by finish reason", ["finish_reason"], registry=r)
        self.rejected = Counter("llm_requests_rejected", "HTTP requests answered with an error", ["status"],
                                registry=r)
        self.ttft = Histogram("llm_time_to_first_token_seconds", "HTTP arrival to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("llm_time_per_output_token_seconds", "(finish - first token) / (tokens - 1)",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("llm_e2e_request_latency_seconds", "HTTP arrival to finish", buckets=TTFT_BUCKETS,
                             registry=r)
        self._queries = self._hits = 0    # 命中率 gauge 用（Counter 的当前值没有公开的读法）

    def snapshot(self, running: int, waiting: int, blocks_total: int, blocks_free: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_blocks_total.set(blocks_total)
        self.kv_blocks_used.set(blocks_total - blocks_free)
        self.kv_usage.set((blocks_total - blocks_free) / blocks_total if blocks_total else 0.0)

    def request_finished(self, finish_reason: str, prompt_len: int, cached: int, num_tokens: int,
                         arrival: float, first_token: float | None, finish: float) -> None:
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_len)
        self.generation_tokens.inc(num_tokens)
        if first_token is None:           # 还没出第一个 token 就被取消：没有 TTFT，也没查过前缀缓存
            return
        self.prefix_cache_queries.inc(prompt_len)
        self.prefix_cache_hits.inc(cached)
        self._queries += prompt_len
        self._hits += cached
        self.prefix_cache_hit_rate.set(self._hits / self._queries)
        self.ttft.observe(first_token - arrival)
        self.e2e.observe(finish - arrival)
        if num_tokens > 1:
            self.tpot.observe((finish - first_token) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
