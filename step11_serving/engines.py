"""服务器能挂哪一步的引擎：step05 起每一步的 engine.py 都有同样的 step API（LLMEngine / EngineConfig，
add_request / step / abort），服务器只认这套 API，所以任何一步都能拿来服务。

加一步只要在 ENGINES 里加一行。每一步的引擎参数直接从它的 EngineConfig 的字段生成
（num_blocks → --num-blocks，max_num_batched_tokens → --max-num-batched-tokens，kv_dtype → --kv-dtype……），
所以服务器的参数永远与那一步的引擎一致，不用在这里再抄一遍。step10 另有 --tp / --pp：服务器进程就是 rank 0，
其余 rank 是它起的子进程（step10_tensor_parallel/launch.py 的 launch），服务器关闭时一起收掉。

权重与引擎无关：--weights q4_1 / q8_0、--linear ours 加载 float32 模型后换上 step14 的块权重与 C++ 内核
（step14_weight_quant/linear.py 的 load_with_weights，规则与报错与 step14 的 run.py 相同），任何一步的引擎都照常跑它。
"""
import argparse
import contextlib
import importlib

from common.cli import config_fields, open_session, positive_int
from common.errors import UserError

ENGINES = {                       # --engine 的名字 → 那一步的包
    "step05": "step05_paged",
    "step06": "step06_prefix_cache",
    "step07": "step07_chunked_prefill",
    "step08": "step08_kv_quant",
    "step09": "step09_speculative",
    "step10": "step10_tensor_parallel",
    "step12": "step12_kv_eviction",   # step09 的引擎 + KV 驱逐（--kv-policy / --kv-budget …）
    "step13": "step13_kv_blend",      # step12 的引擎 + 非前缀复用（--blend / --recompute-ratio）
    "step15": "step15_structured_output",   # step09 的引擎 + 结构化输出（response_format、structured_outputs）
}
DEFAULT_ENGINE = "step10"          # 最后一个通用引擎：step09 的全部 + --tp/--pp（默认 1、1：一个进程）；
                                   # step12/13/15 在 step09 的引擎上各加一件事（驱逐、非前缀复用、约束），用 --engine 选
PARALLEL_ENGINES = {"step10"}      # 有 --tp / --pp 的
# 算 logprobs 的（Request.logprobs / prompt_logprobs → RequestOutput 里带着）；更早的引擎不看这两项，服务器回 400
LOGPROBS_ENGINES = {"step09", "step10", "step12", "step13", "step15"}
# add_request 收段标记的（chunks=[(start, end), ...]，completions 的 chunk_separator 字段）；别的引擎服务器回 400
CHUNK_ENGINES = {"step13"}
# add_request 收约束的（structured_output=StructuredOutputsParams，response_format / structured_outputs）；别的引擎 400
STRUCTURED_ENGINES = {"step15"}
# 认识滑动窗口层的（mistral 之类，common/config.py 的 layer_windows）；更早的引擎的缓存没有窗口，加载时拒绝这种模型
SLIDING_WINDOW_ENGINES = {"step12"}
# 与各步 run.py 同名的参数（run.py 的约定里叫 --no-prefix-cache）；其余字段按字段名生成
FLAG_NAMES = {"enable_prefix_caching": "--prefix-cache"}


def engine_module(name: str):
    if name not in ENGINES:
        raise UserError(f"unknown engine {name!r} (choose from {', '.join(ENGINES)})")
    try:
        mod = importlib.import_module(f"{ENGINES[name]}.engine")
    except ImportError as e:
        raise UserError(f"cannot import engine {name}: {e}") from None
    if not all(hasattr(mod, a) for a in ("LLMEngine", "EngineConfig")):
        raise UserError(f"{ENGINES[name]}.engine does not have the step API (LLMEngine, EngineConfig) yet")
    return mod


def _from(engine, names) -> bool:
    """这个引擎对象来自 names 里的一步吗（按它的类所在的包判断）。"""
    return type(engine).__module__.split(".")[0] in {ENGINES[n] for n in names}


def computes_logprobs(engine) -> bool:
    return _from(engine, LOGPROBS_ENGINES)


def accepts_chunks(engine) -> bool:
    return _from(engine, CHUNK_ENGINES)


def accepts_structured_output(engine) -> bool:
    return _from(engine, STRUCTURED_ENGINES)


def add_engine_args(parser: argparse.ArgumentParser, name: str) -> None:
    """把那一步 EngineConfig 的每个字段加成一个命令行参数（默认值取自 EngineConfig 本身）。"""
    g = parser.add_argument_group(f"{name} 的引擎参数（来自 {ENGINES[name]}.engine.EngineConfig）")
    for f, base, default in config_fields(engine_module(name).EngineConfig):
        flag = FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-"))
        if base is bool:
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default)
        elif base is int:
            g.add_argument(flag, dest=f.name, type=positive_int, default=default, metavar="N")
        elif base is float:
            g.add_argument(flag, dest=f.name, type=float, default=default)
        else:
            g.add_argument(flag, dest=f.name, type=str, default=default)
    if "spec_method" in {f.name for f, _, _ in config_fields(engine_module(name).EngineConfig)}:
        g.add_argument("--draft-model", default=None, metavar="DIR",
                       help="--spec-method draft 的草稿模型（HF 目录，与目标同一个分词器）")
    if name in PARALLEL_ENGINES:
        g.add_argument("--tp", type=positive_int, default=1, help="张量并行的进程数（要整除头数；只用 CPU + gloo）")
        g.add_argument("--pp", type=positive_int, default=1, help="流水线并行的 stage 数")


