"""step06_prefix_cache：前缀缓存——请求之间复用相同前缀的 K/V（vLLM 的块哈希链，对照 SGLang 的基数树）。

    python step06_prefix_cache/run.py [--quick] [--json] [--plot PATH]                # 章节模式（chapter.py）
    python step06_prefix_cache/run.py --prompt "Tell me a joke." --chat --n 4 --temperature 0.8 --seed 1   # 生成模式

--no-prefix-cache 用 step05 的引擎：同样的输出、同样的前向次数。
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import cli  # noqa: E402
from perf import compiled_decode  # noqa: E402
from step02_sampling.sampler import add_sampling_args, params_from_args  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402
from step05_paged import engine as step05  # noqa: E402
from step06_prefix_cache import engine as step06  # noqa: E402
from step06_prefix_cache.config import num_blocks_for_budget  # noqa: E402


def make_parser() -> cli.Parser:
    p = cli.make_parser(__doc__.splitlines()[0])
    add_sampling_args(p)
    cli.add_stop_arg(p)
    compiled_decode.add_compile_arg(cli.add_config_args(p, step06.EngineConfig)["分页与调度"])   # 引擎参数来自 EngineConfig
    g = p.add_argument_group("前缀缓存")         # step06 的引擎总开着前缀缓存：关掉它就是换回 step05 的引擎
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="关掉前缀缓存：用 step05 的引擎（同样的输出、同样的前向次数）")
    g.add_argument("--n", type=cli.positive_int, default=1,
                   help="每个提示词采 K 个样本（种子 S, S+1, ..., S+K-1），共享提示词的整块")
    p.add_argument("--plot", default=None, help="章节模式：TTFT 随共享前缀长度的图存到这个路径（PNG）")
    return p


def engine_for(args, s: cli.Session, num_blocks: int, max_batch_size: int):
    """--no-prefix-cache → step05 的引擎；否则 step06 的。章节模式 (c) 也从这里拿 --no-prefix-cache 的引擎。"""
    step = step05 if args.no_prefix_cache else step06
    config = step.EngineConfig(num_blocks, args.block_size, max_batch_size, attention=args.attention)
    return step.LLMEngine(s.model, config, s.tok, s.tok.eos_ids)


def main(args) -> bool:
    params, stop = params_from_args(args), cli.stop_from_args(args)
    s = cli.load_session(args)
    if args.prompt is None:
        from step06_prefix_cache.chapter import Chapter
        return Chapter(args, s, engine_for).run()
    num_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, args.block_size, s.dtype)
    engine = engine_for(args, s, num_blocks, args.max_batch_size)
    compiled_decode.compile_if_asked(args, engine)
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]
    # --n K：每个提示词 K 个请求，结果按提示词排列（同一提示词的 K 个样本相邻）
    requests = [q for ids in prompt_ids
                for q in Request(ids, args.max_new_tokens, params, args.ignore_eos, stop).parallel_samples(args.n)]
    prompts = [p for p in args.prompt for _ in range(args.n)]
    outputs, st = engine.generate(requests)
    evictions = getattr(engine.block_manager, "num_evictions", 0)
    cli.print_generations(s, prompts, outputs)
    print(f"\n池子 {num_blocks} 块 × {args.block_size} token；{st.num_forwards} 次前向（prefill {st.prefill_steps}，"
          f"decode {st.decode_steps}），prefill 算了 {st.prefill_tokens} 个 token，命中率 {st.hit_rate:.1%}，"
          f"抢占 {st.preemptions} 次，回收 {evictions} 块，峰值并发 {st.peak_running}，KV 浪费 {st.kv_waste:.1%}")
    if args.json:
        out = cli.generation_json(s, prompts, [r.prompt_ids for r in requests], outputs)
        for res, cached in zip(out["results"], st.cached_tokens):
            res["cached_tokens"] = cached
        out["stats"] = {"num_blocks": num_blocks, "block_size": args.block_size, "forwards": st.num_forwards,
                        "prefill_tokens": st.prefill_tokens, "hit_rate": round(st.hit_rate, 4),
                        "preemptions": st.preemptions, "evictions": evictions,
                        "peak_running": st.peak_running, "kv_waste": round(st.kv_waste, 4)}
        cli.emit_json(out)
    return True


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
