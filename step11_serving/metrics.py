"""GET /metrics：Prometheus 文本格式（prometheus-client）。两组名字：

- `llm_*`：这个服务器一开始就有的那一组（测试、bench_serving.py、文档都读它们），名字与含义不变；
- `vllm:*`：vLLM 的仪表盘（Grafana）读的那一组，名字、类型、标签（model_name、engine）与 vLLM 的
  vllm/v1/metrics/loggers.py 相同，含义相同的才用 vLLM 的名字；哪些对得上、哪些是我们自己的，见第 11 章第 7 节的表。

状态类（gauge）每一步之后由引擎循环记一次快照（引擎不是线程安全的，抓取 /metrics 的请求不去碰它）；
`llm_*` 的计数和直方图在请求结束时记；`vllm:*` 的 token 计数、首 token、token 间隔像 vLLM 一样每一步记，
排队 / prefill / decode 等请求级的时长在请求结束时记。每个服务器一个 CollectorRegistry：同一进程里起几个服务器（测试）互不干扰。
"""
from dataclasses import dataclass
from typing import Optional

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)

disable_created_metrics()   # 不要每个计数器旁边的 *_created 时间戳（vLLM 也关掉了它们）

# 秒；CPU 上的小模型 TTFT 从几毫秒（短提示词、空闲）到几秒（长提示词、排队）
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# vllm:* 的请求级时长（首 token、排队、prefill、decode、端到端）：从毫秒一直到一小时——CPU 上一个长回答、
# 或者在满载的队列里排着，几分钟很平常；最后一个桶之外只剩 +Inf，分位数就看不出来了
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
                   600.0, 1200.0, 1800.0, 3600.0)
ITL_BUCKETS = TPOT_BUCKETS + (5.0, 10.0, 30.0, 60.0)   # 相邻两步之间：被一个长 prefill 挡住时也会到几秒
# step15 一步里算掩码 + 铺到 logits 上：缓存命中时几十微秒到毫秒（批 8），第一次到达一个稠密的状态时几毫秒，机器忙时几十毫秒
MASK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
FINISH_REASONS = ("stop", "length", "abort", "error")  # 预先建好这几个标签：没出现过的原因也显示 0（vLLM 同样）


