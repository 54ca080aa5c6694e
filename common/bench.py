"""基准工具：计时取中位数、内存带宽、机器描述、表格。基准只测量，不做断言。"""
import os
import platform
import statistics
import time

import torch


def sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def median_time(fn, repeats: int = 3, warmup: int = 1, device="cpu") -> float:
    """先预热 warmup 次，再跑 repeats 次，返回耗时中位数（秒）。"""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def memory_bandwidth(device="cpu", mib: int = 512, repeats: int = 5) -> float:
    """读带宽（字节/秒）：对一个远大于缓存的张量求和，每次都要把它从内存读一遍。"""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    seconds = median_time(lambda: x.sum(), repeats=repeats, warmup=2, device=device)
    return x.numel() * 4 / seconds


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"{name}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    if hasattr(os, "getloadavg"):  # 负载高时（别的进程在抢 CPU）计时不可信：把它印在表头
        desc += f", load avg {os.getloadavg()[0]:.1f}"
    if torch.cuda.is_available():
        desc += f", GPU {torch.cuda.get_device_name()}"
    return desc


def table(headers: list[str], rows: list[list]) -> str:
    """等宽文本表（中文字符按两列宽计）。"""
    def width(s):
        return sum(2 if ord(c) > 0x2E7F else 1 for c in s)

    cells = [[str(h) for h in headers]] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(width(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c + " " * (w - width(c)) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def top_level_ops(fn) -> tuple[float, list[tuple[str, list, float]]]:
    """用 torch.profiler（CPU）跑一次 fn，返回 (墙钟秒数, [(事件名, 输入形状, 秒), ...])，只列"顶层"事件：
    不在别的算子里面被调用的算子，以及 record_function 标出的范围（它的时间包括范围内的 Python）。
    顶层事件的时间加起来与墙钟之差，就是算子之间的 Python 与调度开销。剖析器本身会让每个算子慢一点，
    所以这里的数字用来看"时间花在哪"，总时间以不开剖析器的计时为准。"""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t = time.perf_counter()
        fn()
        wall = time.perf_counter() - t
    ops = [(ev.name, ev.input_shapes, ev.cpu_time_total / 1e6) for ev in prof.events() if ev.cpu_parent is None]
    return wall, ops
