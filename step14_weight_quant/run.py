"""step14_weight_quant：权重换成量化的块、矩阵乘换成我们自己的 C++ 内核——引擎不变，用的是 step03 与 step09 的。

    python step14_weight_quant/run.py [--quick] [--json]                              # 章节模式（chapter.py）
    python step14_weight_quant/run.py --prompt "..." --weights q4_1                    # 一个提示词：step03 的 generate（批 1）
    python step14_weight_quant/run.py --prompt A --prompt B --weights q4_1             # 几个提示词：step09 的引擎

这一步不是引擎：run.py 加载 float32 模型，把线性层与词嵌入换成 step14 的模块（linear.py），再交给已有的引擎。
一个提示词、--n 1、没有改任何 step09 的引擎参数时用 step03 的 generate（批 1）；否则（几个提示词、--n、
--block-size、--spec-method……）用 step09 的引擎（参数与 step09 的 run.py 相同，草稿模型照常是 float32）。

--weights f32   模型原来的 float32 权重（--linear ours 时换成我们的内核，同样的数）
--weights q4_1  默认模型所转换自的 GGUF 里的块，原样使用：投影 Q4_1、词嵌入与 tie 的 lm_head 是文件里的 Q8_0。
                float32 模型的每个权重就是这些块解码出来的数，所以激活是 float32 时 token 与 float32 模型相同
--weights q8_0  有损：每个矩阵（词嵌入也是）从 float32 权重重新量化成 Q8_0（gguf 包的量化器，llama.cpp 的规则）
--activations q8   有损的一级（只配 q4_1）：投影的激活先量化成 8 位（Q8_1），与 Q4_1 做整数点积，llama.cpp 在 CPU 上的算法
--linear auto   --weights f32 时同前几步（CPU float32 上是 packed）；别的 --weights 时是 ours
--fused-ops     eager 的融合路径（fused.py）：每层的 RMSNorm、残差相加 + RMSNorm、RoPE 各一次 C++ 调用，q/k/v 与
                gate/up 的块各拼成一个；不加就是 common/model.py 原样
--compile       step09 的引擎、decode 步编译成图（perf/compiled_decode.py）；我们的内核在图里是一个算子
                （kernels.graph_op：C++ 注册的 step14::block_matmul），所以与 --weights、--linear ours 都能一起用（有损的 --activations q8 除外）
"""
import sys
from pathlib import Path

import torch  # noqa: E402

# 脚本所在的目录不放在 sys.path 上：这里的 linear.py、kernels.py 会遮住别的包按顶层名字 import 的同名模块
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import cli  # noqa: E402
from common.linear import linear_impl  # noqa: E402
from step02_sampling.sampler import params_from_args  # noqa: E402
from step03_kvcache_single.engine import generate  # noqa: E402
from step04_static_batching.request import Request  # noqa: E402
from step09_speculative import run as step09_run  # noqa: E402
from step09_speculative.config import num_blocks_for_budget  # noqa: E402
from perf import compiled_decode  # noqa: E402
from step14_weight_quant.fused import use_fused_ops_  # noqa: E402
from step14_weight_quant.linear import ACTIVATIONS, LOSSY, WEIGHTS, check_weight_flags, load_with_weights  # noqa: E402

LINEARS = ("auto", "plain", "packed", "ours")


def make_parser() -> cli.Parser:
    p = step09_run.make_parser()
    p.description = __doc__.splitlines()[0]
    linear = next(a for a in p._actions if "--linear" in a.option_strings)
    linear.choices = LINEARS
    linear.help = ("线性层：plain / packed 同前几步（float32 权重）；ours = step14 的 C++ 块内核；"
                   "auto = --weights f32 时同前几步，否则 ours")
    g = p.add_argument_group("权重量化（step14）")
    g.add_argument("--weights", choices=WEIGHTS, default="f32",
                   help="f32 = 模型的 float32 权重；q4_1 = 默认模型的 GGUF 里的块原样使用（与 f32 同样的 token）；"
                        "q8_0 = 从 float32 重新量化（有损）")
    g.add_argument("--fused-ops", action="store_true",
                   help="eager 的融合路径（fused.py）：RMSNorm（连同残差相加）、RoPE 换成一次 C++ 调用，q/k/v、gate/up "
                        "的块拼成一个；数学不变。不加时就是 common/model.py 原样")
    g.add_argument("--activations", choices=ACTIVATIONS, default="f32",
                   help="q8 = 有损的一级：投影的激活量化成 8 位再与 Q4_1 做整数点积（只配 --weights q4_1）")
    return p


