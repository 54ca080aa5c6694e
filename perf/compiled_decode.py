"""编译的 decode：每个批大小桶一张静态形状的图（CPU 上对应 vLLM / nano-vllm 的"每个批大小录一张 CUDA graph"）。

    engine = LLMEngine(model, config, ...)       # step05 起任何一个引擎，一行不改
    compile_engine(engine)                       # engine.model 换成 CompiledDecodeModel，先把每个桶编译一遍（进度条）
    python step07_chunked_prefill/run.py --prompt ... --compile      # run.py 里同一件事

CompiledDecodeModel 看起来就是模型：同样的调用 model(input_ids, positions, cache, logits_index=...)，同样的
.cfg / .device / .dtype。引擎每一步照常调用它；它只接管"纯 decode"的前向（每个请求 1 个 token、注意力按块表读池子），
其余（prefill、分块 prefill 与 decode 混在一起的一行、gather 读法、量化的池子）原样交给 eager 的模型。

接管的一步（forward → run_bucket）：
  1. 批补齐到桶：R 个请求 → 不小于 R 的最小桶 Bp（1, 2, 4, 8, 16, ...）。补出来的 Bp − R 行：token 0、位置 0、
     块表整行是空块（池子的最后一块，从不分给任何请求）、长度 1，新 K/V 写进空块的第 0 个槽。
     没有任何真实的行会读空块（内核只读每行自己 seq_len 以内的块），所以补齐的行改变不了任何请求的输出；
  2. 块表补齐到固定宽度 W = ⌈上下文长度 / block_size⌉（一个请求最多能有的块数）：内核只读每行前
     ⌈seq_len / block_size⌉ 项，多出的项不读；宽度固定，序列变长时图的形状不变。池子的块数也不进图的形状
     （mark_dynamic）：--num-blocks 不同的引擎共用同一组图；
  3. 调用这个桶的图：torch.compile(fullgraph=True, dynamic=False)——除了池子的块数，形状全是常数，整步一张图，
     中间没有 Python；
     注意力是注册成 PyTorch 算子的 C++ 内核（step05_paged/paged_attention.py 的 paged_attention_op），
     写 K/V 是下面的 write_kv_ 算子：编译器把它们当成图里的一个节点，不往里看；
  4. 只把真实行的 logits 按引擎给的顺序（logits_index）交回去：补齐的行从不被采样。

为什么补齐而不是每个 B 编译一张：真实模型编译一张图要几十秒、还要占内存（docs/appendix_performance.md 的表），
而补齐多算的只是几行——权重每步照样只读一遍，多的是算术（附录里批 4 → 批 8 一步多 8%）。桶按 2 的幂取，
最多多算不到一倍的行，max_batch_size = 8 时只有 4 张图。

编译缓存：inductor 把编译好的内核和图存在磁盘上，下一个进程命中时只剩 dynamo 追踪的几秒（use_inductor_cache_dir）。
目录是 <缓存目录>/inductor（缓存目录默认 ~/.cache/llm-from-scratch，环境变量 LLM_FROM_SCRATCH_CACHE 可改；
已设置 TORCHINDUCTOR_CACHE_DIR 时用它）。清掉：rm -rf ~/.cache/llm-from-scratch/inductor。
编好的内核里写死了线程数（torch.get_num_threads()），dynamo 也按它守卫图：换了线程数就是另一份缓存、另一次编译。

CUDA：同一份代码，同样的图，不用 CUDA graph（mode="reduce-overhead"）——注意力算子在 CUDA 上走 gather，它在主机上读
query_lens 的最大值，这种同步不能录进 CUDA graph。这台机器没有 GPU，CUDA 上没有测过。
"""
import contextlib
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch._dynamo.utils import counters

from common.errors import UserError
from common.prepare import cache_root
from step05_paged.paged_attention import paged_attention_op   # 第 05 章的内核，注册成了 PyTorch 算子

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MODES = ("default", "max-autotune", "freezing", "freezing+max-autotune", "cpp-wrapper")
DEFAULT_MODE = "default"


