"""小 M 的矩阵乘 y = x·Wᵀ，W 以 formats.py 重排过的块存放：float32、Q4_1、Q8_0。激活一直是 float32。

    matmul(fmt, x, packed, out_features)        x (M, K) float32 → y (M, N) float32；快内核（C++，OpenMP）
    matmul_naive(fmt, x, blocks_or_w)           同一个数，朴素 C++：一行一行、一个一个权重地解码和累加
    matmul_oracle(fmt, x, blocks_or_w)          同一个数，Python：先整个反量化（formats.decode），再 x @ W.T

验证的梯子（tiny-llm 的做法）：oracle 是定义；朴素内核对着 oracle 查，快内核对着朴素内核和 oracle 查
（tests/test_step14_kernels.py）。三者的权重逐位相同，差别只在 K 个乘积相加的先后顺序。

快内核为什么快（decode 时 M = 1…16，时间几乎全花在把权重从内存读进来）：
  - 每次调用，每个权重字节只从内存读一次，不管 M 多大：一个行组（16 个输出行）的记录读进来，
    对 M 行激活全部算完才去读下一组（M 很大时分成几段，同一组的记录第二次读时还在 L1/L2 里）；
  - 16 个输出行正好是 AVX-512 的一个向量（AVX2 是两个）：读 16 个字节，零扩展成 16 个 int32、转 float，
    得到 16 行的同一个位置的 q；fma(q, d, m) 就是 d·q + m——d·q 精确，只在 + m 处舍入一次，与 formats.decode
    算出的权重逐位相同——然后与广播的 x[m][k] 乘加进 16 行的累加器。内存里的权重是 5 位，寄存器里是 fp32；
  - 行组之间没有依赖：OpenMP 按行组分给各线程。
这就是"权重只读约 1/6 的字节（Q4_1 每个权重 5 位），数却与 fp32 模型相同（求和顺序除外）"：激活没有被量化。llama.cpp 把激活也量化成
8 位（Q8_1）再做整数点积，更省算力，但 logits 会变：这一级也在这里（q4_1_q8_1_matmul，"有损的一级"），
用来对照。

编译：与 step05 的 paged attention 内核同一条路（-O3 -march=native -fopenmp，按 CPU 缓存在
<缓存目录>/kernels/）。源码里用 #if 选指令集：AVX-512（16 个 float 一个向量）、AVX2 + FMA（两个 8 个的），
都没有时是普通的标量循环（编译器自己向量化多少算多少）。isa() 报告编进去的是哪一条。
"""
import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from common.errors import UserError
from step05_paged.paged_attention import CXXFLAGS, KernelBuildError, _compiler, _cpu_identity, kernel_dir

from . import formats
from .formats import QK, ROWS, BLOCK_BYTES, check_blocks, decode, row_groups

FORMATS = ("f32", "q4_1", "q8_0")

KERNEL_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

constexpr int R = 16;        // 一个行组的输出行数 = 记录里交错的行数（formats.ROWS）
constexpr int QK = 32;       // 每块的权重数

// fp16 → fp32，精确（标量版：朴素内核和没有 F16C 的机器用）
static inline float half_to_float(uint16_t h) {
  const int e = (h >> 10) & 31, mant = h & 1023;
  float v;
  if (e == 0) v = std::ldexp((float)mant, -24);                  // 0 与次正规数
  else if (e == 31) v = mant ? NAN : INFINITY;
  else v = std::ldexp((float)(mant | 1024), e - 25);
  return (h & 0x8000) ? -v : v;
}

// 快的标量版：有 F16C 时一条指令（有损的一级每行每块转两次，ldexp 太慢）
static inline float fp16_to_fp32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return half_to_float(h);
#endif
}

// ---- "16 个 float"：一个行组的 16 行。三种实现，内核只用下面这几个函数 ----
#if defined(__AVX512F__)
static const int ISA = 512;
struct V16 { __m512 v; };
static inline V16 vzero() { return {_mm512_setzero_ps()}; }
static inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
static inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }            // a·b + c
static inline V16 vfma_x(float x, V16 w, V16 acc) { return {_mm512_fmadd_ps(_mm512_set1_ps(x), w.v, acc.v)}; }
static inline V16 vhalf(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
static inline void vnibbles(const uint8_t* p, V16& lo, V16& hi) {   // 16 字节 → 低 4 位、高 4 位各 16 个 float
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  lo = {_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)))};
  hi = {_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))};
}
static inline V16 vint8(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))};
}
#elif defined(__AVX2__) && defined(__FMA__)
static const int ISA = 256;
struct V16 { __m256 a, b; };
static inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float* p, V16 v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
static inline V16 vadd(V16 x, V16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
static inline V16 vmul(V16 x, V16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline V16 vfma(V16 x, V16 y, V16 c) { return {_mm256_fmadd_ps(x.a, y.a, c.a), _mm256_fmadd_ps(x.b, y.b, c.b)}; }
static inline V16 vfma_x(float x, V16 w, V16 acc) {
  const __m256 xx = _mm256_set1_ps(x);
  return {_mm256_fmadd_ps(xx, w.a, acc.a), _mm256_fmadd_ps(xx, w.b, acc.b)};
}
static inline V16 vhalf(const uint8_t* p) {
#if defined(__F16C__)
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)))};
#else
  alignas(32) float f[16];
  for (int i = 0; i < 16; ++i) { uint16_t h; std::memcpy(&h, p + 2 * i, 2); f[i] = half_to_float(h); }
  return vload(f);
