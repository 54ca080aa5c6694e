"""OpenMP 线程池的一件小事：服务器进程里，只让一个线程拥有 OpenMP 的线程池。

PyTorch 的 CPU 版 wheel 用 GNU 的 libgomp 做算子内的并行。libgomp 给每个跑过并行算子的线程一个自己的线程池
（第一次在这个线程里跑并行算子时建：2 核、2 个线程时，是这个线程自己加 1 个工作线程）。池里的线程在两个并行区
之间先忙等（GOMP_SPINCOUNT，默认 30 万次，几毫秒），等不到才睡下（futex）；但只要 libgomp 管的线程比 CPU 多，
它就只忙等 100 次（"throttled"，几微秒）就睡：之后每个并行区的开头和结尾都多一次睡下 / 叫醒。一次 decode 前向
有几百个并行区（批 1 时每步约 500 次自愿的上下文切换），空闲的 2 核机器上一步因此慢 1.4–1.7 倍。

服务器正好落进这种情况：主线程加载模型（打包权重、分配 KV 池）时建了一个池，引擎线程（AsyncLLMEngine 在专用线程里
调用 engine.step()）又建了一个：3 个线程 > 2 个 CPU。离线的 run.py 只有主线程一个池，不受影响。
release_thread_pool() 在主线程不再跑并行算子时调用（api_server.main 开始服务之前）：主线程的池还掉，进程里只剩引擎
线程那一个，libgomp 回到默认的忙等，与离线跑一样。机器很忙（别的进程占着 CPU）时忙等反而吃亏——离线的 run.py 也一样，
这里只是让服务器与它们相同。

vLLM 的答案更彻底：引擎核心是另一个进程，模型在那个进程的主线程里跑，API 服务器的线程根本碰不到 OpenMP。
"""
import ctypes
from typing import Optional

OMP_PAUSE_SOFT = 1          # omp_pause_resource_t：soft = 还掉线程，下次用时再建


def _libgomp() -> Optional[ctypes.CDLL]:
    """本进程已经加载的 libgomp（torch 自带的那份）；没有（别的 OpenMP 运行时、不是 Linux）时 None。"""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path, mode=getattr(ctypes, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    return None


def release_thread_pool() -> bool:
    """还掉调用它的线程的 OpenMP 线程池（OpenMP 5.0 的 omp_pause_resource_all；libgomp 只还调用者自己的池）。
    之后这个线程再跑并行算子时会重新建一个池（照样能算，只是又回到两个池）。返回 True 当且仅当确实调用了 libgomp：
    没有 libgomp 时什么也不做。"""
    lib = _libgomp()
    if lib is None or not hasattr(lib, "omp_pause_resource_all"):
        return False
    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
    return lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
