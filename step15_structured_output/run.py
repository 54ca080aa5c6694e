"""step15_structured_output：结构化输出——正则、JSON Schema 或几个字符串之一约束每一步的采样，输出一定满足它。

    python step15_structured_output/run.py [--quick] [--json]                                  # 章节模式（chapter.py）
    python step15_structured_output/run.py --prompt "..." --regex "[0-9]{3}-[0-9]{4}"
    python step15_structured_output/run.py --prompt "..." --json-schema schema.json          # 或直接给 JSON 文本
    python step15_structured_output/run.py --prompt "..." --choice Paris,Beijing,Lima [--no-jump-forward]

一个约束作用于这次的每一个提示词（--regex / --json-schema / --choice 至多给一个）。不给约束时就是 step09 的引擎
（同样的输出、同样的前向）；step09 的全部参数照旧（--no-chunked-prefill 用 step06 的引擎：没有投机，也没有约束）。
--json 的每个结果多一项 finish_reason（"stop"：EOS、停止串、语法结束；"length"：生成满 --max-new-tokens）。
"""
import json
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
from step15_structured_output import engine as step15  # noqa: E402
from step15_structured_output.config import num_blocks_for_budget  # noqa: E402
from step15_structured_output.structured import StructuredOutputsParams  # noqa: E402


def make_parser() -> cli.Parser:
    p = cli.make_parser(__doc__.splitlines()[0])
    add_sampling_args(p)
    cli.add_stop_arg(p)
    groups = cli.add_config_args(p, step15.EngineConfig)   # 引擎参数来自 EngineConfig；下面是 run.py 自己的开关
    compiled_decode.add_compile_arg(groups["分页与调度"])
    groups["前缀缓存"].add_argument("--n", type=cli.positive_int, default=1,
                                   help="每个提示词采 K 个样本（种子 S, S+1, ..., S+K-1），共享提示词的整块")
    groups["分块 prefill"].add_argument("--no-chunked-prefill", action="store_true",
                                       help="关掉分块 prefill：用 step06 的引擎（再加 --no-prefix-cache 就是 step05 的）")
    p.set_defaults(spec_method=None)             # 没给时由 spec_method(args) 按 --draft-model 定
    groups["投机解码"].add_argument("--draft-model", default=None, metavar="DIR",
                                   help="草稿模型的 HF 目录（与目标同一个分词器）；给了它，--spec-method 默认是 draft")
    g = groups["结构化输出"]
    g.add_argument("--regex", default=None, metavar="RE", help="输出整个匹配这个正则（语法见 regex_parser.py）")
    g.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                   help="输出是满足这个 JSON Schema 的 JSON（一个文件，或直接给 JSON 文本；支持的关键字见 schema.py）")
    g.add_argument("--choice", default=None, metavar="A,B,...", help="输出是这几个字符串之一（逗号分开，原样比较）")
    return p


def structured_from_args(args) -> StructuredOutputsParams | None:
    """--regex / --json-schema / --choice → 约束（都没给：None）。给了不止一个、JSON 读不了 → UserError。"""
    given = [f for f in ("regex", "json_schema", "choice") if getattr(args, f) is not None]
    if len(given) > 1:
        raise UserError(f"give at most one of --regex, --json-schema, --choice (got {', '.join(given)})")
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.choice is not None:
        choices = tuple(args.choice.split(","))
        if not all(choices):
            raise UserError(f"--choice needs non-empty strings separated by commas, got {args.choice!r}")
        return StructuredOutputsParams(choice=choices)
    if args.json_schema is not None:
        text = args.json_schema
        path = Path(text)
        if not text.lstrip().startswith(("{", "[")) and path.is_file():
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(f"cannot read --json-schema {path}: {e}") from None
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--json-schema is neither a readable file nor valid JSON: {e}") from None
        return StructuredOutputsParams(json=schema)
    return None


def spec_method(args) -> str:
    """没给 --spec-method：有 --draft-model 就是 draft，--no-chunked-prefill（step06 的引擎）时不猜，否则 ngram（同 step09）。"""
    if args.spec_method is not None:
        return args.spec_method
    return "draft" if args.draft_model else "none" if args.no_chunked_prefill else "ngram"


def check_args(args) -> None:
    """加载模型之前就报错。"""
    if not args.no_chunked_prefill and args.max_num_batched_tokens < args.max_batch_size:
        raise UserError(f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be at least "
                        f"--max-batch-size ({args.max_batch_size})")
    if args.no_chunked_prefill and (args.preempt == "swap" or args.kv_dtype is not None):
        raise UserError("--kv-dtype and --preempt swap need step08's engine (drop --no-chunked-prefill)")
    method = spec_method(args)
    if args.no_chunked_prefill and method != "none":
        raise UserError("speculative decoding needs step09's engine (drop --no-chunked-prefill or use --spec-method none)")
    if args.ngram_min > args.ngram_max:
        raise UserError(f"--ngram-min ({args.ngram_min}) must not exceed --ngram-max ({args.ngram_max})")
    if method == "draft" and not args.draft_model:
        raise UserError("--spec-method draft needs --draft-model DIR")
    if args.draft_model and method != "draft":
        raise UserError(f"--draft-model is only used with --spec-method draft (got {method})")
    if args.no_chunked_prefill and structured_from_args(args) is not None:
        raise UserError("--regex / --json-schema / --choice need step15's engine (drop --no-chunked-prefill)")