#endif
}
static inline void vnibbles(const uint8_t* p, V16& lo, V16& hi) {
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
  const __m256i mask = _mm256_set1_epi32(15);
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
}
static inline V16 vint8(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
}
#else
static const int ISA = 0;
struct V16 { float f[16]; };
static inline V16 vzero() { V16 r; for (int i = 0; i < 16; ++i) r.f[i] = 0.0f; return r; }
static inline V16 vload(const float* p) { V16 r; for (int i = 0; i < 16; ++i) r.f[i] = p[i]; return r; }
static inline void vstore(float* p, V16 a) { for (int i = 0; i < 16; ++i) p[i] = a.f[i]; }
static inline V16 vadd(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.f[i] += b.f[i]; return a; }
static inline V16 vmul(V16 a, V16 b) { for (int i = 0; i < 16; ++i) a.f[i] *= b.f[i]; return a; }
static inline V16 vfma(V16 a, V16 b, V16 c) { for (int i = 0; i < 16; ++i) c.f[i] = std::fma(a.f[i], b.f[i], c.f[i]); return c; }
static inline V16 vfma_x(float x, V16 w, V16 acc) { for (int i = 0; i < 16; ++i) acc.f[i] = std::fma(x, w.f[i], acc.f[i]); return acc; }
static inline V16 vhalf(const uint8_t* p) {
  V16 r;
  for (int i = 0; i < 16; ++i) { uint16_t h; std::memcpy(&h, p + 2 * i, 2); r.f[i] = half_to_float(h); }
  return r;
}
static inline void vnibbles(const uint8_t* p, V16& lo, V16& hi) {
  for (int i = 0; i < 16; ++i) { lo.f[i] = (float)(p[i] & 15); hi.f[i] = (float)(p[i] >> 4); }
}
static inline V16 vint8(const uint8_t* p) { V16 r; for (int i = 0; i < 16; ++i) r.f[i] = (float)(int8_t)p[i]; return r; }
#endif

extern "C" int isa() { return ISA; }

// ---- 一个行组 × MT 行激活：结果 (MT, 16) 写进 out。P = 每行激活几个独立的累加器 ----
// 为什么要 P 个：一次 FMA 要等上一次的结果（约 4 个周期）。M = 1 时只有一行激活，同一个累加器一串乘加排着队，
// 算得比读得慢；分 P 个累加器轮流加，最后再合起来（求和顺序因此不同于按 k 顺序累加，误差同一量级）。

// x 是转置过的一段激活 xt[k][m]（MT 行，见 block_matmul）：第 k 步要的 MT 个数相邻，都从同一个指针按常数偏移读，
// 不必为每一行激活占一个通用寄存器（MT = 8 时寄存器不够，编译器会把行指针放到栈上，每次乘加多一次读）。

// float32：行组是 (K, 16)，第 k 行是 16 个输出行的第 k 个权重
template <int MT, int P>
static void tile_f32(const float* __restrict__ w, int64_t K, const float* __restrict__ x, float* __restrict__ out) {
  V16 acc[MT][P];
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[m][p] = vzero();
  int64_t k = 0;
  for (; k + P <= K; k += P) {
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const V16 wk = vload(w + (k + p) * R);
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) acc[m][p] = vfma_x(x[(k + p) * MT + m], wk, acc[m][p]);
    }
  }
  for (; k < K; ++k) {
    const V16 wk = vload(w + k * R);
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) acc[m][0] = vfma_x(x[k * MT + m], wk, acc[m][0]);
  }
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    V16 s = acc[m][0];
#pragma GCC unroll 4
    for (int p = 1; p < P; ++p) s = vadd(s, acc[m][p]);
    vstore(out + m * R, s);
  }
}

