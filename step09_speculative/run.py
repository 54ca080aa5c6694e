"""step09_speculative：投机解码——prompt lookup 或草稿模型猜 k 个 token，目标模型一次前向验证，输出与 step08 完全相同。

    python step09_speculative/run.py [--quick] [--json]                                  # 章节模式（chapter.py）
    python step09_speculative/run.py --prompt "..." --spec-method ngram --num-spec-tokens 4
    python step09_speculative/run.py --prompt "..." --spec-method draft --draft-model DIR

--spec-method none 是 step08 的行为（同样的输出、同样的前向）。贪心时任何 --spec-method 的输出都与 step08 逐 token
相同；抽样时分布相同（验证规则见 rejection_sampler.py）。step08 的全部参数照旧；--no-chunked-prefill 用 step06 的
引擎（没有投机）。
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import cli  # noqa: E402
from common.errors import UserError  # noqa: E402
from perf import compiled_decode  # noqa: E402
from step02_sampling.sampler import add_sampling_args, params_from_args  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402
from step05_paged import engine as step05  # noqa: E402
from step06_prefix_cache import engine as step06  # noqa: E402
from step09_speculative import engine as step09  # noqa: E402
from step09_speculative.config import num_blocks_for_budget  # noqa: E402


def make_parser() -> cli.Parser:
    p = cli.make_parser(__doc__.splitlines()[0])
    add_sampling_args(p)
    cli.add_stop_arg(p)
    groups = cli.add_config_args(p, step09.EngineConfig)   # 引擎参数来自 EngineConfig；下面是 run.py 自己的开关
    compiled_decode.add_compile_arg(groups["分页与调度"])
    groups["前缀缓存"].add_argument("--n", type=cli.positive_int, default=1,
                                   help="每个提示词采 K 个样本（种子 S, S+1, ..., S+K-1），共享提示词的整块")
    groups["分块 prefill"].add_argument("--no-chunked-prefill", action="store_true",
                                       help="关掉分块 prefill：用 step06 的引擎（再加 --no-prefix-cache 就是 step05 的）")
    p.set_defaults(spec_method=None)             # 没给时由 spec_method(args) 按 --draft-model 定
    groups["投机解码"].add_argument("--draft-model", default=None, metavar="DIR",
                                   help="草稿模型的 HF 目录（与目标同一个分词器）；给了它，--spec-method 默认是 draft")
    return p


def check_budget(args) -> None:
    """加载模型之前就报错：预算至少要放得下每个 decode 的一个 token（引擎的 EngineConfig.validate 也查同一条）。"""
    if not args.no_chunked_prefill and args.max_num_batched_tokens < args.max_batch_size:
        raise UserError(f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be at least "
                        f"--max-batch-size ({args.max_batch_size})")


def check_kv_quant(args) -> None:
    """--no-chunked-prefill 用的是 step06 的引擎：那里没有量化的池子，也没有换出。"""
    if args.no_chunked_prefill and (args.preempt == "swap" or args.kv_dtype is not None):
        raise UserError("--kv-dtype and --preempt swap need step08's engine (drop --no-chunked-prefill)")


def spec_method(args) -> str:
    """没给 --spec-method：有 --draft-model 就是 draft，--no-chunked-prefill（step06 的引擎）时不猜，否则 ngram。"""
    if args.spec_method is not None:
        return args.spec_method
    return "draft" if args.draft_model else "none" if args.no_chunked_prefill else "ngram"


def check_speculative(args) -> None:
    method = spec_method(args)
    if args.no_chunked_prefill and method != "none":
        raise UserError("speculative decoding needs step09's engine (drop --no-chunked-prefill or use --spec-method none)")
    if args.ngram_min > args.ngram_max:
        raise UserError(f"--ngram-min ({args.ngram_min}) must not exceed --ngram-max ({args.ngram_max})")
    if method == "draft" and not args.draft_model:
        raise UserError("--spec-method draft needs --draft-model DIR")
    if args.draft_model and method != "draft":
        raise UserError(f"--draft-model is only used with --spec-method draft (got {method})")


def load_draft_model(args, s: cli.Session):
    """--draft-model：与目标同一设备、同一 dtype 加载（目录不对时一行 error）；不用草稿模型时 None。"""
    return cli.open_session(args.draft_model, s.device, s.dtype_name, args.linear).model if spec_method(args) == "draft" else None


def check_args(args) -> None:
    """加载模型之前就报错。"""
    check_budget(args)
    check_kv_quant(args)
    check_speculative(args)


def engine_for(args, s: cli.Session, num_blocks: int, max_batch_size: int, budget: int, clock=None, draft_model=None):
    """--no-chunked-prefill → step06 的引擎（再加 --no-prefix-cache → step05 的）；否则 step09 的。"""
    if args.no_chunked_prefill:
        step = step05 if args.no_prefix_cache else step06
        config = step.EngineConfig(num_blocks, args.block_size, max_batch_size, attention=args.attention)
        return step.LLMEngine(s.model, config, s.tok, s.tok.eos_ids, clock)
    config = step09.EngineConfig(num_blocks, args.block_size, max_batch_size, budget, not args.no_prefix_cache,
                                 attention=args.attention, kv_dtype=args.kv_dtype, preempt=args.preempt,
                                 spec_method=spec_method(args), num_spec_tokens=args.num_spec_tokens,
                                 ngram_min=args.ngram_min, ngram_max=args.ngram_max)
    return step09.LLMEngine(s.model, config, s.tok, s.tok.eos_ids, clock, draft_model=draft_model)


def main(args) -> bool:
    params, stop = params_from_args(args), cli.stop_from_args(args)
    check_args(args)
    s = cli.load_session(args)
    if args.prompt is None:
        from step09_speculative.chapter import Chapter
        return Chapter(args, s).run()
    num_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, args.block_size, s.dtype, kv_dtype=args.kv_dtype)
    engine = engine_for(args, s, num_blocks, args.max_batch_size, args.max_num_batched_tokens,
                        draft_model=load_draft_model(args, s))
    compiled_decode.compile_if_asked(args, engine)
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]
    requests = [q for ids in prompt_ids
                for q in Request(ids, args.max_new_tokens, params, args.ignore_eos, stop).parallel_samples(args.n)]
    prompts = [p for p in args.prompt for _ in range(args.n)]
    outputs, st = engine.generate(requests)
    cli.print_generations(s, prompts, outputs)
    spec = getattr(engine, "spec_stats", step09.SpecStats())
    rate = spec.accepted / spec.proposed if spec.proposed else 0.0
    print(f"\n投机解码 {spec_method(args)}：验证 {spec.proposed} 个猜测，接受 {spec.accepted} 个（{rate:.1%}）；"
          f"{st.num_forwards} 次前向产出 {st.generated_tokens} 个 token；池子 {num_blocks} 块 × {args.block_size} token，"
          f"抢占 {st.preemptions} 次")
    if args.json:
        out = cli.generation_json(s, prompts, [r.prompt_ids for r in requests], outputs)
        for res, cached in zip(out["results"], st.cached_tokens):
            res["cached_tokens"] = cached
        out["stats"] = {"spec_method": spec_method(args), "num_spec_tokens": args.num_spec_tokens,
                        "proposed": spec.proposed, "accepted": spec.accepted, "acceptance_rate": round(rate, 4),
                        "forwards": st.num_forwards, "generated_tokens": st.generated_tokens,
                        "num_blocks": num_blocks, "block_size": args.block_size, "preemptions": st.preemptions}
        cli.emit_json(out)
    return True


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
