"""所有 run.py 共用的命令行、模型加载、错误处理与 JSON 输出（约定见 docs/00_overview.md 的"run.py 约定"）。"""
import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .device import pick_device, pick_dtype
from .errors import UserError
from .linear import LINEAR_IMPLS
from .prepare import resolve_model
from .tokenizer import Tokenizer
from .weights import load_model


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse 默认打印用法 + "prog: error:"；契约要求一行 "error: ..."、状态码 2
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def positive_int(s):
    """argparse 的 type：正整数，否则一行 `error: ...`（--max-new-tokens、--max-batch-size、--block-size 等共用）。"""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def make_parser(description: str) -> Parser:
    p = Parser(description=description)
    p.add_argument("--quick", action="store_true", help="同样的检查，更小的基准（CI 用）")
    p.add_argument("--model", default=None, help="本地 HF 目录（llama / qwen2 / qwen3）；默认 SmolLM2-135M-Instruct")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    add_linear_arg(p)
    p.add_argument("--json", action="store_true", help="stdout 最后一行输出一个 JSON 对象")
    p.add_argument("--prompt", action="append", default=None, help="生成模式：可重复给多个")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--ignore-eos", action="store_true", help="EOS 当普通 token，正好生成 N 个")
    p.add_argument("--chat", action="store_true", help="用分词器的对话模板包装提示词")
    return p


def add_linear_arg(p) -> None:
    """--linear：线性层用哪种算法（common/linear.py）。"""
    p.add_argument("--linear", default="auto", choices=LINEAR_IMPLS,
                   help="线性层：packed = 加载时把权重打包成 oneDNN 的块格式（CPU float32 的默认），"
                        "plain = x @ W（MKL sgemm，CUDA 与其他 dtype 的默认）；见 docs/appendix_performance.md")


def override(args: argparse.Namespace, **changes) -> argparse.Namespace:
    """同样的命令行参数，改几项（章节模式用 run.py 自己的 engine_for 造"--no-X 时"的引擎）。"""
    return argparse.Namespace(**{**vars(args), **changes})


def add_stop_arg(p: Parser) -> None:
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="停止字符串（可重复）：新生成的文本里出现它就停（包含补全它的那个 token），同 step02/03")


def stop_from_args(args) -> tuple[str, ...]:
    stop = tuple(args.stop or ())
    if any(not t for t in stop):
        raise UserError("--stop must not be empty")
    return stop


def add_paged_args(p: Parser, default_kv_mib: int) -> None:
    """step05 起每个 run.py 都有的分页与调度参数。"""
    g = p.add_argument_group("分页与调度")
    g.add_argument("--block-size", type=positive_int, default=16, help="每块多少个 token（默认 16，同 vLLM）")
    g.add_argument("--num-blocks", type=positive_int, default=None,
                   help=f"池子的块数；默认按 {default_kv_mib} MiB 的 KV 预算换算（SmolLM2 float32、块大小 16 时为 364 块）")
    g.add_argument("--max-batch-size", type=positive_int, default=8, help="运行集合最多几个请求（默认 8）")
    g.add_argument("--attention", choices=("paged", "gather"), default="paged",
                   help="读 KV 池子的注意力：paged（默认）按块表直接读、不拷贝；gather 先按块表拷成连续的再算（可读的参考）")
    add_compile_arg(g, "生成模式：decode 步用 torch.compile 按批大小桶各编译一张静态形状的图（common/compiled_decode.py）")


def add_compile_arg(g, what: str) -> None:
    """--compile [MODE]：step05 起的 run.py、step11 的服务器与它的基准共用（它们引用第 05 章的注意力内核，所以在这里才 import）。"""
    from . import compiled_decode
    g.add_argument("--compile", nargs="?", const=compiled_decode.DEFAULT_MODE, default=None,
                   choices=compiled_decode.MODES, metavar="MODE",
                   help=f"{what}；MODE 默认 {compiled_decode.DEFAULT_MODE}，可选 {' / '.join(compiled_decode.MODES)}"
                        "（速度、编译时间与内存见 docs/appendix_performance.md）")


def compile_if_asked(args, engine) -> None:
    """--compile：把引擎的 decode 换成编译好的图（先把每个桶编译一遍，带进度条）。"""
    if getattr(args, "compile", None):
        from .compiled_decode import compile_engine
        compile_engine(engine, mode=args.compile)


