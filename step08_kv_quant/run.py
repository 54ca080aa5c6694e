"""step08_kv_quant：KV cache 存成 int8 / fp8（外加每个 token、每个头一个 scale），以及换出式抢占。

    python step08_kv_quant/run.py [--quick] [--json]                                     # 章节模式（chapter.py）
    python step08_kv_quant/run.py --prompt "..." --kv-dtype int8 --preempt swap          # 生成模式

默认 --kv-dtype 是模型的 dtype：精确模式，与 step07 逐 token、逐次前向相同。--no-chunked-prefill 用 step06 的引擎
（再加 --no-prefix-cache 就是 step05 的），那时没有量化和换出。
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
from step08_kv_quant import engine as step08  # noqa: E402
from step08_kv_quant.config import num_blocks_for_budget  # noqa: E402


def make_parser() -> cli.Parser:
    p = cli.make_parser(__doc__.splitlines()[0])
    add_sampling_args(p)
    cli.add_stop_arg(p)
    groups = cli.add_config_args(p, step08.EngineConfig)   # 引擎参数来自 EngineConfig；下面是 run.py 自己的开关
    compiled_decode.add_compile_arg(groups["分页与调度"])
    groups["前缀缓存"].add_argument("--n", type=cli.positive_int, default=1,
                                   help="每个提示词采 K 个样本（种子 S, S+1, ..., S+K-1），共享提示词的整块")
    groups["分块 prefill"].add_argument("--no-chunked-prefill", action="store_true",
                                       help="关掉分块 prefill：用 step06 的引擎（再加 --no-prefix-cache 就是 step05 的）")
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


def check_args(args) -> None:
    """加载模型之前就报错。"""
    check_budget(args)
    check_kv_quant(args)


def engine_for(args, s: cli.Session, num_blocks: int, max_batch_size: int, budget: int, clock=None):
    """--no-chunked-prefill → step06 的引擎（再加 --no-prefix-cache → step05 的）；否则 step08 的。"""
    if args.no_chunked_prefill:
        step = step05 if args.no_prefix_cache else step06
        config = step.EngineConfig(num_blocks, args.block_size, max_batch_size, attention=args.attention)
    else:
        step = step08
        config = step08.EngineConfig(num_blocks, args.block_size, max_batch_size, budget, not args.no_prefix_cache,
                                     attention=args.attention, kv_dtype=args.kv_dtype, preempt=args.preempt)
    return step.LLMEngine(s.model, config, s.tok, s.tok.eos_ids, clock)


def main(args) -> bool:
    params, stop = params_from_args(args), cli.stop_from_args(args)
    check_args(args)
    s = cli.load_session(args)
    if args.prompt is None:
        from step08_kv_quant.chapter import Chapter
        return Chapter(args, s).run()
    num_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, args.block_size, s.dtype, kv_dtype=args.kv_dtype)
    engine = engine_for(args, s, num_blocks, args.max_batch_size, args.max_num_batched_tokens)
    compiled_decode.compile_if_asked(args, engine)
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]
    requests = [q for ids in prompt_ids
                for q in Request(ids, args.max_new_tokens, params, args.ignore_eos, stop).parallel_samples(args.n)]
    prompts = [p for p in args.prompt for _ in range(args.n)]
    outputs, st = engine.generate(requests)
    cli.print_generations(s, prompts, outputs)
    fmt, sw = getattr(engine.kv_cache, "fmt", None), getattr(engine, "swap", None)
    per_token = s.cfg.kv_bytes_per_token(s.dtype.itemsize) if fmt is None else fmt.bytes_per_token(s.cfg, args.block_size)
    swap_outs, swap_bytes = (sw.num_swap_out, sw.bytes_out + sw.bytes_in) if sw else (0, 0)
    kv = "精确（模型 dtype）" if fmt is None else f"{fmt.name}（有损）"
    print(f"\nKV 存法 {kv}：每 token {per_token:.0f} 字节；池子 {num_blocks} 块 × {args.block_size} token；"
          f"{st.num_forwards} 次前向，抢占 {st.preemptions} 次（换出 {swap_outs}，{swap_bytes} 字节），峰值并发 {st.peak_running}")
    if args.json:
        out = cli.generation_json(s, prompts, [r.prompt_ids for r in requests], outputs)
        for res, cached in zip(out["results"], st.cached_tokens):
            res["cached_tokens"] = cached
        out["stats"] = {"num_blocks": num_blocks, "block_size": args.block_size, "forwards": st.num_forwards,
                        "kv_dtype": fmt.name if fmt else s.dtype_name, "bytes_per_token": per_token,
                        "preemptions": st.preemptions, "swap_outs": swap_outs, "swap_bytes": swap_bytes,
                        "peak_running": st.peak_running}
        cli.emit_json(out)
    return True


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
