"""对照组账本：step04 静态批处理在同一负载上的逐请求时间、KV 浪费和（同样内存预算下的）并发数。

step04 的引擎只返回输出和汇总统计，这里从外面量：给模型包一层、记下每次前向结束的时刻。
静态批里每一批的第 j 次前向产生每个未结束行的第 j 个 token，所以由各行的输出长度就能还原
每个请求的首 token 时间和结束时间。
"""
import time


class ForwardClock:
    """包住模型：照常前向，另外记下每次前向结束的时刻（秒，相对 start()）。其余属性（cfg、device…）原样转发。"""

    def __init__(self, model):
        self.model = model
        self.times: list[float] = []
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.times, self.t0 = [], time.perf_counter()

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.times.append(time.perf_counter() - self.t0)
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def static_timings(outputs: list[list[int]], max_batch_size: int, times: list[float]):
    """step04 的每批前向次数 = 这批最长的输出（prefill 出第 1 个 token，之后每次 decode 出 1 个）。
    返回 (ttft, tpot)：每个请求的首 token 时间；生成 ≥ 2 个 token 的请求的平均每 token 时间。"""
    batches = [outputs[i:i + max_batch_size] for i in range(0, len(outputs), max_batch_size)]
    expected = sum(max(len(out) for out in batch) for batch in batches)
    if expected != len(times):
        raise RuntimeError(f"expected {expected} forwards from the output lengths, the clock saw {len(times)}")
    ttft, tpot, base = [], [], 0
    for batch in batches:
        for out in batch:
            first, last = times[base], times[base + len(out) - 1]
            ttft.append(first)
            if len(out) > 1:
                tpot.append((last - first) / (len(out) - 1))
        base += max(len(out) for out in batch)
    return ttft, tpot


def static_kv_waste(prompts: list[list[int]], max_new: list[int], outputs: list[list[int]],
                    max_batch_size: int) -> float:
    """与 step05 同一个定义：每次前向后采样 (预留槽 − 存着真实 token 的槽) ÷ 预留槽，按槽数加权平均。
    step04 每批预留 B × (P + max(max_new) - 1)；第 j 次前向后第 r 行存着 p_r + min(j, n_r) - 1 个真实 token
    （已结束的行还在陪跑、往缓存里写，但写的不是它的 token）。"""
    reserved = used = 0
    for i in range(0, len(outputs), max_batch_size):
        ps, ns = prompts[i:i + max_batch_size], [len(o) for o in outputs[i:i + max_batch_size]]
        B, P = len(ps), max(len(p) for p in ps)
        max_len = P + max(max_new[i:i + max_batch_size]) - 1
        for j in range(1, max(ns) + 1):
            reserved += B * max_len
            used += sum(len(p) + min(j, n) - 1 for p, n in zip(ps, ns))
    return 1 - used / reserved


def static_peak_concurrency(prompts: list[list[int]], max_new: list[int], budget_slots: int) -> int:
    """同样 budget_slots 个 KV 槽，step04 式的连续预留最多能让几个请求同时跑：按到达顺序装批，
    一批 B 行要预留 B × (最长提示词 + 最大 max_new - 1) 个槽，装不下下一个就开新批。返回最大的一批。"""
    peak, batch_p, batch_n, count = 0, 0, 0, 0
    for p, n in zip(prompts, max_new):
        P, N = max(batch_p, len(p)), max(batch_n, n)
        if count and (count + 1) * (P + N - 1) > budget_slots:
            peak, batch_p, batch_n, count = max(peak, count), 0, 0, 0
            P, N = len(p), n
        if P + N - 1 > budget_slots:
            raise ValueError(f"a request needs {P + N - 1} slots, budget is {budget_slots}")
        batch_p, batch_n, count = P, N, count + 1
    return max(peak, count)
