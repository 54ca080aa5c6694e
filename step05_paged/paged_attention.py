"""PagedAttention：注意力直接按块表去读池子里的块，不把每个请求的 K/V 先拼成一份连续的拷贝。

    paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_lens, impl="auto") -> (T, H, D)

    q             (T, H, D)   B 个请求的 query 首尾相接：请求 b 占 query_lens[b] 行，位于它自己的位置
                              seq_lens[b] - query_lens[b] .. seq_lens[b] - 1（decode：每个请求 1 行；分块 prefill、
                              前缀缓存命中后的 prefill：若干行）。因果：位置 p 的 query 看本请求的 key 0..p
    k_cache       (num_blocks + 1, H_kv, block_size, D)   一层的 K 池（池子 pool[layer, 0] 的视图，本次的新 K 已写入）
    v_cache       同上，V 池（pool[layer, 1]）；最后一块（第 num_blocks 块）是给块表补齐用的空块
    block_tables  (B, max_blocks)  int32 / int64，每行用空块补齐
    seq_lens      (B,)  这次前向之后每个请求有多少个 key；query_lens (B,)
    返回 (T, H, D)，dtype 同 q；softmax 在 float32 里做；缩放 1/sqrt(D)；GQA：query 头 h 用 KV 头 h // (H // H_kv)

几种实现（impl=），算的是同一个数：
    "reference"  纯 PyTorch：逐请求、逐块的 online softmax。很慢，但每一行都对应第 05 章讲的一步；测试用它对照
    "cpp"        C++ 内核（本文件里的 KERNEL_SOURCE），第一次用时用 C++ 编译器现场编译、缓存下来；只支持 CPU float32
    "gather"     step05 原来的读法：按块表 index_select 出连续的 (B, H_kv, S, D)，再做普通注意力。会拷贝，但哪里都能跑
    "flex"       torch.nn.attention.flex_attention：把整个池子看成一条长序列，用块表造 BlockMask，只访问各请求自己的块。
                 每个新形状要 torch.compile 十几秒，编好后在这台 CPU 上也比 "cpp" 慢；它按整块读，最后一块没写到的
                 尾巴若是 NaN 会混进输出（0 × NaN）。留着作对照（bench/paged_attention_bench.py）
    "auto"       CPU + float32 且内核编得出来 → "cpp"；编不出来（没有编译器）→ "gather"，并在 stderr 打印一行说明；
                 其它设备 / dtype（CUDA、bfloat16）→ "gather"（我们测不了 CUDA，那里取最简单、显然正确的一条）

内核的编译缓存在 <缓存目录>/kernels/（缓存目录默认 ~/.cache/llm-from-scratch，环境变量 LLM_FROM_SCRATCH_CACHE
可改；与默认模型同一个根目录）。清掉它：rm -rf ~/.cache/llm-from-scratch/kernels（下次使用时重新编译，2 核机器上几秒）。
"""
import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import record_function

from common.errors import UserError
from common.model import attention
from common.prepare import cache_root

IMPLS = ("auto", "cpp", "gather", "flex", "reference")


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_lens, impl: str = "auto") -> torch.Tensor:
    """见模块说明。impl="auto" 按设备和 dtype 选（resolve_impl）；显式给 "cpp" 而内核编不出来时抛 UserError。"""
    check_args(q, k_cache, v_cache, block_tables, seq_lens, query_lens)
    impl = resolve_impl(impl, q.device, q.dtype)
    if impl == "cpp":
        with record_function("paged_attention"):    # ctypes 调用不是 aten 算子：标出来，剖析器里才看得到内核
            return paged_attention_cpp(q, k_cache, v_cache, block_tables, seq_lens, query_lens)
    if impl == "gather":
        return paged_attention_gather(q, k_cache, v_cache, block_tables, seq_lens, query_lens)
    if impl == "flex":
        return paged_attention_flex(q, k_cache, v_cache, block_tables, seq_lens, query_lens)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_lens)


def resolve_impl(impl: str, device, dtype) -> str:
    """impl="auto" 实际用哪一种（其余原样返回）。"""
    if impl not in IMPLS:
        raise UserError(f"unknown paged attention impl {impl!r}; choose one of {', '.join(IMPLS)}")
    if impl == "cpp":
        if torch.device(device).type != "cpu" or dtype != torch.float32:
            raise UserError(f"the C++ paged attention kernel runs on CPU float32 only, not {device}/{dtype}")
        if not kernel_available():
            raise UserError(f"the C++ paged attention kernel could not be built: {kernel_build_error()}")
        return "cpp"
    if impl != "auto":
        return impl
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        if kernel_available():
            return "cpp"
        _say_fallback_once()
    return "gather"


