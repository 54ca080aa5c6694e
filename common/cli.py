"""所有 run.py 共用的命令行、模型加载、错误处理与 JSON 输出（约定见 docs/00_overview.md 的"run.py 约定"）。"""
import argparse
import dataclasses
import json
import sys
import typing
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
    p.add_argument("--model", default=None, help="本地 HF 目录（llama / qwen2 / qwen3 / mistral / ministral）；默认 SmolLM2-135M-Instruct")
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


def config_fields(config_cls):
    """配置 dataclass 的每个字段：(field, 类型（Optional[X] 取 X）, 默认值（没有默认值时 None）)。"""
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        t = hints[f.name]
        args = [a for a in typing.get_args(t) if a is not type(None)]
        base = args[0] if typing.get_origin(t) is typing.Union and len(args) == 1 else t
        yield f, base, None if f.default is dataclasses.MISSING else f.default


def add_config_args(p: Parser, config_cls) -> dict:
    """把配置 dataclass 的字段加成命令行参数：step05 起每个 run.py 的引擎参数都从它自己的 EngineConfig 生成。

    字段名 → --flag（num_blocks → --num-blocks），默认值取自字段（没有默认值的字段命令行默认 None，由 run.py 换算），
    int 字段用 positive_int。字段的 metadata 决定其余：
      help     说明；没有 help 的字段不上命令行（只给测试、基准调的旋钮）
      group    参数组的标题（同一标题的字段进同一组）
      choices  可选值
      flag     另一个名字：默认 True 的 bool 字段写成 "--no-X"，命令行上是开关（args.no_x = True 表示关掉）
    返回 {组标题: 参数组}：run.py 把它自己的开关（--no-X 换回前一步的引擎……）加进对应的组。"""
    groups = {}
    for f, base, default in config_fields(config_cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        title = meta.get("group")
        if title not in groups:
            groups[title] = p.add_argument_group(title) if title else p
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        if base is bool:
            if default != flag.startswith("--no-"):
                raise TypeError(f"{config_cls.__name__}.{f.name}: a bool flag is off by default "
                                "(default False as --x, or default True as --no-x)")
            groups[title].add_argument(flag, action="store_true", help=meta["help"])
        else:
            kw = {"choices": meta["choices"]} if "choices" in meta else {}
            groups[title].add_argument(flag, type=positive_int if base is int else base, default=default,
                                       help=meta["help"], **kw)
    return groups


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


def load_session(args, sliding_window: bool = False) -> Session:
    check_compile_args(args)
    return open_session(args.model, args.device, args.dtype, getattr(args, "linear", "auto"), sliding_window)


def open_session(model_dir: str | None = None, device: str = "auto", dtype: str = "auto",
                 linear: str = "auto", sliding_window: bool = False) -> Session:
    """sliding_window：调用者的 KV cache 认识滑动窗口层吗（见 check_sliding_window）。"""
    device = pick_device(device)
    dtype = pick_dtype(dtype, device)
    path = resolve_model(model_dir)
    cfg = ModelConfig.from_dir(path)
    if not sliding_window:
        check_sliding_window(cfg, path)
    model = load_model(path, device, dtype, linear)
    tok = Tokenizer(path)
    return Session(model, tok, cfg, path, device, dtype)


def check_sliding_window(cfg: ModelConfig, path) -> None:
    """有滑动窗口层的模型（mistral、开了 use_sliding_window 的 qwen2……）只有两种引擎算得对：不用缓存、每步整段重算的
    step01/02（common/model.py 的掩码带窗口），和 KV cache 认识窗口的 step12。step03–11 的缓存保存并注意每一个
    key——窗口外的 key 也会被看到，结果悄悄地错。所以默认在加载时拒绝，那几步的 run.py 显式说自己可以
    （load_session(args, sliding_window=True)）。"""
    if cfg.sliding:
        windows = sorted({w for w in cfg.layer_windows if w is not None})
        n = sum(w is not None for w in cfg.layer_windows)
        raise UserError(f"model {path} uses sliding-window attention ({n} of {cfg.num_layers} layers, window "
                        f"{', '.join(map(str, windows))}); this engine's KV cache keeps every key and has no window: "
                        "use step12_kv_eviction (server: --engine step12)")


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