def add_prefix_cache_args(p: Parser) -> None:
    """step06 起：前缀缓存与并行采样。"""
    g = p.add_argument_group("前缀缓存")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="关掉前缀缓存（step06 里就是用 step05 的引擎：同样的输出、同样的前向次数）")
    g.add_argument("--n", type=positive_int, default=1,
                   help="每个提示词采 K 个样本（种子 S, S+1, ..., S+K-1），共享提示词的整块")


def add_chunked_prefill_args(p: Parser, default_budget: int) -> None:
    """step07 起：token 预算与分块 prefill。"""
    g = p.add_argument_group("分块 prefill")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=default_budget,
                   help=f"一次前向最多算多少个 token（decode 各 1 个，剩下的给 prefill 的块；默认 {default_budget}），"
                        "不能小于 --max-batch-size")
    g.add_argument("--no-chunked-prefill", action="store_true",
                   help="关掉分块 prefill：用 step06 的引擎（再加 --no-prefix-cache 就是 step05 的）")


def check_chunked_prefill_args(args) -> None:
    """加载模型之前就报错：预算至少要放得下每个 decode 的一个 token。"""
    if not args.no_chunked_prefill and args.max_num_batched_tokens < args.max_batch_size:
        raise UserError(f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be at least "
                        f"--max-batch-size ({args.max_batch_size})")


def add_kv_quant_args(p: Parser, kv_dtypes, preempt_modes) -> None:
    """step08 起：KV 池子的存法与抢占方式。"""
    g = p.add_argument_group("KV 量化与换出")
    g.add_argument("--kv-dtype", choices=kv_dtypes, default=None,
                   help="KV 池子的存法（默认：模型的 dtype，精确）；int8 / fp8 每个 (token, 头) 一个 scale")
    g.add_argument("--preempt", choices=preempt_modes, default="recompute",
                   help="池子满了怎么让出块：recompute（扔掉 KV、之后重算）或 swap（换出到 CPU 内存、之后换回）")


def check_kv_quant_args(args) -> None:
    """--no-chunked-prefill 用的是 step06 的引擎：那里没有量化的池子，也没有换出。"""
    if args.no_chunked_prefill and (args.preempt == "swap" or args.kv_dtype is not None):
        raise UserError("--kv-dtype and --preempt swap need step08's engine (drop --no-chunked-prefill)")


def add_speculative_args(p: Parser, methods, num_spec_tokens: int, ngram_min: int, ngram_max: int) -> None:
    """step09 起：投机解码（默认值取自那一步的 EngineConfig）。"""
    g = p.add_argument_group("投机解码")
    g.add_argument("--spec-method", choices=methods, default=None,
                   help="谁来猜：ngram（prompt lookup，默认）、draft（草稿模型）、none（不猜 = step08）")
    g.add_argument("--num-spec-tokens", type=positive_int, default=num_spec_tokens, help="每步每个请求至多猜几个 token")
    g.add_argument("--ngram-min", type=positive_int, default=ngram_min, help="prompt lookup 匹配的最短 n-gram")
    g.add_argument("--ngram-max", type=positive_int, default=ngram_max, help="prompt lookup 先试的最长 n-gram")
    g.add_argument("--draft-model", default=None, metavar="DIR",
                   help="草稿模型的 HF 目录（与目标同一个分词器）；给了它，--spec-method 默认是 draft")


def spec_method(args) -> str:
    """没给 --spec-method：有 --draft-model 就是 draft，--no-chunked-prefill（step06 的引擎）时不猜，否则 ngram。"""
    if args.spec_method is not None:
        return args.spec_method
    return "draft" if args.draft_model else "none" if args.no_chunked_prefill else "ngram"


def check_speculative_args(args) -> None:
    method = spec_method(args)
    if args.no_chunked_prefill and method != "none":
        raise UserError("speculative decoding needs step09's engine (drop --no-chunked-prefill or use --spec-method none)")
    if args.ngram_min > args.ngram_max:
        raise UserError(f"--ngram-min ({args.ngram_min}) must not exceed --ngram-max ({args.ngram_max})")
    if method == "draft" and not args.draft_model:
        raise UserError("--spec-method draft needs --draft-model DIR")
    if args.draft_model and method != "draft":
        raise UserError(f"--draft-model is only used with --spec-method draft (got {method})")


