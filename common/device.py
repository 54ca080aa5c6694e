import torch

from .errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str = "auto") -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda requested but CUDA is not available")
    if name not in ("cpu", "cuda"):
        raise UserError(f"unknown device {name!r} (auto, cpu or cuda)")
    return name


def pick_dtype(name: str, device: str) -> torch.dtype:
    """CPU 默认 float32（这些 CPU 上 bf16 并不更快），CUDA 默认 bfloat16。"""
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r} (auto, {', '.join(DTYPES)})")
    return DTYPES[name]