// Q4_1：每块一条 320 字节的记录 [d 16 个 fp16 | m 16 个 fp16 | qs[j][r] 16×16 字节]
// 第 j 个字节给出块内第 j 个（低 4 位）和第 j+16 个（高 4 位）权重：两个累加器（lo、hi）天然独立
template <int MT, int P>
static void tile_q4_1(const uint8_t* __restrict__ w, int64_t nb, const float* __restrict__ x, float* __restrict__ out) {
  V16 acc[MT][2 * P];
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < 2 * P; ++p) acc[m][p] = vzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = w + b * (R * 20);
    const V16 d = vhalf(rec), mn = vhalf(rec + 2 * R);
    const uint8_t* qs = rec + 4 * R;
    const float* xb = x + b * QK * MT;
    for (int j = 0; j < 16; j += P) {
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        V16 lo, hi;
        vnibbles(qs + (j + p) * R, lo, hi);
        const V16 w_lo = vfma(lo, d, mn), w_hi = vfma(hi, d, mn);   // d·q + m，与 formats.decode 逐位相同
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) {
          acc[m][2 * p] = vfma_x(xb[(j + p) * MT + m], w_lo, acc[m][2 * p]);
          acc[m][2 * p + 1] = vfma_x(xb[(j + p + 16) * MT + m], w_hi, acc[m][2 * p + 1]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    V16 s = acc[m][0];
#pragma GCC unroll 8
    for (int p = 1; p < 2 * P; ++p) s = vadd(s, acc[m][p]);
    vstore(out + m * R, s);
  }
}

// Q8_0：每块一条 544 字节的记录 [d 16 个 fp16 | qs[j][r] 32×16 个 int8]
template <int MT, int P>
static void tile_q8_0(const uint8_t* __restrict__ w, int64_t nb, const float* __restrict__ x, float* __restrict__ out) {
  V16 acc[MT][P];
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[m][p] = vzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = w + b * (R * 34);
    const V16 d = vhalf(rec);
    const uint8_t* qs = rec + 2 * R;
    const float* xb = x + b * QK * MT;
    for (int j = 0; j < QK; j += P) {
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const V16 wj = vmul(vint8(qs + (j + p) * R), d);              // d·q：精确
#pragma GCC unroll 16
        for (int m = 0; m < MT; ++m) acc[m][p] = vfma_x(xb[(j + p) * MT + m], wj, acc[m][p]);
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MT; ++m) {
    V16 s = acc[m][0];
#pragma GCC unroll 4
    for (int p = 1; p < P; ++p) s = vadd(s, acc[m][p]);
    vstore(out + m * R, s);
  }
}

// 一次最多算几行激活（累加器要放得进寄存器：AVX-512 有 32 个向量寄存器，AVX2 只有 16 个、一个 V16 占两个）
#if defined(__AVX512F__)
constexpr int MT_MAX = 8;
#else
constexpr int MT_MAX = 4;
#endif

// 累加器个数 MT·P 至少 4 左右，FMA 的延迟才藏得住；M 大时本来就够了
template <int MT> struct Chains { static constexpr int F32 = MT == 1 ? 4 : MT == 2 ? 2 : 1, Q4 = MT == 1 ? 2 : 1,
                                                   Q8 = MT == 1 ? 4 : MT == 2 ? 2 : 1; };

template <int MT>
static void tile(int fmt, const uint8_t* w, int64_t K, const float* xt, float* out) {
  if (fmt == 0) tile_f32<MT, Chains<MT>::F32>((const float*)w, K, xt, out);
  else if (fmt == 1) tile_q4_1<MT, Chains<MT>::Q4>(w, K / QK, xt, out);
  else tile_q8_0<MT, Chains<MT>::Q8>(w, K / QK, xt, out);
}

static void tile_any(int mt, int fmt, const uint8_t* w, int64_t K, const float* xt, float* out) {
  switch (mt) {
    case 1: tile<1>(fmt, w, K, xt, out); break;
    case 2: tile<2>(fmt, w, K, xt, out); break;
    case 3: tile<3>(fmt, w, K, xt, out); break;
    case 4: tile<4>(fmt, w, K, xt, out); break;
#if defined(__AVX512F__)
    case 5: tile<5>(fmt, w, K, xt, out); break;
    case 6: tile<6>(fmt, w, K, xt, out); break;
    case 7: tile<7>(fmt, w, K, xt, out); break;
    case 8: tile<8>(fmt, w, K, xt, out); break;
#endif
  }
}

