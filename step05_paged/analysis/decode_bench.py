"""一次 decode 前向的对照实验：同样的批大小和上下文，step04（PreallocKVCache，读视图）vs step05（plan + 按块表读池子），
以及 step05 读池子的几种纯 PyTorch 写法。chapter.py 的第 5 部分用前两个函数；直接运行本文件比较几种读法：

    python step05_paged/analysis/decode_bench.py [--quick] [--contexts 120,500,300,40,700,250,60,380]

缓存里全是 0：一次 decode 前向的耗时与 K/V 的数值无关，所以不用先跑 prefill。每次调用两边都往后走一个位置
（上下文 +1，像真的在生成），几种写法交替计时、各取中位数，让它们受到同样的机器负载影响。
"""
import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.profiler import record_function  # noqa: E402

from common.bench import interleaved_medians, machine, table, top_level_ops  # noqa: E402
from common.model import attention  # noqa: E402
from step03_kvcache_single.cache import PreallocKVCache  # noqa: E402
from step04_static_batching.engine import forward as static_forward  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402
from step05_paged.kv_cache import AttentionMetadata, PagedKVCache  # noqa: E402
from step05_paged.sequence import Sequence  # noqa: E402

MIB = 2**20


def decode_step_fns(s, contexts: list[int], block_size: int, steps: int, attention: str = "paged",
                    read=AttentionMetadata, query_len: int = 1):
    """返回 (step04_step, step05_step)：各做一次前向（step05 含 plan，包在 record_function("plan") 里，
    返回这一步的 AttentionMetadata，可以看它拷贝了多少字节）。
    B = len(contexts) 行，第 i 行已缓存 contexts[i] - query_len 个 token、这一步算后面 query_len 个（decode：1 个；
    大于 1 是"前缀已在池子里、再算一块"，step06/07 的情况）；最多调用 steps 次。
    attention：step05 读池子的方式（"paged" 按块表直接读，"gather" 先拷成连续的）；
    read：gather 时用哪个 AttentionMetadata 子类（默认就是 step05 自己的）。"""
    B, P, dev, dt = len(contexts), max(contexts), s.device, s.dtype
    # step04：一批左填充到最长的上下文，缓存里已有 P - 1 列，新 token 写第 P - 1 列
    L = query_len
    cache4 = PreallocKVCache(s.cfg, P + steps * L, dev, dt, batch_size=B)
    cache4.advance(P - L)
    pad4 = torch.tensor([P - c for c in contexts], device=dev)
    x4 = torch.zeros(B, L, dtype=torch.long, device=dev)
    # step05：块像真实运行那样交错分配（各行轮流各要一块）
    need = [-(-(c + steps * L) // block_size) for c in contexts]
    cache5 = PagedKVCache(s.cfg, B * max(need), block_size, dev, dt, attention)
    seqs = []
    for i, c in enumerate(contexts):
        seq = Sequence(i, Request([0] * c, steps * L + 1), torch.Generator(), 0.0)
        seq.block_table = [j * B + i for j in range(need[i])]
        seq.num_computed_tokens = c - L
        seqs.append(seq)

    def step04():
        static_forward(s.model, cache4, x4, pad4)

    def step05():
        with record_function("plan"):
            fwd = as_read(cache5.plan(seqs, [L] * B), read)
        s.model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index)
        for seq in seqs:                     # 像引擎一样：这一步的 token 进了缓存，再"生成"L 个
            seq.num_computed_tokens = seq.num_tokens
            seq.output_ids += [0] * L
        return fwd

    return step04, step05


def as_read(fwd: AttentionMetadata, read) -> AttentionMetadata:
    """同一次前向的地址信息，换一种读法（AttentionMetadata 的子类）。"""
    return fwd if read is AttentionMetadata else read(**{f.name: getattr(fwd, f.name) for f in dataclasses.fields(fwd)})


CATEGORIES = ["线性层矩阵乘", "注意力（QKᵀ、softmax、PV、掩码；paged 的内核）", "KV 写入与读取（写槽、gather、清零）",
              "plan() 准备输入", "其它算子（RMSNorm、RoPE、SiLU、嵌入、step04 的掩码…）"]
KV_IO = CATEGORIES[2]
PLAN = CATEGORIES[3]


def categorize(name: str, shapes: list) -> str:
    """按顶层事件的名字（和 matmul 的输入形状）归类：第二个输入是 2 维的 matmul 是线性层 x @ W，
    更高维的是注意力里的 q @ kᵀ、probs @ v；打包的权重（CPU float32 的默认）是 oneDNN 的一个算子。"""
    if name == "plan":
        return PLAN
    if name == "paged_attention":
        return CATEGORIES[1]
    if name == "aten::matmul":
        return CATEGORIES[0] if len(shapes) > 1 and len(shapes[1]) == 2 else CATEGORIES[1]
    if name == "mkldnn::_linear_pointwise":        # --linear packed 的矩阵乘（common/linear.py；这里只剖析 eager）
        return CATEGORIES[0]
    if name in ("aten::softmax", "aten::masked_fill", "aten::div", "aten::bitwise_not"):
        return CATEGORIES[1]
    if name in ("aten::index_select", "aten::index_fill_", "aten::index_put_", "aten::index", "aten::copy_"):
        return KV_IO                         # step04 的写入是切片赋值 aten::copy_；step05 是 index_put_
    return CATEGORIES[4]


def profile_split(fn, steps: int) -> dict:
    """torch.profiler 跑 steps 次 fn，按 CATEGORIES 分开的平均每次秒数，外加算子之间的 Python 与调度开销和合计。"""
    cats = dict.fromkeys(CATEGORIES, 0.0)
    wall = 0.0
    for _ in range(steps):
        w, ops = top_level_ops(fn)
        wall += w / steps
        for name, shapes, sec in ops:
            cats[categorize(name, shapes)] += sec / steps
    cats["Python 与调度（算子之间）"] = max(0.0, wall - sum(cats.values()))
    return cats | {"合计（剖析器下）": wall}


# ---------------- gather 读池子的几种写法（都是 AttentionMetadata 的子类，只换读的部分） ----------------

class TwoSelectsFreshAlloc(AttentionMetadata):
    """最初的写法：K、V 各一次 index_select，每层每次都新分配输出；不清零 V。"""

    def update(self, layer_idx, k, v):
        self.read_rows, rows = None, self.read_rows
        AttentionMetadata.update(self, layer_idx, k, v)          # 只借它的写；read_rows=None 时它不读
        self.read_rows = rows
        B, H_kv, _, D = k.shape
        layer = self.pool[layer_idx]
        bs = layer.shape[3]
        half = rows.numel() // 2
        out = [layer.view(-1, bs * D).index_select(0, rows[kv * half:(kv + 1) * half]) for kv in (0, 1)]
        self.gather_bytes += out[0].nbytes + out[1].nbytes
        return out[0].view(B, H_kv, -1, D), out[1].view(B, H_kv, -1, D)


class NoVZeroing(AttentionMetadata):
    """现在的写法去掉尾巴的清零：看清零本身花多少（它让毒值进不了输出，见 tests）。"""

    def update(self, layer_idx, k, v):
        rows = self.v_tail_rows
        self.v_tail_rows = rows[:0]
        out = AttentionMetadata.update(self, layer_idx, k, v)
        self.v_tail_rows = rows
        return out


class ZeroAllBeyondLength(AttentionMetadata):
    """现在的写法，但读回之后逐 token 清零长度之外的全部 V（补齐的空块 + 尾巴），而不是只清尾巴、靠空块本身是 0。"""

    def update(self, layer_idx, k, v):
        k_all, v_all = AttentionMetadata.update(self, layer_idx, k, v)
        B, H_kv, S, D = v_all.shape
        if layer_idx == 0:                   # 行号每次前向只算一次（像 plan 里那样）
            length = self.positions[:, -1] + 1                                    # (B,)
            beyond = (torch.arange(S)[None, :] >= length[:, None])[:, None, :].expand(B, H_kv, S)
            self.beyond_rows = beyond.flatten().nonzero().squeeze(1)
        v_all.view(-1, D).index_fill_(0, self.beyond_rows, 0)
        return k_all, v_all


class TokenExactGather(AttentionMetadata):
    """按 token 取：每行只取到所有行里最长的真实长度（不按整块补齐），用高级索引 pool[块号, :, 偏移]，
    取出来是 (B, S, H_kv, D)，再 transpose 成连续的 (B, H_kv, S, D)——多一次拷贝。"""

    def update(self, layer_idx, k, v):
        self.read_rows, rows = None, self.read_rows
        AttentionMetadata.update(self, layer_idx, k, v)
        self.read_rows = rows
        B, H_kv, _, D = k.shape
        layer = self.pool[layer_idx]
        bs = layer.shape[3]
        S = int(self.positions.max()) + 1
        pos = torch.arange(S, device=k.device)
        blocks = self.block_tables.gather(1, (pos // bs)[None].expand(B, -1))      # (B, S)
        offsets = (pos % bs)[None].expand(B, -1)                                  # (B, S)
        out = [layer[kv][blocks, :, offsets].transpose(1, 2).contiguous() for kv in (0, 1)]   # (B, H_kv, S, D)
        self.gather_bytes += 2 * (out[0].nbytes + out[1].nbytes)                  # 取出 + transpose 各一次
        self.mask = self.mask[..., :S]
        length = self.positions[:, -1] + 1                                        # (B,)
        out[1].masked_fill_((pos[None, :] >= length[:, None])[:, None, :, None], 0)   # 长度之外的 V 清零
        return out[0], out[1]


class PerRowAttention(AttentionMetadata):
    """不补齐：一次 index_select 只拷各行真正拥有的块（K、V 一起），再逐行做注意力，每行只看自己的 S_i 个位置
    （就是 step03 单请求的那次注意力）。省掉补齐的拷贝和补齐部分的注意力，代价是每层一个 B 次的 Python 循环。"""

    def attend(self, layer_idx, q, k, v):
        B, H_kv, _, D = k.shape
        self.read_rows, rows = None, self.read_rows
        AttentionMetadata.update(self, layer_idx, k, v)          # 写
        self.read_rows = rows
        layer = self.pool[layer_idx]
        bs = layer.shape[3]
        length = (self.positions[:, -1] + 1).tolist()
        nblk = [-(-n // bs) for n in length]
        per = rows.view(2, B, H_kv, -1)
        keep = torch.cat([per[:, i, :, :n].flatten(1) for i, n in enumerate(nblk)], dim=1).flatten()  # (K/V, 行, 头, 块)
        got = layer.view(-1, bs * D).index_select(0, keep)
        self.gather_bytes += got.nbytes
        K, V = got.view(2, -1, bs * D)
        outs, start = [], 0
        for i, (n, nb) in enumerate(zip(length, nblk)):
            ki = K[start:start + H_kv * nb].view(1, H_kv, nb * bs, D)[:, :, :n]   # 视图：只看自己的 n 个位置
            vi = V[start:start + H_kv * nb].view(1, H_kv, nb * bs, D)[:, :, :n]
            outs.append(attention(q[i:i + 1], ki, vi))                           # (1, H, 1, D)，右下对齐的因果掩码
            start += H_kv * nb
        return torch.cat(outs)


PAGED = "paged：按块表直接读池子（C++ 内核，不拷贝）"
READS = {
    "gather：K、V 一次 index_select → 每层复用的缓冲，只清零各行尾巴的 V": AttentionMetadata,
    "  同上，但读回后逐 token 清零长度之外的全部 V": ZeroAllBeyondLength,
    "  同上，但不清零尾巴": NoVZeroing,
    "最初：K、V 各一次 index_select，每层新分配": TwoSelectsFreshAlloc,
    "按 token 取到最长的真实长度（高级索引 + transpose）": TokenExactGather,
    "不补齐：只拷各行自己的块，逐行注意力": PerRowAttention,
}


def main():
    from common.cli import open_session
    from step05_paged.analysis.workload import mixed_workload
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="--quick 负载的上下文、更少的重复")
    ap.add_argument("--contexts", default=None, help="逗号分隔的上下文长度（默认：负载前 8 个请求的 提示词 + max_new/2）")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    s = open_session()
    if args.contexts:
        contexts = [int(c) for c in args.contexts.split(",")]
    else:
        contexts = [len(r.prompt_ids) + r.max_new_tokens // 2 for r in mixed_workload(s.tok, args.quick)[:8]]
    repeats = 5 if args.quick else 15
    fns, copied = {}, {}
    with torch.inference_mode():
        for name, read in READS.items():
            step04, step05 = decode_step_fns(s, contexts, args.block_size, repeats + 3, "gather", read)
            if not fns:
                fns["step04：读预分配缓存的视图（不拷贝）"] = step04
                fns[PAGED] = decode_step_fns(s, contexts, args.block_size, repeats + 3, "paged")[1]
                copied[PAGED] = fns[PAGED]().gather_bytes
            fns[name] = step05
            copied[name] = step05().gather_bytes      # 先单独跑一步：这种写法每步拷贝多少字节（也算预热）
        wall, proc = interleaved_medians(fns, repeats, s.device, cpu=True)
    w0, c0 = next(iter(wall.values())), next(iter(proc.values()))
    print(f"机器: {machine()}；模型 {s.path.name}，{s.device}/{s.dtype_name}")
    print(f"B = {len(contexts)}，上下文 {contexts}，块大小 {args.block_size}；交替各跑 {repeats} 次取中位数")
    print(table(["读法", "每步拷贝 (MiB)", "一次 decode 前向 (ms)", "÷ step04", "进程 CPU 时间 (ms)", "÷ step04"],
                [[name, f"{copied[name] / MIB:.1f}" if name in copied else "0", f"{wall[name] * 1e3:.1f}",
                  f"{wall[name] / w0:.2f}", f"{proc[name] * 1e3:.1f}", f"{proc[name] / c0:.2f}"] for name in fns]))


if __name__ == "__main__":
    main()