def buckets_for(max_batch_size: int, candidates=DEFAULT_BUCKETS) -> tuple[int, ...]:
    """覆盖 1..max_batch_size 的桶：小于 max_batch_size 的那些，再加一个装得下 max_batch_size 的。"""
    out = [b for b in candidates if b < max_batch_size]
    out.append(next((b for b in candidates if b >= max_batch_size), max_batch_size))
    return tuple(out)


def use_inductor_cache_dir() -> str:
    """让 inductor 把磁盘缓存放在 <缓存目录>/inductor（已设置 TORCHINDUCTOR_CACHE_DIR 时尊重它），返回实际的目录。
    要在这个进程第一次 torch.compile 之前调用：inductor 第一次用到缓存目录时把它写回环境变量，之后就不再变。"""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return cache_dir()


def compile_problem(device) -> Optional[str]:
    """torch.compile 在这里用不了的原因；None = 能用。CPU 上 inductor 要一个 C++ 编译器。"""
    if torch.device(device).type != "cpu":
        return None
    import shutil

    from torch._inductor import cpp_builder
    try:
        cxx = cpp_builder.get_cpp_compiler()
    except Exception as e:  # noqa: BLE001  （找不到编译器时各版本抛的异常不同）
        return f"no C++ compiler for torch.compile's CPU backend ({type(e).__name__}: {e})"
    if not shutil.which(cxx):
        return f"no C++ compiler for torch.compile's CPU backend ({cxx!r} not found)"
    return None


@torch.library.custom_op("llm_from_scratch::write_kv_", mutates_args=("pool",))
def write_kv_(pool: torch.Tensor, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
    """pool[layer_idx] 的第 slot_mapping[i] 个槽 ← k[i]、v[i]（各 (Bp, H_kv, D)），原地写。

    为什么是一个算子：编译器先把图改写成不带原地修改的形式（函数化），池子的一个视图上的原地写入会变成
    "复制、改几个槽、再拷回去"——生成的代码里每层多一个这一层 K/V 大小的缓冲区，最后还有一次整个池子的拷贝，
    每步至少把整个池子搬一遍（默认的 256 MiB 池子就是 256 MiB）。
    注册成声明了 mutates_args=("pool",) 的算子，编译器就知道它原地改池子，生成的代码直接在池子上调用它，一个字节不复制。"""
    layer = pool[layer_idx]                                            # (2, num_blocks+1, H_kv, bs, D)：视图
    bs = layer.shape[3]
    block, offset = slot_mapping // bs, slot_mapping % bs              # (Bp,), (Bp,)
    layer[0, block, :, offset] = k                                     # (Bp, H_kv, D) 写进各自的槽
    layer[1, block, :, offset] = v


@write_kv_.register_fake
def _(pool, layer_idx, slot_mapping, k, v):
    return None


class PaddedDecode:
    """图里用的"缓存"（common/kv_cache.py 的接口）：补齐到桶的一批 decode，每行 1 个 token。与引擎的
    AttentionMetadata 做同样的两件事：按 slot_mapping 把新 K/V 写进池子，再按块表读池子算注意力。"""
    mask = None

    def __init__(self, pool, slot_mapping, block_tables, seq_lens, query_lens):
        self.pool, self.slot_mapping = pool, slot_mapping                  # (layers, 2, num_blocks+1, H_kv, bs, D), (Bp,)
        self.block_tables, self.seq_lens, self.query_lens = block_tables, seq_lens, query_lens  # (Bp, W), (Bp,), (Bp,)

    def attend(self, layer_idx: int, q, k, v):
        write_kv_(self.pool, layer_idx, self.slot_mapping, k[:, :, 0], v[:, :, 0])   # (Bp, H_kv, 1, D) -> (Bp, H_kv, D)
        layer = self.pool[layer_idx]
        out = paged_attention_op(q[:, :, 0], layer[0], layer[1], self.block_tables, self.seq_lens,
                                 self.query_lens)                          # (Bp, H, 1, D) -> (Bp, H, D)
        return out[:, :, None]                                             # (Bp, H, 1, D)


class DecodeStep(torch.nn.Module):
    """一个补齐到桶的 decode 步：input_ids / positions (Bp, 1) → logits (Bp, V)。编译的就是它。
    写成持有模型的模块：模型的权重是这个模块的参数，freezing 把它们当常数（见 CompiledDecodeModel.compiling）。"""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, pool, slot_mapping, block_tables, seq_lens, query_lens):
        cache = PaddedDecode(pool, slot_mapping, block_tables, seq_lens, query_lens)
        return self.model(input_ids, positions, cache)[:, 0]              # (Bp, 1, V) -> (Bp, V)


