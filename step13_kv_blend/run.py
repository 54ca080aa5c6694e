"""step13_kv_blend：非前缀的 K/V 复用——文档的 K/V 各算一次、放到任何位置都拿来用（RoPE 再旋转），CacheBlend 只重算偏差最大的一部分。

    python step13_kv_blend/run.py [--quick] [--json]                                        # 章节模式（chapter.py）
    python step13_kv_blend/run.py --doc "文档一……" --doc "文档二……" --prompt "问题？" --blend blend --recompute-ratio 0.15
    python step13_kv_blend/run.py --chunk-sep " # # " --prompt "文档一 # # 文档二 # # 问题？" --blend reuse

怎么标出段（文档）：
  --doc TEXT（可重复）：每个 --prompt 前面依次放这些文档，每篇一段，--prompt 本身是问题（永远重算）；
      --rotate-docs：第 i 个提示词看到的文档轮转 i 篇（同一组文档、不同顺序：前缀缓存命中不了，块缓存可以）；
  --chunk-sep TEXT：LMCache 的做法（它的 blend_special_str，默认 " # # "）：--prompt 在 TEXT 处切开，最后一片是问题，
      前面每片一段；分隔符本身不进提示词。
  每段单独分词（不加特殊 token）后首尾相接，文本原样（想要分隔就在文档末尾带上换行）；--chat 时对话模板的开头
  在第一段之前、结尾在问题之后。
  服务器里的同一件事：vLLM + LMCache 的用户在提示词里插分隔符（我们的 --chunk-sep）。
--blend none（默认）与 step12 的 --kv-policy full 输出相同（标了段也是完整 prefill）；prefix 只用前缀缓存（也精确）；
concat / reuse / blend 是近似的：生成的 JSON 给每个结果 reused_tokens（K/V 来自块缓存、没重算的提示词 token）与
recomputed_tokens（段里被 blend 重算的）。step12 的全部参数照旧（驱逐策略不能与 concat / reuse / blend 同开）；
--no-chunked-prefill 用 step06 的引擎（不复用段）。
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
from step13_kv_blend import engine as step13  # noqa: E402
from step13_kv_blend.config import num_blocks_for_budget  # noqa: E402
from step13_kv_blend.chunk_cache import build_prompt, split_prompt  # noqa: E402


def make_parser() -> cli.Parser:
    p = cli.make_parser(__doc__.splitlines()[0])
    add_sampling_args(p)
    cli.add_stop_arg(p)
    groups = cli.add_config_args(p, step13.EngineConfig)   # 引擎参数来自 EngineConfig；下面是 run.py 自己的开关
    compiled_decode.add_compile_arg(groups["分页与调度"])
    groups["前缀缓存"].add_argument("--n", type=cli.positive_int, default=1,
                                   help="每个提示词采 K 个样本（种子 S, S+1, ..., S+K-1），共享提示词的整块")
    groups["分块 prefill"].add_argument("--no-chunked-prefill", action="store_true",
                                       help="关掉分块 prefill：用 step06 的引擎（再加 --no-prefix-cache 就是 step05 的）")
    p.set_defaults(spec_method=None)             # 没给时由 spec_method(args) 按 --draft-model 定
    groups["投机解码"].add_argument("--draft-model", default=None, metavar="DIR",
                                   help="草稿模型的 HF 目录（与目标同一个分词器）；给了它，--spec-method 默认是 draft")
    p.add_argument("--plot", default=None, metavar="PNG", help="章节模式：把\"重算多少换回多少质量\"的曲线存成图")
    g = groups["非前缀复用"]
    g.add_argument("--doc", action="append", default=None, metavar="TEXT",
                   help="一篇文档（可重复）：依次放在每个 --prompt（问题）前面，每篇是一段")
    g.add_argument("--rotate-docs", action="store_true", help="第 i 个提示词看到的文档轮转 i 篇（同一组文档、不同顺序）")
    g.add_argument("--chunk-sep", default=None, metavar="TEXT",
                   help="分隔符（LMCache 的 blend_special_str，如 \" # # \"）：--prompt 在它处切开，最后一片是问题、前面每片一段")
    return p


def spec_method(args) -> str:
    """没给 --spec-method：有 --draft-model 就是 draft；step06 的引擎或有驱逐策略时不猜；否则 ngram（同 step12）。"""
    if args.spec_method is not None:
        return args.spec_method
    if args.draft_model:
        return "draft"
    return "none" if args.no_chunked_prefill or args.kv_policy != "full" else "ngram"


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
    if args.no_chunked_prefill and (args.kv_policy != "full" or args.max_model_len is not None):
        raise UserError("--kv-policy and --max-model-len need step12's engine (drop --no-chunked-prefill)")
    if args.no_chunked_prefill and args.blend != "none":
        raise UserError(f"--blend {args.blend} needs step13's engine (drop --no-chunked-prefill)")
    if method == "draft" and not args.draft_model:
        raise UserError("--spec-method draft needs --draft-model DIR")
    if args.draft_model and method != "draft":
        raise UserError(f"--draft-model is only used with --spec-method draft (got {method})")
    if args.doc is not None and args.chunk_sep is not None:
        raise UserError("mark chunks either with --doc or with --chunk-sep, not both")
    if args.doc is not None and any(not d for d in args.doc):
        raise UserError("--doc must not be empty")
    if args.chunk_sep == "":
        raise UserError("--chunk-sep must not be empty")
    if args.rotate_docs and args.doc is None:
        raise UserError("--rotate-docs needs --doc")
    if (args.doc is not None or args.chunk_sep is not None) and args.prompt is None:
        raise UserError("--doc / --chunk-sep mark chunks of --prompt: give --prompt")
    if args.chunk_sep is not None:
        for p in args.prompt:
            split_prompt(p, args.chunk_sep)
    if not args.no_chunked_prefill:   # EngineConfig.validate 查的那些（--blend 与其他参数的组合），块数先随便给一个
        config_for(args, args.num_blocks or 1, args.max_batch_size, args.max_num_batched_tokens).validate()


def config_for(args, num_blocks: int, max_batch_size: int, budget: int) -> step13.EngineConfig:
    return step13.EngineConfig(
        num_blocks, args.block_size, max_batch_size, budget, not args.no_prefix_cache, attention=args.attention,
        kv_dtype=args.kv_dtype, preempt=args.preempt, spec_method=spec_method(args),
        num_spec_tokens=args.num_spec_tokens, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
        kv_policy=args.kv_policy, kv_budget=args.kv_budget, num_sinks=args.num_sinks, kv_positions=args.kv_positions,
        h2o_recent=args.h2o_recent, snapkv_window=args.snapkv_window, snapkv_pool=args.snapkv_pool,
        max_model_len=args.max_model_len, blend=args.blend, recompute_ratio=args.recompute_ratio,
        deviation_on=args.deviation_on)


def engine_for(args, s: cli.Session, num_blocks: int, max_batch_size: int, budget: int, clock=None, draft_model=None):
    """--no-chunked-prefill → step06 的引擎（再加 --no-prefix-cache → step05 的）；否则 step13 的。"""
    if args.no_chunked_prefill:
        step = step05 if args.no_prefix_cache else step06
        config = step.EngineConfig(num_blocks, args.block_size, max_batch_size, attention=args.attention)
        return step.LLMEngine(s.model, config, s.tok, s.tok.eos_ids, clock)
    return step13.LLMEngine(s.model, config_for(args, num_blocks, max_batch_size, budget), s.tok, s.tok.eos_ids,
                            clock, draft_model=draft_model)


def prompts_with_chunks(args, s: cli.Session) -> tuple[list[list[int]], list]:
    """每个 --prompt 的 token id 与它的段（没标段时 None）。"""
    out_ids, out_chunks = [], []
    for i, p in enumerate(args.prompt):
        if args.doc is not None:
            k = i % len(args.doc) if args.rotate_docs else 0
            ids, chunks = build_prompt(s.tok, args.doc[k:] + args.doc[:k], p, args.chat)
        elif args.chunk_sep is not None:
            parts = split_prompt(p, args.chunk_sep)
            ids, chunks = build_prompt(s.tok, parts[:-1], parts[-1], args.chat)
        else:
            ids, chunks = s.tok.encode(p, args.chat), None
        ctx = args.max_model_len or s.cfg.max_position_embeddings
        if len(ids) + args.max_new_tokens > ctx:
            raise UserError(f"prompt has {len(ids)} tokens; with --max-new-tokens {args.max_new_tokens} that exceeds "
                            f"the context of {ctx} tokens (--max-model-len)")
        out_ids.append(ids)
        out_chunks.append(chunks)
    return out_ids, out_chunks


def main(args) -> bool:
    params, stop = params_from_args(args), cli.stop_from_args(args)
    check_args(args)
    s = cli.load_session(args)
    if args.prompt is None:
        from step13_kv_blend.chapter import Chapter
        return Chapter(args, s).run()
    num_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, args.block_size, s.dtype, kv_dtype=args.kv_dtype)
    draft = cli.open_session(args.draft_model, s.device, s.dtype_name, args.linear).model if spec_method(args) == "draft" else None
    engine = engine_for(args, s, num_blocks, args.max_batch_size, args.max_num_batched_tokens, draft_model=draft)
    compiled_decode.compile_if_asked(args, engine)
    prompt_ids, prompt_chunks = prompts_with_chunks(args, s)
    requests, chunks = [], []
    for ids, ch in zip(prompt_ids, prompt_chunks):
        for q in Request(ids, args.max_new_tokens, params, args.ignore_eos, stop).parallel_samples(args.n):
            requests.append(q)
            chunks.append(ch)
    prompts = [p for p in args.prompt for _ in range(args.n)]
    outputs, st = engine.generate(requests) if args.no_chunked_prefill else engine.generate(requests, chunks)
    reused = getattr(st, "reused_tokens", None) or [0] * len(requests)          # step05/06 的引擎没有
    recomputed = getattr(st, "recomputed_tokens", None) or [0] * len(requests)
    blocks, peaks = getattr(st, "kv_blocks", None), getattr(st, "kv_blocks_peak", None)
    cli.print_generations(s, prompts, outputs)
    store = getattr(engine, "chunk_store", None)
    print(f"\n--blend {args.blend}：提示词 {sum(len(r.prompt_ids) for r in requests)} 个 token，其中 {sum(reused)} 个的 K/V "
          f"来自块缓存、{sum(recomputed)} 个被重算；块缓存存了 {store.stored if store else 0} 段、命中 {store.hits if store else 0} 次；"
          f"{st.num_forwards} 次前向产出 {st.generated_tokens} 个 token；池子 {num_blocks} 块 × {args.block_size} token")
    if args.json:
        out = cli.generation_json(s, prompts, [r.prompt_ids for r in requests], outputs)
        for i, (res, cached) in enumerate(zip(out["results"], st.cached_tokens)):
            res.update(cached_tokens=cached, chunks=chunks[i], reused_tokens=reused[i], recomputed_tokens=recomputed[i])
            if blocks is not None:
                res["kv_blocks"], res["kv_blocks_peak"] = blocks[i], peaks[i]
        out["stats"] = {"blend": args.blend,
                        "recompute_ratio": engine.config.ratio if args.blend == "blend" else None, "forwards": st.num_forwards,
                        "generated_tokens": st.generated_tokens, "chunks_stored": store.stored if store else 0,
                        "chunk_hits": store.hits if store else 0, "num_blocks": num_blocks,
                        "block_size": args.block_size, "preemptions": st.preemptions, "kv_policy": args.kv_policy,
                        "spec_method": spec_method(args), "compactions": getattr(engine, "num_compactions", 0)}
        cli.emit_json(out)
    return True


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
