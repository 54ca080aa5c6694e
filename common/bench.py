"""基准工具：计时取中位数、内存带宽与矩阵乘算力、每步读多少权重、roofline、逐 token 计时、剖析、机器描述、表格。
基准只测量，不做断言。各步的 run.py、notebooks 和 bench/ 都从这里取，同一个量只有一个定义。"""
import os
import platform
import statistics
import time
from dataclasses import dataclass

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


def interleaved_medians(fns: dict, repeats: int, device, cpu: bool = False) -> dict:
    """每个函数先预热一次，再轮流各跑 repeats 次，返回各自耗时的中位数（秒）。
    cpu=True 时另返回进程 CPU 时间的中位数：机器上别的进程抢 CPU 时，墙钟会把"排队等 CPU"也算进去，
    CPU 时间不会（内存带宽被别人占用的影响它也去不掉）。"""
    for fn in fns.values():
        fn()
    wall, proc = {name: [] for name in fns}, {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t, c = time.perf_counter(), time.process_time()
            fn()
            sync(device)
            wall[name].append(time.perf_counter() - t)
            proc[name].append(time.process_time() - c)
    med = {name: statistics.median(t) for name, t in wall.items()}
    return (med, {name: statistics.median(t) for name, t in proc.items()}) if cpu else med


def memory_bandwidth(device="cpu", mib: int = 512, repeats: int = 5) -> float:
    """读带宽（字节/秒）：对一个远大于缓存的张量求和，每次都要把它从内存读一遍。"""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    seconds = median_time(lambda: x.sum(), repeats=repeats, warmup=2, device=device)
    return x.numel() * 4 / seconds


def matmul_flops(device="cpu", n: int = 1024) -> float:
    """这台机器的实测矩阵乘算力（FLOP/s）：大方阵乘法，算术强度高，接近计算上限。"""
    a = torch.randn(n, n, device=device)
    return 2 * n**3 / median_time(lambda: a @ a, repeats=5, warmup=2, device=device)


def weight_bytes_per_step(model, rows: int = 1) -> int:
    """一次 decode 前向（rows 行、每行 1 个新 token）至少要从内存读的权重字节数。

    约定（全仓库只此一处）：每个参数都读一遍——各层的投影矩阵、RMSNorm 的向量、LM head 的整张 (E, V) 矩阵
    （对全部 V 个词打分，一个不少）；词嵌入表例外：查表只读 rows 行（每行 E 个数），不是整张表。
    tie 的模型里 lm_head 是嵌入表的转置副本（common/weights.py），按整张矩阵算。
    权重也可以是缓冲区（step14 换上的块：BlockLinear / BlockEmbedding 的 packed），同一个张量只算一次；
    嵌入表与 lm_head 共用同一份块时（step14 的 tie），lm_head 整张读，查表不另算。"""
    buffers = {b.data_ptr(): b.nbytes for b in model.buffers()}
    total = sum(p.nbytes for p in model.parameters()) + sum(buffers.values())
    emb = model.embed_tokens
    table = emb.weight if isinstance(emb, torch.nn.Embedding) else emb.packed
    if not isinstance(emb, torch.nn.Embedding) and getattr(model.lm_head, "packed", None) is not None \
            and model.lm_head.packed.data_ptr() == table.data_ptr():
        return total
    return total - table.nbytes + rows * table.nbytes // emb.num_embeddings


@dataclass(frozen=True)
class Roofline:
    """decode 的内存上限：每步至少把 nbytes 字节从内存读一遍，所以一步至少要 nbytes / bandwidth 秒。
    bandwidth 必须是同一次运行里测的（这台 VM 的带宽在不同时刻能差两三倍）；describe() 总把它一起印出来。"""
    bandwidth: float                                    # 字节/秒，memory_bandwidth() 的结果

    def seconds(self, nbytes: float) -> float:
        return nbytes / self.bandwidth

    def fraction(self, nbytes: float, measured_seconds: float) -> float:
        """实测达到上限的比例 = 上限时间 / 实测时间（1 = 读满带宽）。"""
        return self.seconds(nbytes) / measured_seconds

    def describe(self, fraction: float) -> str:
        return f"{fraction:.0%} of roofline @ {self.bandwidth / 1e9:.1f} GB/s"


def stamps_of(model, device, fn) -> list[float]:
    """运行 fn()，返回每个 token 的延迟（秒）：第 1 个 = 从开始到第一次前向结束（TTFT），
    之后每个 = 相邻两次前向结束的间隔（含采样）。钩子挂在模型上，引擎代码不用改。"""
    times = []

    def hook(m, inp, out):
        sync(device)
        times.append(time.perf_counter())

    handle = model.register_forward_hook(hook)
    try:
        sync(device)
        t0 = time.perf_counter()
        fn()
    finally:
        handle.remove()
    return [b - a for a, b in zip([t0] + times[:-1], times)]


@dataclass
class StepProfile:
    """torch.profiler 看到的一步：矩阵乘花了多少秒、发出了多少个算子（内核调用）。"""
    matmul_s: float          # 每步 aten::mm / bmm / addmm（及 int8 权重矩阵乘）的自身时间（秒）
    ops: float               # 每步算子数：从 Python 发出的顶层 aten 算子 + 编译好的图里调用的内核
    table: str               # 按自身时间排序的前 15 行，--profile 时打印


MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::_weight_int8pack_mm",
              "mkldnn::_linear_pointwise",        # --linear packed 的矩阵乘（common/linear.py）
              "step14::block_matmul",             # step14 的块内核（编译的图里是算子；eager 里要调用方标出来）
              "step14::block_matmul_py")          # 同一个内核，C++ 的算子编不出来时的 Python 算子
OP_PREFIXES = ("aten::", "mkldnn::", "step14::")  # 顶层的这些事件各算一个算子（step14::：step14 的 C++ 调用）
COMPILED_GRAPH = "## Call CompiledFxGraph"   # torch.compile 的图在剖析器里的名字；它的子事件是图里的内核


def profile_steps(fn, steps: int) -> StepProfile:
    """用 torch.profiler 跑 fn() steps 次，按步平均。矩阵乘是少数几个长算子，剖析器给它们的计时可信；
    其余小算子各自被剖析器拖慢，所以调用方应该用"不开剖析器的真实一步 − 矩阵乘"估计它们的总开销。
    编译过的图里 inductor 生成的 C++ 内核只有在 torch._inductor.config.cpp.enable_kernel_profile = True
    时才出现在剖析器里（bench/decode_speed.py 这样设置），否则只数得到图里的矩阵乘。"""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    events = prof.key_averages()
    mm = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / steps / 1e6

    def is_op(e):
        if e.cpu_parent is None:
            return e.name.startswith(OP_PREFIXES)
        return e.cpu_parent.name.startswith(COMPILED_GRAPH)

    calls = sum(1 for e in prof.events() if is_op(e)) / steps
    return StepProfile(mm, calls, events.table(sort_by="self_cpu_time_total", row_limit=15))


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
