"""step13 的章节模式（run.py 不带 --prompt 时调用）：

负载：代码里造的多文档问答——每篇文档讲一个虚构的人（出生的城镇、职业、最喜欢的颜色）或一个城镇（镇长），夹着
几句与问题无关的填充句，每篇几百个 token（--quick 约一百）；每个请求 3–6 篇（--quick 3 篇）、顺序打乱，问题的答案
在其中一篇里，或要两篇合起来（"X 出生的城镇的镇长是谁"）。用对话模板：模板开头 + 各篇文档（各是一段）+ 问题 + 模板结尾。

[1] 相同：--blend none 与 step12（--kv-policy full）的贪心输出相同；blend 的 r = 0 与 reuse 的 logits 逐位相同；
    r = 1 与完整 prefill 的 logits 在容差内相同、贪心输出相同（分歧只在几乎打平处被接受）；一篇文档的 K 转到位置 p
    与在 p 处单独算相同（打印最大差）。
[2] 质量（对照完整 prefill）：答案位置上（teacher forcing：提示词后面接上答句，"The favorite color of X is" + 答案，
    只比答案那几个 token 的位置）的 KL(完整 ‖ 模式) 与 top-1 一致率，
    每种模式、r ∈ {0, 0.05, 0.15, 0.3, 1}；引擎贪心生成的回答与完整 prefill 的相同的比例；答案正确率（小模型，仅供参考）。
[3] 代价：每个请求的 TTFT（同一台机器、同一批请求，一次一个请求、各模式交替着跑，块缓存和前缀缓存都预先热好）与算了几个 token
    （折算成走完全部层的 token 数），对照完整 prefill 与前缀缓存。
blend 的偏差比较哪一个随 --deviation-on（默认 k；给它要同时给 --blend blend，同 --recompute-ratio 的规矩，其余模式照常量）。
[2] 的 teacher forcing 量全部请求（每种模式一次前向）；引擎生成（[2] 的"回答同完整""答对"与 [3]）量前 ENGINE_REQUESTS 个
（三种问题各占三分之一）：每种模式都要完整生成一遍，全量跑要半个多小时，这样章节运行在 2 核上约一刻钟。
"""
import dataclasses
import random
import statistics

import torch

from common import cli
from common.bench import machine, table
from common.compare import MARGIN_TOL, compare
from common.harness import Checks, finish, pool_is_free, stage
from step04_static_batching.request import Request
from step12_kv_eviction import engine as step12
from step13_kv_blend import engine as step13
from step13_kv_blend.blend import CHECK_LAYER, blend_prefill, chunk_kv, rerotate

STEP = "step13_kv_blend"
RATIOS = (0.0, 0.05, 0.15, 0.3, 1.0)
MAX_NEW = 24       # 贪心回答的长度上限（--quick：16）：模型用一句话回答（"The mayor of … is …"）
ENGINE_REQUESTS = 12   # 引擎生成量前几个请求（--quick：全部 3 个）

NAMES = ["Alice Moreau", "Bruno Castell", "Chen Wei", "Dara Okafor", "Elena Petrova", "Farid Haddad", "Greta Lind",
         "Hugo Brandt", "Ines Duarte", "Jonas Weber", "Kira Tanaka", "Liam O'Neill"]
TOWNS = ["Ashford", "Brindle", "Corvale", "Dunmore", "Eastwick", "Fernhill", "Glenrock", "Harrowgate"]
MAYORS = ["Oscar Quint", "Paula Reyes", "Quentin Hale", "Rosa Lindqvist", "Samir Nasser", "Tessa Vaughn",
          "Umberto Sala", "Vera Kowalski"]
JOBS = ["baker", "pilot", "chemist", "carpenter", "violinist", "librarian", "surgeon", "gardener"]
COLORS = ["green", "purple", "orange", "yellow", "silver", "crimson", "turquoise", "brown"]
FILLER = [
    "The weather in the region is mild for most of the year, with short rainy springs.",
    "Local newspapers often publish long articles about the annual harvest festival.",
    "Many visitors arrive by train, since the old highway is narrow and slow.",
    "The public library keeps a large collection of maps from the previous century.",
    "On weekends the central market sells bread, cheese, fruit and handmade tools.",
    "A small river runs past the old mill, which is now a museum.",
    "Children learn to swim in the lake during the warm summer months.",
    "The town council meets every second Tuesday in the stone hall near the square.",
    "Several families have lived in the same houses for more than four generations.",
    "Cyclists like the quiet roads that wind between the farms and the forest.",
]