// fmt：0 = float32 (G, K, 16)；1 = Q4_1 (G, K/32, 320)；2 = Q8_0 (G, K/32, 544)。x (M, K)、y (M, N) 都连续
extern "C" void block_matmul(int fmt, const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
                             int num_threads) {
  const int64_t G = (N + R - 1) / R;
  const int64_t group_bytes = fmt == 0 ? K * R * 4 : (K / QK) * R * (fmt == 1 ? 20 : 34);
  // 激活按每 MT_MAX 行一段转置成 xt[k][m]（一次调用转一次，M·K 个数，比权重少得多）
  static thread_local std::vector<float> xt_buf;
  xt_buf.resize(M * K);
  float* xt = xt_buf.data();
  for (int64_t m0 = 0; m0 < M; m0 += MT_MAX) {
    const int64_t mt = std::min<int64_t>(MT_MAX, M - m0);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t m = 0; m < mt; ++m) xt[m0 * K + k * mt + m] = x[(m0 + m) * K + k];
  }
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t g = 0; g < G; ++g) {
    alignas(64) float out[MT_MAX * R];
    const int64_t n0 = g * R, rows = std::min<int64_t>(R, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += MT_MAX) {                  // 同一组的记录第二次读时还在缓存里
      const int mt = (int)std::min<int64_t>(MT_MAX, M - m0);
      tile_any(mt, fmt, w + g * group_bytes, K, xt + m0 * K, out);
      for (int m = 0; m < mt; ++m) std::memcpy(y + (m0 + m) * N + n0, out + m * R, rows * sizeof(float));
    }
  }
}

// ---- 朴素内核：原始块 (N, K/32, 每块字节数)，一个输出一个输出地算，一个权重一个权重地解码，按 k 顺序累加 ----
extern "C" void naive_matmul(int fmt, const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t nb = K / QK, bb = fmt == 1 ? 20 : 34;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        float wk;
        if (fmt == 0) {
          wk = ((const float*)w)[n * K + k];
        } else {
          const uint8_t* blk = w + (n * nb + k / QK) * bb;
          uint16_t dh; std::memcpy(&dh, blk, 2);
          const float d = half_to_float(dh);
          const int j = (int)(k % QK);
          if (fmt == 1) {
            uint16_t mh; std::memcpy(&mh, blk + 2, 2);
            const int q = j < 16 ? (blk[4 + j] & 15) : (blk[4 + j - 16] >> 4);
            wk = d * (float)q + half_to_float(mh);
          } else {
            wk = d * (float)(int8_t)blk[2 + j];
          }
        }
        acc += x[m * K + k] * wk;
      }
      y[m * N + n] = acc;
    }
}

extern "C" void halves_to_floats(const uint16_t* h, float* f, int64_t n) {
  for (int64_t i = 0; i < n; ++i) f[i] = half_to_float(h[i]);
}

// ---- 几个小算子（fused.py 的 eager 融合路径）：每个一次调用做完 PyTorch 要发好几个算子才做完的事 ----
// 都是单线程：decode 时每个只有几百个数，开线程的代价比算本身大。T 行，每行之间跳 stride 个 float。

static inline float sum_squares(const float* x, int64_t n) {
  float acc[16] = {0};                                         // 16 个部分和：编译器能把这个循环向量化
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += x[i + j] * x[i + j];
  float s = 0.0f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// RMSNorm（common/model.py 的 RMSNorm，float32）：y = w · (x / sqrt(mean(x²) + eps))。代替 pow、mean、add、rsqrt、mul、mul
// 和两次 to 共 8 个算子。residual 不为空时先 h += residual（残差相加，原地写进 h），再对 h 做 RMSNorm：再省一个 add
extern "C" void rms_norm(float* h, const float* residual, const float* w, float* y, int64_t T, int64_t E, float eps) {
  for (int64_t t = 0; t < T; ++t) {
    float* x = h + t * E;
    if (residual)
      for (int64_t e = 0; e < E; ++e) x[e] = residual[t * E + e] + x[e];
    const float r = 1.0f / std::sqrt(sum_squares(x, E) / (float)E + eps);
    for (int64_t e = 0; e < E; ++e) y[t * E + e] = w[e] * (x[e] * r);
  }
}

// RoPE（common/model.py 的 apply_rope），原地：x 是 (T, heads, D) 的一行行（行距 stride 个 float），cos/sin (T, D)。
// 第 i 对 (x_i, x_{i+D/2}) 转 pos·θ_i：x_i·cos − x_{i+D/2}·sin，x_{i+D/2}·cos + x_i·sin。
// 代替 PyTorch 的 x·cos + rotate_half(x)·sin：切两半、取负、拼接、两次乘、一次加，q 和 k 各一遍
// 不许编译器把 a·c − b·s 合成一条 FMA（少一次舍入）：与 PyTorch 先乘、再加的结果逐位相同
extern "C" __attribute__((optimize("fp-contract=off")))
void rope(float* x, int64_t stride, int64_t T, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + t * stride + h * D;
      const float *c = cos + t * D, *s = sin + t * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
}

// ---- 有损的一级：llama.cpp 的做法。激活先量化成 8 位（Q8_1），再与 Q4_1 的 4 位权重做整数点积 ----
// 激活每 32 个一块：dy = max|x| / 127，qy = round(x / dy) ∈ [-127, 127]，sy = dy·Σqy。一块的点积
//   Σ_j (dx·qx_j + mx)·(dy·qy_j) = dx·dy·Σ_j qx_j·qy_j + mx·sy
// Σ qx·qy 是精确的整数（AVX-512 VNNI / AVX-VNNI 的 vpdpbusd 一条指令做 4 组 u8×s8 乘加，否则 maddubs + madd）；
// 误差全来自把 x 舍入到 8 位（llama.cpp 的 d、s 存 fp16，这里存 fp32：差别比 8 位舍入小得多）。
// 权重用 GGUF 原来的块顺序 (N, K/32, 20)：llama.cpp 对 Q4_1 也不重排（repack.cpp 里没有 Q4_1）。
static void quantize_q8_1(const float* x, int64_t K, float* d, float* s, int8_t* q) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
      const int v = (int)std::nearbyint(xb[j] * id);                // 就近舍入（平局取偶，同 _mm256_round_ps）
      q[b * QK + j] = (int8_t)v;
      sum += v;
    }
    d[b] = dd, s[b] = dd * (float)sum;
  }
}