def engine_for(args, s: cli.Session, num_blocks: int, max_batch_size: int, budget: int, clock=None, draft_model=None):
    """--no-chunked-prefill → step06 的引擎（再加 --no-prefix-cache → step05 的）；否则 step15 的。"""
    if args.no_chunked_prefill:
        step = step05 if args.no_prefix_cache else step06
        config = step.EngineConfig(num_blocks, args.block_size, max_batch_size, attention=args.attention)
        return step.LLMEngine(s.model, config, s.tok, s.tok.eos_ids, clock)
    config = step15.EngineConfig(num_blocks, args.block_size, max_batch_size, budget, not args.no_prefix_cache,
                                 attention=args.attention, kv_dtype=args.kv_dtype, preempt=args.preempt,
                                 spec_method=spec_method(args), num_spec_tokens=args.num_spec_tokens,
                                 ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                                 jump_forward=not args.no_jump_forward)
    return step15.LLMEngine(s.model, config, s.tok, s.tok.eos_ids, clock, draft_model=draft_model)


def finish_reasons(out, requests: list[Request], eos_ids, tok) -> list[str]:
    """step15 的引擎直接给出；step05/06 的（--no-chunked-prefill）没有这一项：按 Sequence.append_token 的同一条规则
    从最后一个 token 推出来（停止条件成立就是 "stop"，否则是生成满了）。"""
    if hasattr(out, "finish_reasons"):
        return list(out.finish_reasons)
    return ["stop" if r.stops(o, eos_ids, tok) else "length" for r, o in zip(requests, out.outputs)]


def main(args) -> bool:
    params, stop = params_from_args(args), cli.stop_from_args(args)
    check_args(args)
    structured = structured_from_args(args)
    s = cli.load_session(args)
    if args.prompt is None:
        from step15_structured_output.chapter import Chapter
        return Chapter(args, s).run()
    num_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, args.block_size, s.dtype, kv_dtype=args.kv_dtype)
    draft = (cli.open_session(args.draft_model, s.device, s.dtype_name, args.linear).model
             if spec_method(args) == "draft" else None)
    engine = engine_for(args, s, num_blocks, args.max_batch_size, args.max_num_batched_tokens, draft_model=draft)
    compiled_decode.compile_if_asked(args, engine)
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]
    requests = [q for ids in prompt_ids
                for q in Request(ids, args.max_new_tokens, params, args.ignore_eos, stop).parallel_samples(args.n)]
    prompts = [p for p in args.prompt for _ in range(args.n)]
    out = engine.generate(requests, structured) if structured is not None else engine.generate(requests)
    outputs, st = out.outputs, out.stats
    reasons = finish_reasons(out, requests, s.tok.eos_ids, s.tok)
    cli.print_generations(s, prompts, outputs)
    spec = getattr(engine, "spec_stats", step15.SpecStats())
    rate = spec.accepted / spec.proposed if spec.proposed else 0.0
    print(f"\n投机解码 {spec_method(args)}：验证 {spec.proposed} 个猜测，接受 {spec.accepted} 个（{rate:.1%}）；"
          f"{st.num_forwards} 次前向产出 {st.generated_tokens} 个 token；池子 {num_blocks} 块 × {args.block_size} token，"
          f"抢占 {st.preemptions} 次")
    so = getattr(engine, "structured_stats", step15.StructuredStats())
    if structured is not None:
        print(f"结构化输出（{structured.kind()}）：{so.masked_rows} 行 logits 铺了掩码；jump-forward "
              f"{so.jumps} 次、{so.jump_tokens} 个 token 没有一个一个采样；结束原因 {', '.join(reasons)}")
    if args.json:
        out = cli.generation_json(s, prompts, [r.prompt_ids for r in requests], outputs)
        for res, cached, reason in zip(out["results"], st.cached_tokens, reasons):
            res["cached_tokens"] = cached
            res["finish_reason"] = reason
        out["stats"] = {"spec_method": spec_method(args), "num_spec_tokens": args.num_spec_tokens,
                        "proposed": spec.proposed, "accepted": spec.accepted, "acceptance_rate": round(rate, 4),
                        "forwards": st.num_forwards, "generated_tokens": st.generated_tokens,
                        "num_blocks": num_blocks, "block_size": args.block_size, "preemptions": st.preemptions,
                        "structured_output": structured.kind() if structured is not None else None,
                        "jump_forward_tokens": so.jump_tokens, "masked_rows": so.masked_rows}
        cli.emit_json(out)
    return True


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
