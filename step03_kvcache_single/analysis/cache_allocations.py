"""torch.cat 缓存 vs 预分配缓存：一次长 decode 里各分配了多少次内存、峰值占多少、（GPU 上）分配器保留了多少。

    python step03_kvcache_single/analysis/cache_allocations.py [--steps 256] [--prompt-len 16] [--device cpu|cuda]

不跑模型：按默认模型的形状（层数、KV 头数、head_dim，只读 config.json）造全 0 的 K/V，像引擎那样每步对每层
调一次 update、再 advance 一次——缓存做的事与真实生成完全相同，只是省掉了矩阵乘。
- CPU：用 TorchDispatchMode 拦下缓存执行的每个算子，输出不是某个输入的视图、而是一块新存储时记一次分配
  （次数与字节）；峰值 = 分配那一刻缓存里还活着的张量 + 新分配的那块（cat 时旧张量要等新张量建好才释放）。
  CPU 的默认分配器把大块直接还给系统，没有"保留"一说，所以这一列写 —。
- CUDA：直接读 torch.cuda.memory_stats：分配次数、峰值已分配、峰值保留（缓存分配器从驱动拿来、没还回去的）。
"""
import argparse
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


class AllocationCounter(TorchDispatchMode):
    """数新存储：算子的输出不与任何输入共用存储时，就是新分配的一块。live_fn() 给出此刻缓存持有的字节。"""

    def __init__(self, live_fn):
        super().__init__()
        self.live_fn, self.count, self.bytes, self.peak = live_fn, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        live = self.live_fn()                       # 算子执行前缓存持有的（cat 的旧张量此时还在）
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for o in tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                n = o.untyped_storage().nbytes()
                self.count, self.bytes = self.count + 1, self.bytes + n
                self.peak = max(self.peak, live + n)
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


def measure(cls, cfg, prompt_len: int, steps: int, device: str, dtype=torch.float32) -> dict:
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
                    peak=st["allocated_bytes.all.peak"], reserved=st["reserved_bytes.all.peak"], final=cache.nbytes())
    holder = {}
    with AllocationCounter(lambda: holder["c"].nbytes() if "c" in holder else 0) as m:
        holder["c"] = cls(cfg, max_len, device, dtype)
        decode_like(holder["c"], cfg, kv, steps)
    return dict(allocations=m.count, allocated=m.bytes, peak=m.peak, reserved=None, final=holder["c"].nbytes())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=256, help="前向次数（1 次 prefill + steps-1 次 decode）")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", help="模型目录（只读 config.json；默认：默认模型）")
    args = ap.parse_args()
    from common.prepare import resolve_model
    cfg = ModelConfig.from_dir(resolve_model(args.model))
    kvb = cfg.kv_bytes_per_token(4)
    print(f"机器: {machine()}；形状 {cfg.num_layers} 层 × {cfg.num_kv_heads} 个 KV 头 × {cfg.head_dim}，float32，"
          f"每 token {kvb} 字节；提示词 {args.prompt_len}，前向 {args.steps} 次，{args.device}")
    rows = []
    for cls in (CatKVCache, PreallocKVCache):
        r = measure(cls, cfg, args.prompt_len, args.steps, args.device)
        rows.append([cls.__name__, r["allocations"], "—" if r["allocated"] is None else f"{r['allocated'] / MIB:.1f}",
                     f"{r['peak'] / MIB:.2f}", "—" if r["reserved"] is None else f"{r['reserved'] / MIB:.2f}",
                     f"{r['final'] / MIB:.2f}"])
    print(table(["缓存", "分配次数", "累计分配 (MiB)", "峰值 (MiB)", "峰值保留 (MiB)", "结束时缓存 (MiB)"], rows))


if __name__ == "__main__":
    main()