// 一块的整数点积 Σ_j qx_j·qy_j：qs 16 个字节（32 个 4 位权重），qy 32 个 int8。
// AVX2 上返回 8 个 int32 的部分和（不在每块做水平求和：转成 float 乘上 dx·dy 累加进向量，整行算完才求和一次）
#if defined(__AVX2__)
static inline __m256i dot_q4_q8(const uint8_t* qs, const int8_t* qy) {
  const __m128i raw = _mm_loadu_si128((const __m128i*)qs), m4 = _mm_set1_epi8(15);
  const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));  // 低半：第 0..15 个
  const __m256i a = _mm256_loadu_si256((const __m256i*)qy);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a);            // 8 × (4 个 u8·s8 之和)，一条指令
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, a);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));   // 15·127·2 < 32767，不会饱和
#endif
}
static inline float hsum(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

extern "C" void q4_1_q8_1_matmul(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
                                 int num_threads) {
  const int64_t nb = K / QK;
  std::vector<float> dy(M * nb), sy(M * nb);
  std::vector<int8_t> qy(M * K);
  for (int64_t m = 0; m < M; ++m) quantize_q8_1(x + m * K, K, &dy[m * nb], &sy[m * nb], &qy[m * K]);
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> dx(nb), mx(nb);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const uint8_t* row = w + n * nb * 20;
      for (int64_t b = 0; b < nb; ++b) {                            // 这一行各块的 d、m：每行转一次
        uint16_t dh, mh;
        std::memcpy(&dh, row + b * 20, 2);
        std::memcpy(&mh, row + b * 20 + 2, 2);
        dx[b] = fp16_to_fp32(dh), mx[b] = fp16_to_fp32(mh);
      }
      for (int64_t m = 0; m < M; ++m) {
        const float *d = &dy[m * nb], *s = &sy[m * nb];
        const int8_t* q = &qy[m * K];
        float summ = 0.0f;
#if defined(__AVX2__)
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
          const __m256 p = _mm256_cvtepi32_ps(dot_q4_q8(row + b * 20 + 4, q + b * QK));   // 整数和转 float：精确（< 2^24）
          acc = _mm256_fmadd_ps(p, _mm256_set1_ps(dx[b] * d[b]), acc);
          summ += mx[b] * s[b];
        }
        y[m * N + n] = hsum(acc) + summ;
#else
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* qs = row + b * 20 + 4;
          const int8_t* qb = q + b * QK;
          int32_t dot = 0;
          for (int j = 0; j < 16; ++j) dot += (qs[j] & 15) * qb[j] + (qs[j] >> 4) * qb[j + 16];
          acc += dx[b] * d[b] * (float)dot;
          summ += mx[b] * s[b];
        }
        y[m * N + n] = acc + summ;
#endif
      }
    }
  }
}
"""


# 编译：step05 的那一套（编译器、选项、按 CPU 的缓存键）；extra_flags 给测试编别的指令集版本用。
# source / stem / link：编算子库（build_op_library）时换成另一份源码、另一个文件名，链接选项放在源文件之后
def build_kernel(extra_flags: tuple = (), directory: Optional[Path] = None, source: str = KERNEL_SOURCE,
                 stem: str = "block_matmul", link: tuple = ()) -> Path:
    directory = Path(directory) if directory is not None else kernel_dir()
    cxx = _compiler()
    flags = [*CXXFLAGS, *extra_flags]
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cxx} --version failed: {e}") from None
    key = hashlib.sha256("\0".join([source, " ".join(flags + list(link)), cxx, version, _cpu_identity()]).encode())
    lib = directory / f"{stem}_{key.hexdigest()[:16]}.so"
    if lib.is_file():
        return lib
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        src, tmp_lib = Path(tmp) / f"{stem}.cpp", Path(tmp) / f"{stem}.so"
        src.write_text(source)
        try:
            r = subprocess.run([cxx, *flags, str(src), "-o", str(tmp_lib), *link], capture_output=True, text=True,
                               timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelBuildError(f"{cxx} failed: {e}") from None
        if r.returncode != 0:
            first = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr.strip()[:200])
            raise KernelBuildError(f"{cxx} exited with {r.returncode}" + (f": {first}" if first else ""))
        os.replace(tmp_lib, lib)
    return lib


def load_library(extra_flags: tuple = ()) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_kernel(extra_flags)))
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.block_matmul.argtypes = [I, P, P, P, I64, I64, I64, I]
    lib.block_matmul.restype = None
    lib.naive_matmul.argtypes = [I, P, P, P, I64, I64, I64]
    lib.naive_matmul.restype = None
    lib.q4_1_q8_1_matmul.argtypes = [P, P, P, I64, I64, I64, I]
    lib.q4_1_q8_1_matmul.restype = None
    lib.halves_to_floats.argtypes = [P, P, I64]
    lib.halves_to_floats.restype = None
    lib.rms_norm.argtypes = [P, P, P, P, I64, I64, ctypes.c_float]
    lib.rms_norm.restype = None
    lib.rope.argtypes = [P, I64, I64, I64, I64, P, P]
    lib.rope.restype = None
    lib.isa.restype = I
    return lib


_lib: Optional[ctypes.CDLL] = None
_build_error: Optional[str] = None


def kernel_available() -> bool:
    """内核能不能用（第一次调用时编译或从缓存加载；失败的原因见 kernel_build_error()）。"""
    global _lib, _build_error
    if _lib is None and _build_error is None:
        try:
            _lib = load_library()
        except (KernelBuildError, OSError) as e:
            _build_error = str(e)
    return _lib is not None


def kernel_build_error() -> Optional[str]:
    return _build_error


def library(lib: Optional[ctypes.CDLL] = None) -> ctypes.CDLL:
    if lib is not None:
        return lib
    if not kernel_available():
        raise UserError(f"the C++ block matmul kernel could not be built: {_build_error}")
    return _lib


FMT_CODE = {"f32": 0, "q4_1": 1, "q8_0": 2}


def check_x(x: torch.Tensor, K: int) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be a CPU float32 (M, {K}) matrix, got {x.dtype} {tuple(x.shape)} on {x.device}")
    return x.contiguous()


def packed_shape(fmt: str, out_features: int, in_features: int) -> tuple:
    G = row_groups(out_features)
    if fmt == "f32":
        return (G, in_features, ROWS)
    return (G, in_features // QK, ROWS * BLOCK_BYTES[fmt])


def check_packed(fmt: str, packed: torch.Tensor, out_features: int) -> int:
    """packed 的形状与 (fmt, out_features) 对得上吗；返回 K。"""
    K = packed.shape[1] * (1 if fmt == "f32" else QK) if packed.dim() == 3 else -1
    want = packed_shape(fmt, out_features, K)
    if tuple(packed.shape) != want or not packed.is_contiguous() or packed.device.type != "cpu" or \
            packed.dtype != (torch.float32 if fmt == "f32" else torch.uint8):
        raise ValueError(f"packed {fmt} weight is {packed.dtype} {tuple(packed.shape)}, expected a contiguous CPU "
                         f"tensor of shape {want}")
    return K


def matmul(fmt: str, x: torch.Tensor, packed: torch.Tensor, out_features: int, lib=None) -> torch.Tensor:
    """y = x·Wᵀ：x (M, K) float32，packed 是 formats.repack_blocks / repack_f32 的结果 → (M, N) float32。"""
    K = check_packed(fmt, packed, out_features)
    return matmul_unchecked(library(lib), FMT_CODE[fmt], check_x(x, K), packed, out_features, K)


def matmul_unchecked(lib, code: int, x: torch.Tensor, packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """matmul 去掉检查（BlockLinear 在构造时查过 packed，每次调用只查 x）：decode 一步两百多次调用，每次省十几微秒。
    x 是连续的 (..., K) 就行：前面几维合起来就是 M 行，y 直接按 (..., N) 分配（省掉前后两次变形，各是一个算子）。"""
    y = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    lib.block_matmul(code, x.data_ptr(), packed.data_ptr(), y.data_ptr(), x.numel() // K, N, K, torch.get_num_threads())
    return y


# ---------------------------------------------------------------------------------------------------------------
# torch.compile 看到的矩阵乘：同一个内核注册成 PyTorch 算子 step14::block_matmul
# ---------------------------------------------------------------------------------------------------------------
# 为什么要算子：dynamo 追踪不进 ctypes 调用（没有张量语义），整步会断成几百张图；注册成算子，编译器在图里只调用它，
# 形状从 register_fake 得知，不往里看（与 common/linear.py 的 packed_linear、perf/compiled_decode.py 的 write_kv_
# 同一个办法）。
# 为什么在 C++ 里注册：用 torch.library.custom_op 注册的 Python 算子，每次调用要从分发器回到 Python 再进 ctypes，
# 一次十几微秒；decode 一步一百多次调用，就是好几毫秒——编译的图本来就是为了把 Python 拿掉。OP_SOURCE 用 PyTorch
# 的"稳定 ABI"（torch/csrc/stable：只有 C 接口的薄头文件，几秒就编完）把同一个内核注册进分发器：图里（inductor 生成
# 的 Python 包装，或 cpp_wrapper 生成的 C++ 包装）调用它，一路都是 C++。编不出来（没有 PyTorch 的头文件）时退回
# Python 写的同名算子（block_matmul_py），数一样，只是慢（graph_op_kind() 说是哪一个）。
# eager 不经过算子：BlockLinear.matmul 直接做 ctypes 调用（经过分发器多几微秒，Python 算子多十几微秒）。
# 线程数：与 eager 一样是 PyTorch 此刻用的线程数——C++ 里是 omp_get_max_threads()，torch.get_num_threads() 返回的就是它
# （PyTorch 与这个库用同一个 OpenMP 运行库：同名的 libgomp.so.1 只加载一次）。

OP_SCHEMA = "block_matmul(Tensor x, Tensor packed, int code, int N, int K) -> Tensor"

OP_SOURCE = r"""
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <omp.h>