def make_workload(rng: random.Random, n_requests: int, docs_per_request: tuple[int, int], filler: int):
    """文档与请求。返回 (docs: 名字 → 文本, requests: [(文档名列表（已打乱）, 问题, 答句的开头, 答案)])。
    答句照模型自己回答的样子（"The favorite color of X is"），答案是开头后面的那个词或名字。"""
    people = list(zip(NAMES, rng.sample(TOWNS * 2, len(NAMES)), [rng.choice(JOBS) for _ in NAMES],
                      [rng.choice(COLORS) for _ in NAMES]))
    mayor = dict(zip(TOWNS, MAYORS))

    def padded(facts: list[str]) -> str:
        sents = facts + rng.sample(FILLER * 3, filler)
        rng.shuffle(sents)
        return " ".join(sents) + "\n\n"
    docs = {}
    for name, town, job, color in people:
        docs[name] = padded([f"{name} was born in the town of {town}.", f"{name} works as a {job}.",
                             f"The favorite color of {name} is {color}."])
    for town in TOWNS:
        docs[town] = padded([f"The mayor of {town} is {mayor[town]}.", f"{town} has a famous clock tower."])
    requests = []
    for i in range(n_requests):
        name, town, job, color = people[i % len(people)]
        if i % 3 == 2:                                       # 要两篇合起来
            q, a, need = f"Who is the mayor of the town where {name} was born?", mayor[town], [name, town]
            lead = f"The mayor of the town where {name} was born is"
        elif i % 3 == 1:
            q, a, need = f"What is the job of {name}?", job, [name]
            lead = f"{name} works as a"
        else:
            q, a, need = f"What is the favorite color of {name}?", color, [name]
            lead = f"The favorite color of {name} is"
        k = rng.randint(*docs_per_request)
        others = rng.sample([d for d in docs if d not in need], k - len(need))
        chosen = need + others
        rng.shuffle(chosen)
        requests.append((chosen, q, lead, a))
    return docs, requests