@dataclass
class RequestTimes:
    """一个引擎请求的几个时刻（time.perf_counter() 的读数，秒），请求结束时交给 ServerMetrics.vllm_finished。
    与 vLLM 的 RequestStateStats 相同的划分：排队 = 加进引擎 → 第一次被调度；prefill = 第一次被调度 → 第一个 token；
    decode = 第一个 token → 最后一个 token；端到端 = HTTP 请求到达 → 结束。"""
    arrival: float                      # HTTP 请求到达
    added: Optional[float] = None       # 引擎循环把它交给 engine.add_request
    scheduled: Optional[float] = None   # 第一次进入批的那一步开始的时刻
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    num_tokens: int = 0                 # 发给客户端的 token 数


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = ""):
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
        # step15 的结构化输出（别的引擎恒为 0）：引擎的 structured_stats 的增量，引擎循环在两步之间读
        self.mask_seconds = Histogram("llm_structured_output_mask_seconds",
                                      "per engine step with grammar masks: time to fill the masks (first visits of a "
                                      "grammar state included) and apply them to the logits", buckets=MASK_BUCKETS,
                                      registry=r)
        self.masked_rows = Counter("llm_structured_output_masked_rows", "logits rows masked by a grammar", registry=r)
        self.jump_forward_tokens = Counter("llm_structured_output_jump_forward_tokens",
                                           "tokens appended by jump-forward instead of being sampled", registry=r)
        self._queries = self._hits = 0    # 命中率 gauge 用（Counter 的当前值没有公开的读法）
        self.vllm = VllmMetrics(r, model_name)

    def name_model(self, model_name: str) -> None:
        """vLLM 的指标带 model_name 标签（仪表盘按它筛选）：服务器知道模型名之后（build_app）换上。"""
        self.vllm.unregister()
        self.vllm = VllmMetrics(self.registry, model_name)

    def snapshot(self, running: int, waiting: int, blocks_total: int, blocks_free: int) -> None:
        usage = (blocks_total - blocks_free) / blocks_total if blocks_total else 0.0
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_blocks_total.set(blocks_total)
        self.kv_blocks_used.set(blocks_total - blocks_free)
        self.kv_usage.set(usage)
        v = self.vllm
        v.running.set(running)
        v.waiting.set(waiting)
        v.kv_usage.set(usage)
        v.gpu_cache_usage.set(usage)

    def structured_step(self, mask_steps: int, mask_seconds: float, masked_rows: int, jump_tokens: int) -> None:
        """step15 引擎这一步的结构化输出：铺了几次掩码（一步至多一次）、花了多久、几行、jump-forward 追加了几个 token。"""
        for _ in range(mask_steps):
            self.mask_seconds.observe(mask_seconds / mask_steps)
        self.masked_rows.inc(masked_rows)
        self.jump_forward_tokens.inc(jump_tokens)

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

    # ---- vllm:*，引擎循环在两步之间调用 ----
    def vllm_tokens(self, num_tokens: int, ttft: Optional[float], itl: Optional[float],
                    prompt_len: int = 0, cached: int = 0) -> None:
        """一个请求这一步发出了 num_tokens 个 token。第一次（ttft 不是 None）：它的提示词算作处理过了（vLLM 同样在
        第一个 token 出来时计 prompt_tokens 与前缀缓存的查询 / 命中）；之后每一步一个 token 间隔（投机解码一步出几个
        token 也只记一个间隔，与 vLLM 相同）。"""
        v = self.vllm
        v.generation_tokens.inc(num_tokens)
        if ttft is not None:
            v.prompt_tokens.inc(prompt_len)
            v.prefix_cache_queries.inc(prompt_len)
            v.prefix_cache_hits.inc(cached)
            v.ttft.observe(ttft)
        if itl is not None:
            v.itl.observe(itl)
            v.tpot_old.observe(itl)

    def vllm_engine_counts(self, preemptions: int, drafts: int = 0, draft_tokens: int = 0, accepted: int = 0) -> None:
        """引擎这一步的增量：抢占次数、投机解码的验证次数 / 猜测 token / 被接受的 token。"""
        v = self.vllm
        v.preemptions.inc(preemptions)
        v.spec_drafts.inc(drafts)
        v.spec_draft_tokens.inc(draft_tokens)
        v.spec_accepted.inc(accepted)

    def vllm_finished(self, finish_reason: str, t: RequestTimes, finish: float) -> None:
        v = self.vllm
        v.success.labels(v.model_name, "0", finish_reason).inc()
        v.e2e.observe(finish - t.arrival)
        if t.scheduled is None:          # 排队时就结束了（取消）：没有排队完的时间，也没有 prefill / decode
            return
        v.queue.observe(t.scheduled - t.added)
        if t.first_token is None:
            return
        v.prefill.observe(t.first_token - t.scheduled)
        v.decode.observe(t.last_token - t.first_token)
        v.inference.observe(t.last_token - t.scheduled)
        if t.num_tokens > 1:
            v.request_tpot.observe((t.last_token - t.first_token) / (t.num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VllmMetrics:
    """名字、类型、标签与 vLLM（vllm/v1/metrics/loggers.py、vllm/v1/spec_decode/metrics.py）相同的那一组。
    Counter 的名字不带 _total：prometheus-client 在输出时加上（vllm:prompt_tokens → vllm:prompt_tokens_total）。
    只有一个引擎：engine 标签恒为 "0"。"""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.registry, self.model_name, self._families = registry, model_name, []
        self.running = self._make(Gauge, "vllm:num_requests_running", "Number of requests in the running batch.")
        self.waiting = self._make(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = self._make(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage = self._make(Gauge, "vllm:gpu_cache_usage_perc",   # vLLM 0.9 之前的名字，旧仪表盘读它
                                          "KV-cache usage (the name before vLLM 0.9; same value).")
        self.preemptions = self._make(Counter, "vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = self._make(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._make(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_cache_queries = self._make(Counter, "vllm:prefix_cache_queries",
                                               "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = self._make(Counter, "vllm:prefix_cache_hits",
                                            "Prefix cache hits, in terms of number of cached tokens.")
        success = Counter("vllm:request_success", "Count of finished requests by finish reason.",
                          ["model_name", "engine", "finished_reason"], registry=registry)
        self._families.append(success)
        for reason in FINISH_REASONS:
            success.labels(model_name, "0", reason)
        self.success = success
        self.ttft = self._make(Histogram, "vllm:time_to_first_token_seconds", "Time to first token in seconds.",
                               buckets=REQUEST_BUCKETS)
        self.itl = self._make(Histogram, "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.",
                              buckets=ITL_BUCKETS)
        self.tpot_old = self._make(Histogram, "vllm:time_per_output_token_seconds",   # vLLM 0.11 之前 ITL 的名字
                                   "Inter-token latency in seconds (the name before vLLM 0.11; same values).",
                                   buckets=ITL_BUCKETS)
        self.request_tpot = self._make(Histogram, "vllm:request_time_per_output_token_seconds",
                                       "Per request: decode time / (generated tokens - 1).", buckets=ITL_BUCKETS)
        self.e2e = self._make(Histogram, "vllm:e2e_request_latency_seconds", "End to end request latency in seconds.",
                              buckets=REQUEST_BUCKETS)
        self.queue = self._make(Histogram, "vllm:request_queue_time_seconds",
                                "Time from entering the engine to first being scheduled.", buckets=REQUEST_BUCKETS)
        self.prefill = self._make(Histogram, "vllm:request_prefill_time_seconds",
                                  "Time from first being scheduled to the first token.", buckets=REQUEST_BUCKETS)
        self.decode = self._make(Histogram, "vllm:request_decode_time_seconds",
                                 "Time from the first token to the last token.", buckets=REQUEST_BUCKETS)
        self.inference = self._make(Histogram, "vllm:request_inference_time_seconds",
                                    "Time from first being scheduled to the last token.", buckets=REQUEST_BUCKETS)
        self.spec_drafts = self._make(Counter, "vllm:spec_decode_num_drafts",
                                      "Number of speculative verifications (one per request per step with guesses).")
        self.spec_draft_tokens = self._make(Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = self._make(Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")

    def _make(self, cls, name: str, doc: str, **kw):
        family = cls(name, doc, ["model_name", "engine"], registry=self.registry, **kw)
        self._families.append(family)
        return family.labels(self.model_name, "0")

    def unregister(self) -> None:
        for family in self._families:
            self.registry.unregister(family)