def check_args(q, k_cache, v_cache, block_tables, seq_lens, query_lens) -> None:
    """形状和 dtype 的一致性（便宜：不看张量里的数）。块号越界、长度不合理由各实现自己查。"""
    T, H, D = q.shape
    _, H_kv, _, D_kv = k_cache.shape
    if v_cache.shape != k_cache.shape or D_kv != D or H % H_kv:
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)} "
                         "do not fit: want q (T, H, D), caches (num_blocks + 1, H_kv, block_size, D), H % H_kv == 0")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but the caches are {k_cache.dtype}/{v_cache.dtype}")
    B = block_tables.shape[0]
    if block_tables.dim() != 2 or seq_lens.shape != (B,) or query_lens.shape != (B,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)}, "
                         f"query_lens {tuple(query_lens.shape)}: want (B, max_blocks), (B,), (B,)")


# ---------------------------------------------------------------------------------------------------------------
# 参考实现：第 05 章逐行讲的就是它
# ---------------------------------------------------------------------------------------------------------------

def paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_lens) -> torch.Tensor:
    """逐请求、逐块的 online softmax（FlashAttention / flash-decoding 的思路），纯 PyTorch，慢但好读。

    每个 query 行维护三样东西，每读一块就更新一次：
        m  到目前为止见过的最大分数（running max）
        l  到目前为止 Σ exp(分数 − m)（running sum）
        o  到目前为止 Σ exp(分数 − m) · v（running output，还没除以 l）
    新的一块让最大值从 m 变成 m_new 时，旧的 l 和 o 是以 m 为基准算的，乘上 exp(m − m_new) 换成新基准，
    再加上这一块的贡献。全部块读完，输出 = o / l，与"拼成整段再 softmax"精确相等（只差浮点舍入）。
    K/V 只以"池子里一块的视图"的形式出现（k_cache[block, :, :n]），从不拼接。"""
    T, H, D = q.shape
    H_kv, bs = k_cache.shape[1], k_cache.shape[2]
    G = H // H_kv                                                  # 每个 KV 头服务 G 个 query 头
    scale = 1.0 / math.sqrt(D)
    out = torch.empty_like(q)
    start = 0                                                      # 请求 b 的 query 从 q 的第 start 行开始
    for b in range(block_tables.shape[0]):
        S, L = int(seq_lens[b]), int(query_lens[b])
        if not 1 <= L <= S or -(-S // bs) > block_tables.shape[1]:
            raise ValueError(f"request {b}: seq_len {S}, query_len {L}, {block_tables.shape[1]} blocks of {bs}")
        qb = q[start:start + L].float().view(L, H_kv, G, D)        # (L, H, D) -> (L, H_kv, G, D)：同组 G 个头相邻
        q_pos = torch.arange(S - L, S, device=q.device)            # (L,) 这些 query 的位置
        m = torch.full((L, H_kv, G), -math.inf, device=q.device)   # (L, H_kv, G) running max
        l = torch.zeros(L, H_kv, G, device=q.device)               # (L, H_kv, G) running sum
        o = torch.zeros(L, H_kv, G, D, device=q.device)            # (L, H_kv, G, D) running output
        for j in range(-(-S // bs)):                               # 只走到覆盖 key S-1 的那一块：补齐的空块一块不读
            block = int(block_tables[b, j])                        # 逻辑块 j → 物理块
            n = min(bs, S - j * bs)                                # 这块里属于本请求的 key 数（最后一块可能不满）
            k = k_cache[block, :, :n].float()                      # (H_kv, n, D)：池子里这一块的视图，不拷贝
            v = v_cache[block, :, :n].float()                      # (H_kv, n, D)
            s = torch.einsum("lhgd,hnd->lhgn", qb, k) * scale      # (L, H_kv, G, D) x (H_kv, n, D) -> (L, H_kv, G, n)
            k_pos = torch.arange(j * bs, j * bs + n, device=q.device)   # (n,) 这些 key 的位置
            s = s.masked_fill(k_pos > q_pos[:, None, None, None], -math.inf)  # 因果：看不到自己之后的 key
            m_new = torch.maximum(m, s.amax(dim=-1))               # (L, H_kv, G)
            # 第 0 块含 key 0，任何 query 都看得到它，所以读完第 0 块 m 就是有限数，m_new 从不是 -inf：
            # 第 0 块时 alpha = exp(-inf) = 0（o、l 本来就是 0）；之后整块被遮住的行 p 全是 exp(-inf) = 0
            alpha = torch.exp(m - m_new)                           # (L, H_kv, G) 旧基准换新基准
            p = torch.exp(s - m_new[..., None])                    # (L, H_kv, G, n)
            l = l * alpha + p.sum(dim=-1)                          # (L, H_kv, G)
            o = o * alpha[..., None] + torch.einsum("lhgn,hnd->lhgd", p, v)  # (L, H_kv, G, n) x (H_kv, n, D) -> (L, H_kv, G, D)
            m = m_new
        out[start:start + L] = (o / l[..., None]).view(L, H, D).to(q.dtype)
        start += L
    if start != T:
        raise ValueError(f"q has {T} rows but query_lens sum to {start}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# gather：step05 原来的读法（会拷贝）。编不出内核时的后备，也是 CUDA 上的默认
# ---------------------------------------------------------------------------------------------------------------

def gather_kv(k_cache, v_cache, block_tables):
    """按块表把每个请求的块拷成连续的 (B, H_kv, S, D)，S = max_blocks · block_size；返回 (k, v, 拷贝的字节数)。
    池子一层看成 (num_blocks + 1) · H_kv 行、每行一块一个头的 block_size · D 个数：(物理块, 头) 在第 块号 · H_kv + 头 行。"""
    _, H_kv, bs, D = k_cache.shape
    B, max_blocks = block_tables.shape
    heads = torch.arange(H_kv, device=k_cache.device)
    rows = (block_tables.long()[:, None, :] * H_kv + heads[None, :, None]).flatten()   # (B, H_kv, max_blocks) 展平
    k = k_cache.reshape(-1, bs * D).index_select(0, rows).view(B, H_kv, max_blocks * bs, D)   # 拷贝
    v = v_cache.reshape(-1, bs * D).index_select(0, rows).view(B, H_kv, max_blocks * bs, D)   # 拷贝
    return k, v, k.nbytes + v.nbytes


def paged_attention_gather(q, k_cache, v_cache, block_tables, seq_lens, query_lens) -> torch.Tensor:
    T, H, D = q.shape
    B = block_tables.shape[0]
    k, v, _ = gather_kv(k_cache, v_cache, block_tables)           # 各 (B, H_kv, S, D)
    S = k.shape[2]
    dev = q.device
    seq_lens, query_lens = seq_lens.to(dev).long(), query_lens.to(dev).long()
    L = int(query_lens.max())
    col = torch.arange(L, device=dev)
    starts = torch.cumsum(query_lens, 0) - query_lens              # (B,) 每个请求的第一行 query 在 q 里的行号
    real = col[None, :] < query_lens[:, None]                      # (B, L) 哪些是真的 query（其余是补齐）
    rows = torch.where(real, starts[:, None] + col[None, :], 0)    # (B, L) q 的行号，补齐处取第 0 行
    qp = q[rows].transpose(1, 2)                                   # (B, L, H, D) -> (B, H, L, D)
    q_pos = seq_lens[:, None] - query_lens[:, None] + col[None, :]  # (B, L) 每个 query 的位置
    k_pos = torch.arange(S, device=dev)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])  # (B, L, S)
    # 长度之外的槽（补齐的空块、最后一块的尾巴）K 被掩码遮住，V 以"概率 0 × 值"进入 probs @ v，而 0 × NaN = NaN：清零
    v.masked_fill_((k_pos[None, :] >= seq_lens[:, None])[:, None, :, None], 0)   # (B, 1, S, 1)
    out = attention(qp, k, v, mask[:, None, None])                 # (B, H, L, D)，common/model.py 的注意力
    return out.transpose(1, 2)[real]                               # (B, L, H, D) -> (T, H, D)，按 q 的行序


# ---------------------------------------------------------------------------------------------------------------
# C++ 内核：一个 OpenMP 任务负责一个 (请求, KV 头, 一段 query)，沿这个请求的块做 online softmax
# ---------------------------------------------------------------------------------------------------------------

KERNEL_SOURCE = r"""
// 与 paged_attention_reference 同一个算法（online softmax，沿块表逐块读），外加两点为了快：
//   1. 一个任务 = (请求, KV 头, 一段 query, 一段块)。同一个 KV 头的 G 个 query 头在同一个任务里，
//      每块 K/V 从内存读进缓存一次，给 G 个头（和这段的各个 query 位置）用。
//   2. 任务太少、两个线程分不匀时（比如只有 1 个请求：3 个 KV 头 = 3 个任务），把长的块表切成几段
//      各算各的 (m, l, o)，最后按 online softmax 同一条换基准的规则合并（flash-decoding 的做法）。
// 布局：k/v_cache (num_blocks + 1, H_kv, block_size, D)；一块里一个 KV 头的 block_size × D 个 float 连续，
// 块和头的步长由调用方给出（池子 pool[layer, 0/1] 的视图）。q、out 是连续的 (T, H, D)。
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

static const float NEG_INF = -std::numeric_limits<float>::infinity();

// exp(x)，只用于 x <= 0（分数减去最大值之后）。写成没有分支的直线代码，编译器才能把整个循环向量化
// （标准库的 expf 不开 -ffast-math 不会被向量化）：exp(x) = 2^n · exp(r)，n = round(x / ln2)，|r| <= ln2 / 2，
// exp(r) 用 6 次多项式（Cephes 的 expf 系数），相对误差约 1e-7；x < -87 时结果当 0。
static inline float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.0f);
  const float n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;   // 加减 1.5·2^23：四舍五入到整数
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;    // ln2 拆成两段，减的时候不丢精度
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float two_n = __builtin_bit_cast(float, ((int32_t)n + 127) << 23);   // 2^n：直接拼出浮点数的指数位
  return x < -87.0f ? 0.0f : y * two_n;
}

// 下面的函数对 head_dim 写成模板：DT = 64、128 时 D 是编译期常数，内层循环完全展开；DT = 0 时用运行时的 D。

// s[k] = q · K[k]，k < n。一次算 4 个 key：4 个互不依赖的累加和让乘加单元不用等上一次的结果，q 读一次用 4 次
template <int DT>
static inline void scores(const float* __restrict__ q, const float* __restrict__ kb, int64_t n, int64_t D_rt,
                          float* __restrict__ s) {
  const int64_t D = DT > 0 ? DT : D_rt;
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    const float *k0 = kb + k * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t d = 0; d < D; ++d) {
      a0 += q[d] * k0[d];
      a1 += q[d] * k1[d];
      a2 += q[d] * k2[d];
      a3 += q[d] * k3[d];
    }
    s[k] = a0, s[k + 1] = a1, s[k + 2] = a2, s[k + 3] = a3;
  }
  for (; k < n; ++k) {
    const float* kk = kb + k * D;
    float a = 0.0f;
#pragma omp simd reduction(+ : a)
    for (int64_t d = 0; d < D; ++d) a += q[d] * kk[d];
    s[k] = a;
  }
}

// o += Σ_k p[k] · V[k]，k < n。一次加 4 个 key 的 V：o 读写一次，做 4 次乘加
template <int DT>
static inline void accumulate(float* __restrict__ o, const float* __restrict__ p, const float* __restrict__ vb,
                              int64_t n, int64_t D_rt) {
  const int64_t D = DT > 0 ? DT : D_rt;
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    const float *v0 = vb + k * D, *v1 = v0 + D, *v2 = v1 + D, *v3 = v2 + D;
    const float p0 = p[k], p1 = p[k + 1], p2 = p[k + 2], p3 = p[k + 3];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
  }
  for (; k < n; ++k) {
    const float* vk = vb + k * D;
    const float pk = p[k];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] += pk * vk[d];
  }
}

struct Args {
  float* out; const float* q; const float* k_cache; const float* v_cache;
  int64_t block_stride, head_stride;
  const int32_t* block_tables; int64_t max_blocks; const int32_t* seq_lens; const int32_t* query_lens;
  int64_t H, H_kv, G, D, bs, q_tile;
};

// 一个任务：请求 b 的第 i0..i1-1 个 query（q 的第 row0 + i0 .. 行），KV 头 kvh，只读逻辑块 j0..j1-1
struct Task { int64_t b, row0, i0, i1, kvh, j0, j1; };

// 算一个任务，结果（还没除以 l 的 o，以及 m、l）写进它自己的 part：m[rows]、l[rows]、o[rows][D]，行 r = i·G + g
template <int DT>
static void run_task(const Args& a, const Task& t, float* part, float* qs, float* s) {
  const int64_t D = DT > 0 ? DT : a.D, G = a.G, bs = a.bs;
  const int64_t S = a.seq_lens[t.b], L = a.query_lens[t.b];
  const int64_t n_q = t.i1 - t.i0, rows = n_q * G;
  const int64_t pos0 = S - L + t.i0;                          // 这段第一个 query 的位置
  float *m = part, *l = part + rows, *o_acc = part + 2 * rows;
  const float scale = 1.0f / std::sqrt((float)D);
  for (int64_t i = 0; i < n_q; ++i)                           // 这个 KV 头的 G 个 query 头，乘好缩放放进连续的 qs
    for (int64_t g = 0; g < G; ++g) {
      const float* src = a.q + ((t.row0 + t.i0 + i) * a.H + t.kvh * G + g) * D;
      float* dst = qs + (i * G + g) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
    }
  std::fill(m, m + rows, NEG_INF);
  std::fill(l, l + rows, 0.0f);
  std::fill(o_acc, o_acc + rows * D, 0.0f);

  const int32_t* table = a.block_tables + t.b * a.max_blocks;
  for (int64_t j = t.j0; j < t.j1; ++j) {                     // 沿块表走：每块 K、V 各 block_size × D，原地读
    const float* kb = a.k_cache + table[j] * a.block_stride + t.kvh * a.head_stride;
    const float* vb = a.v_cache + table[j] * a.block_stride + t.kvh * a.head_stride;
    if (j + 1 < t.j1) {                                       // 下一块在池子里的别处，硬件预取猜不到：先告诉它
      const float* kn = a.k_cache + table[j + 1] * a.block_stride + t.kvh * a.head_stride;
      const float* vn = a.v_cache + table[j + 1] * a.block_stride + t.kvh * a.head_stride;
      for (int64_t x = 0; x < bs * D; x += 16) {              // 16 个 float = 一条 64 字节的缓存行
        __builtin_prefetch(kn + x);
        __builtin_prefetch(vn + x);
      }
    }
    const int64_t k0 = j * bs;                                // 这块第一个 key 的位置
    const int64_t n = std::min(bs, S - k0);                   // 属于本请求的 key 数：尾巴的槽不读
    for (int64_t i = 0; i < n_q; ++i) {
      const int64_t lim = std::min(n, pos0 + i - k0 + 1);     // 因果：位置 p 的 query 只看 key <= p
      if (lim <= 0) continue;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g;
        scores<DT>(qs + r * D, kb, lim, D, s);                // s_k = q · k_k（q 已乘好缩放）
        float mx = NEG_INF;
        for (int64_t k = 0; k < lim; ++k) mx = std::max(mx, s[k]);
        const float m_new = std::max(m[r], mx);
        const float alpha = std::exp(m[r] - m_new);           // 旧基准换新基准；这一行的第一块时 exp(-inf) = 0
        const int64_t lim8 = (lim + 7) / 8 * 8;               // 8 个一组：每组循环次数是常数，编译器整组向量化
        for (int64_t k = lim; k < lim8; ++k) s[k] = NEG_INF;  // 凑整的几个 exp 得 0
        float sum = 0.0f;
        for (int64_t c = 0; c < lim8; c += 8) {
#pragma omp simd reduction(+ : sum)
          for (int64_t k = c; k < c + 8; ++k) {
            s[k] = exp_nonpositive(s[k] - m_new);             // p_k = exp(s_k − m_new)
            sum += s[k];
          }
        }
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
        float* o = o_acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
        accumulate<DT>(o, s, vb, lim, D);                     // o += Σ_k p_k · v_k
      }
    }
  }
}

// 同一段 query 被切成 n_parts 段块算出的 (m, l, o) 合并成输出：m* = max m_p，
// out = Σ_p exp(m_p − m*) · o_p / Σ_p exp(m_p − m*) · l_p。和逐块更新是同一条规则；n_parts = 1 时就是 o / l
template <int DT>
static void merge(const Args& a, const Task& t, const float* parts, int64_t n_parts, int64_t part_stride) {
  const int64_t D = DT > 0 ? DT : a.D, G = a.G, rows = (t.i1 - t.i0) * G;
  for (int64_t r = 0; r < rows; ++r) {
    float m_all = NEG_INF;
    for (int64_t p = 0; p < n_parts; ++p) m_all = std::max(m_all, parts[p * part_stride + r]);
    float* dst = a.out + ((t.row0 + t.i0 + r / G) * a.H + t.kvh * G + r % G) * D;
    std::fill(dst, dst + D, 0.0f);
    float l_all = 0.0f;
    for (int64_t p = 0; p < n_parts; ++p) {
      const float* part = parts + p * part_stride;
      const float w = std::exp(part[r] - m_all);              // 没看到任何 key 的段：m = -inf，w = 0
      l_all += w * part[rows + r];
      const float* o = part + 2 * rows + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) dst[d] += w * o[d];
    }
    const float inv = 1.0f / l_all;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
  }
}

template <int DT>
static void run(const Args& a, const std::vector<Task>& tasks, const std::vector<int64_t>& group_start,
                int num_threads) {
  const int64_t rows_max = a.q_tile * a.G, part_stride = rows_max * (a.D + 2);
  static thread_local std::vector<float> buffer;              // 各任务的 (m, l, o)：调用之间复用，不反复分配
  buffer.resize(tasks.size() * part_stride);                  // （thread_local 属于调用的线程；OpenMP 的线程用指针）
  float* parts = buffer.data();
  const int64_t n_tasks = (int64_t)tasks.size(), n_groups = (int64_t)group_start.size() - 1;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> qs(rows_max * a.D), s(a.bs + 8);       // 每个线程自己的工作区
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_tasks; ++i) run_task<DT>(a, tasks[i], parts + i * part_stride, qs.data(), s.data());
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < n_groups; ++g) {
      const int64_t first = group_start[g];
      merge<DT>(a, tasks[first], parts + first * part_stride, group_start[g + 1] - first, part_stride);
    }
  }
}

// 返回 0 = 成功；1 = 长度不合理（query_len < 1、seq_len < query_len、块表不够长）；2 = 块号越界；3 = q 的行数不对
extern "C" int paged_attention_f32(
    float* out, const float* q, const float* k_cache, const float* v_cache,
    int64_t block_stride, int64_t head_stride, int64_t num_pool_blocks,
    const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_lens, const int32_t* query_lens,
    int64_t B, int64_t T, int64_t H, int64_t H_kv, int64_t D, int64_t bs, int64_t q_tile, int num_threads) {
  const Args a{out, q, k_cache, v_cache, block_stride, head_stride, block_tables, max_blocks, seq_lens, query_lens,
               H, H_kv, H / H_kv, D, bs, q_tile};
  // 先检查，再排任务：每个请求的 query 切成至多 q_tile 个位置一段（decode：一段一个位置），每段 × H_kv 个 KV 头
  std::vector<Task> segments;
  int64_t row0 = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t S = seq_lens[b], L = query_lens[b], n_blocks = (S + bs - 1) / bs;
    if (L < 1 || S < L || n_blocks > max_blocks) return 1;
    for (int64_t j = 0; j < n_blocks; ++j)                   // 只查会读到的块：补齐用的块号根本不会被用到
      if (block_tables[b * max_blocks + j] < 0 || block_tables[b * max_blocks + j] >= num_pool_blocks) return 2;
    for (int64_t i0 = 0; i0 < L; i0 += q_tile)
      for (int64_t kvh = 0; kvh < H_kv; ++kvh) {
        const int64_t i1 = std::min(L, i0 + q_tile);
        segments.push_back({b, row0, i0, i1, kvh, 0, (S - L + i1 - 1) / bs + 1});   // 最后一个 query 看得到的块
      }
    row0 += L;
  }
  if (row0 != T) return 3;
  // 任务不到线程数的 4 倍时，把长的块表切段（每段至少 16 块），让每个线程都有活
  const int64_t want = num_threads > 1 ? 4 * num_threads : 1;
  const int64_t split = std::max<int64_t>(1, (want + (int64_t)segments.size() - 1) / (int64_t)segments.size());
  std::vector<Task> tasks;
  std::vector<int64_t> group_start;
  for (const Task& seg : segments) {
    const int64_t n_parts = std::max<int64_t>(1, std::min(split, seg.j1 / 16));
    group_start.push_back((int64_t)tasks.size());
    for (int64_t p = 0; p < n_parts; ++p) {
      Task t = seg;
      t.j0 = seg.j1 * p / n_parts, t.j1 = seg.j1 * (p + 1) / n_parts;
      tasks.push_back(t);
    }
  }
  group_start.push_back((int64_t)tasks.size());
  switch (D) {
    case 64: run<64>(a, tasks, group_start, num_threads); break;
    case 128: run<128>(a, tasks, group_start, num_threads); break;
    default: run<0>(a, tasks, group_start, num_threads);
  }
  return 0;
}
"""

# 编译选项。-march=native：为这台机器的 CPU 生成指令（AVX2、FMA……），torch.compile 在 CPU 上编它的内核也这么做；
# 所以编译缓存的文件名里带着 CPU 的型号和指令集（同一个缓存目录被别的机器用到时，会重新编译，不会跑出非法指令）。
# -fopenmp：#pragma omp 生效；库链接的 libgomp.so.1 就是 torch 已经加载的那一份，线程池与 torch 共用同一个运行时。
CXXFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]
QUERY_TILE = 16                     # 一个任务最多负责一个请求的多少个 query 位置（只影响长 prefill 段怎么切）


class KernelBuildError(RuntimeError):
    pass


_kernel: Optional[ctypes.CDLL] = None
_build_error: Optional[str] = None
_fallback_said = False


def kernel_dir() -> Path:
    return cache_root() / "kernels"


def _cpu_identity() -> str:
    """CPU 型号 + 指令集标志（-march=native 编出来的库只能在同样的 CPU 上用）。"""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx or not shutil.which(cxx):
        raise KernelBuildError("no C++ compiler found (install g++, or set CXX)")
    return cxx


def build_kernel(directory: Optional[Path] = None) -> Path:
    """编译 KERNEL_SOURCE（已编过就直接返回缓存里的 .so）。文件名是源码、编译器、选项与 CPU 的哈希：
    改了其中任何一样都会编一个新的。先编到临时文件再原子地改名，几个进程同时第一次用也不会读到半个文件。"""
    directory = Path(directory) if directory is not None else kernel_dir()
    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cxx} --version failed: {e}") from None
    key = hashlib.sha256("\0".join([KERNEL_SOURCE, " ".join(CXXFLAGS), cxx, version, _cpu_identity()]).encode())
    lib = directory / f"paged_attention_{key.hexdigest()[:16]}.so"
    if lib.is_file():
        return lib
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        src, tmp_lib = Path(tmp) / "paged_attention.cpp", Path(tmp) / "paged_attention.so"
        src.write_text(KERNEL_SOURCE)
        try:
            r = subprocess.run([cxx, *CXXFLAGS, str(src), "-o", str(tmp_lib)], capture_output=True, text=True,
                               timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelBuildError(f"{cxx} failed: {e}") from None
        if r.returncode != 0:
            first = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr.strip()[:200])
            raise KernelBuildError(f"{cxx} exited with {r.returncode}" + (f": {first}" if first else ""))
        os.replace(tmp_lib, lib)
    return lib


