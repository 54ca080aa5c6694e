"""从 HF 的 config.json 读出我们的模型需要的全部超参数（llama / qwen2 / qwen3 / mistral / ministral）。"""
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import UserError

# mistral、ministral 的权重与 llama 同名同形（q/k/v/o 不带 bias），区别只在滑动窗口（见 layer_windows）
SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "ministral")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int            # E
    intermediate_size: int      # F (SwiGLU 中间维度)
    num_layers: int
    num_heads: int              # H   (query 头数)
    num_kv_heads: int           # H_kv (K/V 头数, GQA: H_kv 整除 H)
    head_dim: int               # D
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict          # {"rope_type": "default"} 或 linear / llama3 的参数
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool              # qwen2: q/k/v 带 bias
    o_bias: bool                # llama 的 attention_bias=True 时 o_proj 也带 bias
    mlp_bias: bool
    qk_norm: bool               # qwen3: 对每个头的 q/k 再做一次 RMSNorm
    # 每层的滑动窗口 W（None = 全注意力）：位置 i 的 query 只看位置 j 满足 i - W < j <= i 的 key（含自己共 W 个），
    # 与 HF 的 sliding_window_overlay 相同
    layer_windows: tuple[Optional[int], ...]

    @property
    def sliding(self) -> bool:
        """有没有任何一层用滑动窗口。"""
        return any(w is not None for w in self.layer_windows)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """每个 token 在 KV cache 里占的字节数：K 和 V 两份 × 层数 × KV 头数 × 头维度 × 每个数的字节数。"""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_dict(cls, c: dict) -> "ModelConfig":
        mt = c.get("model_type")
        if mt not in SUPPORTED:
            raise UserError(f"unsupported architecture {mt!r} (supported: {', '.join(SUPPORTED)})")
        try:
            heads = int(c["num_attention_heads"])
            hidden = int(c["hidden_size"])
            # transformers 5 把 rope 参数放在 rope_parameters 里；老的 config 用 rope_theta + rope_scaling
            rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
            theta = float(rope.pop("rope_theta", c.get("rope_theta", 10000.0)))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            rope["rope_type"] = rope_type
            if rope_type not in ROPE_TYPES:
                raise UserError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
            attention_bias = bool(c.get("attention_bias", False))
            num_layers = int(c["num_hidden_layers"])
            cfg = cls(
                model_type=mt,
                vocab_size=int(c["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(c["intermediate_size"]),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or hidden // heads),
                rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=rope,
                max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                qkv_bias=True if mt == "qwen2" else attention_bias,
                o_bias=attention_bias if mt != "qwen2" else False,
                mlp_bias=bool(c.get("mlp_bias", False)),
                qk_norm=(mt == "qwen3"),
                layer_windows=layer_windows(c, mt, num_layers),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"config.json is missing or has a bad field: {e}") from None
        if cfg.num_heads % cfg.num_kv_heads:
            raise UserError(f"num_attention_heads {cfg.num_heads} is not a multiple of num_key_value_heads {cfg.num_kv_heads}")
        return cfg

    @classmethod
    def from_dir(cls, path) -> "ModelConfig":
        f = Path(path) / "config.json"
        if not f.is_file():
            raise UserError(f"model directory {path} has no config.json")
        try:
            return cls.from_dict(json.loads(f.read_text()))
        except json.JSONDecodeError as e:
            raise UserError(f"{f} is not valid JSON: {e}") from None


def layer_windows(c: dict, mt: str, num_layers: int) -> tuple[Optional[int], ...]:
    """每层的滑动窗口，规则与 transformers 的配置类逐字相同（缺省值也取它们的）：
      qwen2 / qwen3  use_sliding_window（缺省 false）为真时窗口 = sliding_window（缺省 4096），否则没有窗口；
                     哪些层滑动看 layer_types，没有 layer_types 时是编号 >= max_window_layers（缺省 28）的层
      mistral        每层都用 sliding_window（缺省 4096；null = 全注意力）；layer_types 不看（HF 的 Mistral 也不看）
      ministral      同 mistral，但哪些层滑动看 layer_types（交错的局部层）
      llama          没有窗口（HF 的 Llama 不看这几个字段）"""
    if mt == "llama":
        return (None,) * num_layers
    window = c.get("sliding_window", 4096)
    if mt in ("qwen2", "qwen3") and not c.get("use_sliding_window", False):
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise UserError(f"sliding_window must be a positive integer or null, got {window!r}")
    if mt == "mistral":
        return (window,) * num_layers
    types = c.get("layer_types")
    if types is None:
        first = 0 if mt == "ministral" else int(c.get("max_window_layers", 28))
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise UserError(f"layer_types must list 'full_attention' / 'sliding_attention' for each of the "
                        f"{num_layers} layers, got {types!r}")
    if window is None and "sliding_attention" in types:   # HF 在前向时报同样的错（create_sliding_window_causal_mask）
        raise UserError("layer_types has sliding_attention layers but there is no sliding window "
                        "(sliding_window is null, or use_sliding_window is false)")
    return tuple(window if t == "sliding_attention" else None for t in types)


def eos_token_ids(path) -> list[int]:
    """与 HF generate 相同的停止 token：优先 generation_config.json，其次 config.json。"""
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []
