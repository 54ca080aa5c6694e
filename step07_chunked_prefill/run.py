"""step07_chunked_prefill：分块 prefill——每次前向一个 token 预算，decode 与 prefill 的块混在一行里算，没有填充。

    python step07_chunked_prefill/run.py [--quick] [--json] [--plot PATH] [--plot-timeline PATH]     # 章节模式（chapter.py）
    python step07_chunked_prefill/run.py --prompt "..." --prompt "..." --max-num-batched-tokens 32   # 生成模式

--no-chunked-prefill 用 step06 的引擎（再加 --no-prefix-cache 就是 step05 的）：同样的输出、同样的每一次前向。
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
from step07_chunked_prefill import engine as step07  # noqa: E402
from step07_chunked_prefill.config import num_blocks_for_budget  # noqa: E402


def make_parser() -> cli.Parser:
    p = cli.make_parser(__doc__.splitlines()[0])
    add_sampling_args(p)
    cli.add_stop_arg(p)
    groups = cli.add_config_args(p, step07.EngineConfig)   # 引擎参数来自 EngineConfig；下面是 run.py 自己的开关
    compiled_decode.add_compile_arg(groups["分页与调度"])
    groups["前缀缓存"].add_argument("--n", type=cli.positive_int, default=1,
                                   help="每个提示词采 K 个样本（种子 S, S+1, ..., S+K-1），共享提示词的整块")
    groups["分块 prefill"].add_argument("--no-chunked-prefill", action="store_true",
                                       help="关掉分块 prefill：用 step06 的引擎（再加 --no-prefix-cache 就是 step05 的）")
    p.add_argument("--plot", default=None, help="章节模式：TTFT / TPOT 随预算变化的图存到这个路径（PNG）")
    p.add_argument("--plot-timeline", default=None, help="章节模式：step06 / step07 每个请求出 token 的时间线图（PNG）")
    return p

def check_budget(args) -> None:
    """加载模型之前就报错：预算至少要放得下每个 decode 的一个 token（引擎的 EngineConfig.validate 也查同一条）。"""
    if not args.no_chunked_prefill and args.max_num_batched_tokens < args.max_batch_size:
        raise UserError(f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be at least "
                        f"--max-batch-size ({args.max_batch_size})")


def engine_for(args, s: cli.Session, num_blocks: int, max_batch_size: int, budget: int, clock=None):
    """--no-chunked-prefill → step06 的引擎（再加 --no-prefix-cache → step05 的）；否则 step07 的。"""
    if args.no_chunked_prefill:
        step = step05 if args.no_prefix_cache else step06
        config = step.EngineConfig(num_blocks, args.block_size, max_batch_size, attention=args.attention)
    else:
        step = step07
        config = step07.EngineConfig(num_blocks, args.block_size, max_batch_size, budget,
                                     enable_prefix_caching=not args.no_prefix_cache, attention=args.attention)
    return step.LLMEngine(s.model, config, s.tok, s.tok.eos_ids, clock)


def main(args) -> bool:
    params, stop = params_from_args(args), cli.stop_from_args(args)
    check_budget(args)
    s = cli.load_session(args)
    if args.prompt is None:
        from step07_chunked_prefill.chapter import Chapter
        return Chapter(args, s, engine_for).run()
    num_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, args.block_size, s.dtype)
    engine = engine_for(args, s, num_blocks, args.max_batch_size, args.max_num_batched_tokens)
    compiled_decode.compile_if_asked(args, engine)
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]
    requests = [q for ids in prompt_ids
                for q in Request(ids, args.max_new_tokens, params, args.ignore_eos, stop).parallel_samples(args.n)]
    prompts = [p for p in args.prompt for _ in range(args.n)]
    outputs, st = engine.generate(requests)
    cli.print_generations(s, prompts, outputs)
    mode = "不分块（step06）" if args.no_chunked_prefill else f"每次前向最多 {args.max_num_batched_tokens} 个 token"
    print(f"\n{mode}；池子 {num_blocks} 块 × {args.block_size} token；{st.num_forwards} 次前向，prefill 算了 "
          f"{st.prefill_tokens} 个 token（填充 {st.prefill_padding_waste:.1%}），命中率 {st.hit_rate:.1%}，"
          f"抢占 {st.preemptions} 次，峰值并发 {st.peak_running}")
    if args.json:
        out = cli.generation_json(s, prompts, [r.prompt_ids for r in requests], outputs)
        for res, cached in zip(out["results"], st.cached_tokens):
            res["cached_tokens"] = cached
        out["stats"] = {"num_blocks": num_blocks, "block_size": args.block_size, "forwards": st.num_forwards,
                        "max_num_batched_tokens": None if args.no_chunked_prefill else args.max_num_batched_tokens,
                        "prefill_tokens": st.prefill_tokens, "prefill_padding_waste": round(st.prefill_padding_waste, 4),
                        "hit_rate": round(st.hit_rate, 4), "preemptions": st.preemptions, "peak_running": st.peak_running}
        cli.emit_json(out)
    return True


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
