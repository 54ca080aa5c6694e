"""step05_paged：分页 KV cache + 连续批处理 + 抢占 —— 每个请求与 step03 逐 token 一致，再与 step04 比吞吐与内存。

    python step05_paged/run.py [--quick] [--json]                                   # 章节模式：检查 + 基准（chapter.py）
    python step05_paged/run.py --prompt A --prompt B --num-blocks 8 --max-new-tokens 64 --ignore-eos [--stop "."]

生成模式：全部提示词作为一个负载，在 0 时刻按给定顺序到达，先来先服务。
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import cli  # noqa: E402
from perf import compiled_decode  # noqa: E402
from step02_sampling.sampler import add_sampling_args, params_from_args  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402
from step05_paged.config import num_blocks_for_budget  # noqa: E402
from step05_paged.engine import EngineConfig, LLMEngine  # noqa: E402


def make_parser() -> cli.Parser:
    p = cli.make_parser(__doc__.splitlines()[0])
    add_sampling_args(p)
    cli.add_stop_arg(p)
    compiled_decode.add_compile_arg(cli.add_config_args(p, EngineConfig)["分页与调度"])   # 引擎参数来自 EngineConfig
    p.add_argument("--plot", default=None, help="章节模式：decode 一步随上下文长度与批大小的图存到这个路径（PNG）")
    return p


def main(args) -> bool:
    params, stop = params_from_args(args), cli.stop_from_args(args)
    s = cli.load_session(args)
    if args.prompt is None:
        from step05_paged.chapter import chapter
        return chapter(args, s)
    num_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, args.block_size, s.dtype)
    engine = LLMEngine(s.model, EngineConfig(num_blocks, args.block_size, args.max_batch_size, attention=args.attention), s.tok, s.tok.eos_ids)
    compiled_decode.compile_if_asked(args, engine)
    # 先编码、检查全部提示词（包括"池子放不放得下"），任何一个有错都在开始生成前报告
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]
    outputs, st = engine.generate([Request(ids, args.max_new_tokens, params, args.ignore_eos, stop) for ids in prompt_ids])
    cli.print_generations(s, args.prompt, outputs)
    print(f"\n池子 {num_blocks} 块 × {args.block_size} token；{st.num_forwards} 次前向（prefill {st.prefill_steps}，"
          f"decode {st.decode_steps}），抢占 {st.preemptions} 次，峰值并发 {st.peak_running}，KV 浪费 {st.kv_waste:.1%}")
    if args.json:
        out = cli.generation_json(s, args.prompt, prompt_ids, outputs)
        out["stats"] = {"num_blocks": num_blocks, "block_size": args.block_size, "preemptions": st.preemptions,
                        "peak_running": st.peak_running, "kv_waste": round(st.kv_waste, 4)}
        cli.emit_json(out)
    return True


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