def load_draft_model(args, s: "Session"):
    """--draft-model：与目标同一设备、同一 dtype 加载（目录不对时一行 error）；不用草稿模型时 None。"""
    if spec_method(args) != "draft":
        return None
    return open_session(args.draft_model, s.device, s.dtype_name, getattr(args, "linear", "auto")).model


@dataclass
class Session:
    model: torch.nn.Module
    tok: Tokenizer
    cfg: ModelConfig
    path: Path
    device: str
    dtype: torch.dtype

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def encode(self, text: str, chat: bool = False, max_new_tokens: int = 0) -> list[int]:
        """编码并检查长度：提示词 + 要生成的 token 不能超过模型的上下文长度。"""
        ids = self.tok.encode(text, chat)
        ctx = self.cfg.max_position_embeddings
        if len(ids) + max_new_tokens > ctx:
            raise UserError(f"prompt has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} "
                            f"that exceeds the model's context of {ctx} tokens")
        return ids

    @torch.inference_mode()
    def full_logits(self, ids: list[int]) -> torch.Tensor:
        """整段重算一次前向，返回 (T, V)：teacher-forcing 参考与分歧容差检查用。"""
        x = torch.tensor([ids], device=self.device)
        pos = torch.arange(len(ids), device=self.device)[None]
        return self.model(x, pos)[0]


def check_compile_args(args) -> None:
    """--compile 只用于生成模式（章节模式比较的是 eager 的引擎）。在加载模型之前就报错。"""
    if getattr(args, "compile", None) and args.prompt is None:
        raise UserError("--compile is for generation mode (--prompt ...); the chapter compares eager engines "
                        "(compiled numbers: python bench/decode_speed.py)")


def load_session(args) -> Session:
    check_compile_args(args)
    return open_session(args.model, args.device, args.dtype, getattr(args, "linear", "auto"))


def open_session(model_dir: str | None = None, device: str = "auto", dtype: str = "auto",
                 linear: str = "auto") -> Session:
    device = pick_device(device)
    dtype = pick_dtype(dtype, device)
    path = resolve_model(model_dir)
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, device, dtype, linear)
    tok = Tokenizer(path)
    return Session(model, tok, cfg, path, device, dtype)


def emit_json(obj: dict) -> None:
    print(json.dumps(obj, ensure_ascii=False))


def chapter_json(step: str, s: Session, checks: dict, figures: dict) -> dict:
    return {"step": step, "model_path": str(s.path), "device": s.device, "dtype": s.dtype_name,
            "checks": {k: bool(v) for k, v in checks.items()}, "figures": figures}


def generation_json(s: Session, prompts: list[str], prompt_ids: list[list[int]], outputs: list[list[int]]) -> dict:
    return {"model_path": str(s.path), "results": [
        {"prompt": p, "prompt_ids": ids, "output_ids": out, "text": s.tok.decode(out)}
        for p, ids, out in zip(prompts, prompt_ids, outputs)]}


def print_generations(s: Session, prompts, outputs) -> None:
    for p, out in zip(prompts, outputs):
        print(f"--- prompt: {p!r}  ({len(out)} new tokens)")
        print(s.tok.decode(out))


def print_checks(checks: dict, notes: list[str] = ()) -> None:
    """只打印检查真实算出来的结果：✅ 只给真正通过的检查。"""
    print("\n检查:")
    for name, ok in checks.items():
        print(f"  {'✅' if ok else '❌'} {name}")
    for n in notes:
        print(f"  · {n}")


def run_main(parser: Parser, main, argv=None) -> None:
    """运行 main(args)；UserError → stderr 一行 `error: ...`、退出码 2，不打印 traceback。
    main 返回 False 表示有检查没通过（退出码 1）。"""
    args = parser.parse_args(argv)
    if args.prompt is not None and any(not p for p in args.prompt):
        print("error: empty prompt", file=sys.stderr)
        sys.exit(2)
    try:
        ok = main(args)
    except UserError as e:
        msg = " ".join(str(e).split())  # 契约：恰好一行（底层库的消息可能跨多行）
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(0 if ok is not False else 1)
