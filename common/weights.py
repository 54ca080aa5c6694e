"""读 safetensors 权重并装进我们的 Transformer。只读 .safetensors，不执行任何 pickle。"""
import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .errors import UserError
from .linear import resolve_linear, use_linear_
from .model import Transformer


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """HF 检查点里应当出现的每个张量名及其形状（不含 "model." 前缀）。"""
    E, Fd, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    HD, KD = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"embed_tokens.weight": (V, E), "norm.weight": (E,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, E)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,),
            p + "self_attn.q_proj.weight": (HD, E), p + "self_attn.k_proj.weight": (KD, E),
            p + "self_attn.v_proj.weight": (KD, E), p + "self_attn.o_proj.weight": (E, HD),
            p + "mlp.gate_proj.weight": (Fd, E), p + "mlp.up_proj.weight": (Fd, E), p + "mlp.down_proj.weight": (E, Fd),
        }
        if cfg.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (HD,), p + "self_attn.k_proj.bias": (KD,), p + "self_attn.v_proj.bias": (KD,)}
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (E,)
        if cfg.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (Fd,), p + "mlp.up_proj.bias": (Fd,), p + "mlp.down_proj.bias": (E,)}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)}
    return shapes


def safetensors_files(path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():  # 分片检查点：index 里列出每个张量在哪个文件
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / f for f in files]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    raise UserError(f"model directory {path} has no model.safetensors (only safetensors weights are supported)")


def _strip(name: str) -> str:
    return name.removeprefix("model.")


def check_weights(path, cfg: ModelConfig) -> None:
    """只读文件头（不读数据），检查每个需要的张量都在、形状都对。"""
    shapes = expected_shapes(cfg)
    found = {}
    for f in safetensors_files(path):
        if not f.is_file():
            raise UserError(f"missing weight file {f}")
        try:
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    found[_strip(name)] = tuple(sf.get_slice(name).get_shape())
        except Exception as e:  # 截断或损坏的文件
            raise UserError(f"cannot read {f}: {e}") from None
    for name, shape in shapes.items():
        if name not in found:
            raise UserError(f"weight {name!r} is missing from {path}")
        if found[name] != shape:
            raise UserError(f"weight {name!r} has shape {list(found[name])}, expected {list(shape)} from config.json")


def load_model(path, device: str, dtype: torch.dtype, linear: str = "auto") -> Transformer:
    """linear：auto（CPU float32 上打包，其余 plain）、plain 或 packed，见 common/linear.py。"""
    impl = resolve_linear(linear, device, dtype)          # 先检查：显式 packed 而这里不能打包时，不必先读完权重
    cfg = ModelConfig.from_dir(path)
    check_weights(path, cfg)
    names = expected_shapes(cfg)
    state = {}
    for f in safetensors_files(path):
        with safe_open(f, framework="pt", device="cpu") as sf:
            for name in sf.keys():
                if _strip(name) in names:  # 忽略检查点里多余的张量（如 rotary 的 inv_freq）
                    state[_strip(name)] = sf.get_tensor(name).to(device=device, dtype=dtype)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    for name, t in state.items():
        # 投影矩阵 (out, in) -> (in, out)，见 common/model.py 的 Linear。tie 的 lm_head 因此是 embed 的
        # 转置副本（多占 V·E 个数）：换来 lm_head 这一最大的矩阵-向量乘快约一倍。
        # 要打包的矩阵只转置视图、不拷贝：打包（pack_weight）要的正是原来 (out, in) 的连续内存，
        # 先拷成 (in, out) 再拷回去是两次整份权重的白拷贝
        if t.dim() == 2 and name != "embed_tokens.weight":
            state[name] = t.t() if impl == "packed" else t.t().contiguous()
    with torch.device("meta"):  # 先在 meta 设备上搭骨架（不分配、不初始化），再把权重"指派"进去
        model = Transformer(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    state.clear()  # 模型持有权重了；不清掉的话打包时每个矩阵的旧副本要等函数返回才释放（峰值两份权重）
    # 装好之后才打包：每个矩阵打包成一份新的、丢掉 (in, out) 那份。tie 的 lm_head 是嵌入表的转置副本（上面），
    # 打包它不碰 embed_tokens.weight
    return use_linear_(model, impl).eval()