def compile_options(mode: str) -> dict:
    """--compile MODE → torch.compile 的 options。"""
    if mode not in MODES:
        raise UserError(f"unknown compile mode {mode!r} (choose from {', '.join(MODES)})")
    options = {}
    if "max-autotune" in mode:
        # CPU 上：每个矩阵乘在 aten（MKL）与 inductor 的 C++ GEMM 模板之间实测挑快的；模板要求权重是常数
        # （预先重排成它的块格式），所以只有和 freezing 一起才真的有模板可挑
        options["max_autotune"] = True
        options["autotune_num_choices_displayed"] = 0         # 不往 stderr 打印每个矩阵乘的候选表
        options["max_autotune_report_choices_stats"] = False
    if "freezing" in mode:
        # 权重当常数：常量折叠，矩阵乘换成权重预先打包好的 MKL / oneDNN 版本。光在这里写还不够，见 compiling()；
        # 写在这里让两种模式的后端不相等——dynamo 按后端区分缓存的图，否则 freezing 会直接拿到 default 编好的那张
        options["freezing"] = True
    if "cpp-wrapper" in mode:
        # 调用图里各个内核的那层包装也生成成 C++（默认是一段 Python：每个内核、每个算子一次 Python 调用）。
        # 图里的算子（注意力、step14 的矩阵乘）要是在 C++ 里注册的，一步就没有 Python 了；代价是第一次编译多编一个
        # 几千行的 C++ 文件（bench/decode_speed.py 的 step14 几行量了两者）
        options["cpp_wrapper"] = True
    return options


@dataclass
class BucketStats:
    bucket: int
    compile_s: float        # 第一次调用（dynamo 追踪 + inductor 编译或读磁盘缓存）
    cache_hit: bool         # 这次编译是从 inductor 的磁盘缓存读回来的
    calls: int = 0          # 之后用它跑了几步
    padded_rows: int = 0    # 这些步里补了多少行


