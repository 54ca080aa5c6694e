"""线性层的两种算法：plain（x @ W，MKL 的 sgemm）与 packed（加载时把权重打包一次，之后每次调用 oneDNN 的内核）。

    model = load_model(path, "cpu", torch.float32)                  # 默认 linear="auto"：CPU float32 上是 packed
    model = load_model(path, "cpu", torch.float32, linear="plain")  # 第 01 章写的那个 x @ W
    python step03_kvcache_single/run.py --prompt ... --linear plain # 命令行上同一件事

为什么要打包（测量与表格见 docs/appendix_performance.md 的"小 M 的矩阵乘"，复测：python bench/linear_bench.py）：
decode 每一步都是"几行 × 矩阵"（M = 批里的请求数，1…16），时间几乎全花在把权重从内存读一遍上。
`x @ W` 每次都调用一次独立的 MKL sgemm（MKL_VERBOSE=1 可以看到每次一行 SGEMM），调用之间不复用任何对权重
做过的处理；在 M 这么小时它读权重的速度离内存带宽很远（这个问题的起因，复测见上面的脚本）。
oneDNN 的 `_reorder_linear_weight` 把权重一次性重排成它的内核最爱读的块格式（AVX2 上是 AB16b64a：
每 64 个输出 × 16 个输入一块，连续存放），之后 `_linear_pointwise` 每次只顺序读这些块一遍、不再重排
（ONEDNN_VERBOSE=1：打包时一行 reorder，之后每次调用只有一行 inner_product）。torch.compile 的 freezing
对常数权重做的也是这件事（mkldnn_fusion.py 的 pack_linear_weight）；这里在 eager 里、加载时做一次。

packed 时每个 Linear 只留打包后的那一份（.packed，oneDNN 的不透明张量；形状是块的倍数时字节数与原权重相同，
否则按块补齐），.weight 为 None：
内存里不会有两份权重。要 (in, out) 的普通张量时用 dense_weight(m)（每次现拷一份，只给少数不在热路径上的地方用）。

什么时候不打包（resolve_linear 的 "auto" 退回 plain；显式要 packed 时报错，说明原因）：
  - CUDA：cuBLAS 本来就好，矩阵乘照旧；
  - float32 以外：oneDNN 的 bf16 打包要 AVX-512 或 AVX-NE-CONVERT（开发机只有 AVX2，会直接报错），没测过，不用；
  - torch 没有编进 oneDNN（mkldnn）或没有这两个算子。

torch.compile（perf/compiled_decode.py、bench/）照样能编译打包过的模型：图里每个矩阵乘是一次 packed_linear
（下面）。freezing 模式下 inductor 只会打包、自动调优它自己看得到的 aten 矩阵乘；想让编译器自己挑，加载时用
--linear plain（编译之前的老路，一字不差）。
"""
from typing import Optional

import torch

LINEAR_IMPLS = ("auto", "plain", "packed")


def packed_problem(device, dtype: torch.dtype) -> Optional[str]:
    """这里用不了 packed 的原因；None = 能用。"""
    if torch.device(device).type != "cpu":
        return f"packed linear is for the CPU ({torch.device(device).type} keeps its BLAS)"
    if dtype != torch.float32:
        return f"packed linear is float32 only (got {str(dtype).removeprefix('torch.')})"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return "this torch build lacks torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise"
    return None


def resolve_linear(name: str, device, dtype: torch.dtype) -> str:
    """--linear auto|plain|packed → plain 或 packed。auto：能打包就打包；显式 packed 而这里不能打包：UserError。"""
    from .errors import UserError
    if name not in LINEAR_IMPLS:
        raise UserError(f"unknown --linear {name!r} (choose from {', '.join(LINEAR_IMPLS)})")
    problem = packed_problem(device, dtype)
    if name == "auto":
        return "plain" if problem else "packed"
    if name == "packed" and problem:
        raise UserError(f"--linear packed: {problem}; use --linear plain")
    return name


def pack_weight(w_io: torch.Tensor) -> torch.Tensor:
    """(in, out) 的权重 → oneDNN 打包好的权重（逻辑形状 (out, in)，存成它的块格式；一次拷贝）。
    不给 batch_size 提示：让 oneDNN 挑一种对所有 M 都合适的格式（给 1 时 AVX2 上它挑的就是原样的 (out, in)）。"""
    return torch.ops.mkldnn._reorder_linear_weight(w_io.t().contiguous())


def packed_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x (..., in) · W → (..., out)，W 是 pack_weight 的结果。一个 oneDNN inner product，不加 bias、不融合激活。
    torch.compile 追踪时换成下面的 packed_linear 算子：同一个调用，只是对编译器不透明。"""
    if torch.compiler.is_compiling():
        return packed_linear(x, packed)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@torch.library.custom_op("llm_from_scratch::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """packed_matmul 给编译器看的样子。为什么要包一层：inductor 自己降 mkldnn._linear_pointwise 时，要求权重是
    它 freezing 时自己打包的常数，遇到作为输入的打包权重就报 LoweringException（torch 2.13 实测）；包成一个算子，
    编译器只在图里调用它、不往里看（与 perf/compiled_decode.py 的 write_kv_ 同一个办法）。
    eager 不走这里：每次经过 Python 实现的算子要多十几微秒，一步有 211 次矩阵乘。"""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@packed_linear.register_fake
def _(x, packed):
    return x.new_empty(*x.shape[:-1], packed.shape[0])               # (..., in) -> (..., out)；packed 逻辑形状 (out, in)


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """pack_weight 的逆：普通的 (in, out) 连续张量（新拷的一份，数值逐位相同）。"""
    return packed.to_dense().t().contiguous()


def linears(model) -> list:
    """模型里全部的 Linear（common/model.py 的，及其子类：step10 的切片层、lm_head）。"""
    from .model import Linear
    return [m for m in model.modules() if isinstance(m, Linear)]


def pack_(m) -> None:
    """一个 Linear 换成 packed：打包一次，丢掉原来的 (in, out) 权重（内存里只剩一份）。已经打包过的不动。"""
    if m.packed is not None:
        return
    with torch.no_grad():
        m.packed = torch.nn.Parameter(pack_weight(m.weight), requires_grad=False)
    m.weight = None


def unpack_(m) -> None:
    """pack_ 的逆：换回普通的 (in, out) 权重。"""
    if m.packed is None:
        return
    m.weight = torch.nn.Parameter(unpack_weight(m.packed), requires_grad=False)
    m.packed = None


def use_linear_(model, impl: str):
    """把模型的全部 Linear 换成 impl（"plain" 或 "packed"，先用 resolve_linear 决定），返回模型。"""
    if impl not in ("plain", "packed"):
        raise ValueError(f"impl must be plain or packed, got {impl!r}")
    for m in linears(model):
        (pack_ if impl == "packed" else unpack_)(m)
    return model


def linear_impl(model) -> str:
    """模型现在用的是哪种："packed"（全部打包）、"plain"（都没打包）或 "mixed"。"""
    packed = {m.packed is not None for m in linears(model)}
    return "mixed" if len(packed) > 1 else "packed" if packed == {True} else "plain"


def dense_weight(m) -> torch.Tensor:
    """Linear 的 (in, out) 权重，不管它是否打包过（打包过时现拷一份：只给不在热路径上的地方用）。"""
    return m.weight if m.packed is None else unpack_weight(m.packed)
