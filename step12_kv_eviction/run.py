"""step12_kv_eviction：KV 驱逐——每个请求只留 --kv-budget 个 token 的 K/V（window / sinks / h2o / snapkv /
snapkv-chunked），多出来的块还回池子。

    python step12_kv_eviction/run.py [--quick] [--json] [--plot PATH] [--plot-blocks PATH]  # 章节模式（chapter.py）
    python step12_kv_eviction/run.py --sections passkey,greedy --settings snapkv   # 章节模式只重跑其中几节、几个设置
    python step12_kv_eviction/run.py --prompt "..." --kv-policy sinks --kv-budget 256
    python step12_kv_eviction/run.py --prompt "..." --kv-policy h2o --kv-budget 512 --kv-positions text

--kv-policy full（默认）是 step09 的行为（同样的输出、同样的前向）；其余策略是有损的：输出可以不同，--json 的每个
结果带 kv_blocks（结束时的块数）与 kv_blocks_peak（最多时的块数）。step09 的全部参数照旧（驱逐时不能投机、
不能量化池子：一行 error）；--no-chunked-prefill 用 step06 的引擎（没有投机，也没有驱逐）。
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
from step12_kv_eviction import engine as step12  # noqa: E402
from step12_kv_eviction.config import num_blocks_for_budget  # noqa: E402


def make_parser() -> cli.Parser:
    p = cli.make_parser(__doc__.splitlines()[0])
    add_sampling_args(p)
    cli.add_stop_arg(p)
    groups = cli.add_config_args(p, step12.EngineConfig)   # 引擎参数来自 EngineConfig；下面是 run.py 自己的开关
    compiled_decode.add_compile_arg(groups["分页与调度"])
    groups["前缀缓存"].add_argument("--n", type=cli.positive_int, default=1,
                                   help="每个提示词采 K 个样本（种子 S, S+1, ..., S+K-1），共享提示词的整块")
    groups["分块 prefill"].add_argument("--no-chunked-prefill", action="store_true",
                                       help="关掉分块 prefill：用 step06 的引擎（再加 --no-prefix-cache 就是 step05 的）")
    p.set_defaults(spec_method=None)             # 没给时由 spec_method(args) 定
    groups["投机解码"].add_argument("--draft-model", default=None, metavar="DIR",
                                   help="草稿模型的 HF 目录（与目标同一个分词器）；给了它，--spec-method 默认是 draft")
    p.add_argument("--plot", default=None, help="章节模式：逐位置 NLL 的图存到这个路径（PNG）")
    p.add_argument("--plot-blocks", default=None, help="章节模式：每个请求持有的 KV 块随已处理 token 的图存到这个路径（PNG）")
    p.add_argument("--sections", default=None,
                   help="章节模式：只跑这几节（逗号分开：exactness,streams,passkey,greedy,concurrency,speed）")
    p.add_argument("--settings", default=None,
                   help="章节模式：每一节只跑名字以这些前缀开头的设置（逗号分开，如 snapkv；长文本与 decode 速度的参照 full 留着）")
    return p


def spec_method(args) -> str:
    """没给 --spec-method：有 --draft-model 就是 draft；step06 的引擎或有驱逐策略时不猜；否则 ngram（同 step09）。"""
    if args.spec_method is not None:
        return args.spec_method
    if args.draft_model:
        return "draft"
    return "none" if args.no_chunked_prefill or args.kv_policy != "full" else "ngram"


def config(args, num_blocks: int, max_batch_size: int, budget: int) -> step12.EngineConfig:
    return step12.EngineConfig(
        num_blocks, args.block_size, max_batch_size, budget, not args.no_prefix_cache, attention=args.attention,
        kv_dtype=args.kv_dtype, preempt=args.preempt, spec_method=spec_method(args),
        num_spec_tokens=args.num_spec_tokens, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
        kv_policy=args.kv_policy, kv_budget=args.kv_budget, num_sinks=args.num_sinks, kv_positions=args.kv_positions,
        h2o_recent=args.h2o_recent, snapkv_window=args.snapkv_window, snapkv_pool=args.snapkv_pool,
        max_model_len=args.max_model_len)


def check_args(args) -> None:
    """加载模型之前就报错：step09 的几条，加上驱逐的（EngineConfig.validate 查的那些，块数先随便给一个）。"""
    if not args.no_chunked_prefill and args.max_num_batched_tokens < args.max_batch_size:
        raise UserError(f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be at least "
                        f"--max-batch-size ({args.max_batch_size})")
    if args.no_chunked_prefill and (args.preempt == "swap" or args.kv_dtype is not None):
        raise UserError("--kv-dtype and --preempt swap need step08's engine (drop --no-chunked-prefill)")
    method = spec_method(args)
    if args.no_chunked_prefill and method != "none":
        raise UserError("speculative decoding needs step09's engine (drop --no-chunked-prefill or use --spec-method none)")
    if args.no_chunked_prefill and (args.kv_policy != "full" or args.max_model_len is not None):
        raise UserError("--kv-policy and --max-model-len need step12's engine (drop --no-chunked-prefill)")
    if method == "draft" and not args.draft_model:
        raise UserError("--spec-method draft needs --draft-model DIR")
    if args.draft_model and method != "draft":
        raise UserError(f"--draft-model is only used with --spec-method draft (got {method})")
    if not args.no_chunked_prefill:
        config(args, args.num_blocks or 1, args.max_batch_size, args.max_num_batched_tokens).validate()
    if (args.sections or args.settings) and args.prompt is not None:
        raise UserError("--sections and --settings select parts of the chapter mode (drop --prompt)")
    if args.sections:
        from step12_kv_eviction.chapter import SECTIONS
        unknown = sorted(set(args.sections.split(",")) - set(SECTIONS))
        if unknown:
            raise UserError(f"unknown --sections {', '.join(unknown)} (choose from {', '.join(SECTIONS)})")


def engine_for(args, s: cli.Session, num_blocks: int, max_batch_size: int, budget: int, clock=None, draft_model=None):
    """--no-chunked-prefill → step06 的引擎（再加 --no-prefix-cache → step05 的）；否则 step12 的。"""
    if args.no_chunked_prefill:
        step = step05 if args.no_prefix_cache else step06
        cfg = step.EngineConfig(num_blocks, args.block_size, max_batch_size, attention=args.attention)
        return step.LLMEngine(s.model, cfg, s.tok, s.tok.eos_ids, clock)
    return step12.LLMEngine(s.model, config(args, num_blocks, max_batch_size, budget), s.tok, s.tok.eos_ids, clock,
                            draft_model=draft_model)


def encode(args, s: cli.Session, text: str) -> list[int]:
    """同 Session.encode，只是上下文是 --max-model-len（默认模型的 max_position_embeddings）。"""
    ids = s.tok.encode(text, args.chat)
    ctx = args.max_model_len or s.cfg.max_position_embeddings
    if len(ids) + args.max_new_tokens > ctx:
        raise UserError(f"prompt has {len(ids)} tokens; with --max-new-tokens {args.max_new_tokens} that exceeds "
                        f"the context of {ctx} tokens (--max-model-len)")
    return ids


def main(args) -> bool:
    params, stop = params_from_args(args), cli.stop_from_args(args)
    check_args(args)
    s = cli.load_session(args, sliding_window=True)   # 这一步的引擎认识滑动窗口层（gather.py 的掩码）
    if s.cfg.sliding and args.no_chunked_prefill:
        raise UserError("--no-chunked-prefill runs step05/06's engine, whose cache has no sliding window: "
                        f"drop it for this sliding-window model ({s.path})")
    if args.prompt is None:
        from step12_kv_eviction.chapter import Chapter
        return Chapter(args, s).run()
    num_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, args.block_size, s.dtype, kv_dtype=args.kv_dtype)
    draft = (cli.open_session(args.draft_model, s.device, s.dtype_name, args.linear, sliding_window=True).model
             if spec_method(args) == "draft" else None)
    engine = engine_for(args, s, num_blocks, args.max_batch_size, args.max_num_batched_tokens, draft_model=draft)
    compiled_decode.compile_if_asked(args, engine)
    prompt_ids = [encode(args, s, p) for p in args.prompt]
    requests = [q for ids in prompt_ids
                for q in Request(ids, args.max_new_tokens, params, args.ignore_eos, stop).parallel_samples(args.n)]
    prompts = [p for p in args.prompt for _ in range(args.n)]
    outputs, st = engine.generate(requests)
    cli.print_generations(s, prompts, outputs)
    blocks, peaks = getattr(st, "kv_blocks", None), getattr(st, "kv_blocks_peak", None)   # step05/06 的引擎没有
    print(f"\nKV 驱逐 {args.kv_policy}" + (f"（预算 {args.kv_budget} 个 token）" if args.kv_budget else "") +
          f"：{st.num_forwards} 次前向产出 {st.generated_tokens} 个 token；池子 {num_blocks} 块 × {args.block_size} token，"
          f"抢占 {st.preemptions} 次" + (f"；每个请求最多占 {max(peaks)} 块" if peaks else ""))
    if args.json:
        out = cli.generation_json(s, prompts, [r.prompt_ids for r in requests], outputs)
        for i, (res, cached) in enumerate(zip(out["results"], st.cached_tokens)):
            res["cached_tokens"] = cached
            if blocks is not None:
                res["kv_blocks"], res["kv_blocks_peak"] = blocks[i], peaks[i]
        out["stats"] = {"kv_policy": args.kv_policy, "kv_budget": args.kv_budget, "spec_method": spec_method(args),
                        "forwards": st.num_forwards, "generated_tokens": st.generated_tokens,
                        "num_blocks": num_blocks, "block_size": args.block_size, "preemptions": st.preemptions,
                        "compactions": getattr(engine, "num_compactions", 0)}
        cli.emit_json(out)
    return True


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
