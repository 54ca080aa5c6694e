"""外部碎片：同一个负载、同样大小的 KV 内存，交给"连续分配"（每个请求要一整段地址连续的槽，首次适配
first-fit）与分页池（step05 的 BlockManager，任意空闲块都能用）。不跑模型，只按 token 数模拟调度：

    python step05_paged/analysis/fragmentation.py [--quick] [--block-size 16] [--capacities 2,3,4,6]

负载是 step05 章节模式的 mixed_workload（同一个种子），每个请求都写满 max_new_tokens（像小池子那次的
ignore_eos）。每一步：按到达顺序放行等待的请求（队首放不下就停，先来先服务），然后所有运行中的请求各前进一个
token（放行那一步就是它的 prefill），写满的请求释放内存。容量 = 最大请求所需槽数 × 倍数（--capacities），
三种策略拿到的槽数相同：
- contiguous：放行时按一生最多要的 提示词 + N − 1 个槽，first-fit 找一整段连续空闲（PagedAttention 之前的
  系统就是这样按最坏情况连续预留）；
- paged-reserve：同样按最坏情况预留，只是换成块（向上取整到块）——与 contiguous 只差"要不要连续"；
- paged：step05 的做法，放行时只给提示词的块，decode 写满一块再加一块，没块时抢占最后放行的请求（重算）。
"""
import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.bench import table  # noqa: E402


class FirstFit:
    """连续地址空间上的首次适配分配器：空闲区间按起点排序，分配取第一个够大的区间的开头，释放时与相邻空闲区间合并。"""

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.holes: list[list[int]] = [[0, capacity]]   # [起点, 长度]，按起点排序、互不相邻

    @property
    def free_total(self) -> int:
        return sum(n for _, n in self.holes)

    @property
    def largest_hole(self) -> int:
        return max((n for _, n in self.holes), default=0)

    def alloc(self, n: int) -> int | None:
        """分配 n 个连续槽，返回起点；没有够大的连续空闲区间时返回 None（即使空闲总数够）。"""
        if n <= 0:
            raise ValueError(f"n must be > 0, got {n}")
        for i, (start, length) in enumerate(self.holes):
            if length >= n:
                if length == n:
                    del self.holes[i]
                else:
                    self.holes[i] = [start + n, length - n]
                return start
        return None

    def free(self, start: int, n: int) -> None:
        end = start + n
        if start < 0 or end > self.capacity or n <= 0:
            raise ValueError(f"bad region [{start}, {end})")
        i = 0
        while i < len(self.holes) and self.holes[i][0] < start:
            i += 1
        prev, nxt = (self.holes[i - 1] if i > 0 else None), (self.holes[i] if i < len(self.holes) else None)
        if (prev and prev[0] + prev[1] > start) or (nxt and end > nxt[0]):
            raise RuntimeError(f"double free / overlap at [{start}, {end})")
        if prev and prev[0] + prev[1] == start and nxt and end == nxt[0]:   # 两边都相邻：三段并成一段
            prev[1] += n + nxt[1]
            del self.holes[i]
        elif prev and prev[0] + prev[1] == start:
            prev[1] += n
        elif nxt and end == nxt[0]:
            nxt[0], nxt[1] = start, nxt[1] + n
        else:
            self.holes.insert(i, [start, n])


@dataclass
class Req:
    prompt: int
    max_new: int
    done: int = 0                      # 已生成的 token 数
    region: tuple | list | None = None  # contiguous：(起点, 长度)；paged：块号列表


@dataclass
class SimResult:
    steps: int = 0
    admitted: int = 0
    refusals: int = 0                  # 队首请求放不下的步数
    frag_refusals: int = 0             # 其中空闲总数其实够、只是不连续的步数
    unusable_at_refusal: list = field(default_factory=list)   # 那些时刻空闲却用不上的槽数
    running_sum: int = 0               # 每步运行中的请求数之和（算平均并发）
    used_sum: int = 0                  # 每步存着真实 token 的槽数之和
    preemptions: int = 0


