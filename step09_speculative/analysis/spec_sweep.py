"""k 扫一遍：每个 k 量验证的代价 c(k)、grounded 批 1 的加速与每次验证接受几个 a，对照预测 (1 + a) / c(k)（docs/09 练习 7）。

对每个 k（--ks，默认 1..8）：
- c(k)：批 1、上下文 512，一次前向算 1 + k 个 token 与算 1 个 token 的时间之比（同 chapter.py 的 [2]，中位数）；
- grounded 负载的前 4 个提示词、各至多 128 个 token、批 1、关掉前缀缓存：step08 与 step09（ngram，num_spec_tokens = k）
  交替跑几轮取中位数（同 chapter.py 的 [3]），两者的 token 必须相同（按 run.py 的"相等"规则），否则退出码 1；
- a = 接受的猜测 ÷ 验证次数、接受率、每 token 的目标前向次数；预测的加速 (1 + a) / c(k) 与量到的加速。
预测只算带猜测的步：找不到 n-gram 的步照常 decode，接受率低时按请求暂停（SPEC_MIN_ACCEPTANCE），所以两者会有差距。

    python step09_speculative/analysis/spec_sweep.py [--ks 1,2,4] [--repeats 3] [--quick] [--json]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from common import cli  # noqa: E402
from common.bench import interleaved_medians, machine, table  # noqa: E402
from common.compare import MARGIN_TOL, compare  # noqa: E402
from common.prompts import LONG_PROMPT  # noqa: E402
from step02_sampling.sampler import SamplingParams  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402
from step08_kv_quant import engine as step08  # noqa: E402
from step09_speculative import engine as step09  # noqa: E402
from step09_speculative.config import DEFAULT_MAX_NUM_BATCHED_TOKENS  # noqa: E402
from step09_speculative.analysis.workload import GROUNDED, requests as workload  # noqa: E402
from step09_speculative.engine import SPEC_MIN_ACCEPTANCE, SpecStats, blocks_needed  # noqa: E402

BLOCK_SIZE = 16


def engine(s: cli.Session, step, num_blocks: int, batch: int, budget: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, **kw):
    """同 chapter.py 的 Chapter.engine：step09 的引擎（kw 给 spec_method、num_spec_tokens……）或 step=step08 的参照。"""
    config = step.EngineConfig(num_blocks, BLOCK_SIZE, batch, budget, **kw)
    return step.LLMEngine(s.model, config, s.tok, s.tok.eos_ids)


@torch.inference_mode()
def verify_costs(s: cli.Session, ks, context: int = 512, repeats: int = 10) -> dict[int, float]:
    """k → c(k)：批 1，一次前向算 1 + k 个 token ÷ 算 1 个 token（同 chapter.py 的 verify_cost 的量法，猜测内容不影响时间；
    不同的是各个 k 轮流量）。"""
    e = engine(s, step09, (context + max(ks)) // BLOCK_SIZE + 4, 1, max(DEFAULT_MAX_NUM_BATCHED_TOKENS, context),
               spec_method="none")
    ids = s.tok.encode(LONG_PROMPT)
    rid = e.add_request(Request((ids * (context // len(ids) + 2))[:context], 64, SamplingParams(), ignore_eos=True))
    e.step()                                                             # prefill：之后这个请求在 decode
    seq = e.seqs[rid]
    seq.spec_token_ids = seq.token_ids[-max(ks):]                        # 块表一次补到能写最大的 k 个
    seq.block_table += e.block_manager.allocate(max(0, e.block_manager.blocks_for(seq.num_tokens_with_spec) - len(seq.block_table)))

    def forward(k):
        seq.spec_token_ids = seq.token_ids[-k:] if k else []
        fwd = e.kv_cache.plan([seq], [1 + k])
        return s.model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index)
    # 各个 k 轮流量、取中位数：机器负载慢慢变时，每个 k 受的影响差不多，比值比一个一个量稳
    times = interleaved_medians({k: (lambda k=k: forward(k)) for k in (0, *ks)}, repeats, s.device)
    seq.spec_token_ids = []
    e.abort(rid)
    return {k: times[k] / times[0] for k in ks}


@torch.inference_mode()
def sweep(s: cli.Session, ks, n_prompts: int = 4, n_new: int = 128, repeats: int = 3,
          context: int = 512, cost_repeats: int = 10) -> dict:
    """每个 k 一行：c(k)、两种引擎的时间（交替取中位数）、a、接受率、每 token 前向、预测与量到的加速；exact = token 都相同。"""
    cost = verify_costs(s, ks, context, cost_repeats)
    reqs = workload(s.tok, GROUNDED[:n_prompts], n_new)
    nb = sum(blocks_needed(r, BLOCK_SIZE) for r in reqs) + 8
    points, mismatches = [], []
    for k in ks:
        engines = {"step08": engine(s, step08, nb, 1, enable_prefix_caching=False),   # 每一轮都做同样多的 prefill
                   "step09": engine(s, step09, nb, 1, enable_prefix_caching=False, spec_method="ngram",
                                    num_spec_tokens=k)}
        last = {}

        def run(name):
            if name == "step09":
                engines[name].spec_stats = SpecStats()                    # 只记最后一轮
            last[name] = engines[name].generate(reqs)
        med = interleaved_medians({n: (lambda n=n: run(n)) for n in engines}, repeats, s.device)
        (out8, st8), (out9, st9) = last["step08"], last["step09"]
        for i, (r, ref, got) in enumerate(zip(reqs, out8, out9)):       # 与 chapter.py 的 compare_all 同一个规则
            c = compare(f"k{k}#{i}", r.prompt_ids, ref, got, s.full_logits, MARGIN_TOL[s.dtype])
            if not c.ok:
                mismatches.append(c.describe())
        sp = engines["step09"].spec_stats
        a = sp.accepted / sp.verifications if sp.verifications else 0.0
        points.append({"k": k, "verify_cost": round(cost[k], 3), "step08_s": round(med["step08"], 3),
                       "step09_s": round(med["step09"], 3), "generated_tokens": st9.generated_tokens,
                       "accepted_per_verification": round(a, 3),
                       "acceptance_rate": round(sp.accepted / sp.proposed, 4) if sp.proposed else 0.0,
                       "forwards_per_token": round(st9.num_forwards / st9.generated_tokens, 4),
                       "predicted_speedup": round((1 + a) / cost[k], 3),
                       "measured_speedup": round(med["step08"] / med["step09"], 3)})
    return {"points": points, "exact": not mismatches, "mismatches": mismatches}


def parse_ks(text: str) -> tuple[int, ...]:
    """"1,2,4" → (1, 2, 4)：正整数，逗号分隔。"""
    try:
        ks = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ks or min(ks) <= 0:
        raise argparse.ArgumentTypeError(f"every k must be > 0, got {text!r}")
    return ks


def main(args) -> bool:
    s = cli.load_session(args)
    ks = args.ks or ((1, 4) if args.quick else tuple(range(1, 9)))
    n_prompts, n_new = (2, 32) if args.quick else (4, 128)
    repeats = args.repeats or (1 if args.quick else 3)
    before = machine()
    print(f"机器: {before}；模型 {s.path.name}，{s.device}/{s.dtype_name}；grounded 前 {n_prompts} 个提示词、批 1、"
          f"各至多 {n_new} 个 token、{repeats} 轮交替取中位数", flush=True)
    res = sweep(s, ks, n_prompts, n_new, repeats, cost_repeats=3 if args.quick else 10)
    after = machine()
    print(f"机器: {after}")
    print(table(["k", "c(k)", "step08 (s)", "step09 (s)", "a", "接受率", "每 token 前向", "预测 (1+a)/c(k)", "量到的加速"],
                [[p["k"], f"{p['verify_cost']:.2f}", f"{p['step08_s']:.2f}", f"{p['step09_s']:.2f}",
                  f"{p['accepted_per_verification']:.2f}", f"{p['acceptance_rate']:.1%}", f"{p['forwards_per_token']:.2f}",
                  f"{p['predicted_speedup']:.2f}", f"{p['measured_speedup']:.2f}"] for p in res["points"]]))
    print(f"预测只算带猜测的步：找不到 n-gram 的步照常 decode；最近 4 次验证平均接受率低于 {SPEC_MIN_ACCEPTANCE} 的请求"
          "暂停猜测几步（SPEC_MIN_ACCEPTANCE）；每步还有查 n-gram、回滚的 Python 开销——所以量到的加速通常低于预测。")
    for line in res["mismatches"]:
        print(line)
    if not res["exact"]:
        print("error: step09 的 token 与 step08 不同（见上面几行）")
    if args.json:
        cli.emit_json({"script": "step09_speculative/analysis/spec_sweep.py", "model_path": str(s.path),
                       "device": s.device, "dtype": s.dtype_name, "machine_before": before, "machine_after": after,
                       "exact": res["exact"], "points": res["points"]})
    return res["exact"]


def parser() -> cli.Parser:
    p = cli.Parser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 个提示词、各 32 个 token、k = 1,4、1 轮")
    p.add_argument("--model", default=None, help="本地 HF 目录；默认 SmolLM2-135M-Instruct")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    cli.add_linear_arg(p)
    p.add_argument("--ks", type=parse_ks, default=None, help="逗号分隔的 k（默认 1,2,3,4,5,6,7,8；--quick 为 1,4）")
    p.add_argument("--repeats", type=cli.positive_int, default=None, help="交替几轮（默认 3；--quick 为 1）")
    p.add_argument("--json", action="store_true", help="stdout 最后一行输出一个 JSON 对象")
    p.set_defaults(prompt=None)
    return p


if __name__ == "__main__":
    cli.run_main(parser(), main)
