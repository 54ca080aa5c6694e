"""step15 的章节模式（run.py 不带 --prompt 时调用）：

[1] 不给约束就是 step09：章节提示词（贪心与带种子的抽样，不猜与 ngram）的输出与每一次前向都与 step09 的引擎相同；
[2] 输出满足约束：正则、choice、JSON Schema、json_object，贪心与抽样、不猜与 ngram；结束（接受了 EOS）的输出
    用别人的实现检查——re.fullmatch、jsonschema.validate、json.loads；没写完就到 max_new_tokens 的，每个 token 都被
    语法接受（是某个合法输出的前缀）；
[3] 掩码只去掉不合法的：贪心的输出本来就满足约束（约束就是它的文本本身）时，加上约束 token 一个不变（不猜与 ngram）；
[4] jump-forward：固定键的 schema 上，跳的输出是"强制的几段按分词器的切法、其余是铺了掩码的贪心"（jump_relation：
    重放每一次跳、teacher forcing 检查每个采样的 token），与不跳的输出逐 token 相同，直到第一个"跳放进去的 token
    与模型自己选的切法不同"的位置；之后模型的上文不同，文本可以不同（打印有几个相同）。前向少了多少；
[5] 快慢：同一组要 JSON 的请求，不约束 / 约束（不跳）/ 约束（跳）各跑一遍：token/s、前向次数、每步算掩码的时间、
    jump-forward 省下的 token。
"""
import json
import re
import time
from dataclasses import dataclass
from typing import Callable, Optional

import jsonschema
import torch

from common import cli
from common.bench import interleaved_medians, machine, table
from common.compare import MARGIN_TOL, compare, top2_margin
from common.harness import Checks, finish, pool_is_free, stage
from common.prompts import CHAPTER_PROMPTS
from step02_sampling.sampler import SamplingParams
from step04_static_batching.request import Request
from step09_speculative import engine as step09
from step15_structured_output import engine as step15
from step15_structured_output.config import num_blocks_for_budget
from step15_structured_output.schema import literal
from step15_structured_output.structured import Grammars, jump_forward_tokens
from step15_structured_output.structured import StructuredOutputsParams as SO
from step15_structured_output.token_index import TokenIndex, allocate_token_bitmask, unpack_bits

