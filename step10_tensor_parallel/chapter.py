"""step10 的章节模式（run.py 不带 --prompt 时调用）：

[1] 相同：TP = 3（SmolLM2：每个 rank 3 个 query 头、1 个 KV 头、512 的 MLP 宽度、16384 行词表）与 PP = 2（每个 stage
    15 层）的引擎与 step09（不猜测）按 run.py 的"相同"规则一致——章节提示词（贪心）、一个带种子的采样请求、
    小池子里的抢占；报告 rank 0 上 logits 与一个进程的最大差，被接受的分歧按名字列出（all-reduce 改变了 float32
    的求和顺序）。
[2] 每个 rank 存多少：权重字节，同样的每 rank KV 预算能放几块（TP 倍）。
[3] 每个 decode 步的通信：all-reduce 的次数与字节、logits 的 gather、计划的 broadcast、stage 之间的 send/recv；
    每个 rank 的前向里有多少时间在通信；decode 一步的时间：TP = 1、TP = 3、PP = 2（这台机器只有几个核：
    TP = 3 的 3 个进程抢 2 个核，只会更慢——速度的结论在 [5] 里按真实互连换算）。
[4] 词表切开还是复制：每 rank 的权重、lm_head 矩阵乘的时间、logits gather 的字节与时间。
[5] 同样的字节放到真实互连上：NVLink / PCIe / 100 Gb/s 以太网每个 decode 步的通信要多久，TP 什么时候划算。
模型的头数不能被 3 整除时（例如 --model 换了模型）用 TP = 2。
"""
import statistics
from contextlib import contextmanager

import torch

from common import cli
from common.bench import machine, median_time, table
from common.compare import MARGIN_TOL, compare
from common.errors import UserError
from common.harness import Checks, finish, pool_is_free, stage
from common.prompts import CHAPTER_PROMPTS, LONG_PROMPT
from common.linear import dense_weight
from common.weights import load_model
from step02_sampling.sampler import SamplingParams, draw_margin
from step04_static_batching.request import Request
from step09_speculative import engine as step09
from step10_tensor_parallel import engine as step10
from step10_tensor_parallel.config import DEFAULT_KV_MIB, num_blocks_for_budget
from step10_tensor_parallel.kv_cache import PagedKVCache
from step10_tensor_parallel.distributed import FORWARD_OPS, Layout, forward_comm_seconds
from step10_tensor_parallel.launch import launch
from step10_tensor_parallel.model_runner import serve_worker
from step10_tensor_parallel.parallel_layers import Shard, check_parallel, load_shard

STEP = "step10_tensor_parallel"

# 互连的单向带宽（字节/秒）与出处；延迟是每次 all-reduce 的固定开销，按"每跳"算（环形 all-reduce 有 2(n−1) 跳），
# 它没有统一的数据手册值：下面取的是量级假设（标明了），改一个数就能看它怎样改变结论
LINKS = [
    ("NVLink 4（H100 SXM）", 450e9, 2e-6,
     "NVIDIA H100 数据手册：每 GPU 900 GB/s（双向）；延迟为假设（NCCL 小消息协议的量级）"),
    ("PCIe 4.0 ×16", 31.5e9, 5e-6, "PCI-SIG PCIe 4.0：16 GT/s × 16 lane，128b/130b 编码；延迟为假设"),
    ("100 Gb/s 以太网", 12.5e9, 20e-6, "IEEE 802.3 100GBASE：100 Gb/s = 12.5 GB/s；延迟为假设（RoCE / TCP 的量级）"),
]


class Recorder:
    """包住模型：记下每次前向的 logits（与一个进程比最大差）。"""

    def __init__(self, model):
        self.model, self.logits = model, []

    def __getattr__(self, name):
        return getattr(self.__dict__["model"], name)

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.logits.append(out)
        return out


def max_logit_diff(a: list, b: list) -> float:
    """两次运行逐步的 logits 最大差（只比两边形状相同、有 logits 的那些步：分歧之后的步不再一一对应）。"""
    return max([float((x - y).abs().max()) for x, y in zip(a, b) if x.shape == y.shape and x.numel()] or [0.0])


def ring_allreduce_seconds(nbytes: float, n: int, bandwidth: float, hop_latency: float) -> float:
    """环形 all-reduce：2(n−1) 跳，每个 rank 收发 2(n−1)/n 倍的数据。"""
    return 2 * (n - 1) * hop_latency + 2 * (n - 1) / n * nbytes / bandwidth