def simulate(lengths: list[tuple[int, int]], capacity: int, policy: str, block_size: int = 16) -> SimResult:
    """lengths：每个请求的 (提示词 token 数, max_new_tokens)。capacity：槽数（paged 时向下取整到整块）。"""
    from step05_paged.block_manager import BlockManager
    bs = block_size
    ff = FirstFit(capacity) if policy == "contiguous" else None
    bm = None if policy == "contiguous" else BlockManager(capacity // bs, bs)
    blocks = lambda n: -(-n // bs)            # noqa: E731
    waiting, running, res = [Req(p, n) for p, n in lengths], [], SimResult()
    if any(p + n - 1 > capacity for p, n in lengths):
        raise ValueError("a request is larger than the whole capacity")
    while waiting or running:
        res.steps += 1
        # 1) 放行：先来先服务，队首放不下就停
        while waiting:
            r = waiting[0]
            life = r.prompt + r.max_new - 1
            if policy == "contiguous":
                start = ff.alloc(life)
                ok = start is not None
                if ok:
                    r.region = (start, life)
                elif ff.free_total >= life:
                    res.frag_refusals += 1
                    res.unusable_at_refusal.append(ff.free_total)
            else:
                need = blocks(life) if policy == "paged-reserve" else blocks(r.prompt + r.done)
                ok = bm.can_allocate(need)
                if ok:
                    r.region = bm.allocate(need)
            if not ok:
                res.refusals += 1
                break
            running.append(waiting.pop(0))
            res.admitted += 1
        # 2) paged：decode 写满一块时加一块；没有空闲块就抢占最后放行的请求（它的块全还回来，回到队首重算）
        if policy == "paged":
            i = 0
            while i < len(running):
                r = running[i]
                if r.done > 0 and r.prompt + r.done > len(r.region) * bs:   # 这一步要写位置 prompt + done - 1
                    if not bm.can_allocate(1):
                        victim = running.pop()
                        bm.free(victim.region)
                        victim.region = None
                        waiting.insert(0, victim)
                        res.preemptions += 1
                        continue                                          # 重看同一个 i（也可能就是被抢占的它）
                    r.region += bm.allocate(1)
                i += 1
        # 3) 一次前向：每个运行中的请求前进一个 token；写满的释放
        res.running_sum += len(running)
        for r in running:
            r.done += 1
        res.used_sum += sum(r.prompt + r.done - 1 for r in running)
        for r in [r for r in running if r.done == r.max_new]:
            running.remove(r)
            if policy == "contiguous":
                ff.free(*r.region)
            else:
                bm.free(r.region)
    return res


def workload_lengths(quick: bool) -> list[tuple[int, int]]:
    """step05 章节模式的负载（同一个种子）；只用分词器，不加载模型权重。"""
    from common.prepare import prepare_default_model
    from common.tokenizer import Tokenizer
    from step05_paged.analysis.workload import mixed_workload
    return [(len(r.prompt_ids), r.max_new_tokens) for r in mixed_workload(Tokenizer(prepare_default_model()), quick)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="step05 --quick 的负载（12 个请求）；默认完整负载（32 个）")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--capacities", default="2,3,4,6", help="容量 = 最大请求的槽数 × 这些倍数")
    args = ap.parse_args()
    lengths = workload_lengths(args.quick)
    biggest = max(p + n - 1 for p, n in lengths)
    print(f"负载：{len(lengths)} 个请求（{'--quick' if args.quick else '完整'}），最大的一个一生要 {biggest} 个槽；"
          f"块大小 {args.block_size}")
    rows = []
    for mult in [float(x) for x in args.capacities.split(",")]:
        cap = int(biggest * mult) // args.block_size * args.block_size   # 三种策略同样的槽数（整块）
        for policy in ("contiguous", "paged-reserve", "paged"):
            r = simulate(lengths, cap, policy, args.block_size)
            unusable = (f"{sum(r.unusable_at_refusal) / len(r.unusable_at_refusal):.0f}"
                        f"（{100 * sum(r.unusable_at_refusal) / len(r.unusable_at_refusal) / cap:.0f}%）"
                        if r.unusable_at_refusal else "—")
            rows.append([f"{mult:g}× = {cap}", policy, r.steps, f"{r.running_sum / r.steps:.2f}",
                         f"{100 * r.used_sum / r.steps / cap:.0f}%", r.refusals, r.frag_refusals, unusable,
                         r.preemptions])
    print(table(["容量（槽）", "策略", "步数", "平均并发", "槽利用率", "队首被拒（步）", "其中因不连续",
                 "那时空闲却用不上（槽）", "抢占"], rows))


if __name__ == "__main__":
    main()