def add_weight_args(p: argparse.ArgumentParser) -> None:
    """step14 的 --weights / --activations，--linear 多一个 ours。这里只定义参数，不 import step14。"""
    linear = next(a for a in p._actions if "--linear" in a.option_strings)
    linear.choices = (*linear.choices, "ours")
    linear.help += "；ours = step14 的 C++ 块内核（--weights 不是 f32 时 auto 就是它）"
    g = p.add_argument_group("权重量化（step14，只在 CPU float32 上）")
    g.add_argument("--weights", choices=("f32", "q8_0", "q4_1"), default="f32",
                   help="f32 = 模型的 float32 权重；q4_1 = 默认模型的 GGUF 里的块原样使用（与 f32 同样的 token）；"
                        "q8_0 = 从 float32 重新量化（有损）")
    g.add_argument("--activations", choices=("f32", "q8"), default="f32",
                   help="q8 = 有损的一级：投影的激活量化成 8 位再与 Q4_1 做整数点积（只配 --weights q4_1）")


def uses_step14(args) -> bool:
    """命令行要 step14 的权重或内核吗（只有这时才 import step14）。"""
    return (getattr(args, "weights", "f32") != "f32" or getattr(args, "activations", "f32") != "f32"
            or getattr(args, "linear", "auto") == "ours")


def check_weight_args(args) -> None:
    """加载模型之前检查 step14 的参数与 --compile、--tp/--pp 的组合（坏组合 UserError）。"""
    if uses_step14(args):
        from step14_weight_quant.linear import check_weight_flags
        check_weight_flags(args.weights, args.activations, args.linear, getattr(args, "compile", None),
                           getattr(args, "tp", 1) * getattr(args, "pp", 1))


def open_serving_session(args, sliding_window: bool = False):
    """加载要服务的模型：返回 (Session, step14 的格式或 None)。--weights / --linear ours 时换上 step14 的块权重。"""
    def load(linear):
        return open_session(args.model, args.device, args.dtype, linear, sliding_window=sliding_window)
    if not uses_step14(args):
        return load(args.linear), None
    from step14_weight_quant.linear import load_with_weights
    return load_with_weights(load, args.weights, args.activations, args.linear, args.model, args.device, args.dtype)


@contextlib.contextmanager
def parallel_group(name: str, session, args):
    """step10 的 --tp × --pp > 1：起其余的 rank（本进程是 rank 0），把 session.model 换成 rank 0 的那一份；
    yield 的 ParallelContext 交给 build_engine。其余情况 yield None，什么也不起。退出时（正常、出错、Ctrl-C）
    worker 一个不剩地收掉。"""
    tp, pp = getattr(args, "tp", 1), getattr(args, "pp", 1)
    if tp * pp == 1:
        yield None
        return
    from step10_tensor_parallel.launch import launch, serve_worker
    from step10_tensor_parallel.parallel_layers import check_parallel, load_shard
    if session.device != "cpu":
        raise UserError("--tp/--pp > 1 run CPU processes over gloo here: use --device cpu")
    check_parallel(session.cfg, tp, pp)
    linear = getattr(args, "linear", "auto")
    with launch(tp, pp, serve_worker, (session.path, session.device, session.dtype, linear)) as parallel:
        session.model = load_shard(session.path, parallel, session.device, session.dtype, linear)
        yield parallel


def build_engine(name: str, session, args, parallel=None):
    """按命令行参数建那一步的引擎。num_blocks 没给时用那一步自己的 num_blocks_for_budget 按那一步的 DEFAULT_KV_MIB 换算
    （step08 的量化池子每 token 字节更少，同样的预算放更多块；step10 的每个 rank 只有自己那份层与头，按它的配置算）。
    parallel：parallel_group 给的 ParallelContext（step10 的 --tp/--pp > 1）。"""
    from common.clock import WallClock
    mod = engine_module(name)
    conf = importlib.import_module(f"{ENGINES[name]}.config")   # 那一步的 EngineConfig 与块数换算
    kw = {f.name: getattr(args, f.name) for f, _, _ in config_fields(mod.EngineConfig)
          if getattr(args, f.name) is not None}
    if "num_blocks" not in kw:
        kv = {"kv_dtype": kw["kv_dtype"]} if kw.get("kv_dtype") else {}
        kw["num_blocks"] = int(conf.num_blocks_for_budget(session.model.cfg, kw["block_size"], session.model.dtype,
                                                          conf.DEFAULT_KV_MIB, **kv))
    extra = {"parallel": parallel} if parallel is not None else {}
    draft = getattr(args, "draft_model", None)
    if (kw.get("spec_method") == "draft") != bool(draft):
        raise UserError("--spec-method draft needs --draft-model DIR" if draft is None else
                        f"--draft-model is only used with --spec-method draft (got {kw.get('spec_method')})")
    if draft:                                  # 与目标同一设备、同一 dtype
        extra["draft_model"] = open_session(draft, session.device, session.dtype_name).model
    try:
        config = mod.EngineConfig(**kw)
        return mod.LLMEngine(session.model, config, tokenizer=session.tok, eos_ids=session.tok.eos_ids,
                             clock=WallClock(), **extra)
    except (TypeError, ValueError) as e:
        raise UserError(f"bad engine settings for {name}: {e}") from None


@contextlib.contextmanager
def serving_engine(name: str, session, args):
    """建那一步的引擎来服务（api_server、run.py、chapter 用）；step10 的 --tp/--pp > 1 时先起其余的 rank。
    退出时先停引擎（worker 那边的引擎跟着结束），再收掉 worker 进程。"""
    with parallel_group(name, session, args) as parallel:
        engine = build_engine(name, session, args, parallel)
        try:
            yield engine
        finally:
            if parallel is not None:
                engine.close()
