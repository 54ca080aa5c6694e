"""torch.cat 缓存 vs 预分配缓存：一次长 decode 里各分配了多少次内存、峰值占多少、分配器多拿着多少（碎片）。

    python step03_kvcache_single/analysis/cache_allocations.py [--steps 256] [--prompt-len 16] [--device cpu|cuda]

不跑模型：按默认模型的形状（层数、KV 头数、head_dim，只读 config.json）造全 0 的 K/V，像引擎那样每步对每层
调一次 update、再 advance 一次——缓存做的事与真实生成完全相同，只是省掉了矩阵乘。每种缓存在一个新的子进程里量
（前一种留下的空闲内存不影响后一种），量的时候关掉 Python 的 gc：旧张量只能靠引用计数释放。
- CPU：用 TorchDispatchMode 拦下缓存执行的每个算子，输出不是某个输入的视图、而是一块新存储时记一次分配
  （次数与字节）。峰值与碎片读 glibc 的 mallinfo2()（≥ 2.33；别的 C 库上这几列写 —）：每个算子刚执行完时
  分配器交出去、还没收回的字节（减去开始前的），取最大——这一刻新张量已经建好、被替换的旧张量还没释放；
  结束时分配器从系统拿着、却没交给任何人的字节，就是释放掉的小块留在堆里的空洞：碎片。
- CUDA：直接读 torch.cuda.memory_stats：分配次数、峰值已分配、峰值保留（缓存分配器从驱动拿来、没还回去的）。
"""
import argparse
import ctypes
import ctypes.util
import gc
import multiprocessing
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from common.bench import machine, table  # noqa: E402
from common.config import ModelConfig  # noqa: E402
from step03_kvcache_single.cache import CatKVCache, PreallocKVCache  # noqa: E402

MIB = 2**20
CACHE_CLASSES = {"CatKVCache": CatKVCache, "PreallocKVCache": PreallocKVCache}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc_mallinfo2():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


MALLINFO2 = _libc_mallinfo2()


def heap() -> tuple[int, int] | None:
    """(分配器交出去的字节, 分配器从系统拿着的字节)：堆里用着的 + mmap 的大块；不是 glibc 时 None。"""
    if MALLINFO2 is None:
        return None
    m = MALLINFO2()
    return m.uordblks + m.hblkhd, m.arena + m.hblkhd


class AllocationCounter(TorchDispatchMode):
    """数新存储：算子的输出不与任何输入共用存储时，就是新分配的一块。每个算子刚执行完时读一次分配器的账，记下最大值。"""

    def __init__(self):
        super().__init__()
        self.count, self.bytes, self.peak_in_use = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for o in tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                self.count, self.bytes = self.count + 1, self.bytes + o.untyped_storage().nbytes()
        h = heap()                                  # 新张量已建好；cat 时被替换的旧张量此刻还被缓存引用着
        if h is not None:
            self.peak_in_use = max(self.peak_in_use, h[0])
        return out


def decode_like(cache, cfg: ModelConfig, kv: torch.Tensor, steps: int) -> None:
    """prefill kv 的全部位置，再 decode steps - 1 步（每步 1 个位置）；每次前向每层 update 一次，之后 advance 一次。
    kv 是外面造好的 (1, H_kv, prompt_len, D)：它相当于模型算出的新 K/V，不算缓存的分配。"""
    prompt_len = kv.shape[2]
    for step in range(steps):
        L = prompt_len if step == 0 else 1
        for layer in range(cfg.num_layers):
            cache.update(layer, kv[:, :, :L], kv[:, :, :L])
        cache.advance(L)


def measure(name: str, cfg, prompt_len: int, steps: int, device: str, dtype=torch.float32) -> dict:
    """量一种缓存（CACHE_CLASSES 里的名字）：gc 关着（旧张量不等 gc：引用计数归零就释放，gc 只管引用成环的对象），量完再打开。"""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _measure(CACHE_CLASSES[name], cfg, prompt_len, steps, device, dtype)
    finally:
        if was_enabled:
            gc.enable()


def _measure(cls, cfg, prompt_len: int, steps: int, device: str, dtype) -> dict:
    max_len = prompt_len + steps
    kv = torch.zeros(1, cfg.num_kv_heads, prompt_len, cfg.head_dim, device=device, dtype=dtype)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
        cache = cls(cfg, max_len, device, dtype)
        decode_like(cache, cfg, kv, steps)
        torch.cuda.synchronize()
        st = torch.cuda.memory_stats()
        return dict(allocations=st["allocation.all.allocated"] - before, allocated=None,
                    peak=st["allocated_bytes.all.peak"], held=st["reserved_bytes.all.peak"], final=cache.nbytes())
    with AllocationCounter():          # 预热：第一次走这些算子时 torch 与 Python 建的东西不算进缓存的账
        decode_like(cls(cfg, max_len, device, dtype), cfg, kv, 2)
    start = heap()
    with AllocationCounter() as m:
        cache = cls(cfg, max_len, device, dtype)
        decode_like(cache, cfg, kv, steps)
    end = heap()
    return dict(allocations=m.count, allocated=m.bytes, final=cache.nbytes(),
                peak=None if start is None else m.peak_in_use - start[0],
                held=None if start is None else end[1] - start[1])


def measure_in_child(name: str, model_dir: str, prompt_len: int, steps: int, device: str) -> dict:
    cfg = ModelConfig.from_dir(Path(model_dir))
    return measure(name, cfg, prompt_len, steps, device)


def mib(x) -> str:
    return "—" if x is None else f"{x / MIB:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=256, help="前向次数（1 次 prefill + steps-1 次 decode）")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", help="模型目录（只读 config.json；默认：默认模型）")
    args = ap.parse_args()
    from common.prepare import resolve_model
    path = resolve_model(args.model)
    cfg = ModelConfig.from_dir(path)
    kvb = cfg.kv_bytes_per_token(4)
    print(f"机器: {machine()}；形状 {cfg.num_layers} 层 × {cfg.num_kv_heads} 个 KV 头 × {cfg.head_dim}，float32，"
          f"每 token {kvb} 字节；提示词 {args.prompt_len}，前向 {args.steps} 次，{args.device}；"
          f"每种缓存一个新进程，gc 关着")
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for name in CACHE_CLASSES:
        with ctx.Pool(1) as pool:
            r = pool.apply(measure_in_child, (name, str(path), args.prompt_len, args.steps, args.device))
        frag = None if r["held"] is None or args.device != "cpu" else r["held"] - r["final"]
        rows.append([name, r["allocations"], "—" if r["allocated"] is None else f"{r['allocated'] / MIB:.1f}",
                     mib(r["peak"]), mib(r["final"]), mib(r["held"]), mib(frag)])
    held = "峰值保留 (MiB)" if args.device != "cpu" else "结束时分配器拿着 (MiB)"
    print(table(["缓存", "分配次数", "累计分配 (MiB)", "峰值 (MiB)", "结束时缓存 (MiB)", held, "其中空着的：碎片 (MiB)"],
                rows))
    if args.device == "cpu" and MALLINFO2 is None:
        print("（这里的 C 库没有 glibc 的 mallinfo2：峰值与碎片量不了）")


if __name__ == "__main__":
    main()