// x (M, K) 连续的 CPU float32，packed 是 BlockLinear 查过的块 → y (M, N)；与 Python 里 ctypes 调的是同一个函数
static torch::stable::Tensor block_matmul_op(torch::stable::Tensor x, torch::stable::Tensor packed, int64_t code,
                                             int64_t N, int64_t K) {
  x = torch::stable::contiguous(x);                          // 已经连续时不拷
  const int64_t M = x.numel() / K;
  torch::stable::Tensor y = torch::stable::new_empty(x, {M, N});
  block_matmul((int)code, (const float*)x.const_data_ptr(), (const uint8_t*)packed.const_data_ptr(),
               (float*)y.mutable_data_ptr(), M, N, K, omp_get_max_threads());
  return y;
}

STABLE_TORCH_LIBRARY(step14, m) { m.def("%s"); }
STABLE_TORCH_LIBRARY_IMPL(step14, CPU, m) { m.impl("block_matmul", TORCH_BOX(&block_matmul_op)); }
""" % OP_SCHEMA


def build_op_library() -> Path:
    """KERNEL_SOURCE + OP_SOURCE 编成一个算子库：带上 PyTorch 的头文件与库（缓存键里有 PyTorch 的版本）。"""
    root = Path(torch.__file__).resolve().parent
    link = (f"-L{root / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{root / 'lib'}")
    return build_kernel((f"-I{root / 'include'}",), source=KERNEL_SOURCE + OP_SOURCE + f"// torch {torch.__version__}\n",
                        stem="block_matmul_op", link=link)


_op_kind: Optional[str] = None
_op_error: Optional[str] = None


def graph_op():
    """编译的图里调用的算子（第一次调用时编译 / 加载 C++ 的算子库，不行就注册 Python 的）。BlockLinear 构造时调用：
    dynamo 追踪时只拿现成的算子，不在追踪里编译。"""
    global _op_kind, _op_error
    if _op_kind is None:
        try:
            torch.ops.load_library(str(build_op_library()))
            torch.library.register_fake("step14::block_matmul")(_fake)
            _op_kind = "C++"
        except (KernelBuildError, OSError, RuntimeError) as e:
            _op_error = str(e).splitlines()[0][:300]
            _register_python_op()
            _op_kind = "Python"
    return torch.ops.step14.block_matmul if _op_kind == "C++" else torch.ops.step14.block_matmul_py


def graph_op_kind() -> Optional[str]:
    """"C++"、"Python"（C++ 的编不出来：原因见 graph_op_error()）或 None（还没用过）。"""
    return _op_kind


def graph_op_error() -> Optional[str]:
    return _op_error


def _fake(x, packed, code, N, K):
    return x.new_empty(x.shape[0], N)                                   # (M, K) -> (M, N)


def _register_python_op() -> None:
    """退路：同一个内核写成 Python 的算子（ctypes 调用）。"""
    if hasattr(torch.ops.step14, "block_matmul_py"):
        return

    @torch.library.custom_op("step14::block_matmul_py", mutates_args=())
    def block_matmul_py(x: torch.Tensor, packed: torch.Tensor, code: int, N: int, K: int) -> torch.Tensor:
        return matmul_unchecked(library(), code, x.contiguous(), packed, N, K)

    block_matmul_py.register_fake(_fake)


def matmul_naive(fmt: str, x: torch.Tensor, w, lib=None) -> torch.Tensor:
    """朴素 C++：w 是原始块 (N, K/32, 字节) uint8 numpy（q4_1 / q8_0），或 float32 的 W (N, K) torch 张量。"""
    if fmt == "f32":
        w = w.float().contiguous()
        N, K = w.shape
    else:
        N, K = w.shape[0], w.shape[1] * QK
        check_blocks(fmt, w, N, K)
        w = torch.from_numpy(np.ascontiguousarray(w))
    x = check_x(x, K)
    y = torch.empty(x.shape[0], N, dtype=torch.float32)
    library(lib).naive_matmul(FMT_CODE[fmt], x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], N, K)
    return y


def matmul_oracle(fmt: str, x: torch.Tensor, w) -> torch.Tensor:
    """Python 的定义：反量化（formats.decode，与 gguf.quants.dequantize 逐位相同），再 x @ W.T。"""
    W = w.float() if fmt == "f32" else torch.from_numpy(decode(fmt, w))
    return x @ W.T                                                       # (M, K) x (K, N) -> (M, N)


# ---------------------------------------------------------------------------------------------------------------
# 有损的一级：激活量化成 8 位（llama.cpp 的 Q8_1），整数点积。权重是 GGUF 原来顺序的 Q4_1 块
# ---------------------------------------------------------------------------------------------------------------

def matmul_q8_activations(x: torch.Tensor, blocks: torch.Tensor, out_features: int, lib=None) -> torch.Tensor:
    """y ≈ x·Wᵀ：x 每 32 个一块量化成 int8（缩放 max|x|/127），与 Q4_1 块 (N, K/32, 20) uint8 做整数点积。有损。"""
    if blocks.dim() != 3 or blocks.shape[0] != out_features or blocks.shape[2] != BLOCK_BYTES["q4_1"] \
            or blocks.dtype != torch.uint8 or not blocks.is_contiguous():
        raise ValueError(f"want contiguous Q4_1 blocks ({out_features}, K/32, 20) uint8, got {tuple(blocks.shape)}")
    K = blocks.shape[1] * QK
    x = check_x(x, K)
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    library(lib).q4_1_q8_1_matmul(x.data_ptr(), blocks.data_ptr(), y.data_ptr(), x.shape[0], out_features, K,
                                  torch.get_num_threads())
    return y


def quantize_q8_1_oracle(x: torch.Tensor):
    """Python 版的激活量化（与内核同一条规则）：x (M, K) → d (M, K/32)、s (M, K/32)、q (M, K) int。"""
    xb = x.view(x.shape[0], -1, QK)                                      # (M, nb, 32)
    d = xb.abs().amax(-1) / 127                                          # (M, nb)
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None])                                 # torch.round：平局取偶，同内核
    return d, d * q.sum(-1), q.view(x.shape[0], -1)


def matmul_q8_activations_oracle(x: torch.Tensor, blocks: np.ndarray) -> torch.Tensor:
    """Python 的定义：Σ_b dx·dy·Σ qx·qy + mx·sy（整数点积用 float64 算，精确）。"""
    N, nb = blocks.shape[:2]
    d, s, q = quantize_q8_1_oracle(x)
    dx = torch.from_numpy(formats.fp16_fields(blocks, 0)[..., 0]).double()   # (N, nb)
    mx = torch.from_numpy(formats.fp16_fields(blocks, 2)[..., 0]).double()
    qx = torch.from_numpy(formats.q4_1_nibbles(blocks[..., 4:]).astype(np.float64))   # (N, nb, 32)
    dots = torch.einsum("mbj,nbj->mnb", q.double().view(x.shape[0], nb, QK), qx)      # (M, N, nb)：精确的整数
    return (dots * dx[None] * d.double()[:, None] + mx[None] * s.double()[:, None]).sum(-1).float()