class Chapter:
    def __init__(self, args, s: cli.Session):
        self.args, self.s, self.quick = args, s, args.quick
        s.model = load_model(s.path, s.device, s.dtype, args.linear)  # 完整的模型：step09 的参照与 teacher forcing
        self.tol, self.bs, self.eos = MARGIN_TOL[s.dtype], args.block_size, s.tok.eos_ids
        self.tp = next((t for t in (3, 2) if self.fits(t, 1)), None)
        self.pp = 2 if self.fits(1, 2) else None
        if self.tp is None or self.pp is None:
            raise UserError("the chapter needs a model whose heads split in 2 or 3 and that has at least 2 layers")
        self.checks, self.figures, self.engines = Checks(), {}, []

    def fits(self, tp: int, pp: int) -> bool:
        try:
            check_parallel(self.s.cfg, tp, pp)
            return True
        except UserError:
            return False

    @contextmanager
    def group(self, tp: int, pp: int):
        """起一组进程（rank 0 是本进程），装上 rank 0 的那一份模型。"""
        s = self.s
        with launch(tp, pp, serve_worker, (s.path, s.device, s.dtype, self.args.linear)) as par:
            yield par, load_shard(s.path, par, s.device, s.dtype, self.args.linear)

    def config(self, num_blocks: int, max_batch_size: int = 8, **kw) -> dict:
        return dict(num_blocks=num_blocks, block_size=self.bs, max_batch_size=max_batch_size,
                    max_num_batched_tokens=self.args.max_num_batched_tokens, attention=self.args.attention,
                    spec_method="none", **kw)

    def run_engine(self, step, model, config: dict, reqs, parallel=None):
        """跑完 reqs，返回 (输出, 统计, 每次前向的 logits, 每个 rank 的通信账)。"""
        extra = {"parallel": parallel} if step is step10 and parallel is not None else {}
        e = step.LLMEngine(model, step.EngineConfig(**config), self.s.tok, self.eos, **extra)
        e.model = rec = Recorder(e.model)
        out, st = e.generate(reqs)
        comm = e.close() if step is step10 else []
        self.engines.append(e)
        return out, st, rec.logits, comm

    def workloads(self) -> list[tuple[str, list[Request], int]]:
        """(名字, 请求, 池子块数)：章节提示词（贪心）+ 一个带种子的采样请求；4 个长提示词的切片挤在小池子里（抢占）。"""
        s, n_new = self.s, 16 if self.quick else 48
        chap = [Request(s.encode(t, chat), n_new, SamplingParams()) for _, t, chat in CHAPTER_PROMPTS]
        chap.append(Request(s.encode(CHAPTER_PROMPTS[3][1], True), n_new, SamplingParams(temperature=0.8, top_p=0.9,
                                                                                          seed=1), ignore_eos=True))
        text = s.tok.encode(LONG_PROMPT)
        tight = [Request(text[11 * i:11 * i + n], 24 if self.quick else 40, SamplingParams(), ignore_eos=True)
                 for i, n in enumerate([20, 14, 30, 9])]
        tight_blocks = max(step10.blocks_needed(r, self.bs) for r in tight) + 1
        return [("章节提示词", chap, 256), ("小池子", tight, tight_blocks)]

    # ---------- [1] 相同 ----------
    @torch.inference_mode()
    def exactness(self):
        stage(f"[1] TP = {self.tp}、PP = {self.pp} 与 step09（不猜测）：章节提示词 + 带种子的采样、小池子里的抢占 ...")
        rows, ok = [], True
        refs = {name: (reqs, nb, self.run_engine(step09, self.s.model, self.config(nb), reqs))
                for name, reqs, nb in self.workloads()}
        for tp, pp in ((self.tp, 1), (1, self.pp)):
            with self.group(tp, pp) as (par, model):
                for name, (reqs, nb, (ref, st9, ref_logits, _)) in refs.items():
                    out, st, logits, _ = self.run_engine(step10, model, self.config(nb), reqs, par)
                    res = [compare(f"tp{tp}_pp{pp}_{name}#{i}", r.prompt_ids, a, b, self.s.full_logits, self.tol,
                                   draw_margin(r.params)) for i, (r, a, b) in enumerate(zip(reqs, ref, out))]
                    for c in res:
                        if not c.equal:
                            self.checks.note(c.describe())
                    same = all(c.ok for c in res) and st.preemptions == st9.preemptions
                    ok &= same and (name != "小池子" or st.preemptions > 0)
                    diff = max_logit_diff(ref_logits, logits)
                    self.figures[f"max_logit_diff_tp{tp}_pp{pp}"] = max(diff, self.figures.get(
                        f"max_logit_diff_tp{tp}_pp{pp}", 0.0))
                    rows.append([f"TP {tp} × PP {pp}", name, len(reqs), st.num_forwards, st.preemptions, f"{diff:.1e}",
                                 sum(c.equal for c in res), "相同" if same else "不同"])
            self.checks[f"tp{tp}_pp{pp}_equals_step09"] = ok
        print(table(["切法", "负载", "请求", "前向次数", "抢占", "最大 |Δlogit|", "逐 token 相同的请求", "结果"], rows))

    # ---------- [2] 每个 rank 存多少 ----------
    def memory(self):
        s, cfg = self.s, self.s.cfg
        stage(f"\n[2] 每个 rank 存多少（TP = {self.tp}；PP = {self.pp}）...")
        full = sum(p.nbytes for p in s.model.parameters())
        per_block = PagedKVCache.bytes_per_block(cfg, self.bs, s.dtype)
        mib = DEFAULT_KV_MIB
        rows = [["1 个进程", "-", f"{full / 2**20:.1f}", "1.000", f"{per_block / 2**10:.1f}",
                 num_blocks_for_budget(cfg, self.bs, s.dtype)]]
        for tp, pp in ((self.tp, 1), (1, self.pp)):
            for rank in range(tp * pp):
                layout = Layout(rank, tp, pp)                                        # 只有位置，不通信
                shard = Shard.of(cfg, layout)
                model = load_shard(s.path, layout, s.device, s.dtype, self.args.linear)   # 只装切片
                w = sum(p.nbytes for p in model.parameters())
                b = PagedKVCache(model.cfg, 1, self.bs, s.device, s.dtype).pool[:, :, 0].nbytes
                rows.append([f"TP {tp} × PP {pp}", f"rank {rank}（层 {shard.layers.start}–{shard.layers.stop - 1}，"
                             f"KV 头 {shard.kv_heads.start}–{shard.kv_heads.stop - 1}）", f"{w / 2**20:.1f}",
                             f"{w / full:.3f}", f"{b / 2**10:.1f}",
                             num_blocks_for_budget(model.cfg, self.bs, s.dtype)])
                if (tp, pp, rank) == (self.tp, 1, 0):
                    self.figures["tp_weight_bytes_per_rank_ratio"] = round(w / full, 4)
                    self.figures["tp_kv_capacity_ratio"] = round(per_block / b, 4)
                del model
        print(table(["切法", "rank", "权重 (MiB)", "÷ 整体", "每块 KV (KiB)", f"{mib} MiB 能放几块"], rows))
        print("权重：rank 的全部参数张量（整体是一个进程的模型，含 lm_head 那份 embedding 的转置副本；切开后每个 rank 的 "
              "embedding 与 lm_head 也是各一份、各 1/TP）。每块 KV：这个 rank 的池子里一块的实际字节（它的层 × 它的 KV 头）。")

    # ---------- [3] 每个 decode 步 ----------
    @torch.inference_mode()
    def decode(self, model, parallel=None) -> dict:
        """B 个请求一次 prefill，再 decode steps 步：decode 步的墙钟时间；rank 0 每个 decode 步的通信（prefill 之后的
        差）；每个 rank 整次运行的通信账。"""
        s, B = self.s, 4 if self.quick else 8
        steps = 24 if self.quick else 64
        text = s.tok.encode(LONG_PROMPT)
        reqs = [Request(text[7 * i:7 * i + 32], steps + 1, SamplingParams(), ignore_eos=True) for i in range(B)]
        nb = sum(step10.blocks_needed(r, self.bs) for r in reqs) + 4
        extra = {"parallel": parallel} if parallel is not None else {}
        e = step10.LLMEngine(model, step10.EngineConfig(**self.config(nb, B, enable_prefix_caching=False)),
                             s.tok, self.eos, **extra)
        for r in reqs:
            e.add_request(r)
        e.step()                                                   # 一次 prefill：之后每一步都是 B 个 decode
        assert all(not q.in_prefill for q in e.scheduler.running), "the prefill did not fit one step"
        before = parallel.stats.snapshot() if parallel is not None else {}
        while e.has_unfinished_requests():
            e.step()
        after = parallel.stats.snapshot() if parallel is not None else {}
        decode = [st.seconds for st in list(e.step_stats)[1:] if not st.prefill]
        per_step = {k: [(after[k][i] - before.get(k, [0, 0, 0.0])[i]) / len(decode) for i in range(3)] for k in after}
        self.engines.append(e)
        return {"B": B, "step_s": statistics.median(decode[2:]), "per_step": per_step, "comm": e.close(),
                "steps": len(decode)}

    def communication(self):
        stage(f"\n[3] 每个 decode 步：TP = 1、TP = {self.tp}、PP = {self.pp} 各跑同样的 decode 负载 ...")
        runs = {"TP 1": self.decode(self.s.model)}
        threads = torch.get_num_threads()
        if threads > 1:   # 同一个进程只用 1 个线程：与每个 rank 的线程数相同（机器上别的进程抢 CPU 时，多线程的一步会慢很多）
            torch.set_num_threads(1)
            try:
                runs["TP 1（1 线程）"] = self.decode(self.s.model)
            finally:
                torch.set_num_threads(threads)
        for tp, pp in ((self.tp, 1), (1, self.pp)):
            with self.group(tp, pp) as (par, model):
                runs[f"TP {tp}" if pp == 1 else f"PP {pp}"] = self.decode(model, par)
        self.runs = runs
        tp_run, pp_run, base = runs[f"TP {self.tp}"], runs[f"PP {self.pp}"], runs["TP 1"]
        B = base["B"]
        rows = []
        for name, run in runs.items():
            ps = run["per_step"]
            rows.append([name, f"{run['step_s'] * 1e3:.1f}", f"{run['step_s'] / base['step_s']:.2f}",
                         *(f"{ps[k][0]:.0f} 次 / {ps[k][1] / 1024:.1f} KiB" if k in ps else "-"
                           for k in ("all_reduce", "gather", "send", "recv", "broadcast"))])
        print(f"机器: {machine()}；批 {B}，每个配置 {base['steps']} 个 decode 步，时间取中位数（去掉前两步）；"
              f"TP 1 用 {torch.get_num_threads()} 个线程，多进程时每个 rank 1 个")
        print(table(["配置", "decode 一步 (ms)", "÷ TP 1", "all-reduce", "gather（logits）", "send", "recv",
                     "broadcast（计划）"], rows))
        ar = tp_run["per_step"]["all_reduce"]
        self.figures.update({"allreduce_per_step": round(ar[0], 2), "allreduce_bytes_per_step": round(ar[1]),
                             "step_time_ratio_tp3_vs_tp1": round(tp_run["step_s"] / base["step_s"], 4),
                             "step_time_ratio_pp2_vs_pp1": round(pp_run["step_s"] / base["step_s"], 4)})
        if "TP 1（1 线程）" in runs:
            one = runs["TP 1（1 线程）"]["step_s"]
            self.figures["step_time_ratio_tp3_vs_tp1_one_thread"] = round(tp_run["step_s"] / one, 4)
        self.checks["allreduce_count_is_two_per_layer_plus_embedding"] = ar[0] == 2 * self.s.cfg.num_layers + 1
        rows, fractions = [], []
        for name in (f"TP {self.tp}", f"PP {self.pp}"):
            for rank, ops in enumerate(runs[name]["comm"]):
                fwd, talk = ops["forward"][2], forward_comm_seconds(ops)
                rows.append([name, rank, f"{fwd:.2f}", f"{talk:.2f}", f"{fwd - talk:.2f}", f"{talk / fwd:.1%}",
                             "，".join(f"{k} {ops[k][0]}" for k in FORWARD_OPS if k in ops)])
                if name == f"TP {self.tp}":
                    fractions.append(talk / fwd)
        self.figures["comm_fraction_tp3"] = round(statistics.mean(fractions), 4)
        print(table(["配置", "rank", "前向 (s)", "其中通信 (s)", "其余（计算）(s)", "通信占比", "次数"], rows))
        print("通信时间包括等别的 rank 算到同一处的时间：几个进程抢 CPU 时，它大部分是排队，不是搬字节。")

    # ---------- [4] 词表 ----------
    @torch.inference_mode()
    def vocabulary(self):
        s, cfg, tp = self.s, self.s.cfg, self.tp
        stage(f"\n[4] 词表（embedding + lm_head）：按行切成 {tp} 份 vs 每个 rank 复制一份 ...")
        E, V, B = cfg.hidden_size, cfg.vocab_size, self.runs["TP 1"]["B"]
        item = s.dtype.itemsize
        x = torch.randn(B, E, dtype=s.dtype, device=s.device)
        W = dense_weight(s.model.lm_head)                                   # (E, V)
        W_shard = W[:, :-(-V // tp)].contiguous()                           # (E, V/TP)
        full_t = median_time(lambda: x @ W, repeats=20, warmup=3, device=s.device)
        shard_t = median_time(lambda: x @ W_shard, repeats=20, warmup=3, device=s.device)
        g = self.runs[f"TP {tp}"]["comm"][0].get("gather", [0, 0, 0.0])
        forwards = self.runs[f"TP {tp}"]["comm"][0]["forward"][0]
        rows = [["复制", f"{2 * V * E * item / 2**20:.1f}", f"{full_t * 1e3:.2f}", "0", "0"],
                ["按行切（本步采用）", f"{2 * -(-V // tp) * E * item / 2**20:.1f}", f"{shard_t * 1e3:.2f}",
                 f"{g[1] / max(g[0], 1) / 1024:.1f}", f"{g[2] / max(g[0], 1) * 1e3:.2f}"]]
        print(table(["词表", "每 rank 的 embedding + lm_head (MiB)", f"lm_head 矩阵乘，批 {B} (ms)",
                     "每步 gather 的字节 (KiB，每 rank 发出)", "每步 gather (ms，rank 0)"], rows))
        print(f"（gather 是 TP = {tp} 那次 decode 运行里 {forwards} 次前向的平均；embedding 另有一次 (T, E) 的 all-reduce，"
              f"算在 [3] 的 all-reduce 里。）")

    # ---------- [5] 真实互连 ----------
    def interconnects(self):
        tp, pp = self.tp, self.pp
        stage(f"\n[5] 同样的字节放到真实互连上（TP = {tp} 与 PP = {pp}，每个 decode 步）...")
        ar = self.runs[f"TP {tp}"]["per_step"]["all_reduce"]
        n_ar, ar_bytes = ar[0], ar[1] / max(ar[0], 1)                     # 次数，每次的字节
        g = self.runs[f"TP {tp}"]["per_step"].get("gather", [0, 0, 0])
        ps = self.runs[f"PP {pp}"]["per_step"]
        p2p = [ps.get("send", [0, 0])[i] + ps.get("recv", [0, 0])[i] for i in range(2)]   # rank 0：hidden 出去、logits 回来
        compute = self.runs["TP 1"]["step_s"]
        rows = []
        for name, bw, lat, source in LINKS:
            # all-reduce 每次按环形算；logits 的 gather：rank 0 收另外 tp − 1 份
            t_tp = (n_ar * ring_allreduce_seconds(ar_bytes, tp, bw, lat)
                    + g[0] * (lat + (tp - 1) * g[1] / max(g[0], 1) / bw))
            t_pp = p2p[0] * lat + p2p[1] / bw
            rows.append([name, f"{bw / 1e9:.1f}", f"{lat * 1e6:.0f}", f"{t_tp * 1e3:.3f}", f"{t_pp * 1e3:.3f}", source])
        print(table(["互连", "单向带宽 (GB/s)", "每跳延迟 (µs)", f"TP {tp} 每步通信 (ms)", f"PP {pp} 每步通信 (ms)",
                     "出处"], rows))
        print(f"字节来自 [3] 的实测：每步 {n_ar:.0f} 次 all-reduce、每次 {ar_bytes / 1024:.1f} KiB（float32；bf16 减半），"
              f"logits gather 每个 rank {g[1] / 1024:.0f} KiB；PP 每步 rank 0 {p2p[0]:.0f} 次 send/recv 共 {p2p[1] / 1024:.0f} KiB"
              f"（hidden 发给下一个 stage 一次 + logits 回到 rank 0 一次）。对照：这台机器上 TP = 1 的一步 {compute * 1e3:.1f} ms。"
              f"TP 理想情况下把每步的计算分成 {tp} 份，只有每步通信远小于省下的那 (1 − 1/{tp}) 份计算时才划算："
              f"{n_ar:.0f} 次 all-reduce 的固定延迟是小模型的主要代价，模型越大（每层计算越多）越划算。")

    def run(self) -> bool:
        print(f"机器: {machine()}；模型 {self.s.path.name}，{self.s.device}/{self.s.dtype_name}；TP = {self.tp}，PP = {self.pp}",
              flush=True)
        self.exactness()
        self.memory()
        self.communication()
        self.vocabulary()
        self.interconnects()
        self.checks["every_pool_empty_at_the_end"] = all(pool_is_free(e) for e in self.engines)
        return finish(STEP, self.s, self.checks, self.figures, self.args.json)


if __name__ == "__main__":
    raise SystemExit("run step10_tensor_parallel/run.py (without --prompt) for the chapter mode")