class CompiledDecodeModel(torch.nn.Module):
    """见模块说明。buckets 升序；block_table_width：块表补齐到的宽度（一个请求最多的块数）；
    backend：torch.compile 的后端（默认 inductor；测试可以换成不编 C++ 的后端）。"""

    def __init__(self, model, buckets: tuple[int, ...], block_table_width: int, mode: str = DEFAULT_MODE,
                 backend: str = "inductor"):
        super().__init__()
        options = compile_options(mode) if backend == "inductor" else None
        self.model, self.buckets, self.width, self.mode = model, tuple(sorted(buckets)), block_table_width, mode
        self.stats: dict[int, BucketStats] = {}
        self.eager_calls = 0
        import torch._dynamo
        # 每个桶是 DecodeStep.forward 的一次"重新编译"（形状不同），各个实例、各种 mode 共用这个计数：
        # dynamo 默认每个函数最多 8 张，超过就悄悄退回 eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.step = torch.compile(DecodeStep(model), fullgraph=True, dynamic=False, backend=backend, options=options)

    def compiling(self):
        """调用（也就是编译）图时要开着的设置。freezing 必须在 dynamo 追踪时就打开：dynamo 据此把权重装进图里当属性，
        而不是当输入；torch.compile(options={"freezing": True}) 只在 inductor 那一层打开，那时权重已经是图的输入，
        什么也冻不住（torch 2.13 上实测：生成的代码里矩阵乘照旧读输入的权重，看不到 _frozen_param）。"""
        stack = contextlib.ExitStack()
        if "freezing" in self.mode:
            import torch._inductor.config
            stack.enter_context(torch._inductor.config.patch(freezing=True))
        if "max-autotune" in self.mode:
            # inductor 挑 GEMM 模板时（select_algorithm）自己调了弃用的 TypedStorage：torch 内部的警告，别打到学习者屏幕上
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        return stack

    # 引擎与 run.py 读的属性：与模型相同
    @property
    def cfg(self):
        return self.model.cfg

    @property
    def device(self):
        return self.model.device

    @property
    def dtype(self):
        return self.model.dtype

    def bucket_for(self, R: int) -> Optional[int]:
        return next((b for b in self.buckets if b >= R), None)

    def takes(self, input_ids, cache) -> bool:
        """这一步是不是纯 decode、注意力按块表读模型 dtype 的池子：step05/06 的批形状 (R, 1)，或 step07/08
        展平的一行 (1, T) 里 T 个请求（T 个 token、每个请求至少 1 个，所以每个恰好 1 个）。"""
        seq_lens = getattr(cache, "seq_lens", None)
        if seq_lens is None or getattr(cache, "segments", None) is not None or cache.pool.dtype != self.model.dtype:
            return False                       # 全新的 prefill（不读池子）、gather 读法（step07 起按段）、量化的池子
        B, L = input_ids.shape
        R = seq_lens.shape[0]
        if not ((L == 1 and B == R) or (B == 1 and L == R)):
            return False                       # 有 prefill 的块（或 prefill 与 decode 在同一行里）
        return self.bucket_for(R) is not None and cache.block_tables.shape[1] <= self.width

    def forward(self, input_ids, positions, cache=None, last_only=False, logits_index=None):
        if cache is None or not self.takes(input_ids, cache):
            self.eager_calls += 1
            return self.model(input_ids, positions, cache, last_only=last_only, logits_index=logits_index)
        B, L = input_ids.shape
        R = cache.seq_lens.shape[0]
        logits = self.run_bucket(self.bucket_for(R), cache.pool, input_ids.reshape(R), positions.reshape(R),
                                 cache.slot_mapping, cache.block_tables, cache.seq_lens)[:R]   # (R, V)：只要真实行
        logits = logits.view(B, L, -1)                                     # 回到模型会给的形状 (R, 1, V) / (1, R, V)
        if last_only:
            return logits[:, -1:]
        return logits if logits_index is None else logits[:, logits_index]

    def run_bucket(self, Bp: int, pool, input_ids, positions, slot_mapping, block_tables, seq_lens) -> torch.Tensor:
        """R 个真实行（各 (R,)，块表 (R, ≤ W)）补齐到 Bp 行，调用这个桶的图，返回 logits (Bp, V)。"""
        R, dev = input_ids.shape[0], pool.device
        null, bs = pool.shape[2] - 1, pool.shape[4]                        # 空块的块号；块大小
        ids = torch.zeros(Bp, 1, dtype=torch.long, device=dev)             # 补齐的行：token 0、位置 0
        pos = torch.zeros(Bp, 1, dtype=torch.long, device=dev)
        ids[:R, 0], pos[:R, 0] = input_ids, positions
        slots = torch.full((Bp,), null * bs, dtype=torch.long, device=dev)  # 补齐的行写空块的第 0 个槽
        slots[:R] = slot_mapping
        tables = torch.full((Bp, self.width), null, dtype=torch.int32, device=dev)   # (Bp, W)：补齐的行整行是空块
        tables[:R, :block_tables.shape[1]] = block_tables
        lens = torch.ones(Bp, dtype=torch.int32, device=dev)               # 补齐的行：1 个 key（它自己刚写的那个）
        lens[:R] = seq_lens
        ones = torch.ones(Bp, dtype=torch.int32, device=dev)               # query_lens：每行 1 个
        # 池子的块数不进图的形状（dynamo 把这一维当符号）：换一个 --num-blocks 的引擎也用同一组图
        torch._dynamo.mark_dynamic(pool, 2)
        st = self.stats.get(Bp)
        hits, t0 = counters["inductor"]["fxgraph_cache_hit"], time.perf_counter()
        with self.compiling():
            out = self.step(ids, pos, pool, slots, tables, lens, ones)
        if st is None:                                                     # 这个桶第一次用：这次调用就是编译
            st = self.stats[Bp] = BucketStats(Bp, time.perf_counter() - t0,
                                              counters["inductor"]["fxgraph_cache_hit"] > hits)
        st.calls += 1
        st.padded_rows += Bp - R
        return out

    @torch.inference_mode()
    def warm_up(self, pool, progress: bool = True) -> None:
        """把每个桶编译一遍：全部行都是补齐的行，只写空块，不碰任何请求的 K/V。"""
        from tqdm import tqdm
        dev = pool.device
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        bar = tqdm(self.buckets, desc=f"torch.compile decode buckets ({self.mode})", unit="bucket",
                   disable=not progress, file=sys.stderr)
        for Bp in bar:
            bar.set_postfix_str(f"batch {Bp}")
            if Bp not in self.stats:
                self.run_bucket(Bp, pool, empty, empty, empty, torch.zeros(0, 1, dtype=torch.int32, device=dev),
                                empty.int())
                self.stats[Bp].calls = self.stats[Bp].padded_rows = 0