def load(args):
    """加载 float32 模型并换上 step14 的模块：返回 (Session, 格式或 None)。规则与报错在 linear.py（服务器也用）。"""
    s, fmt = load_with_weights(lambda linear: cli.load_session(cli.override(args, linear=linear)), args.weights,
                               args.activations, args.linear, args.model, args.device, args.dtype)
    if args.fused_ops:
        if s.model.device.type != "cpu" or s.model.dtype != torch.float32:
            print(f"--fused-ops 的 C++ 小算子只在 CPU float32 上：{s.model.device}/{str(s.model.dtype).removeprefix('torch.')} "
                  "上照常用 common/model.py 的写法")
        else:
            use_fused_ops_(s.model)
    return s, fmt


def uses_step09(args, parser) -> bool:
    """几个提示词，或 --n、step09 的任何引擎参数不是默认值：step09 的引擎；否则 step03 的 generate。"""
    step03_dests = {a.dest for a in cli.make_parser("")._actions} | {"temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop",
                           "weights", "activations", "fused_ops", "help"}
    changed = [a.dest for a in parser._actions if a.dest not in step03_dests
               and getattr(args, a.dest, None) != parser.get_default(a.dest)]
    return len(args.prompt) > 1 or bool(changed)


def main(args) -> bool:
    params, stop = params_from_args(args), cli.stop_from_args(args)
    step09_run.check_args(args)
    check_weight_flags(args.weights, args.activations, args.linear, compile=getattr(args, "compile", None))
    if args.prompt is None:
        from step14_weight_quant.chapter import Chapter
        return Chapter(args, engine_for).run()
    on_step09 = uses_step09(args, make_parser())
    s, fmt = load(args)
    if fmt in LOSSY:
        print(f"（--weights {args.weights} --activations {args.activations} 是有损的一级：token 可能与 float32 模型不同；"
              "质量见章节模式）")
    prompt_ids = [s.encode(p, args.chat, args.max_new_tokens) for p in args.prompt]
    if not on_step09:
        outputs = [generate(s.model, prompt_ids[0], args.max_new_tokens, params, s.tok.eos_ids, args.ignore_eos,
                            stop_strings=stop, tokenizer=s.tok)]
        prompts, ids_out, stats = args.prompt, prompt_ids, {"engine": "step03"}
    else:
        engine = engine_for(args, s)
        compiled_decode.compile_if_asked(args, engine)     # --compile：开始之前编译好每个桶
        requests = [q for ids in prompt_ids
                    for q in Request(ids, args.max_new_tokens, params, args.ignore_eos, stop).parallel_samples(args.n)]
        outputs, st = engine.generate(requests)
        prompts, ids_out = [p for p in args.prompt for _ in range(args.n)], [r.prompt_ids for r in requests]
        stats = {"engine": "step09", "forwards": st.num_forwards, "generated_tokens": st.generated_tokens}
    cli.print_generations(s, prompts, outputs)
    print(f"\n权重 {fmt or 'float32（' + linear_impl(s.model) + '）'}，引擎 {stats['engine']}")
    if args.json:
        out = cli.generation_json(s, prompts, ids_out, outputs)
        out["stats"] = {**stats, "weights": args.weights, "activations": args.activations, "format": fmt or "f32"}
        cli.emit_json(out)
    return True


def engine_for(args, s: cli.Session):
    """step09 的引擎（run.py 的同一套参数），跑 s.model——换没换过权重都行。"""
    num_blocks = args.num_blocks or num_blocks_for_budget(s.cfg, args.block_size, s.dtype, kv_dtype=args.kv_dtype)
    draft = step09_run.load_draft_model(cli.override(args, linear="auto"), s)
    return step09_run.engine_for(args, s, num_blocks, args.max_batch_size, args.max_num_batched_tokens,
                                 draft_model=draft)


if __name__ == "__main__":
    cli.run_main(make_parser(), main)