STEP = "step15_structured_output"
POOL_BLOCKS = 160          # 每个引擎的池子至多这么多块（块 16 时 2560 个 token 的槽）
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "age", "city"]}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
CITIES = ("Paris", "Beijing", "Lima", "Nairobi")
CONSTRAINTS = [   # (名字, 约束, 它的文本是否合法：别人的实现)
    ("regex", SO(regex=DATE), lambda t: re.fullmatch(DATE, t) is not None),
    ("choice", SO(choice=CITIES), lambda t: t in CITIES),
    ("json_schema", SO(json=PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ("json_object", SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
]
JSON_PROMPTS = [
    "Describe Ada Lovelace as a JSON object with name, age and city.",
    "Give me a JSON object for a person called Bob who is 42 and lives in Paris.",
    "Return JSON describing the author of Hamlet: name, age, city.",
    "Make up a person and describe them in JSON with name, age and city.",
    "Describe Marie Curie as JSON: name, age, city.",
    "JSON please: a 30-year-old engineer named Li who lives in Beijing.",
    "Output a JSON record (name, age, city) for Albert Einstein.",
    "Describe a fictional detective as a JSON object with name, age and city.",
]
ASK = {"regex": "When did the first person walk on the Moon? Answer with a date.",
       "choice": "Which city is the capital of France?",
       "json_schema": JSON_PROMPTS[0], "json_object": "List three colors as a JSON object."}


def valid_text(check, text: str) -> bool:
    try:
        return bool(check(text))
    except (ValueError, jsonschema.ValidationError):   # json.JSONDecodeError 是 ValueError
        return False


def forced_positions(grammars: Grammars, so: SO, output: list[int], max_new_tokens: int) -> Optional[list[bool]]:
    """output（贪心、不猜、不带停止条件的请求在 jump-forward 开着时的输出）的每个位置是 jump-forward 放进去的（True）
    还是采样的：照引擎的顺序重放——add_request 时跳一次（至多 max_new_tokens − 1 个、不含 EOS），之后每采样一个 token
    （没结束时）跳一次。重放出的强制 token 与输出对不上时返回 None。"""
    m, flags = grammars.matcher(so), []

    def jump(cap: int, with_eos: bool = True) -> bool:
        tokens = jump_forward_tokens(m, grammars, cap, with_eos)
        if output[len(flags):len(flags) + len(tokens)] != tokens:
            return False
        for t in tokens:
            m.accept_token(t)
        flags.extend([True] * len(tokens))
        return True

    if not jump(max_new_tokens - 1, with_eos=False):
        return None
    while len(flags) < len(output):
        if not m.accept_token(output[len(flags)]):
            return None
        flags.append(False)
        if m.is_terminated() or len(flags) == max_new_tokens:
            break
        if not jump(max_new_tokens - len(flags)):
            return None
    return flags if len(flags) == len(output) else None


@dataclass
class JumpRelation:
    ok: bool
    forced: Optional[list[bool]]   # 跳的输出每个位置是不是强制的（重放不出来时 None）
    divergence: Optional[int]      # 跳与不跳第一个不同的 token 的位置（逐 token 相同时 None）
    reason: str                    # 不成立时：哪一条、在哪里；成立时：分歧是哪一种


def jump_relation(grammars: Grammars, so: SO, prompt_ids: list[int], jumped: list[int], plain: list[int],
                  max_new_tokens: int, logits_fn: Callable[[list[int]], torch.Tensor], tol: float,
                  token_bytes: list) -> JumpRelation:
    """jump-forward 能保证的关系（贪心）：
    (a) 跳的输出 = 强制的几段（重放 jump_forward_tokens 得到，分词器的切法）+ 其余每个 token 都是"在它自己的上文上
        铺了掩码的 logits 的 argmax"（teacher forcing：logits_fn(提示词 + 跳的输出) 一次前向；top-2 差小于 tol 的
        打平不算错）；
    (b) 跳与不跳逐 token 相同，直到第一个不同的位置 d；d 上跳的那个 token 是强制的，不跳的是模型自己对同一段强制字节
        的另一种切法（两个 token 的字节一个是另一个的前缀）——或者 d 上是一次打平。
    d 之后两边的上文不同，不再比：模型在不同的 token 上接着写，文本可以不同。"""
    forced = forced_positions(grammars, so, jumped, max_new_tokens)
    if forced is None:
        return JumpRelation(False, None, None, "the forced tokens do not replay")
    n = len(prompt_ids)
    logits = logits_fn(prompt_ids + jumped)[n - 1:n - 1 + len(jumped)].float()   # (len(jumped), V)：第 i 行预测 jumped[i]
    m, bitmask = grammars.matcher(so), allocate_token_bitmask(1, logits.shape[-1])
    margins = []
    for i, (t, f) in enumerate(zip(jumped, forced)):
        m.fill_bitmask(bitmask)
        row = logits[i].masked_fill(~unpack_bits(bitmask, logits.shape[-1])[0], float("-inf"))
        margins.append(top2_margin(row))
        if not f and int(row.argmax()) != t and margins[i] >= tol:
            return JumpRelation(False, forced, None, f"sampled token {i} ({t}) is not the masked argmax "
                                                     f"({int(row.argmax())}, margin {margins[i]:.2e})")
        m.accept_token(t)
    d = next((i for i, (a, b) in enumerate(zip(jumped, plain)) if a != b), None)
    if d is None:
        same = len(jumped) == len(plain)
        return JumpRelation(same, forced, None, "identical tokens" if same else "one output is a prefix of the other")
    a, b = token_bytes[jumped[d]] or b"", token_bytes[plain[d]] or b""
    if forced[d] and (a.startswith(b) or b.startswith(a)):
        return JumpRelation(True, forced, d, "forced spelling")
    if not forced[d] and margins[d] < tol:
        return JumpRelation(True, forced, d, f"near-tie (margin {margins[d]:.2e})")
    return JumpRelation(False, forced, d, f"the outputs differ at {d}: {jumped[d]} ({'forced' if forced[d] else 'sampled'})"
                                          f" vs {plain[d]}")


class Chapter:
    def __init__(self, args, s: cli.Session):
        self.args, self.s, self.quick = args, s, args.quick
        self.tol, self.eos, self.bs, self.B = MARGIN_TOL[s.dtype], s.tok.eos_ids, args.block_size, args.max_batch_size
        # 这里的负载（批至多 8、每个至多几百个 token）用不了默认的 256 MiB 池子；章节要建几十个引擎，每个只给够用的
        self.num_blocks = args.num_blocks or min(POOL_BLOCKS, num_blocks_for_budget(s.cfg, self.bs, s.dtype))
        self.checks, self.figures, self.pools_free = Checks(), {}, True

    def engine(self, step=step15, **kw):
        a = self.args
        config = step.EngineConfig(self.num_blocks, self.bs, self.B, a.max_num_batched_tokens,
                                   **{"attention": a.attention, "num_spec_tokens": a.num_spec_tokens,
                                      "ngram_min": a.ngram_min, "ngram_max": a.ngram_max, **kw})
        return step.LLMEngine(self.s.model, config, self.s.tok, self.eos)

    def generate(self, e, reqs, so=None):
        """跑完，顺便记下块是否全部还回来了（引擎用完就扔：几十个池子不同时留在内存里）。"""
        out = e.generate(reqs, so) if so is not None else e.generate(reqs)
        self.pools_free &= pool_is_free(e)
        return out

    def text(self, ids: list[int]) -> str:
        return self.s.tok.hf.decode(ids, skip_special_tokens=True)

    def compare_all(self, name, reqs, refs, outs) -> bool:
        res = [compare(f"{name}#{i}", r.prompt_ids, ref, got, self.s.full_logits, self.tol)
               for i, (r, ref, got) in enumerate(zip(reqs, refs, outs))]
        for c in res:
            if not c.equal:
                self.checks.note(c.describe())
        return all(c.ok for c in res)

    # ---------- [1] 不给约束 = step09 ----------
    @torch.inference_mode()
    def same_as_step09(self):
        s = self.s
        n_new = 16 if self.quick else 48
        stage(f"[1] 不给约束：step15 与 step09 的引擎（章节提示词，{n_new} 个 token）...")
        ok, rows = True, []
        for spec in ("none", "ngram"):
            for pname, params in (("贪心", SamplingParams()), ("抽样", SamplingParams(temperature=0.8, top_p=0.95, seed=1))):
                reqs = [Request(s.encode(t, chat), n_new, params) for _, t, chat in CHAPTER_PROMPTS]
                ref = self.generate(self.engine(step09, spec_method=spec), reqs)
                out = self.generate(self.engine(spec_method=spec), reqs)
                same = out.outputs == ref.outputs and out.stats.forward_shapes == ref.stats.forward_shapes
                ok &= same
                rows.append([spec, pname, out.stats.num_forwards, ref.stats.num_forwards,
                             "输出与每一次前向都相同" if same else "不同"])
        self.checks["no_constraint_equals_step09"] = ok
        print(table(["--spec-method", "采样", "前向次数", "step09 前向次数", "结果"], rows))

    # ---------- [2] 输出满足约束 ----------
    @torch.inference_mode()
    def validity(self):
        s = self.s
        n_new = 48 if self.quick else 96
        stage(f"\n[2] 约束下的输出（至多 {n_new} 个 token），用 re / jsonschema / json 检查 ...")
        rows, ok, stopped, total = [], True, 0, 0
        for name, so, check in CONSTRAINTS:
            for spec in ("none", "ngram"):
                for pname, params in (("贪心", SamplingParams()), ("抽样", SamplingParams(temperature=0.8, seed=2))):
                    e = self.engine(spec_method=spec)
                    out = self.generate(e, [Request(s.encode(ASK[name], True), n_new, params)], so)
                    ids, reason = out.outputs[0], out.finish_reasons[0]
                    m = e.grammars.matcher(so)
                    legal = all(m.accept_token(t) for t in ids)
                    good = legal and (reason != "stop" or valid_text(check, self.text(ids)))
                    ok &= good
                    stopped += reason == "stop"
                    total += 1
                    shown = self.text(ids)
                    rows.append([name, spec, pname, reason, repr(shown if len(shown) < 60 else shown[:57] + "..."),
                                 ("✅ 合法" if reason == "stop" else "✅ 合法的前缀") if good else "❌"])
        self.checks["constrained_outputs_valid"] = ok
        self.figures["constrained_stop_fraction"] = round(stopped / total, 4)
        print(table(["约束", "--spec-method", "采样", "结束", "输出", "检查"], rows))

    # ---------- [3] 掩码只去掉不合法的 ----------
    @torch.inference_mode()
    def masking_only_removes(self):
        s = self.s
        n_new = 16 if self.quick else 32
        stage("\n[3] 贪心的输出本来就满足约束时（约束 = 它自己的文本），加上约束 token 不变 ...")
        ok, rows = True, []
        reqs = [Request(s.encode(t, chat), n_new, SamplingParams()) for _, t, chat in CHAPTER_PROMPTS]
        free = self.generate(self.engine(spec_method="none"), reqs)
        index = Grammars(s.tok.hf, self.eos, s.cfg.vocab_size).index
        for (pname, _, _), r, ids, reason in zip(CHAPTER_PROMPTS, reqs, free.outputs, free.finish_reasons):
            body = ids[:-1] if reason == "stop" and ids[-1] in self.eos else ids     # 结尾的 EOS 不是文本
            try:
                so = SO(regex=literal(b"".join(index.token_bytes[t] or b"" for t in body).decode("utf-8")))
            except UnicodeDecodeError:   # 输出停在一个字符的中间：写不成正则，这个提示词不比
                rows.append([pname, "-", "输出停在一个 UTF-8 字符中间，跳过"])
                continue
            for spec in ("none", "ngram"):
                got = self.generate(self.engine(spec_method=spec, jump_forward=False), [r], so).outputs[0]
                same = got == ids
                ok &= same
                rows.append([pname, spec, "相同" if same else f"不同：{self.text(got)!r}"])
        self.checks["masking_only_removes_greedy"] = ok
        print(table(["提示词", "--spec-method", "加上约束后的 token"], rows))

    # ---------- [4] jump-forward 与不跳 ----------
    @torch.inference_mode()
    def jump_forward(self):
        s = self.s
        n_new = 64 if self.quick else 96
        prompts = JSON_PROMPTS[:2 if self.quick else 8]
        stage(f"\n[4] 固定键的 schema：jump-forward 与不跳（贪心、不猜，{len(prompts)} 个提示词一批）...")
        so = SO(json=PERSON)
        reqs = [Request(s.encode(t, True), n_new, SamplingParams()) for t in prompts]
        on, off = self.engine(spec_method="none"), self.engine(spec_method="none", jump_forward=False)
        a, b = self.generate(on, reqs, so), self.generate(off, reqs, so)
        index = on.grammars.index
        hf = s.tok.hf
        rows, ok, same_text, same_tokens = [], True, 0, 0
        for t, r, x, y in zip(prompts, reqs, a.outputs, b.outputs):
            rel = jump_relation(on.grammars, so, r.prompt_ids, x, y, n_new, s.full_logits, self.tol, index.token_bytes)
            ok &= rel.ok
            if not rel.ok:
                self.checks.note(f"[4] {t[:40]}...: {rel.reason}")
            same_text += self.text(x) == self.text(y)
            same_tokens += x == y
            d = rel.divergence
            where = "-" if d is None else (f"{d}：跳 {hf.convert_ids_to_tokens(x[d])!r}（{'强制' if rel.forced[d] else '采样'}）"
                                           f" / 不跳 {hf.convert_ids_to_tokens(y[d])!r}")
            rows.append([t[:40] + "...", f"{len(x)} / {len(y)}", sum(rel.forced or []), where,
                         "相同" if self.text(x) == self.text(y) else "不同", "✅" if rel.ok else f"❌ {rel.reason}"])
        self.checks["jump_forward_is_greedy_with_the_tokenizers_spelling"] = ok
        self.figures["forwards_ratio_jump_vs_no_jump"] = round(a.stats.num_forwards / b.stats.num_forwards, 4)
        self.figures["jump_forward_same_text_fraction"] = round(same_text / len(prompts), 4)
        print(table(["提示词", "token（跳 / 不跳）", "强制的 token", "第一个不同的 token（Ġ 是空格）", "文本", "关系"], rows))
        print(f"前向次数：跳 {a.stats.num_forwards}，不跳 {b.stats.num_forwards}；强制追加的 token "
              f"{on.structured_stats.jump_tokens} 个（{on.structured_stats.jumps} 次）。文本相同 {same_text}/{len(prompts)}，"
              f"token 逐个相同 {same_tokens}/{len(prompts)}。\n"
              "关系：跳的输出 = 强制的几段（分词器的切法）+ 其余每个 token 是它自己上文上铺了掩码的贪心（teacher forcing 检查）；"
              "与不跳的逐 token 相同，直到第一个强制 token 与模型自己的切法不同的位置（例如跳放进 `{\"`，模型自己写 `{` + `\"`）。"
              "那之后模型的上文不同，写出的文本可以不同：jump-forward 保证的是这个关系，不是文本相同")

    # ---------- [5] 快慢 ----------
    @torch.inference_mode()
    def speed(self):
        s = self.s
        n_new = 64 if self.quick else 128
        prompts = JSON_PROMPTS[:2 if self.quick else 8]
        repeats = 1 if self.quick else 3
        stage(f"\n[5] 同样 {len(prompts)} 个要 JSON 的请求（批 {min(self.B, len(prompts))}，至多 {n_new} 个 token）："
              f"不约束 / 约束不跳 / 约束并跳；{repeats} 轮交替取中位数 ...")
        t0 = time.perf_counter()                       # 分词器这一侧的索引：每个分词器建一次（引擎里有缓存，这里另建一份量时间）
        TokenIndex.from_tokenizer(s.tok.hf, self.eos, s.cfg.vocab_size)
        self.figures["token_index_build_s"] = round(time.perf_counter() - t0, 3)
        print(f"建分词器的 TokenIndex（trie 与每个 token 的字节，每个分词器一次）：{self.figures['token_index_build_s']:.2f} s")
        reqs = [Request(s.encode(t, True), n_new, SamplingParams()) for t in prompts]
        runs = {"free": (dict(), None), "no_jump": (dict(jump_forward=False), SO(json=PERSON)),
                "jump": (dict(), SO(json=PERSON))}
        engines = {name: self.engine(spec_method="none", enable_prefix_caching=False, **kw) for name, (kw, _) in runs.items()}
        last = {}

        def run(name):
            e = engines[name]
            e.structured_stats = step15.StructuredStats()
            last[name] = self.generate(e, reqs, runs[name][1])
        med = interleaved_medians({n: (lambda n=n: run(n)) for n in runs}, repeats, s.device)
        rows = []
        labels = {"free": "不约束", "no_jump": "约束（不跳）", "jump": "约束 + jump-forward"}
        for name in runs:
            out, st = last[name], engines[name].structured_stats
            tok_s = out.stats.generated_tokens / med[name]
            mask_ms = 1e3 * st.mask_seconds / st.mask_steps if st.mask_steps else 0.0
            rows.append([labels[name], out.stats.generated_tokens, out.stats.num_forwards, f"{med[name]:.2f}",
                         f"{tok_s:.1f}", f"{mask_ms:.2f}" if st.mask_steps else "-", st.jump_tokens])
            self.figures[f"tok_s_{'unconstrained' if name == 'free' else 'constrained_' + name}"] = round(tok_s, 2)
            if name == "no_jump":
                self.figures["mask_ms_per_step"] = round(mask_ms, 4)
                self.figures["mask_fraction_of_step"] = round(st.mask_seconds / med[name], 4)
            if name == "jump":
                self.figures["jump_forward_tokens"] = st.jump_tokens
                self.figures["jump_forward_token_fraction"] = round(st.jump_tokens / max(out.stats.generated_tokens, 1), 4)
        print(f"机器: {machine()}")
        print(table(["", "产出 token", "前向次数", "时间 (s)", "token/s", "掩码 (ms/步)", "jump-forward 的 token"], rows))
        print("掩码的时间含：这一步每一行的位图（状态第一次到达时沿 trie 算一遍，之后是缓存）与把它铺到 logits 上。")

    def run(self) -> bool:
        print(f"机器: {machine()}；模型 {self.s.path.name}，{self.s.device}/{self.s.dtype_name}", flush=True)
        self.same_as_step09()
        self.validity()
        self.masking_only_removes()
        self.jump_forward()
        self.speed()
        self.checks["every_pool_empty_at_the_end"] = self.pools_free
        return finish(STEP, self.s, self.checks, self.figures, self.args.json)


if __name__ == "__main__":
    raise SystemExit("run step15_structured_output/run.py (without --prompt) for the chapter mode")