def block_table_width(engine) -> int:
    """一个请求最多能有的块数：上下文装满（add_request 检查过不会超过它）。只取决于模型和块大小，
    与池子有多少块无关：不同 --num-blocks 的引擎共用同一组图。"""
    return -(-engine.model.cfg.max_position_embeddings // engine.kv_cache.block_size)


def compile_engine(engine, mode: str = DEFAULT_MODE, buckets: Optional[tuple[int, ...]] = None,
                   progress: bool = True, compiled: Optional[CompiledDecodeModel] = None, log=print) -> bool:
    """把 engine.model 换成 CompiledDecodeModel 并预热全部桶，返回 True。
    引擎没有可编译的 decode（gather 读法、量化的池子）时打印一行说明、引擎保持 eager，返回 False。
    这里编译不了（CPU 上没有 C++ 编译器）时抛 UserError（run.py 打印一行 error:）。
    compiled：另一个引擎已经编好的 CompiledDecodeModel（同一个模型、同样的池子形状）——直接拿来用，不再编译。"""
    kv, model = engine.kv_cache, engine.model
    if isinstance(model, CompiledDecodeModel):
        return True
    if getattr(kv, "attention", "paged") != "paged" or kv.pool.dtype != model.dtype:
        what = ("a quantized KV pool" if getattr(kv, "fmt", None) is not None else
                "a sliding-window model (gather path: the kernel has no window)" if model.cfg.sliding else
                "--attention gather")
        log(f"--compile: {what} has no compiled decode path (the compiled graph calls the paged attention kernel on "
            f"a {model.dtype} pool); decode stays eager")
        return False
    if compiled is None:
        use_inductor_cache_dir()
        problem = compile_problem(model.device)
        if problem is not None:
            raise UserError(f"--compile: {problem}; install g++ or drop --compile")
        compiled = CompiledDecodeModel(model, buckets or buckets_for(engine.config.max_batch_size),
                                       block_table_width(engine), mode)
    elif compiled.model is not model or compiled.width != block_table_width(engine):
        raise ValueError("compiled was built for another model or block-table width")
    compiled.warm_up(kv.pool, progress)
    engine.model = compiled
    return True


RUN_PY_HELP = "生成模式：decode 步用 torch.compile 按批大小桶各编译一张静态形状的图（perf/compiled_decode.py）"


def add_compile_arg(g, what: str = RUN_PY_HELP) -> None:
    """--compile [MODE]：step05 起的 run.py、step11 的服务器与它的基准共用。"""
    g.add_argument("--compile", nargs="?", const=DEFAULT_MODE, default=None, choices=MODES, metavar="MODE",
                   help=f"{what}；MODE 默认 {DEFAULT_MODE}，可选 {' / '.join(MODES)}"
                        "（速度、编译时间与内存见 docs/appendix_performance.md）")


def compile_if_asked(args, engine) -> None:
    """--compile：把引擎的 decode 换成编译好的图（先把每个桶编译一遍，带进度条）。"""
    if getattr(args, "compile", None):
        compile_engine(engine, mode=args.compile)