def _load_kernel() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_kernel()))
    fn = lib.paged_attention_f32
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [P, P, P, P, I64, I64, I64, P, I64, P, P, I64, I64, I64, I64, I64, I64, I64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def kernel_available() -> bool:
    """C++ 内核能不能用（第一次调用时编译或从缓存加载；失败的原因见 kernel_build_error()）。"""
    global _kernel, _build_error
    if _kernel is None and _build_error is None:
        try:
            _kernel = _load_kernel()
        except (KernelBuildError, OSError) as e:
            _build_error = str(e)
    return _kernel is not None


def kernel_build_error() -> Optional[str]:
    return _build_error


def _say_fallback_once() -> None:
    global _fallback_said
    if not _fallback_said:
        _fallback_said = True
        print(f"paged attention: C++ kernel unavailable ({_build_error}); using the gather path (impl='gather')",
              file=sys.stderr)


_KERNEL_ERRORS = {1: "a request has query_len < 1, seq_len < query_len, or a block table too short for seq_len",
                  2: "a block table points outside the pool", 3: "q's row count differs from the sum of query_lens"}


def paged_attention_cpp(q, k_cache, v_cache, block_tables, seq_lens, query_lens) -> torch.Tensor:
    if not kernel_available():
        raise UserError(f"the C++ paged attention kernel could not be built: {_build_error}")
    if q.dtype != torch.float32 or q.device.type != "cpu":
        raise UserError(f"the C++ paged attention kernel runs on CPU float32 only, not {q.device}/{q.dtype}")
    check_args(q, k_cache, v_cache, block_tables, seq_lens, query_lens)   # 内核按这些形状算地址：先对上
    T, H, D = q.shape
    num_pool_blocks, H_kv, bs, _ = k_cache.shape
    # 内核假定：q 连续；一块里一个头的 block_size × D 个数连续；K 和 V 的块步长、头步长相同（池子的两个视图正是如此）
    if k_cache.stride()[2:] != (D, 1) or v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache/v_cache strides {k_cache.stride()}/{v_cache.stride()} are not a pool's views")
    q = q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()      # 已是 int32 时不拷贝
    seq_lens, query_lens = seq_lens.to(torch.int32).contiguous(), query_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    rc = _kernel.paged_attention_f32(
        out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), k_cache.stride(1), num_pool_blocks,
        block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), query_lens.data_ptr(),
        block_tables.shape[0], T, H, H_kv, D, bs, QUERY_TILE, torch.get_num_threads())
    if rc:
        raise ValueError(f"paged attention: {_KERNEL_ERRORS[rc]}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# flex_attention：把整个池子看成一条长序列，用块表造 BlockMask
# ---------------------------------------------------------------------------------------------------------------

_flex_compiled = None


def flex_block_mask(k_cache, block_tables, seq_lens, query_lens, num_heads: int):
    """一次前向（全部层共用）的 BlockMask：把一层的池子看成一条长度 N = (num_blocks + 1)·H_kv·block_size 的序列
    （池子本来就连续，这只是换个视角，不拷贝），第 块号·H_kv + 头 个长度为 block_size 的段就是"这个物理块的这个头"。
    请求 b 的 query 头 h 只访问它自己块表里的段 table[b, j]·H_kv + h // G（kv_indices），其余的段根本不读。
    整段都看得到的块记为 full（不调 mask_mod）；最后一块、以及分块 prefill 里与 query 交错的块要逐个 key 判断：
    mask_mod 用"物理块 → 这个请求的第几个逻辑块"的反查表 p2l 算出 key 的位置，与 query 的位置比较（因果）。"""
    from torch.nn.attention.flex_attention import BlockMask
    num_pool_blocks, H_kv, bs, _ = k_cache.shape
    B, max_blocks = block_tables.shape
    dev = k_cache.device
    G = num_heads // H_kv
    table = block_tables.to(dev).long()
    seq_lens, query_lens = seq_lens.to(dev).long(), query_lens.to(dev).long()
    q_off = seq_lens - query_lens                                  # (B,) 每个请求第一个 query 的位置
    n_blocks = (seq_lens + bs - 1) // bs                           # (B,) 读到的块数
    n_full = torch.minimum((q_off + 1) // bs, seq_lens // bs)      # (B,) 每个 query 都整块看得到的块数
    W = num_pool_blocks * H_kv                                     # 段的总数：kv_indices 的宽度必须覆盖整条序列
    segs = table[:, None, :] * H_kv + (torch.arange(num_heads, device=dev) // G)[None, :, None]   # (B, H, max_blocks)
    shift = (torch.arange(max_blocks, device=dev)[None, :] + n_full[:, None]).clamp(max=max_blocks - 1)
    partial = segs.gather(2, shift[:, None, :].expand(B, num_heads, max_blocks))    # 从第 n_full 块起的段
    full_idx = torch.zeros(B, num_heads, 1, W, dtype=torch.int32, device=dev)
    full_idx[:, :, 0, :max_blocks] = segs.int()                    # (B, H, 1, W)，前 n_full 个有效
    part_idx = torch.zeros(B, num_heads, 1, W, dtype=torch.int32, device=dev)
    part_idx[:, :, 0, :max_blocks] = partial.int()                 # (B, H, 1, W)，前 n_blocks − n_full 个有效
    p2l = torch.full((B, num_pool_blocks), -1, dtype=torch.int64, device=dev)   # (B, num_blocks + 1) 物理块 → 逻辑块
    p2l.scatter_(1, table, torch.arange(max_blocks, device=dev).expand(B, max_blocks))

    def mask_mod(b, h, q_idx, kv_idx):
        # 编译后的内核只对 kv_indices 里的段调用它；不编译（eager）时对每个 key 都调用，所以它自己也要完整：
        # 段属于这个 query 头的 KV 头、物理块在这个请求的块表里、key 的位置不在 query 之后
        logical = p2l[b, kv_idx // (bs * H_kv)]
        own = (logical >= 0) & ((kv_idx // bs) % H_kv == h // G)
        return own & (logical * bs + kv_idx % bs <= q_off[b] + q_idx)

    L = int(query_lens.max())
    return BlockMask.from_kv_blocks(
        (n_blocks - n_full).int()[:, None, None].expand(B, num_heads, 1).contiguous(), part_idx,
        n_full.int()[:, None, None].expand(B, num_heads, 1).contiguous(), full_idx,
        BLOCK_SIZE=(L, bs), mask_mod=mask_mod, seq_lengths=(L, W * bs), compute_q_blocks=False)


def paged_attention_flex(q, k_cache, v_cache, block_tables, seq_lens, query_lens, block_mask=None) -> torch.Tensor:
    """flex_attention 读池子：q 排成 (B, H, L, D)（L = 最长的 query_len，短的补齐），K/V 是整个池子 (1, 1, N, D)，
    BlockMask 告诉它每个 (请求, 头) 读哪些段。第一次调用（以及 B、L 变了之后）要 torch.compile，CPU 上十几秒。
    block_mask：flex_block_mask 的结果，同一次前向的各层可以共用（默认每次调用现造，约 1 ms）。"""
    global _flex_compiled
    if _flex_compiled is None:
        from torch.nn.attention.flex_attention import flex_attention
        _flex_compiled = torch.compile(flex_attention)
    T, H, D = q.shape
    num_pool_blocks, H_kv, bs, _ = k_cache.shape
    if block_mask is None:
        block_mask = flex_block_mask(k_cache, block_tables, seq_lens, query_lens, H)
    query_lens = query_lens.to(q.device).long()
    L = int(query_lens.max())
    col = torch.arange(L, device=q.device)
    real = col[None, :] < query_lens[:, None]                      # (B, L)
    rows = torch.where(real, (torch.cumsum(query_lens, 0) - query_lens)[:, None] + col[None, :], 0)   # (B, L)
    qp = q[rows].transpose(1, 2)                                   # (B, L, H, D) -> (B, H, L, D)
    N = num_pool_blocks * H_kv * bs
    k = k_cache.view(1, 1, N, D)                                   # 整个池子当一条序列：视图，不拷贝
    v = v_cache.view(1, 1, N, D)
    out = _flex_compiled(qp, k, v, block_mask=block_mask, enable_gqa=True)   # (B, H, L, D)
    return out.transpose(1, 2)[real]                               # (T, H, D)