class Chapter:
    def __init__(self, args, s: cli.Session):
        self.args, self.s, self.quick = args, s, args.quick
        self.deviation = args.deviation_on or "k"             # blend 的偏差比较 K 还是 V（--deviation-on）
        self.bs, self.tol = args.block_size, MARGIN_TOL[s.dtype]
        self.checks, self.figures = Checks(), {}
        rng = random.Random(13)
        n_req = 3 if self.quick else 24                         # --quick：三种问题各一个
        self.max_new = 16 if self.quick else MAX_NEW
        self.docs, self.work = make_workload(rng, n_req, (3, 3) if self.quick else (3, 6), 3 if self.quick else 14)
        tok = s.tok.hf
        head, tail = tok.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False,
                                             add_generation_prompt=True).split("\x00")
        self.head = tok(head, add_special_tokens=False).input_ids
        self.doc_ids = {d: tok(t, add_special_tokens=False).input_ids for d, t in self.docs.items()}
        self.reqs = []   # (prompt ids, chunks, 答句开头的 ids, 答案的 ids, 答案)
        for chosen, q, lead, a in self.work:
            ids, chunks = list(self.head), []
            for d in chosen:
                chunks.append((len(ids), len(ids) + len(self.doc_ids[d])))
                ids += self.doc_ids[d]
            ids += tok(f"Question: {q} Answer with a single word or name." + tail, add_special_tokens=False).input_ids
            self.reqs.append((ids, chunks, tok(lead, add_special_tokens=False).input_ids,
                              tok(" " + a + ".", add_special_tokens=False).input_ids, a))
        self.gen_reqs = self.reqs[:ENGINE_REQUESTS]                # 引擎生成只量这几个（见文件开头）
        self.chunk_cache = {}                                   # 文档名 → 单独算的 K/V（块缓存存的就是它）
        self.modes = ["concat", "reuse"] + [f"blend{round(r * 100)}" for r in RATIOS]
        self.L = s.cfg.num_layers
        # 池子：全部文档（块缓存）+ 最长的一个请求，每篇文档最后一块可能不满
        need = sum(len(v) for v in self.doc_ids.values()) + max(len(r[0]) for r in self.reqs) + self.max_new
        self.num_blocks = -(-need // self.bs) + len(self.doc_ids) + 8

    # ---- 工具 ----
    def kv_of(self, ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in self.chunk_cache:
            self.chunk_cache[key] = chunk_kv(self.s.model, ids)
        return self.chunk_cache[key]

    @torch.inference_mode()
    def blended(self, ids, chunks, mode: str, ratio: float, n_answer: int):
        """teacher forcing：提示词 + 答句（开头 + 答案）一起过 blend_prefill，返回预测最后 n_answer 个 token 的
        logits (A, V) 与 BlendResult。"""
        model = self.s.model
        cfg = model.cfg
        n = len(ids)
        kv = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, n, cfg.head_dim, device=model.device, dtype=model.dtype)
        reused = torch.zeros(n, dtype=torch.bool)
        for s_, e in chunks:
            c = self.kv_of(ids[s_:e])
            if mode != "concat":
                c = torch.stack((rerotate(c[:, 0], s_, model), c[:, 1]), dim=1)
            kv[:, :, :, s_:e], reused[s_:e] = c, True
        base = "blend" if mode.startswith("blend") else mode
        res = blend_prefill(model, ids, kv, reused, base, ratio, self.deviation, all_logits=True)
        idx = res.selected.nonzero()[:, 0].tolist()
        rows = [idx.index(p) for p in range(n - n_answer - 1, n - 1)]   # 位置 p 的 logits 预测第 p+1 个 token
        return res.all_logits[rows], res

    def engine(self, blend: str, ratio=None):
        """一次跑一个请求；前缀缓存只在 prefix 模式开（none = 完整 prefill；标了段的请求在 concat / reuse / blend 下
        本来就不读它）。"""
        cfg = step13.EngineConfig(self.num_blocks, self.bs, max_batch_size=1, enable_prefix_caching=blend == "prefix",
                                  blend=blend, recompute_ratio=ratio)
        return step13.LLMEngine(self.s.model, cfg, self.s.tok, self.s.tok.eos_ids)

    def warm(self, eng, mode: str) -> None:
        """块缓存：每篇文档单独算好存进去（LMCache / CacheBlend 的预计算）；前缀缓存：模板开头 + 每篇文档各作为一个
        提示词跑一遍（命中的是"模板开头 + 第一篇"整块的部分）。"""
        if mode == "prefix":
            eng.generate([Request(self.head + ids, 1) for ids in self.doc_ids.values()])
        elif mode != "none":
            for ids in self.doc_ids.values():
                e = eng.chunk_store.put(ids, self.kv_of(ids))
                eng.chunk_store.release(e)

    def run_engines(self, modes: list[str]) -> dict:
        """全部模式并排量：两个引擎（前缀缓存关着的一个给 none 与各种拼段模式——标了段的请求本来就不读前缀缓存，
        换模式只换 config.blend / recompute_ratio，块缓存热一次；开着前缀缓存的一个给 prefix），每个请求依次在每种模式下
        跑一遍（交替，机器负载的起伏落在每种模式上的机会相同）。贪心，最多 self.max_new 个 token。
        返回 模式 → (输出, TTFT, 前缀缓存命中, 块缓存复用, 量的时候块缓存有没有未命中)。"""
        main, pre = self.engine("none"), self.engine("prefix")
        self.warm(main, "reuse")
        self.warm(pre, "prefix")
        misses0 = main.chunk_store.misses
        out = {m: ([], [], [], []) for m in modes}
        for ids, chunks, *_ in self.gen_reqs:
            for m in modes:
                blend, ratio = ("blend", int(m[5:]) / 100) if m.startswith("blend") else (m, None)
                eng = pre if m == "prefix" else main
                eng.config = dataclasses.replace(eng.config, blend=blend, recompute_ratio=ratio,
                                                 deviation_on=self.deviation if blend == "blend" else None)
                eng.config.validate()
                r = eng.generate([Request(ids, self.max_new)], [chunks])
                st = r.stats
                for acc, v in zip(out[m], (r.outputs[0], st.first_token_s[0] - st.arrival_s[0], st.cached_tokens[0],
                                           st.reused_tokens[0])):
                    acc.append(v)
        self.store_all_hit = main.chunk_store.misses == misses0
        self.pools_free = pool_is_free(main) and pool_is_free(pre)
        return out

    # ---- 章节 ----
    def run(self) -> bool:
        s, c, f = self.s, self.checks, self.figures
        print(f"机器：{machine()}；模型 {s.path.name}（{s.dtype_name}，{self.L} 层）；{len(self.reqs)} 个请求，"
              f"每个 {min(len(r[1]) for r in self.reqs)}–{max(len(r[1]) for r in self.reqs)} 篇文档，"
              f"提示词 {min(len(r[0]) for r in self.reqs)}–{max(len(r[0]) for r in self.reqs)} 个 token；"
              f"文档 {min(map(len, self.doc_ids.values()))}–{max(map(len, self.doc_ids.values()))} 个 token；"
              f"teacher forcing 量全部 {len(self.reqs)} 个，引擎生成量前 {len(self.gen_reqs)} 个")

        stage("\n[1] 相同")
        ids0 = self.doc_ids[self.work[0][0][0]]
        at0, p = self.kv_of(ids0), 300
        at_p = chunk_kv(s.model, ids0, start=p)
        d = (rerotate(at0[:, 0], p, s.model) - at_p[:, 0]).abs().max().item()
        f["rerotate_max_abs_diff"] = d
        print(f"  一篇文档（{len(ids0)} 个 token）在位置 0 单独算、K 再转 {p}，与在 {p} 处单独算：每层 K 的最大差 {d:.2e}"
              f"（不转时 {(at0[:, 0] - at_p[:, 0]).abs().max().item():.2e}）")
        c["rerotated keys equal keys computed at the new offset"] = d < 10 * self.tol

        full_logits, quality = [], {m: {"kl": [], "top1": []} for m in self.modes}
        r0_equal, r1_diff = True, 0.0
        for ids, chunks, lead, ans, _ in self.reqs:
            seq = ids + lead + ans                                               # 只比答案那几个 token 的位置
            full = s.full_logits(seq)[len(seq) - len(ans) - 1:len(seq) - 1].float()   # (A, V)
            full_logits.append(full)
            got = {}
            for m in self.modes:
                ratio = int(m[5:]) / 100 if m.startswith("blend") else 0.0
                got[m], _ = self.blended(seq, chunks, m, ratio, len(ans))
                lp_full, lp = torch.log_softmax(full, -1), torch.log_softmax(got[m].float(), -1)
                quality[m]["kl"].append((lp_full.exp() * (lp_full - lp)).sum(-1).mean().item())
                quality[m]["top1"].append((full.argmax(-1) == got[m].argmax(-1)).float().mean().item())
            r0_equal &= torch.equal(got["blend0"], got["reuse"])
            r1_diff = max(r1_diff, (got["blend100"].float() - full).abs().max().item())
        c["blend r=0 logits equal reuse exactly"] = r0_equal
        c["blend r=1 logits equal full prefill (tolerance)"] = r1_diff < 10 * self.tol
        print(f"  r = 0 与 reuse 的答案位置 logits 逐位相同：{r0_equal}；r = 1 与完整 prefill 的最大差 {r1_diff:.2e}")

        stage(f"\n[2][3] 引擎：贪心回答、TTFT、算了多少（前 {len(self.gen_reqs)} 个请求，一次一个、各模式交替，缓存预先热好）")
        runs = self.run_engines(["none", "prefix"] + self.modes)
        ref12 = step12.LLMEngine(s.model, step12.EngineConfig(self.num_blocks, self.bs), s.tok,
                                 s.tok.eos_ids).generate([Request(r[0], self.max_new) for r in self.gen_reqs]).outputs
        none_out = runs["none"][0]
        c["--blend none equals step12 (--kv-policy full)"] = none_out == ref12
        for m in ("prefix", "blend100"):
            cmp = [compare(f"{m} request {i}", r[0], none_out[i], runs[m][0][i], s.full_logits, self.tol)
                   for i, r in enumerate(self.gen_reqs)]
            c[f"--blend {m} greedy output equals full prefill"] = all(x.ok for x in cmp)
            for x in cmp:
                if not x.equal:
                    c.note(x.describe())
        c["chunk store: every chunk hit after warm-up, every block returned"] = self.store_all_hit and self.pools_free

        P = [len(r[0]) for r in self.gen_reqs]
        ttft_full = statistics.median(runs["none"][1])
        rows, curve = [], []
        for m in ["none", "prefix"] + self.modes:
            outs, ttft, cached, reused = runs[m]
            same = sum(o == n for o, n in zip(outs, none_out)) / len(outs)
            acc = sum(r[4].lower() in s.tok.decode(o).lower() for o, r in zip(outs, self.gen_reqs)) / len(outs)
            probe = (CHECK_LAYER / self.L) * sum(P) if m.startswith("blend") and m != "blend0" else 0.0   # r = 0 不跑检查段
            computed = (sum(P) - sum(cached) - sum(reused) + probe) / len(P)
            t = statistics.median(ttft)
            name = "full" if m == "none" else m
            f[f"accuracy_{name}"], f[f"ttft_ms_{name}"], f[f"prefill_tokens_{name}"] = acc, 1000 * t, computed
            if name != "full":
                f[f"answer_same_as_full_{name}"], f[f"ttft_ratio_{name}_vs_full"] = same, t / ttft_full
            q = quality.get(m)
            kl = statistics.mean(q["kl"]) if q else None
            top1 = statistics.mean(q["top1"]) if q else None
            if q:
                f[f"kl_{name}"], f[f"top1_agree_{name}"] = kl, top1
                curve.append((name, computed / statistics.mean(P), top1, same))
            rows.append([name, "精确" if q is None else f"{kl:.4f}", "精确" if q is None else f"{top1:.3f}",
                         f"{same:.2f}", f"{acc:.2f}", f"{computed:.0f}", f"{1000 * t:.1f}", f"{t / ttft_full:.2f}"])
        print(table(["模式", "KL(完整‖模式)", "top-1 一致", "回答同完整", "答对", "算了几个 token", "TTFT ms", "TTFT ÷ 完整"],
                    rows))
        print(f"  （KL、top-1：全部 {len(self.reqs)} 个请求的答案位置；其余列：引擎生成的 {len(P)} 个，每个请求平均；"
              f"提示词平均 {statistics.mean(P):.0f} 个 token；'算了几个 token' 折算成走完全部 {self.L} 层的 "
              f"token 数，blend 含第 0..{CHECK_LAYER - 1} 层为选择而算的全部 token；prefix 命中的是模板开头 + 第一篇文档的整块）")
        if self.args.plot:
            plot(self.args.plot, curve)
            print(f"图已存到 {self.args.plot}")
        return finish(STEP, s, c, f, self.args.json)


def plot(path, curve) -> None:
    """质量找回多少 vs 算了多少：横轴 = 算的 token ÷ 完整 prefill 的，纵轴 = 答案位置的 top-1 一致率、回答同完整的比例。
    落在同一点的模式（r = 0 与 reuse 逐位相同、代价也相同）只标一次，名字用 = 连起来。blend r = 1 在 1 的右边：
    它除了全部重算，还跑了检查段（n / L）。"""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.plotting import use_chinese_font
    use_chinese_font()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    xs = [x for _, x, _, _ in curve]
    ax.axvline(1.0, color="gray", ls=":", lw=1)
    ax.text(1.0, 0.02, "完整 prefill ", ha="right", va="bottom", fontsize=8, color="gray",
            transform=ax.get_xaxis_transform())
    ax.plot(xs, [t for _, _, t, _ in curve], "o-", label="答案位置 top-1 与完整 prefill 一致")
    ax.plot(xs, [s for _, _, _, s in curve], "s--", label="贪心回答与完整 prefill 相同")
    labels: dict = {}                                           # (x, y) → 落在这一点的模式名
    for name, x, t, _ in curve:
        labels.setdefault((round(x, 6), round(t, 6)), []).append(name)
    for (x, t), names in labels.items():
        ax.annotate(" = ".join(names), (x, t), textcoords="offset points", xytext=(-4 if x > 0.9 else 4, -10),
                    ha="right" if x > 0.9 else "left", fontsize=8)
    ax.set_xlabel("算了多少（÷ 完整 prefill 的 token 数）")
    ax.set_ylabel("比例")
    ax.set_title("复用文档的 K/V：重算多少换回多少质量")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
