"""step10_tensor_parallel：一个模型切在 tp × pp 个进程上（torch.distributed，gloo），输出与一个进程（step09）相同。

    python step10_tensor_parallel/run.py [--quick] [--json]                          # 章节模式（chapter.py）
    python step10_tensor_parallel/run.py --prompt "..." --tp 3                      # 自己起 3 个进程（torch.multiprocessing）
    torchrun --nproc-per-node 3 step10_tensor_parallel/run.py --prompt "..." --tp 3
    torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --rdzv-endpoint 127.0.0.1:29500 \\
        step10_tensor_parallel/run.py --prompt "..." --pp 2                         # 另一个终端里 --node-rank 1

--tp 1 --pp 1（默认）就是一个进程，与 step09 的引擎相同；step09 的全部参数照旧（投机解码的猜测只在 rank 0 上做）。
--no-chunked-prefill 用 step06 的引擎，只能一个进程。
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import cli  # noqa: E402
from perf import compiled_decode  # noqa: E402
from common.config import ModelConfig  # noqa: E402
from common.device import pick_device, pick_dtype  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.prepare import resolve_model  # noqa: E402
from common.tokenizer import Tokenizer  # noqa: E402
from step02_sampling.sampler import add_sampling_args, params_from_args  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402
from step05_paged import engine as step05  # noqa: E402
from step06_prefix_cache import engine as step06  # noqa: E402
from step10_tensor_parallel import engine as step10  # noqa: E402
from step10_tensor_parallel.config import num_blocks_for_budget  # noqa: E402
from step10_tensor_parallel.kv_cache import PagedKVCache  # noqa: E402
from step10_tensor_parallel.quant import kv_format  # noqa: E402
from step10_tensor_parallel.distributed import Layout, forward_comm_seconds  # noqa: E402
from step10_tensor_parallel.launch import launch  # noqa: E402
from step10_tensor_parallel.model_runner import serve_worker  # noqa: E402
from step10_tensor_parallel.parallel_layers import Shard, check_parallel, load_shard  # noqa: E402

def make_parser() -> cli.Parser:
    p = cli.make_parser(__doc__.splitlines()[0])
    add_sampling_args(p)
    cli.add_stop_arg(p)
    groups = cli.add_config_args(p, step10.EngineConfig)   # 引擎参数来自 EngineConfig；下面是 run.py 自己的开关
    compiled_decode.add_compile_arg(groups["分页与调度"])
    groups["前缀缓存"].add_argument("--n", type=cli.positive_int, default=1,
                                   help="每个提示词采 K 个样本（种子 S, S+1, ..., S+K-1），共享提示词的整块")
    groups["分块 prefill"].add_argument("--no-chunked-prefill", action="store_true",
                                       help="关掉分块 prefill：用 step06 的引擎（再加 --no-prefix-cache 就是 step05 的）")
    p.set_defaults(spec_method=None)             # 没给时由 spec_method(args) 按 --draft-model 定
    groups["投机解码"].add_argument("--draft-model", default=None, metavar="DIR",
                                   help="草稿模型的 HF 目录（与目标同一个分词器）；给了它，--spec-method 默认是 draft")
    g = p.add_argument_group("并行")
    g.add_argument("--tp", type=cli.positive_int, default=1, help="张量并行：一个 stage 里几个进程分每一层（要整除头数）")
    g.add_argument("--pp", type=cli.positive_int, default=1, help="流水线并行：层分成几个 stage")
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
    check_budget(args)
    check_kv_quant(args)
    check_speculative(args)
    if args.tp * args.pp > 1 and args.no_chunked_prefill:
        raise UserError("--no-chunked-prefill runs step06's engine in one process: drop --tp/--pp")
    if args.tp * args.pp > 1 and args.device == "cuda":
        raise UserError("--tp/--pp > 1 run CPU processes over gloo here (GPUs would use NCCL): use --device cpu")
    cli.check_compile_args(args)
    if args.tp * args.pp > 1 and args.compile:
        raise UserError("--compile compiles one process's decode: drop --tp/--pp (each shard's forward all-reduces "
                        "across processes)")


def num_blocks_per_rank(cfg: ModelConfig, args, dtype) -> int:
    """每个 rank 同样的 KV 预算（256 MiB）能放几块：块号在所有 rank 上通用，所以取最满的那个 rank（层最多的 stage）。"""
    return min(num_blocks_for_budget(Shard.of(cfg, Layout(r, args.tp, args.pp)).rank_config(cfg),
                                            args.block_size, dtype, kv_dtype=args.kv_dtype)
               for r in range(args.tp * args.pp))


def engine_for(args, s: cli.Session, num_blocks: int, parallel, draft_model=None):
    """--no-chunked-prefill → step06 的引擎（再加 --no-prefix-cache → step05 的），一个进程；否则 step10 的。"""
    if args.no_chunked_prefill:
        step = step05 if args.no_prefix_cache else step06
        config = step.EngineConfig(num_blocks, args.block_size, args.max_batch_size, attention=args.attention)
        return step.LLMEngine(s.model, config, s.tok, s.tok.eos_ids)
    config = step10.EngineConfig(num_blocks, args.block_size, args.max_batch_size, args.max_num_batched_tokens,
                                 not args.no_prefix_cache, attention=args.attention, kv_dtype=args.kv_dtype,
                                 preempt=args.preempt, spec_method=spec_method(args),
                                 num_spec_tokens=args.num_spec_tokens, ngram_min=args.ngram_min,
                                 ngram_max=args.ngram_max)
    return step10.LLMEngine(s.model, config, s.tok, s.tok.eos_ids, draft_model=draft_model,
                            parallel=parallel if parallel.world_size > 1 else None)


def main(args) -> bool:
    if os.environ.get("RANK", "0") != "0":       # torchrun 起的其他 rank：什么也不打印（出错由 rank 0 报告）
        sys.stdout = sys.stderr = open(os.devnull, "w")
    params, stop = params_from_args(args), cli.stop_from_args(args)
    check_args(args)
    device = "cpu" if args.tp * args.pp > 1 else pick_device(args.device)
    path, dtype = resolve_model(args.model), pick_dtype(args.dtype, device)
    cfg = ModelConfig.from_dir(path)
    cli.check_sliding_window(cfg, path)          # 这里不经过 cli.open_session（它在那里检查），所以自己查一次
    check_parallel(cfg, args.tp, args.pp)
    s = cli.Session(None, Tokenizer(path), cfg, path, device, dtype)
    if args.prompt is None:
        if "RANK" in os.environ:
            raise UserError("chapter mode starts its own process groups: run it without torchrun")
        from step10_tensor_parallel.chapter import Chapter
        return Chapter(args, s).run()
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]   # 坏输入在起进程之前报告
    requests = [q for ids in prompt_ids
                for q in Request(ids, args.max_new_tokens, params, args.ignore_eos, stop).parallel_samples(args.n)]
    prompts = [p for p in args.prompt for _ in range(args.n)]
    num_blocks = args.num_blocks or num_blocks_per_rank(cfg, args, dtype)
    with launch(args.tp, args.pp, serve_worker, (path, device, dtype, args.linear)) as parallel:
        s.model = load_shard(path, parallel, device, dtype, args.linear)          # 这里往下只有 rank 0 在跑
        engine = engine_for(args, s, num_blocks, parallel, load_draft_model(args, s))
        compiled_decode.compile_if_asked(args, engine)
        outputs, st = engine.generate(requests)
        comm = engine.close() if parallel.world_size > 1 else []
    cli.print_generations(s, prompts, outputs)
    weights = sum(p.nbytes for p in s.model.parameters())
    kv = PagedKVCache.bytes_per_block(s.model.cfg, args.block_size, dtype,
                                             kv_format(args.kv_dtype, dtype)) / args.block_size
    print(f"\n{args.tp} × {args.pp} 个进程（tp × pp）：rank 0 的权重 {weights / 2**20:.1f} MiB，KV 每 token {kv:.0f} 字节"
          f"（本 rank 的层与 KV 头）；池子 {num_blocks} 块 × {args.block_size} token；{st.num_forwards} 次前向，抢占 {st.preemptions} 次")
    for rank, ops in enumerate(comm):
        talk = "，".join(f"{k} {v[0]} 次 {v[1] / 1024:.0f} KiB" for k, v in ops.items() if k != "forward")
        print(f"  rank {rank}: {talk}"
              + f"；前向 {ops['forward'][2]:.2f} s，其中通信 {forward_comm_seconds(ops):.2f} s")
    if args.json:
        out = cli.generation_json(s, prompts, [r.prompt_ids for r in requests], outputs)
        for res, cached in zip(out["results"], st.cached_tokens):
            res["cached_tokens"] = cached
        out["stats"] = {"tp": args.tp, "pp": args.pp, "num_blocks": num_blocks, "block_size": args.block_size,
                        "forwards": st.num_forwards, "preemptions": st.preemptions, "weight_bytes_rank0": weights,
                        "kv_bytes_per_token_rank0": kv, "comm": comm}
        cli.emit_json(out)
    return True


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
