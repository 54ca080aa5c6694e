"""结构化输出（step15）的代价与 jump-forward 的收益，同一次运行里量、与 xgrammar / outlines-core 并排：

1. 编译一个语法：我们（正则 → DFA，再算起点的掩码；另列"全部状态的掩码"，对照 outlines-core 在建 Index 时就算好全部状态）、
   xgrammar 0.2.8（compile_regex / compile_json_schema(any_whitespace=False) / 内置的 JSON 文法，单线程）、outlines-core 0.2.14
   （Index：全部状态 × 全部 token）。分词器一侧的准备（我们的 TokenIndex、xgrammar 的 TokenizerInfo、outlines 的 Vocabulary）
   每个分词器一次，另列；
2. 每个 token 的掩码：沿一条合法输出的 token 路径，每一步填一行位图——我们第一遍（新编译的语法：每个新状态第一次算）、
   第二遍（全是缓存）；xgrammar 的 fill_next_token_bitmask；outlines-core 的 write_mask_into。中位数与最大值（µs）；
3. 铺到 logits 上：(B, V) 的 float32 logits、B = 1 / 8，我们的 apply_token_bitmask_ 与 xgrammar 的 apply_token_bitmask_inplace；
4. 引擎里掩码占一步的多少（批 1 与批 8）：真实模型、章节模式的 schema、不跳、不猜，一步一步地走，每个 decode 步记下
   算掩码 + 铺掩码的时间（engine.structured_stats 的增量）与整步的时间；冷（语法刚编译，状态第一次到达）与热（同样的
   请求再跑一遍，全是缓存）各一遍；
5. token/s：同一批 JSON 请求，不约束 / 约束（不跳）/ 约束 + jump-forward，轮流各跑几轮取中位数；批 8（8 个提示词一批）与
   批 1（前 2 个提示词一个一个地跑）；两个 schema：章节模式的（3 个短键）与一个长的固定键的。token/s 之外另列文本字节/s
   与同一批写完的时间之比：不跳时同样的文本常常是更多的 token。另查 jump-forward 与不跳的输出：文本相同的有几个、
   第 9 节的关系（chapter.jump_relation）成立的有几个。

    python bench/structured_bench.py [--quick] [--json] [--repeats N]

只测量，不断言。表头与结尾印机器与 load avg（开始与结束）：负载高时时间不可信，比值也可能变。--quick：1 轮、
第 5 部分只有长键的 schema（批 8 用 4 个提示词、批 1 用 1 个）、不量 outlines-core 在大语法上的 Index、不算"全部状态"。
--json 最后打印一行 JSON。
目标（第 15 章）：热的掩码 + 铺掩码 ≤ 批 8 一次 decode 的 5 %；固定键的 schema 上 jump-forward ≥ 不跳的 1.3 倍 token/s。
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.bench import interleaved_medians, machine, table  # noqa: E402
from common.compare import MARGIN_TOL  # noqa: E402
from step02_sampling.sampler import SamplingParams  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402
from step15_structured_output import engine as step15  # noqa: E402
from step15_structured_output.automaton import START  # noqa: E402
from step15_structured_output.chapter import JSON_PROMPTS, PERSON, jump_relation  # noqa: E402
from step15_structured_output.schema import json_object_regex, schema_to_regex  # noqa: E402
from step15_structured_output.structured import StructuredOutputsParams as SO  # noqa: E402
from step15_structured_output.token_index import (GrammarCompiler, GrammarMatcher, TokenIndex,  # noqa: E402
                                                  allocate_token_bitmask, apply_token_bitmask_, vocab_bytes)

SCHEMA1 = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                            "city": {"enum": ["Paris", "Beijing", "Lima"]}},
           "required": ["name", "age", "city"]}
LONG_KEYS = {"type": "object",
             "properties": {"full_name_of_the_person": {"type": "string", "maxLength": 40},
                            "age_in_completed_years": {"type": "integer"},
                            "city_of_current_residence": {"type": "string", "maxLength": 40},
                            "is_currently_employed_full_time": {"type": "boolean"}},
             "required": ["full_name_of_the_person", "age_in_completed_years", "city_of_current_residence",
                          "is_currently_employed_full_time"]}
# (名字, 种类, 语法, 一条合法的输出：第 2 部分沿它的 token 走)
GRAMMARS = [
    ("date", "regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "1969-07-20"),
    ("phone", "regex", r"\+1 [0-9]{3}-[0-9]{3}-[0-9]{4}", "+1 415-555-0132"),
    ("schema1", "json", SCHEMA1, '{"name": "Ada", "age": 36, "city": "Paris"}'),
    ("person", "json", PERSON, '{"name": "Ada Lovelace", "age": 36, "city": "London"}'),
    ("long_keys", "json", LONG_KEYS, '{"full_name_of_the_person": "Ada Lovelace", "age_in_completed_years": 36, '
                                     '"city_of_current_residence": "London", "is_currently_employed_full_time": false}'),
    ("json_object", "json_object", None, '{"colors": ["red", "green", "blue"], "count": 3}'),
]
BIG = {"person", "long_keys", "json_object"}     # --quick 时 outlines-core 不建它们的 Index（全部状态，几秒到几十秒）


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"load average {os.getloadavg()}"


def med(xs) -> float:
    return statistics.median(xs)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def our_regex(kind, g) -> str:
    return schema_to_regex(json.dumps(g)) if kind == "json" else json_object_regex() if kind == "json_object" else g


# ---------------- 1–3：语法一侧（不用模型） ----------------

class Peers:
    """三家的分词器一侧，每个一次。"""

    def __init__(self, hf, eos, vocab_size):
        import xgrammar as xgr
        from outlines_core import Vocabulary
        self.xgr, self.vocab_size, self.eos = xgr, vocab_size, eos
        self.prep = {}
        self.prep["ours_vocab_bytes"], (token_bytes, _) = timed(lambda: vocab_bytes(hf))
        self.prep["ours_token_index"], self.index = timed(lambda: TokenIndex(token_bytes, [eos], vocab_size))
        self.prep["xgrammar_tokenizer_info"], self.info = timed(
            lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size))

        def outlines_vocab():
            by_bytes: dict[bytes, list[int]] = {}
            for i, b in enumerate(token_bytes):
                if b:
                    by_bytes.setdefault(b, []).append(i)
            return Vocabulary(eos, by_bytes)
        self.prep["outlines_vocabulary"], self.vocab = timed(outlines_vocab)
        self.hf = hf

    # 编译：每次都是新的编译器（没有缓存）
    def ours(self, kind, g):
        c = GrammarCompiler(self.index)
        grammar = c.compile_regex(our_regex(kind, g))
        grammar.masks(START)
        return grammar

    def xgrammar(self, kind, g):
        c = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json":
            return c.compile_json_schema(json.dumps(g), any_whitespace=False)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        return c.compile_regex(g)

    def outlines(self, kind, g):
        from outlines_core import Index
        return Index(our_regex(kind, g), self.vocab)


def compile_section(p: Peers, quick: bool, repeats: int) -> dict:
    out = {}
    for name, kind, g, _ in GRAMMARS:
        row = {}
        row["ours_s"] = med([timed(lambda: p.ours(kind, g))[0] for _ in range(repeats)])
        grammar = p.ours(kind, g)
        row["states"] = grammar.dfa.num_states
        if not quick or name not in BIG:
            row["ours_all_states_s"], _ = timed(lambda: [grammar.masks(s) for s in range(1, grammar.dfa.num_states)])
        row["xgrammar_s"] = med([timed(lambda: p.xgrammar(kind, g))[0] for _ in range(repeats)])
        if not quick or name not in BIG:
            row["outlines_s"] = med([timed(lambda: p.outlines(kind, g))[0] for _ in range(1 if name in BIG else repeats)])
        out[name] = row
    return out


def path_of(p: Peers, kind, g, text) -> list[int]:
    ids = p.hf(text, add_special_tokens=False).input_ids + [p.eos]
    m = GrammarMatcher(p.ours(kind, g))
    assert all(m.accept_token(t) for t in ids) and m.is_terminated(), text
    return ids


def mask_section(p: Peers, quick: bool) -> dict:
    """每个语法沿它那条路径：每一步填位图的时间（µs）。"""
    out = {}
    for name, kind, g, text in GRAMMARS:
        ids = path_of(p, kind, g, text)
        bm = allocate_token_bitmask(1, p.vocab_size)
        grammar = p.ours(kind, g)            # 新编译的：只有起点算过

        def ours_pass():
            m, times = GrammarMatcher(grammar), []
            for t in ids:
                dt, _ = timed(lambda: m.fill_bitmask(bm, 0))
                times.append(dt)
                m.accept_token(t)
            return times
        first, cached = ours_pass(), ours_pass()
        xm = p.xgr.GrammarMatcher(p.xgrammar(kind, g))
        xbm = p.xgr.allocate_token_bitmask(1, p.vocab_size)

        def xgr_pass():
            xm.reset()
            times = []
            for t in ids:
                dt, _ = timed(lambda: xm.fill_next_token_bitmask(xbm))
                times.append(dt)
                xm.accept_token(t)
            return times
        x1, x2 = xgr_pass(), xgr_pass()
        row = {"tokens": len(ids), "ours_first_us": first, "ours_cached_us": cached, "xgrammar_first_us": x1,
               "xgrammar_second_us": x2}
        if not quick or name not in BIG:
            from outlines_core import Guide
            guide = Guide(p.outlines(kind, g))
            obm = torch.zeros((p.vocab_size + 31) // 32, dtype=torch.int32)
            times = []
            for t in ids:
                dt, _ = timed(lambda: guide.write_mask_into(obm.data_ptr(), obm.numel(), 4))
                times.append(dt)
                if t != p.eos:
                    guide.advance(t)
            row["outlines_us"] = times
        out[name] = {k: (v if k == "tokens" else {"median": 1e6 * med(v), "max": 1e6 * max(v)}) for k, v in row.items()}
    return out


def apply_section(p: Peers, repeats: int) -> dict:
    out = {}
    grammar = p.ours("json", SCHEMA1)
    for B in (1, 8):
        bm = allocate_token_bitmask(B, p.vocab_size)
        m = GrammarMatcher(grammar)
        for r in range(B):
            m.fill_bitmask(bm, r)
        logits = torch.randn(B, p.vocab_size)

        def ours():
            apply_token_bitmask_(logits, bm)

        def xgr():
            p.xgr.apply_token_bitmask_inplace(logits, bm)

        def fill_and_apply():            # 引擎的 _apply_masks 做的：B 行缓存的位图拷进来，再铺上
            b = allocate_token_bitmask(B, p.vocab_size)
            for r in range(B):
                m.fill_bitmask(b, r)
            apply_token_bitmask_(logits, b)
        n = max(20, 5 * repeats)
        out[B] = {k: 1e6 * med([timed(f)[0] for _ in range(n)])
                  for k, f in (("ours_us", ours), ("xgrammar_us", xgr), ("cached_fill_and_apply_us", fill_and_apply))}
    return out


# ---------------- 4–5：引擎（真实模型） ----------------

def engine(s, B, **kw):
    config = step15.EngineConfig(num_blocks=160, block_size=16, max_batch_size=B, enable_prefix_caching=False,
                                 spec_method="none", **kw)
    return step15.LLMEngine(s.model, config, s.tok, s.tok.eos_ids)


def requests(s, prompts, n_new):
    return [Request(s.encode(t, True), n_new, SamplingParams()) for t in prompts]


@torch.inference_mode()
def step_split(s, e, reqs, so) -> dict:
    """一步一步地走；每个 decode 步（没有 prefill 的块）记 (掩码的时间, 整步的时间)。"""
    st = e.structured_stats
    for r in reqs:
        e.add_request(r, so)
    mask, step = [], []
    while e.has_unfinished_requests():
        m0, n0 = st.mask_seconds, st.mask_steps
        e.step()
        row = e.step_stats[-1]
        if not row.prefill and st.mask_steps > n0:
            mask.append(st.mask_seconds - m0)
            step.append(row.seconds)
    return {"steps": len(step), "mask_ms": 1e3 * med(mask), "step_ms": 1e3 * med(step),
            "share": sum(mask) / sum(step), "mask_ms_max": 1e3 * max(mask)}


def share_section(s, quick) -> dict:
    out = {}
    so = SO(json=PERSON)
    for B in (1, 8):
        e = engine(s, B, jump_forward=False)
        e.grammars.compiler.grammars.clear()     # 冷：这个语法重新编译，每个状态第一次到达时才算（TokenIndex 留着）
        reqs = requests(s, JSON_PROMPTS[:B], 32 if quick else 48)
        cold = step_split(s, e, reqs, so)
        warm = step_split(s, e, reqs, so)
        out[B] = {"cold": cold, "warm": warm}
    return out


def speed_section(s, quick, repeats) -> dict:
    out = {}
    tol = MARGIN_TOL[s.dtype]
    n_new = 128          # 长键的 schema 不跳时要近 80 个 token（键名被掩码切碎，见 docs/15 第 9 节）：留够，让每个请求都写完
    cases = [("batch8", 8, JSON_PROMPTS[:4 if quick else 8]), ("batch1", 1, JSON_PROMPTS[:1 if quick else 2])]
    for sname, schema in (("person", PERSON), ("long_keys", LONG_KEYS)):
        so = SO(json=schema)
        for cname, B, prompts in cases:
            if quick and sname == "person":
                continue
            reqs = requests(s, prompts, n_new)
            runs = {"free": (dict(), None), "no_jump": (dict(jump_forward=False), so), "jump": (dict(), so)}
            engines = {k: engine(s, B, **kw) for k, (kw, _) in runs.items()}
            last = {}

            def run(k):
                e = engines[k]
                e.structured_stats = step15.StructuredStats()
                with torch.inference_mode():
                    last[k] = e.generate(reqs, runs[k][1]) if runs[k][1] is not None else e.generate(reqs)
            t = interleaved_medians({k: (lambda k=k: run(k)) for k in runs}, repeats, s.device)
            row = {}
            for k in runs:
                o = last[k]
                nbytes = sum(len(s.tok.hf.decode(x, skip_special_tokens=True).encode()) for x in o.outputs)
                row[k] = {"seconds": t[k], "tokens": o.stats.generated_tokens, "forwards": o.stats.num_forwards,
                          "tok_s": o.stats.generated_tokens / t[k], "bytes_s": nbytes / t[k],
                          "finished": sum(r == "stop" for r in o.finish_reasons),
                          "jump_tokens": engines[k].structured_stats.jump_tokens}
            a, b = last["jump"].outputs, last["no_jump"].outputs
            text = [s.tok.hf.decode(x, skip_special_tokens=True) == s.tok.hf.decode(y, skip_special_tokens=True)
                    for x, y in zip(a, b)]
            with torch.inference_mode():
                rel = [jump_relation(engines["jump"].grammars, so, r.prompt_ids, x, y, n_new, s.full_logits, tol,
                                     engines["jump"].grammars.index.token_bytes).ok for r, x, y in zip(reqs, a, b)]
            row["prompts"] = len(prompts)
            row["same_text"], row["same_tokens"], row["relation_ok"] = sum(text), sum(x == y for x, y in zip(a, b)), sum(rel)
            row["jump_vs_no_jump_tok_s"] = row["jump"]["tok_s"] / row["no_jump"]["tok_s"]
            row["jump_vs_no_jump_time"] = row["jump"]["seconds"] / row["no_jump"]["seconds"]
            row["jump_vs_no_jump_bytes_s"] = row["jump"]["bytes_s"] / row["no_jump"]["bytes_s"]
            row["no_jump_vs_free_tok_s"] = row["no_jump"]["tok_s"] / row["free"]["tok_s"]
            out[f"{sname}_{cname}"] = row
            print(f"  {sname} {cname}：token/s 不约束 {row['free']['tok_s']:.1f}、不跳 {row['no_jump']['tok_s']:.1f}、"
                  f"跳 {row['jump']['tok_s']:.1f}（跳 ÷ 不跳 {row['jump_vs_no_jump_tok_s']:.2f}×）；{uptime()}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="冒烟：1 轮；第 5 部分只有长键的 schema、批 8 用 4 个提示词；大语法不建 outlines 的 Index")
    ap.add_argument("--json", action="store_true", help="最后打印一行 JSON")
    ap.add_argument("--repeats", type=int, default=None, help="每个时间量几轮取中位数（默认 3，--quick 1）")
    ap.add_argument("--model", help="模型目录（默认：默认模型）")
    args = ap.parse_args(argv)
    q, repeats = args.quick, args.repeats or (1 if args.quick else 3)
    from common.cli import open_session
    s = open_session(args.model, "cpu", "float32")
    load0, up0, t_start = os.getloadavg()[0], uptime(), time.time()
    print(f"机器: {machine()}；模型 {s.path.name}，cpu/float32\n{up0}", flush=True)

    p = Peers(s.tok.hf, s.tok.eos_ids[0], s.cfg.vocab_size)
    print("\n[1] 编译一个语法（中位数；xgrammar 单线程、不缓存）。分词器一侧每个一次："
          + "，".join(f"{k} {v:.2f} s" for k, v in p.prep.items()), flush=True)
    comp = compile_section(p, q, repeats)

    def ms(x):
        return "-" if x is None else f"{1e3 * x:.1f}"
    print(table(["语法", "DFA 状态", "我们：DFA + 起点 (ms)", "我们：全部状态的掩码 (ms)", "xgrammar (ms)", "outlines-core Index (ms)"],
                [[n, r["states"], ms(r["ours_s"]), ms(r.get("ours_all_states_s")), ms(r["xgrammar_s"]),
                  ms(r.get("outlines_s"))] for n, r in comp.items()]))
    print("xgrammar 的 json_object 一行是它内置的 JSON 文法（任意深度，语言与我们的不同）；person、long_keys 的字符串有 maxLength，"
          "xgrammar 的语言在那里也略不同（测试里写明了）——时间可以并排看，掩码不逐位比。")

    masks = mask_section(p, q)
    print(f"\n[2] 沿一条合法输出的 token 路径，每一步填一行位图（µs，中位数 / 最大）；{uptime()}")

    def mm(r, k):
        return "-" if k not in r else f"{r[k]['median']:.1f} / {r[k]['max']:.0f}"
    print(table(["语法", "token", "我们第一遍", "我们第二遍（缓存）", "xgrammar 第一遍", "xgrammar 第二遍", "outlines-core"],
                [[n, r["tokens"], mm(r, "ours_first_us"), mm(r, "ours_cached_us"), mm(r, "xgrammar_first_us"),
                  mm(r, "xgrammar_second_us"), mm(r, "outlines_us")] for n, r in masks.items()]))

    apply = apply_section(p, repeats)
    print("\n[3] 铺到 (B, 49152) 的 float32 logits 上（µs，中位数）：")
    print(table(["B", "我们 apply_token_bitmask_", "xgrammar apply_token_bitmask_inplace", "我们：B 行缓存的位图拷进来 + 铺"],
                [[B, f"{r['ours_us']:.0f}", f"{r['xgrammar_us']:.0f}", f"{r['cached_fill_and_apply_us']:.0f}"]
                 for B, r in apply.items()]))

    print(f"\n[4] 引擎里：每个 decode 步的掩码时间 ÷ 整步的时间（章节模式的 schema，不跳、不猜）；{uptime()}", flush=True)
    share = share_section(s, q)
    rows = []
    for B, r in share.items():
        for k in ("cold", "warm"):
            x = r[k]
            rows.append([B, "冷（第一次到达的状态要算）" if k == "cold" else "热（全是缓存）", x["steps"], f"{x['mask_ms']:.2f}",
                         f"{x['mask_ms_max']:.1f}", f"{x['step_ms']:.1f}", f"{x['share']:.2%}"])
    print(table(["批", "", "decode 步", "掩码 (ms，中位数)", "掩码 (ms，最大)", "一步 (ms，中位数)", "掩码占 decode 步的时间"], rows))

    print(f"\n[5] token/s：不约束 / 约束不跳 / 约束 + jump-forward（贪心、不猜、关掉前缀缓存，{repeats} 轮轮流取中位数）；{uptime()}",
          flush=True)
    speed = speed_section(s, q, repeats)
    rows = []
    for name, r in speed.items():
        rows.append([name, r["prompts"], *[f"{r[k]['tok_s']:.1f}" for k in ("free", "no_jump", "jump")],
                     f"{r['no_jump']['tokens']} / {r['jump']['tokens']}",
                     f"{r['no_jump']['forwards']} / {r['jump']['forwards']}", r["jump"]["jump_tokens"],
                     f"{r['jump_vs_no_jump_tok_s']:.2f}×", f"{r['jump_vs_no_jump_bytes_s']:.2f}×",
                     f"{r['jump_vs_no_jump_time']:.2f}",
                     f"{r['same_text']}/{r['prompts']}", f"{r['same_tokens']}/{r['prompts']}",
                     f"{r['relation_ok']}/{r['prompts']}"])
    print(table(["schema / 批", "提示词", "不约束 tok/s", "不跳 tok/s", "跳 tok/s", "token（不跳 / 跳）", "前向（不跳 / 跳）",
                 "强制的 token", "跳 ÷ 不跳 tok/s", "跳 ÷ 不跳 文本字节/s", "跳 ÷ 不跳 时间", "文本相同", "token 相同",
                 "关系成立"], rows))
    print("不跳时同样的文本常常是更多的 token（掩码把模型想要的长 token 挡掉，键名被切碎），所以 token/s 偏向不跳；"
          "同一批请求写完的时间（与文本字节/s）才是 jump-forward 省下的。")

    load1, up1 = os.getloadavg()[0], uptime()
    w8 = share[8]["warm"]["share"]
    lk = speed["long_keys_batch8"]
    print(f"\n目标：热的掩码 + 铺掩码占批 8 decode 步的 {w8:.2%}（≤ 5 %）；长的固定键 schema、批 8 上 jump-forward 是不跳的 "
          f"{lk['jump_vs_no_jump_tok_s']:.2f}× token/s、{lk['jump_vs_no_jump_bytes_s']:.2f}× 文本字节/s、时间 "
          f"{lk['jump_vs_no_jump_time']:.2f} 倍（≥ 1.3×）。跳与不跳的输出不保证相同：见'文本相同'与'关系成立'两列（docs/15 第 9 节）。")
    print(f"load avg 开始 {load0:.2f}、结束 {load1:.2f}；墙钟 {time.time() - t_start:.0f} s\n{up1}")
    if args.json:
        print(json.dumps({"machine": machine(), "uptime": [up0, up1], "load_avg": [round(load0, 2), round(load1, 2)],
                          "quick": q, "repeats": repeats, "prep_s": p.prep, "compile": comp, "mask_per_token": masks,
                          "apply": apply, "engine_mask_share": share, "speed": speed,
                          "ratios": {"warm_mask_share_batch8": w8, "warm_mask_share_batch1": share[1]["warm"]["share"],
                                     "jump_vs_no_jump_tok_s": {k: r["jump_vs_no_jump_tok_s"] for k, r in speed.items()},
                                     "jump_vs_no_jump_bytes_s": {k: r["jump_vs_no_jump_bytes_s"] for k, r in speed.items()},
                                     "jump_vs_no_jump_time": {k: r["jump_vs_no_jump_time"] for k, r in speed.items()},
                                     "no_jump_vs_free_tok_s": {k: r["no_jump_vs_free_tok_s"] for k, r in speed.items()}}},
                         ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
