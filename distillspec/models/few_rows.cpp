// Products of a few rows by a frozen float32, bfloat16 or int8 weight on an x86 CPU with AVX2 and FMA, at about the
// rate the memory reads the weight: a decoding step (1 row) and a verification of gamma + 1 positions (2-8 rows) of a
// target, a drafting step of an int8 draft.
// The rows and the sums are float32; a bfloat16 weight is widened to float32 in registers (exact). Where the CPU has
// AVX512-BF16 a bfloat16 weight also takes bfloat16 rows (a bfloat16 target's), multiplied in pairs. An int8 weight
// (one scale per output row) is multiplied in integers: each row of the input is rounded to 16 bits (a scale per
// row, its largest magnitude at 32767), 32 weights at a time sign-extended to 16 bits in registers and multiplied
// in pairs (vpmaddwd) into 32-bit sums, which become float32 at the end of each chunk; the product is those sums
// times the two scales. Where the CPU has AVX512-VNNI, the same sums take vpmovsxbw and vpdpwssd (chunk_int8_vnni).
// A 4-bit weight in groups of 32 inputs (an int4 draft's, a 4-bit target's) takes a layout of its own: by rows in 16
// bits through AVX512-VNNI (int4_run), by rows in 8 bits with a scale a group at AVX2 (int4_run_avx2). A 6-bit one
// (a step for each 16 inputs: a GGUF's Q6_K layers) takes AVX2's products by rows in 8 bits too (int6_run_avx2).
// Built once by distillspec/models/few_rows.py (torch.utils.cpp_extension), which documents the layout and the
// figures.
//
// The weight [N, K] is laid out once in blocks of NB output rows; each block holds its rows' inputs in chunks of KC,
// a chunk's rows one after another: [blocks][chunks][NB][kc]. A thread takes whole blocks and reads each once,
// in order. The rows' inputs are taken in tiles of up to 8 rows, and a tile's inputs for one chunk (at most
// 8 x KC floats, 16 KB) stay in the first-level cache while the chunk's NB weight rows stream past them; each weight
// vector is loaded once and multiplied into every row of the tile. Partial sums stay in vector registers within a
// weight row's chunk and in a small buffer between chunks. From two rows on, a software prefetch runs 8 KB ahead of
// the weight stream. Past two tiles of bfloat16 rows (a prompt), where the arithmetic bounds the product rather than
// the weight's reads, register blocks of 4 rows by 4 weight rows sum spans of 2,048 inputs instead (span_bf16).

#include "few_rows.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t NB = 64;   // output rows of a block
constexpr int64_t KC = 512;  // inputs of a chunk
constexpr int64_t TILE = 8;  // rows of the input multiplied together

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  s = _mm_add_ss(s, _mm_movehl_ps(sh, s));
  return _mm_cvtss_f32(s);
}

// From 2 rows on, the rows' products keep a core busy enough that the hardware prefetcher falls behind the weight's
// stream: a software prefetch PREFETCH_BYTES ahead (a few weight rows of a chunk) keeps the reads in flight. At one
// row it costs a float32 weight more than it gains; a bfloat16 one, widened in registers, gains (on a Zen 3 VM the
// 1.5B Qwen target's one-token step with its head and 6-bit layers in bfloat16 took 93-95 ms against 100-109 in one
// pair of alternating runs, 121-135 against 132-182 in another).
constexpr int64_t PREFETCH_BYTES = 8192;

template <int M, typename T>
inline void prefetch_ahead(const T* p, int64_t bytes) {
  if constexpr (M >= 2 || sizeof(T) == 2)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES + b, _MM_HINT_T0);
}

// part[r * M + m] += sum over the chunk's kc inputs of W[r, k] X[m, k], for the block's NB rows r. U independent
// accumulators per row keep the FMA units busy when M is small.
template <typename T, int M, int U>
void chunk(const T* w_chunk, const float* x, int64_t K, int64_t kc, __m256* part) {
  for (int64_t r = 0; r < NB; ++r) {
    const T* w = w_chunk + r * kc;
    __m256 acc[U][M];
    for (int m = 0; m < M; ++m) acc[0][m] = part[r * M + m];
    for (int u = 1; u < U; ++u)
      for (int m = 0; m < M; ++m) acc[u][m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 * U <= kc; k += 8 * U) {
      prefetch_ahead<M>(w + k, 8 * U * sizeof(T));
      for (int u = 0; u < U; ++u) {
        __m256 wv = load8(w + k + 8 * u);
        for (int m = 0; m < M; ++m)
          acc[u][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k + 8 * u), acc[u][m]);
      }
    }
    for (; k < kc; k += 8) {
      __m256 wv = load8(w + k);
      for (int m = 0; m < M; ++m) acc[0][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[0][m]);
    }
    for (int m = 0; m < M; ++m) {
      __m256 s = acc[0][m];
      for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[u][m]);
      part[r * M + m] = s;
    }
  }
}

template <typename T>
void chunk_rows(int64_t rows, const T* w_chunk, const float* x, int64_t K, int64_t kc, __m256* part) {
  switch (rows) {
    case 1: chunk<T, 1, 4>(w_chunk, x, K, kc, part); break;
    case 2: chunk<T, 2, 4>(w_chunk, x, K, kc, part); break;
    case 3: chunk<T, 3, 2>(w_chunk, x, K, kc, part); break;
    case 4: chunk<T, 4, 2>(w_chunk, x, K, kc, part); break;
    case 5: chunk<T, 5, 2>(w_chunk, x, K, kc, part); break;
    case 6: chunk<T, 6, 2>(w_chunk, x, K, kc, part); break;
    case 7: chunk<T, 7, 1>(w_chunk, x, K, kc, part); break;
    default: chunk<T, 8, 1>(w_chunk, x, K, kc, part); break;
  }
}

// The int8 form of chunk: x holds the tile's rows in 16 bits, each group of 32 inputs as its 16 even inputs, then its
// 16 odd ones, to match the weights' even and odd bytes as one 32-byte load sign-extends them in place (two shifts
// and one). 32-bit sums cannot overflow within a chunk: a lane sums 64 of its 512 products, each at most 128 x 32767.
template <int M, int U>
void chunk_int8(const int8_t* w_chunk, const int16_t* x, int64_t K, int64_t kc, __m256* part) {
  for (int64_t r = 0; r < NB; ++r) {
    const int8_t* w = w_chunk + r * kc;
    __m256i acc[U][M];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < M; ++m) acc[u][m] = _mm256_setzero_si256();
    auto step = [&](int64_t k, int u) {
      __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
      __m256i odd = _mm256_srai_epi16(wv, 8), even = _mm256_srai_epi16(_mm256_slli_epi16(wv, 8), 8);
      for (int m = 0; m < M; ++m) {
        const __m256i* xv = reinterpret_cast<const __m256i*>(x + m * K + k);
        __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(even, _mm256_loadu_si256(xv)),
                                       _mm256_madd_epi16(odd, _mm256_loadu_si256(xv + 1)));
        acc[u][m] = _mm256_add_epi32(acc[u][m], sum);
      }
    };
    int64_t k = 0;
    for (; k + 32 * U <= kc; k += 32 * U) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k + 2048), _MM_HINT_T0);  // the stream, a few rows ahead
      for (int u = 0; u < U; ++u) step(k + 32 * u, u);
    }
    for (; k < kc; k += 32) step(k, 0);
    for (int m = 0; m < M; ++m) {
      __m256i s = acc[0][m];
      for (int u = 1; u < U; ++u) s = _mm256_add_epi32(s, acc[u][m]);
      part[r * M + m] = _mm256_add_ps(part[r * M + m], _mm256_cvtepi32_ps(s));
    }
  }
}

void chunk_rows(int64_t rows, const int8_t* w_chunk, const int16_t* x, int64_t K, int64_t kc, __m256* part) {
  switch (rows) {
    case 1: chunk_int8<1, 2>(w_chunk, x, K, kc, part); break;
    case 2: chunk_int8<2, 2>(w_chunk, x, K, kc, part); break;
    case 3: chunk_int8<3, 1>(w_chunk, x, K, kc, part); break;
    case 4: chunk_int8<4, 1>(w_chunk, x, K, kc, part); break;
    case 5: chunk_int8<5, 1>(w_chunk, x, K, kc, part); break;
    case 6: chunk_int8<6, 1>(w_chunk, x, K, kc, part); break;
    case 7: chunk_int8<7, 1>(w_chunk, x, K, kc, part); break;
    default: chunk_int8<8, 1>(w_chunk, x, K, kc, part); break;
  }
}

// bfloat16 rows by a bfloat16 weight on a CPU with AVX512-BF16 (compiled for it alone, called only where the CPU has
// it): vdpbf16ps multiplies 32 weights by 32 inputs in pairs into 16 float32 sums, the products exact, so the rows
// stay bfloat16 as the model computes them and a chunk's tile of inputs takes half the first-level cache of float32
// rows. A chunk's tail (kc a multiple of 8) is loaded under a mask. The sums of a row are folded to 8 lanes into part.
// (DISTILLSPEC_AVX512_EXTENSIONS: a compiler that knows it.)
#ifdef DISTILLSPEC_AVX512_EXTENSIONS
#define DISTILLSPEC_BF16_ROWS 1
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

template <int M, int U>
BF16_TARGET void chunk_bf16(const uint16_t* w_chunk, const uint16_t* x, int64_t K, int64_t kc, __m256* part) {
  for (int64_t r = 0; r < NB; ++r) {
    const uint16_t* w = w_chunk + r * kc;
    __m512 acc[U][M];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < M; ++m) acc[u][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 * U <= kc; k += 32 * U)
      for (int u = 0; u < U; ++u) {
        const __m512i wv = _mm512_loadu_si512(w + k + 32 * u);
        prefetch_ahead<M>(w + k + 32 * u, 64);
        for (int m = 0; m < M; ++m)
          acc[u][m] = _mm512_dpbf16_ps(acc[u][m], (__m512bh)wv, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * u));
      }
    for (; k < kc; k += 32) {
      const __mmask32 mask = kc - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (kc - k)) - 1;
      const __m512i wv = _mm512_maskz_loadu_epi16(mask, w + k);
      for (int m = 0; m < M; ++m)
        acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)wv, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k));
    }
    for (int m = 0; m < M; ++m) {
      __m512 s = acc[0][m];
      for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[u][m]);
      const __m256 folded = _mm256_add_ps(_mm512_castps512_ps256(s),
                                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
      part[r * M + m] = _mm256_add_ps(part[r * M + m], folded);
    }
  }
}

BF16_TARGET void chunk_rows(int64_t rows, const uint16_t* w_chunk, const at::BFloat16* xs, int64_t K, int64_t kc,
                            __m256* part) {
  const uint16_t* x = reinterpret_cast<const uint16_t*>(xs);
  switch (rows) {
    case 1: chunk_bf16<1, 4>(w_chunk, x, K, kc, part); break;
    case 2: chunk_bf16<2, 4>(w_chunk, x, K, kc, part); break;
    case 3: chunk_bf16<3, 2>(w_chunk, x, K, kc, part); break;
    case 4: chunk_bf16<4, 2>(w_chunk, x, K, kc, part); break;
    case 5: chunk_bf16<5, 2>(w_chunk, x, K, kc, part); break;
    case 6: chunk_bf16<6, 2>(w_chunk, x, K, kc, part); break;
    case 7: chunk_bf16<7, 2>(w_chunk, x, K, kc, part); break;
    default: chunk_bf16<8, 2>(w_chunk, x, K, kc, part); break;
  }
}

// More bfloat16 rows than two tiles (a prompt's), where the products are bound by arithmetic, not by the weight's
// reads: a register block of R weight rows by M input rows sums inputs [s0, s1) (whole chunks) in registers, each
// step's M input vectors loaded once for all R weight rows (M + R loads for M x R products, against M + 1 for M of
// a tile), and its sums are written to ys (the first span) or added there.
template <int M, int R>
BF16_TARGET void span_bf16(const uint16_t* block, const uint16_t* x, int64_t K, int64_t s0, int64_t s1, int64_t r0,
                           int64_t r_end, float* ys, int64_t N, bool first) {
  __m512 acc[R][M];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) acc[i][m] = _mm512_setzero_ps();
  for (int64_t c0 = s0; c0 < s1; c0 += KC) {
    const int64_t kc = std::min(KC, K - c0);
    const uint16_t* w = block + c0 * NB + r0 * kc;
    const uint16_t* xc = x + c0;
    int64_t k = 0;
    for (; k + 32 <= kc; k += 32) {
      __m512i xv[M];
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512(xc + m * K + k);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const __m512i wv = _mm512_loadu_si512(w + i * kc + k);
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) acc[i][m] = _mm512_dpbf16_ps(acc[i][m], (__m512bh)wv, (__m512bh)xv[m]);
      }
    }
    if (k < kc) {  // the chunk's tail, under a mask
      const __mmask32 mask = (__mmask32(1) << (kc - k)) - 1;
      __m512i xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm512_maskz_loadu_epi16(mask, xc + m * K + k);
      for (int i = 0; i < R; ++i) {
        const __m512i wv = _mm512_maskz_loadu_epi16(mask, w + i * kc + k);
        for (int m = 0; m < M; ++m) acc[i][m] = _mm512_dpbf16_ps(acc[i][m], (__m512bh)wv, (__m512bh)xv[m]);
      }
    }
  }
  for (int i = 0; i < R && r0 + i < r_end; ++i)
    for (int m = 0; m < M; ++m) {
      const float sum = _mm512_reduce_add_ps(acc[i][m]);
      ys[m * N + r0 + i] = first ? sum : ys[m * N + r0 + i] + sum;
    }
}

constexpr int64_t SPAN = 2048;  // inputs summed in registers (whole chunks): a block's span of weights stays in L2
constexpr int64_t SPAN_ROWS = 4, SPAN_OUTPUTS = 4;  // the register block of span_bf16 (NB a multiple of SPAN_OUTPUTS)

// ys [M, N] = xs [M, K] times W's transpose for many bfloat16 rows: a thread takes whole blocks; in each, span by
// span, register blocks of SPAN_ROWS rows by SPAN_OUTPUTS weight rows.
BF16_TARGET void multiply_bf16_rows(const uint16_t* W, const at::BFloat16* xs_in, float* ys, int64_t M, int64_t K,
                                    int64_t N) {
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xs_in);
  const int64_t blocks = (N + NB - 1) / NB;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* block = W + b * NB * K;
      const int64_t r_end = std::min(NB, N - b * NB);
      for (int64_t s0 = 0; s0 < K; s0 += SPAN) {
        const int64_t s1 = std::min(K, s0 + SPAN);
        for (int64_t t = 0; t < M; t += SPAN_ROWS) {
          const uint16_t* x = xs + t * K;
          float* y = ys + t * N + b * NB;
          for (int64_t r0 = 0; r0 < r_end; r0 += SPAN_OUTPUTS) {
            switch (std::min(SPAN_ROWS, M - t)) {
              case 1: span_bf16<1, SPAN_OUTPUTS>(block, x, K, s0, s1, r0, r_end, y, N, s0 == 0); break;
              case 2: span_bf16<2, SPAN_OUTPUTS>(block, x, K, s0, s1, r0, r_end, y, N, s0 == 0); break;
              case 3: span_bf16<3, SPAN_OUTPUTS>(block, x, K, s0, s1, r0, r_end, y, N, s0 == 0); break;
              default: span_bf16<4, SPAN_OUTPUTS>(block, x, K, s0, s1, r0, r_end, y, N, s0 == 0); break;
            }
          }
        }
      }
    }
  });
}
#endif

// An int8 weight by rows in 16 bits on a CPU with AVX512-VNNI (compiled for it alone, called only where the CPU has
// it): 32 weights sign-extended to 16 bits in one instruction (vpmovsxbw), multiplied by 32 inputs in pairs and
// summed into 16 lanes of 32 bits in another (vpdpwssd), so the rows stay in their natural order (Natural16). The
// integer sums are those of chunk_int8; a lane sums 32 of a chunk's 512 products. (A compiler that knows it.)
#ifdef DISTILLSPEC_AVX512_EXTENSIONS
#define DISTILLSPEC_INT8_VNNI 1
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

enum class Natural16 : int16_t {};  // a row's 16-bit inputs in their own order (chunk_int8's are interleaved)

template <int M, int U>
VNNI_TARGET void chunk_int8_vnni(const int8_t* w_chunk, const int16_t* x, int64_t K, int64_t kc, __m256* part) {
  for (int64_t r = 0; r < NB; ++r) {
    const int8_t* w = w_chunk + r * kc;
    __m512i acc[U][M];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < M; ++m) acc[u][m] = _mm512_setzero_si512();
    for (int64_t k = 0; k < kc; k += 32 * U) {  // kc a multiple of 32 * U: chunk_rows sees to it
      prefetch_ahead<M>(w + k, 32 * U);
      for (int u = 0; u < U; ++u) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k + 32 * u)));
        for (int m = 0; m < M; ++m)
          acc[u][m] = _mm512_dpwssd_epi32(acc[u][m], wv, _mm512_loadu_si512(x + m * K + k + 32 * u));
      }
    }
    for (int m = 0; m < M; ++m) {
      __m512i s = acc[0][m];
      for (int u = 1; u < U; ++u) s = _mm512_add_epi32(s, acc[u][m]);
      const __m256i folded = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
      part[r * M + m] = _mm256_add_ps(part[r * M + m], _mm256_cvtepi32_ps(folded));
    }
  }
}

template <int U>
VNNI_TARGET void chunk_rows_vnni(int64_t rows, const int8_t* w_chunk, const int16_t* x, int64_t K, int64_t kc,
                                 __m256* part) {
  switch (rows) {
    case 1: chunk_int8_vnni<1, U>(w_chunk, x, K, kc, part); break;
    case 2: chunk_int8_vnni<2, U>(w_chunk, x, K, kc, part); break;
    case 3: chunk_int8_vnni<3, U>(w_chunk, x, K, kc, part); break;
    case 4: chunk_int8_vnni<4, U>(w_chunk, x, K, kc, part); break;
    case 5: chunk_int8_vnni<5, U>(w_chunk, x, K, kc, part); break;
    case 6: chunk_int8_vnni<6, U>(w_chunk, x, K, kc, part); break;
    case 7: chunk_int8_vnni<7, U>(w_chunk, x, K, kc, part); break;
    default: chunk_int8_vnni<8, U>(w_chunk, x, K, kc, part); break;
  }
}

VNNI_TARGET void chunk_rows(int64_t rows, const int8_t* w_chunk, const Natural16* xs, int64_t K, int64_t kc,
                            __m256* part) {
  const int16_t* x = reinterpret_cast<const int16_t*>(xs);
  if (kc % 64)  // 32 inputs a step (K's last chunk)
    chunk_rows_vnni<1>(rows, w_chunk, x, K, kc, part);
  else
    chunk_rows_vnni<2>(rows, w_chunk, x, K, kc, part);
}
#endif

// A 4-bit weight in groups of 32 inputs (each group of an output row with its own scale s and zero point z, a weight
// (q - 8) s + z for its code q in 0-15: an int4 draft's) by rows in 16 bits on a CPU with AVX512-VNNI (int4_run;
// AVX2's products, int4_run_avx2 below, take rows in 8 bits and a layout of their own). Output rows lie in the
// vectors' lanes, 16 to a vector: a unit of 32 bytes holds 16 output rows' codes for 4 inputs k to k + 3, byte 2l + j
// the codes of row l for input k + j (low nibble) and k + 2 + j (high nibble). A unit widens to 16 bits
// in one instruction, its low and high nibbles are masked and shifted apart, and vpdpwssd multiplies each by a pair
// of an input row's values broadcast to every lane: 16 output rows by 4 inputs in three instructions for the weight
// and two per input row. A group's integer sums D (at most 32 x 15 x 32767, exact in float32) then take the group's
// scales for 16 output rows at once: s D + (z - 8 s) X, X the group's sum of the input row. The weight is laid out in
// runs of 64 output rows (4 vectors' lanes, so that the sums' chains are several deep at one input row), one stream
// a run: for each group, its 8 units of the run's 4 blocks of 16 rows, then the blocks' 16 scales and 16 zero points
// (bfloat16, as torch's int4 kernel takes them): [runs][groups][8 units][4 blocks][32 bytes], [4 blocks][16 s, 16 z].
constexpr int64_t INT4_RUN = 64, INT4_BLOCKS = 4, INT4_GROUP_SIZE = 32;  // output rows of a run, its blocks of 16
constexpr int64_t INT4_UNITS = INT4_GROUP_SIZE / 4, INT4_UNIT = 32;       // a group's units of 4 inputs, their bytes
constexpr int64_t INT4_SCALES = INT4_BLOCKS * 64;                         // bytes of a run's scales for a group
constexpr int64_t INT4_RUN_GROUP = INT4_UNITS * INT4_BLOCKS * INT4_UNIT + INT4_SCALES;  // bytes of a run's group

// Bytes of a 4-bit weight [N, K] in this layout (its output rows padded to a multiple of 64).
constexpr int64_t int4_bytes(int64_t N, int64_t K) {
  return (N + INT4_RUN - 1) / INT4_RUN * (K / INT4_GROUP_SIZE) * INT4_RUN_GROUP;
}

// At AVX2 (int4_run_avx2) the rows go in 8 bits, a scale for each group of 32 inputs (its largest magnitude at
// 127), and the weight has a layout of its own: for each group, 8 eighths of the run (its output rows 8e to 8e + 7) of
// 4 pieces (its inputs 8p to 8p + 7) of 32 bytes, byte 4j + i holding the codes of output row j for input i (low
// nibble) and 4 + i (high nibble), then the same scales. A piece's nibbles, masked and shifted apart, are two vectors
// of 8 output rows by 4 inputs as unsigned bytes; vpmaddubsw multiplies each by 4 of an input row's bytes broadcast
// to every lane and sums them in pairs (at most 2 x 15 x 127, so 8 such sums hold in 16 bits), and one vpmaddwd by
// ones per group sums each row's pairs into 32 bits: 32 products an instruction where vpmaddwd alone gave 16 (on a
// Zen 3 VM, one core, a layer's products of 6 rows ran at 51 GMAC/s with 16-bit rows and vpmaddwd, at 78 with these;
// docs/MEASUREMENTS.md). A group's sum D then takes the group's scales, 8 output rows at once: c (s D + (z - 8 s) X),
// c the group's scale of the input row and X the sum of its bytes. (Integer scales of superblocks of 8 groups, as
// Q4_K's, would do the float work once a superblock, but need the rows' scale a superblock: verifications 4-9% faster,
// the target 1.3-1.6x as far from the file's model; docs/MEASUREMENTS.md.)
// Each group's every line is prefetched INT4_PREFETCH_BYTES ahead: with the hardware's prefetcher alone the products
// kept too few reads in flight (on a Zen 3 VM, 2 threads, a 4-bit step of the 0.5B Qwen draft took 31-40 ms against
// 22-24 with it, and the 1.5B target's step 130-147 ms against 105-109; docs/MEASUREMENTS.md).
constexpr int64_t INT4_PREFETCH_BYTES = 2048;
constexpr int64_t INT4_EIGHTHS = INT4_RUN / 8, INT4_PIECES = INT4_GROUP_SIZE / 8;  // 8 output rows, 8 inputs

template <int M, typename Y>
void int4_run_avx2(const uint8_t* run, const int8_t* xq, const float* xsum, const float* x_scales, Y* ys,
                   int64_t K, int64_t N, int64_t n0) {
  const int64_t G = K / INT4_GROUP_SIZE;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  float sums[M][INT4_RUN] = {};
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* group = run + g * INT4_RUN_GROUP;
    const uint16_t* sz = reinterpret_cast<const uint16_t*>(group + INT4_RUN_GROUP - INT4_SCALES);
    for (int64_t l = 0; l < INT4_RUN_GROUP; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(group) + INT4_PREFETCH_BYTES + l, _MM_HINT_T0);
    __m256i fours[M][INT4_PIECES][2];  // each row's inputs 8p .. 8p + 3 and 8p + 4 .. 8p + 7, in every lane
    for (int m = 0; m < M; ++m)
      for (int64_t p = 0; p < INT4_PIECES; ++p) {
        int32_t four[2];
        std::memcpy(four, xq + m * K + g * INT4_GROUP_SIZE + 8 * p, sizeof(four));
        fours[m][p][0] = _mm256_set1_epi32(four[0]);
        fours[m][p][1] = _mm256_set1_epi32(four[1]);
      }
    for (int64_t e = 0; e < INT4_EIGHTHS; ++e) {
      __m256i acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
      for (int64_t p = 0; p < INT4_PIECES; ++p) {
        const __m256i piece =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + (e * INT4_PIECES + p) * 32));
        const __m256i lo = _mm256_and_si256(piece, low), hi = _mm256_and_si256(_mm256_srli_epi16(piece, 4), low);
        for (int m = 0; m < M; ++m) {
          acc[m] = _mm256_add_epi16(acc[m], _mm256_maddubs_epi16(lo, fours[m][p][0]));
          acc[m] = _mm256_add_epi16(acc[m], _mm256_maddubs_epi16(hi, fours[m][p][1]));
          asm("" : "+x"(acc[m]));  // a sum in a register: the compiler's reassociated tree spilled every product
        }
      }
      const __m256 s = load8(sz + 32 * (e / 2) + 8 * (e % 2)), z = load8(sz + 32 * (e / 2) + 16 + 8 * (e % 2));
      const __m256 zero_term = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, z);  // z - 8 s
      for (int m = 0; m < M; ++m) {
        const __m256 d = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[m], ones));
        const __m256 term = _mm256_fmadd_ps(s, d, _mm256_mul_ps(zero_term, _mm256_set1_ps(xsum[m * G + g])));
        float* at = sums[m] + 8 * e;
        _mm256_storeu_ps(at, _mm256_fmadd_ps(term, _mm256_set1_ps(x_scales[m * G + g]), _mm256_loadu_ps(at)));
      }
    }
  }
  for (int64_t r = 0; r < INT4_RUN && n0 + r < N; ++r)
    for (int m = 0; m < M; ++m) ys[m * N + n0 + r] = static_cast<Y>(sums[m][r]);
}

#ifdef DISTILLSPEC_INT8_VNNI

// 16 sums stored as float32, or rounded to bfloat16 (to nearest, ties to even, as torch rounds: the rows' dtype).
VNNI_TARGET inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
VNNI_TARGET inline void store16(at::BFloat16* y, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(rounded));
}

// ys[m * N + n] for the run's 64 output rows (those below N) and up to 4 input rows m: the run's stream read once.
// At one row the low and high nibbles' sums are chained apart (8 chains), from two rows on together.
template <int M, typename Y>
VNNI_TARGET void int4_run(const uint8_t* run, const int16_t* xq, const float* xsum, const float* x_scales, Y* ys,
                          int64_t K, int64_t N, int64_t n0) {
  constexpr int SPLIT = M == 1 ? 2 : 1;
  const int64_t G = K / INT4_GROUP_SIZE;
  const __m512i low = _mm512_set1_epi16(0x0F);
  __m512 sums[INT4_BLOCKS][M];
  for (int b = 0; b < INT4_BLOCKS; ++b)
    for (int m = 0; m < M; ++m) sums[b][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* group = run + g * INT4_RUN_GROUP;
    __m512i acc[SPLIT][INT4_BLOCKS][M];
    for (int h = 0; h < SPLIT; ++h)
      for (int b = 0; b < INT4_BLOCKS; ++b)
        for (int m = 0; m < M; ++m) acc[h][b][m] = _mm512_setzero_si512();
    for (int64_t u = 0; u < INT4_UNITS; ++u) {
      __m512i xa[M], xb[M];  // inputs k, k + 1 and k + 2, k + 3 of each row, in every lane
      for (int m = 0; m < M; ++m) {
        int32_t pair[2];
        std::memcpy(pair, xq + m * K + g * INT4_GROUP_SIZE + 4 * u, sizeof(pair));
        xa[m] = _mm512_set1_epi32(pair[0]);
        xb[m] = _mm512_set1_epi32(pair[1]);
      }
      const uint8_t* units = group + u * INT4_BLOCKS * INT4_UNIT;
      _mm_prefetch(reinterpret_cast<const char*>(units) + 4096, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(units) + 4096 + 64, _MM_HINT_T0);
      for (int b = 0; b < INT4_BLOCKS; ++b) {
        const __m512i wide =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(units + b * INT4_UNIT)));
        const __m512i lo = _mm512_and_si512(wide, low), hi = _mm512_srli_epi16(wide, 4);
        for (int m = 0; m < M; ++m) {
          acc[0][b][m] = _mm512_dpwssd_epi32(acc[0][b][m], lo, xa[m]);
          acc[SPLIT - 1][b][m] = _mm512_dpwssd_epi32(acc[SPLIT - 1][b][m], hi, xb[m]);
        }
      }
    }
    const uint16_t* sz = reinterpret_cast<const uint16_t*>(group + INT4_RUN_GROUP - INT4_SCALES);
    for (int b = 0; b < INT4_BLOCKS; ++b) {
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + 32 * b))), 16));
      const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + 32 * b + 16))), 16));
      const __m512 zero_term = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, z);  // z - 8 s
      for (int m = 0; m < M; ++m) {
        __m512i d = acc[0][b][m];
        if constexpr (SPLIT == 2) d = _mm512_add_epi32(d, acc[1][b][m]);
        sums[b][m] = _mm512_fmadd_ps(zero_term, _mm512_set1_ps(xsum[m * G + g]),
                                     _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(d), sums[b][m]));
      }
    }
  }
  for (int b = 0; b < INT4_BLOCKS; ++b) {
    const int64_t n = n0 + 16 * b;
    if (n >= N) break;  // the padding of the last run
    for (int m = 0; m < M; ++m)
      store16(ys + m * N + n, _mm512_mul_ps(sums[b][m], _mm512_set1_ps(x_scales[m])));
  }
}

#endif

// A run's products for up to 4 rows through AVX512-VNNI (rows in 16 bits), or up to 8 through AVX2 (in 8 bits).
template <int M, typename X, typename Y>
void int4_run_rows(const uint8_t* run, const X* xq, const float* xsum, const float* x_scales, Y* ys, int64_t K,
                   int64_t N, int64_t n0) {
  if constexpr (std::is_same_v<X, int8_t>) {
    int4_run_avx2<M, Y>(run, xq, xsum, x_scales, ys, K, N, n0);
  } else {
#ifdef DISTILLSPEC_INT8_VNNI
    if constexpr (M <= 4) int4_run<M, Y>(run, xq, xsum, x_scales, ys, K, N, n0);
#endif
  }
}

// ys [M, N] = the rows (in 16 bits with a scale each through AVX512-VNNI, in 8 bits with a scale a group at AVX2, and
// their groups' sums) times the 4-bit weight's transpose (N a multiple of 16): a thread takes whole runs, and reads a
// run once for every 4 rows through AVX512-VNNI, every 8 at AVX2 (from its second-level cache after the first). At
// AVX2 a pass's cost was mostly the weight's: on an 8960 x 1536 layer (Zen 3, one thread) 6 rows in passes of 4 and 2
// took 1.71x the time of 4 rows, in one pass 1.25-1.32x, and the 1.5B Qwen target's 6-token step 192-288 ms against
// 259-276 (docs/MEASUREMENTS.md).
template <typename X, typename Y>
void multiply_int4(const uint8_t* W, const X* xq, const float* xsum, const float* x_scales, Y* ys, int64_t M,
                   int64_t K, int64_t N) {
  const int64_t runs = (N + INT4_RUN - 1) / INT4_RUN, G = K / INT4_GROUP_SIZE;
  constexpr bool avx2 = std::is_same_v<X, int8_t>;
  const int64_t most = avx2 ? 8 : 4;  // rows a pass over a run takes (AVX2: 8, whose 8 sums fit its 16 registers)
  const int64_t scales_a_row = avx2 ? G : 1;
  at::parallel_for(0, runs, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* run = W + r * G * INT4_RUN_GROUP;
      for (int64_t m0 = 0; m0 < M; m0 += most) {
        const X* x = xq + m0 * K;
        const float* sum = xsum + m0 * G;
        const float* scale = x_scales + m0 * scales_a_row;
        Y* y = ys + m0 * N;
        switch (std::min<int64_t>(most, M - m0)) {
          case 1: int4_run_rows<1, X, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
          case 2: int4_run_rows<2, X, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
          case 3: int4_run_rows<3, X, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
          case 4: int4_run_rows<4, X, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
          case 5: int4_run_rows<5, X, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
          case 6: int4_run_rows<6, X, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
          case 7: int4_run_rows<7, X, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
          default: int4_run_rows<8, X, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
        }
      }
    }
  });
}

// The largest of 8 floats.
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// The largest magnitude of count values (a multiple of 8), NaNs passed over: as a scalar std::max would.
template <typename T>
inline float peak_of(const T* x, int64_t count) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 peak = _mm256_setzero_ps();
  for (int64_t k = 0; k < count; k += 8) peak = _mm256_max_ps(_mm256_and_ps(load8(x + k), magnitude), peak);
  return hmax(peak);
}

// 8 values times inverse, to the nearest integer (ties to even, as lrintf in the default rounding mode).
template <typename T>
inline __m256i rounded8(const T* x, __m256 inverse) {
  return _mm256_cvtps_epi32(_mm256_mul_ps(load8(x), inverse));
}

// Rows' groups of 32 inputs (count of them, one after another) in 8 bits, as int4_run_avx2 reads them: each group's
// scale (its largest magnitude at 127) and the sum of its bytes; where halves is given, also each 16 inputs' sum of
// bytes times 32 (int6_run_avx2's). Vectors of 8 throughout: rounded by lrintf a value at a time (4.3 ns a value on a
// Zen 3 VM, against 0.3), the 1.5B Qwen target's rows made its 6-token verification take 77-79 ms against 66-70 and a
// forward pass of 160 tokens 2.0-2.3 s against 1.8 (docs/MEASUREMENTS.md).
template <typename T>
void round_groups(const T* x, int8_t* xq, float* scales, float* sums, int64_t count, int32_t* halves = nullptr) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the packs interleave 128-bit lanes
  for (int64_t c = 0; c < count; ++c) {
    const T* group = x + c * INT4_GROUP_SIZE;
    const float peak = peak_of(group, INT4_GROUP_SIZE);
    const float scale = peak > 0.0f ? peak / 127.0f : 1.0f;
    const __m256 inverse = _mm256_set1_ps(1.0f / scale);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = rounded8(group + 8 * i, inverse);
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + c * INT4_GROUP_SIZE),
                        _mm256_permutevar8x32_epi32(bytes, order));
    const __m256i low = _mm256_add_epi32(q[0], q[1]), high = _mm256_add_epi32(q[2], q[3]);
    const __m128i low4 = _mm_add_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1));
    const __m128i high4 = _mm_add_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
    const __m128i pairs = _mm_hadd_epi32(low4, high4);
    const __m128i half = _mm_hadd_epi32(pairs, pairs);  // [low, high, low, high]
    const int32_t first = _mm_cvtsi128_si32(half), second = _mm_extract_epi32(half, 1);
    scales[c] = scale;
    sums[c] = static_cast<float>(first + second);
    if (halves) {
      halves[2 * c] = 32 * first;
      halves[2 * c + 1] = 32 * second;
    }
  }
}

// A weight on 6-bit grids of 16 inputs (each 16 inputs of an output row with a step s of their own, a weight
// (q - 32) s for its code q in 0-63: llama.cpp's Q6_K layers, dequantized, lie on such grids) takes AVX2's products
// with its codes a byte each: rows in 8 bits with a scale for each group of 32 inputs (round_groups), as a 4-bit
// weight's at AVX2. Per run of 64 output rows and group of 32 inputs, each eighth of the run (output rows 8e to
// 8e + 7) holds 8 pieces (inputs 4p to 4p + 3) of 32 bytes, byte 4j + i the code of output row j for input 4p + i,
// then the eighth's steps (float32, exact: the file's d times its 8-bit scale), 8 output rows for inputs 0-15, 8 for
// 16-31. vpmaddubsw multiplies a piece by 4 of an input row's bytes broadcast to every lane and sums them in pairs (at
// most 2 x 63 x 127, so two pieces' sums hold in 16 bits); vpmaddwd by ones sums two pieces' pairs into 32 bits. A
// half's sum D then takes its step, 8 output rows at once: c s (D - 32 X), c the group's scale of the input row and X
// the sum of its bytes over the 16 inputs. (Codes in 6 bits read a fifth less, but their unpacking made a
// verification's 6-bit products 4-14% slower; docs/MEASUREMENTS.md.)
constexpr int64_t INT6_PIECES = INT4_GROUP_SIZE / 4;                 // a group's pieces of 4 inputs
constexpr int64_t INT6_EIGHTH = INT6_PIECES * 32 + 2 * 8 * 4;        // an eighth's codes, then its 2 x 8 steps
constexpr int64_t INT6_RUN_GROUP = INT4_EIGHTHS * INT6_EIGHTH;       // bytes of a run's group
constexpr int64_t INT6_PREFETCH_BYTES = 2048;

// Bytes of a 6-bit weight [N, K] in this layout (its output rows padded to a multiple of 64).
constexpr int64_t int6_bytes(int64_t N, int64_t K) {
  return (N + INT4_RUN - 1) / INT4_RUN * (K / INT4_GROUP_SIZE) * INT6_RUN_GROUP;
}

// ys[m * N + n] for the run's 64 output rows (those below N) and up to 8 input rows m (in 8 bits, xq; each group's
// scale x_scales [M, K / 32] and each 16 inputs' sum of bytes times 32, x32 [M, K / 16]): the run's stream read once.
template <int M, typename Y>
void int6_run_avx2(const uint8_t* run, const int8_t* xq, const int32_t* x32, const float* x_scales, Y* ys, int64_t K,
                   int64_t N, int64_t n0) {
  const int64_t G = K / INT4_GROUP_SIZE;
  const __m256i ones = _mm256_set1_epi16(1);
  float sums[M][INT4_RUN] = {};
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* group = run + g * INT6_RUN_GROUP;
    __m256i fours[M][INT6_PIECES];  // each row's inputs 4p .. 4p + 3, in every lane
    for (int m = 0; m < M; ++m)
      for (int64_t p = 0; p < INT6_PIECES; ++p) {
        int32_t four;
        std::memcpy(&four, xq + m * K + g * INT4_GROUP_SIZE + 4 * p, sizeof(four));
        fours[m][p] = _mm256_set1_epi32(four);
      }
    for (int64_t e = 0; e < INT4_EIGHTHS; ++e) {
      const uint8_t* eighth = group + e * INT6_EIGHTH;
      for (int64_t l = 0; l < INT6_EIGHTH; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(eighth) + INT6_PREFETCH_BYTES + l, _MM_HINT_T0);
      const float* steps = reinterpret_cast<const float*>(eighth + INT6_PIECES * 32);
      __m256i acc[2][M];
      for (int h = 0; h < 2; ++h) {
        for (int64_t q = 0; q < 2; ++q) {
          const int64_t p = 4 * h + 2 * q;
          const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(eighth + p * 32));
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(eighth + (p + 1) * 32));
          for (int m = 0; m < M; ++m) {
            const __m256i pairs =
                _mm256_add_epi16(_mm256_maddubs_epi16(a, fours[m][p]), _mm256_maddubs_epi16(b, fours[m][p + 1]));
            const __m256i wide = _mm256_madd_epi16(pairs, ones);
            acc[h][m] = q ? _mm256_add_epi32(acc[h][m], wide) : wide;
            asm("" : "+x"(acc[h][m]));  // a sum in a register, as int4_run_avx2's
          }
        }
      }
      const __m256 s0 = _mm256_loadu_ps(steps), s1 = _mm256_loadu_ps(steps + 8);
      for (int m = 0; m < M; ++m) {
        const __m256 d0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[0][m], _mm256_set1_epi32(x32[m * 2 * G + 2 * g])));
        const __m256 d1 =
            _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[1][m], _mm256_set1_epi32(x32[m * 2 * G + 2 * g + 1])));
        const __m256 term = _mm256_fmadd_ps(s1, d1, _mm256_mul_ps(s0, d0));
        float* at = sums[m] + 8 * e;
        _mm256_storeu_ps(at, _mm256_fmadd_ps(term, _mm256_set1_ps(x_scales[m * G + g]), _mm256_loadu_ps(at)));
      }
    }
  }
  for (int64_t r = 0; r < INT4_RUN && n0 + r < N; ++r)
    for (int m = 0; m < M; ++m) ys[m * N + n0 + r] = static_cast<Y>(sums[m][r]);
}

// ys [M, N] = the rows (in 8 bits, a scale a group of 32 inputs) times the 6-bit weight's transpose: a thread takes
// whole runs, and reads a run once for every 8 rows (from its second-level cache after the first).
template <typename Y>
void multiply_int6(const uint8_t* W, const int8_t* xq, const int32_t* x32, const float* x_scales, Y* ys, int64_t M,
                   int64_t K, int64_t N) {
  const int64_t runs = (N + INT4_RUN - 1) / INT4_RUN, G = K / INT4_GROUP_SIZE;
  at::parallel_for(0, runs, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* run = W + r * G * INT6_RUN_GROUP;
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int8_t* x = xq + m0 * K;
        const int32_t* sum = x32 + m0 * 2 * G;
        const float* scale = x_scales + m0 * G;
        Y* y = ys + m0 * N;
        switch (std::min<int64_t>(8, M - m0)) {
          case 1: int6_run_avx2<1, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
          case 2: int6_run_avx2<2, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
          case 3: int6_run_avx2<3, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
          case 4: int6_run_avx2<4, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
          case 5: int6_run_avx2<5, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
          case 6: int6_run_avx2<6, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
          case 7: int6_run_avx2<7, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
          default: int6_run_avx2<8, Y>(run, x, sum, scale, y, K, N, r * INT4_RUN); break;
        }
      }
    }
  });
}

// Lanes 0, 2, 4, 6 (IMM 0x88) or 1, 3, 5, 7 (IMM 0xDD) of a and then of b, in order.
template <int IMM>
inline __m256i alternate_lanes(__m256i a, __m256i b) {
  const __m256 lanes = _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), IMM);  // within 128 bits
  return _mm256_permutevar8x32_epi32(_mm256_castps_si256(lanes), _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

// Rows [M, K] of float32 in 16 bits, as chunk_int8 reads them (K a multiple of 32; interleaved: each 32 inputs' even
// ones, then their odd ones) or chunk_int8_vnni (natural), and each row's scale; vectors of 8, as round_groups.
template <typename T>
void round_rows(const T* x, int16_t* xq, float* scales, int64_t M, int64_t K, bool interleaved = true) {
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * K;
    const float peak = peak_of(row, K);
    const float scale = peak > 0.0f ? peak / 32767.0f : 1.0f;
    const __m256 inverse = _mm256_set1_ps(1.0f / scale);
    scales[m] = scale;
    int16_t* out = xq + m * K;
    for (int64_t k = 0; k < K; k += 32) {
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = rounded8(row + k + 8 * i, inverse);
      __m256i first, second;  // inputs k .. k + 15 and k + 16 .. k + 31, or the even ones and the odd ones
      if (interleaved) {
        first = _mm256_packs_epi32(alternate_lanes<0x88>(q[0], q[1]), alternate_lanes<0x88>(q[2], q[3]));
        second = _mm256_packs_epi32(alternate_lanes<0xDD>(q[0], q[1]), alternate_lanes<0xDD>(q[2], q[3]));
      } else {
        first = _mm256_packs_epi32(q[0], q[1]);
        second = _mm256_packs_epi32(q[2], q[3]);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), _mm256_permute4x64_epi64(first, 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k + 16), _mm256_permute4x64_epi64(second, 0xD8));
    }
  }
}

template <typename T>
void pack_blocks(const T* src, T* dst, int64_t N, int64_t K) {
  const int64_t blocks = (N + NB - 1) / NB;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c0 = 0; c0 < K; c0 += KC) {
        const int64_t kc = std::min(KC, K - c0);
        for (int64_t r = 0; r < NB && b * NB + r < N; ++r)
          std::memcpy(dst + b * NB * K + c0 * NB + r * kc, src + (b * NB + r) * K + c0, kc * sizeof(T));
      }
  });
}

// ys [M, N] = xs [M, K] times W's transpose; with row_scales (an int8 weight's, [N]) and x_scales (its rows', [M])
// each sum is multiplied by both.
template <typename T, typename X>
void multiply(const T* W, const X* xs, float* ys, int64_t M, int64_t K, int64_t N, const float* row_scales = nullptr,
              const float* x_scales = nullptr) {
  const int64_t blocks = (N + NB - 1) / NB, tiles = (M + TILE - 1) / TILE;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<__m256> part(tiles * NB * TILE);
    for (int64_t b = b0; b < b1; ++b) {
      std::fill(part.begin(), part.end(), _mm256_setzero_ps());
      const T* block = W + b * NB * K;
      for (int64_t c0 = 0; c0 < K; c0 += KC)
        for (int64_t t = 0; t < tiles; ++t)
          chunk_rows(std::min(TILE, M - TILE * t), block + c0 * NB, xs + TILE * t * K + c0, K, std::min(KC, K - c0),
                     part.data() + t * NB * TILE);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t rows = std::min(TILE, M - TILE * t);
        for (int64_t r = 0; r < NB && b * NB + r < N; ++r)
          for (int64_t m = 0; m < rows; ++m) {
            float y = hsum(part[t * NB * TILE + r * rows + m]);
            if (row_scales) y *= row_scales[b * NB + r] * x_scales[TILE * t + m];
            ys[(TILE * t + m) * N + b * NB + r] = y;
          }
      }
    }
  });
}

}  // namespace

// Whether this CPU has AVX512-BF16, which bfloat16 rows take (by a bfloat16 weight).
bool bf16_rows_supported() {
#ifdef DISTILLSPEC_BF16_ROWS
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// Whether this CPU has AVX512-VNNI, which an int8 weight's products then take (else AVX2's);
// DISTILLSPEC_INT8_VNNI=0 keeps AVX2's (a comparison).
bool int8_vnni_supported() {
#ifdef DISTILLSPEC_INT8_VNNI
  static const bool supported = [] {
    const char* off = std::getenv("DISTILLSPEC_INT8_VNNI");
    return !(off && std::string(off) == "0") && __builtin_cpu_supports("avx512vnni");
  }();
  return supported;
#else
  return false;
#endif
}

// The weight [N, K] (float32 or bfloat16, K a multiple of 8; int8, K a multiple of 32) in the blocked layout, its rows
// past N zero.
at::Tensor pack(const at::Tensor& weight) {
  const auto type = weight.scalar_type();
  const bool bf16 = type == at::kBFloat16, int8 = type == at::kChar;
  TORCH_CHECK(weight.dim() == 2 && (bf16 || int8 || type == at::kFloat) && weight.device().is_cpu(),
              "few_rows.pack takes a 2-d float32, bfloat16 or int8 CPU weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % (int8 ? 32 : 8) == 0, "few_rows.pack takes inputs in multiples of ", int8 ? 32 : 8, ", not ", K);
  auto packed = at::zeros({(N + NB - 1) / NB * NB * K}, weight.options());
  auto dense = weight.contiguous();
  if (int8)
    pack_blocks(dense.data_ptr<int8_t>(), packed.data_ptr<int8_t>(), N, K);
  else if (bf16)
    pack_blocks(reinterpret_cast<const uint16_t*>(dense.data_ptr<at::BFloat16>()),
                reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>()), N, K);
  else
    pack_blocks(dense.data_ptr<float>(), packed.data_ptr<float>(), N, K);
  return packed;
}

// Whether this CPU takes 4-bit weights: every CPU the kernel runs on (AVX2), through AVX512-VNNI where it has it
// (int8_vnni_supported; DISTILLSPEC_INT8_VNNI=0 keeps AVX2's products for them too).
bool int4_supported() { return true; }

// A 4-bit weight's codes [N, K] (0-15, any integer type; N a multiple of 16, K of 32) and its groups' scales and zero
// points [K / 32, N, 2] (bfloat16, torch's layout) in the layout of int4_run: one uint8 tensor, its padding zero.
at::Tensor pack_int4(const at::Tensor& codes, const at::Tensor& scales_zeros) {
  TORCH_CHECK(codes.dim() == 2 && codes.device().is_cpu(), "few_rows.pack_int4 takes 2-d CPU codes");
  const int64_t N = codes.size(0), K = codes.size(1), G = K / INT4_GROUP_SIZE;
  TORCH_CHECK(N % 16 == 0 && K % INT4_GROUP_SIZE == 0, "few_rows.pack_int4 takes outputs in multiples of 16 and ",
              "inputs in multiples of ", INT4_GROUP_SIZE, ", not ", N, " x ", K);
  TORCH_CHECK(scales_zeros.scalar_type() == at::kBFloat16 && scales_zeros.dim() == 3 && scales_zeros.size(0) == G &&
                  scales_zeros.size(1) == N && scales_zeros.size(2) == 2,
              "few_rows.pack_int4 takes bfloat16 scales and zero points [K / 32, N, 2]");
  auto q = codes.to(at::kByte).contiguous();
  auto sz = scales_zeros.contiguous();
  auto packed = at::zeros({int4_bytes(N, K)}, codes.options().dtype(at::kByte));
  const uint8_t* src = q.data_ptr<uint8_t>();
  const uint16_t* sz_src = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const bool vnni = int8_vnni_supported();  // the layout of the products that run here
  at::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {  // block b: run b / 4, its (b % 4)th block
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* group = dst + ((b / INT4_BLOCKS) * G + g) * INT4_RUN_GROUP;
        for (int64_t l = 0; l < 16; ++l) {
          const uint8_t* row = src + (b * 16 + l) * K + g * INT4_GROUP_SIZE;
          if (vnni) {
            for (int64_t u = 0; u < INT4_UNITS; ++u) {
              uint8_t* unit = group + (u * INT4_BLOCKS + b % INT4_BLOCKS) * INT4_UNIT;
              for (int64_t j = 0; j < 2; ++j)
                unit[2 * l + j] = (row[4 * u + j] & 0x0F) | ((row[4 * u + 2 + j] & 0x0F) << 4);
            }
          } else {  // eighth 2 (b % 4) + l / 8 of the run, its row l % 8
            const int64_t e = 2 * (b % INT4_BLOCKS) + l / 8;
            for (int64_t p = 0; p < INT4_PIECES; ++p) {
              uint8_t* piece = group + (e * INT4_PIECES + p) * 32 + 4 * (l % 8);
              for (int64_t i = 0; i < 4; ++i)
                piece[i] = (row[8 * p + i] & 0x0F) | ((row[8 * p + 4 + i] & 0x0F) << 4);
            }
          }
        }
        uint16_t* scales = reinterpret_cast<uint16_t*>(group + INT4_RUN_GROUP - INT4_SCALES) + 32 * (b % INT4_BLOCKS);
        for (int64_t l = 0; l < 16; ++l)
          for (int64_t half = 0; half < 2; ++half) scales[16 * half + l] = sz_src[(g * N + b * 16 + l) * 2 + half];
      }
    }
  });
  return packed;
}

// A 6-bit weight's codes [N, K] (0-63, any integer type; K a multiple of 32) and its steps [N, K / 16] (float32; each
// weight (code - 32) step) in the layout of int6_run_avx2: a uint8 tensor [runs x groups, INT6_RUN_GROUP] (a 4-bit
// weight's is flat: matmul tells them apart so), its padding zero.
at::Tensor pack_int6(const at::Tensor& codes, const at::Tensor& steps) {
  TORCH_CHECK(codes.dim() == 2 && codes.device().is_cpu(), "few_rows.pack_int6 takes 2-d CPU codes");
  const int64_t N = codes.size(0), K = codes.size(1), G = K / INT4_GROUP_SIZE;
  TORCH_CHECK(K % INT4_GROUP_SIZE == 0, "few_rows.pack_int6 takes inputs in multiples of ", INT4_GROUP_SIZE, ", not ",
              K);
  TORCH_CHECK(steps.scalar_type() == at::kFloat && steps.dim() == 2 && steps.size(0) == N && steps.size(1) == 2 * G,
              "few_rows.pack_int6 takes float32 steps [N, K / 16]");
  auto q = codes.to(at::kByte).contiguous();
  auto s = steps.contiguous();
  auto packed = at::zeros({int6_bytes(N, K) / INT6_RUN_GROUP, INT6_RUN_GROUP}, codes.options().dtype(at::kByte));
  const uint8_t* src = q.data_ptr<uint8_t>();
  const float* step = s.data_ptr<float>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {  // run n / 64, its eighth (n % 64) / 8, row n % 8 of it
      const int64_t e = (n % INT4_RUN) / 8, j = n % 8;
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* eighth = dst + ((n / INT4_RUN) * G + g) * INT6_RUN_GROUP + e * INT6_EIGHTH;
        const uint8_t* row = src + n * K + g * INT4_GROUP_SIZE;
        for (int64_t p = 0; p < INT6_PIECES; ++p)
          for (int64_t i = 0; i < 4; ++i) eighth[p * 32 + 4 * j + i] = row[4 * p + i];
        float* steps_at = reinterpret_cast<float*>(eighth + INT6_PIECES * 32);
        steps_at[j] = step[n * 2 * G + 2 * g];
        steps_at[8 + j] = step[n * 2 * G + 2 * g + 1];
      }
    }
  });
  return packed;
}

// A weight [N, K] (float32; K a multiple of 32) on 6-bit grids of 16 inputs, as packing.int6_grid defines them: its
// codes [N, K] (uint8, 0-63) and steps [N, K / 16] (float32), each weight (code - 32) step; nothing where a group lies
// on no such grid. Each group is tried on its largest magnitude over 32 levels, then 31, ... 1 (a weight counts as on
// a grid within tolerance of a step), its codes -32 to 31 on a step of either sign.
std::optional<std::tuple<at::Tensor, at::Tensor>> int6_grid(const at::Tensor& weight, double tolerance) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "few_rows.int6_grid takes a 2-d float32 CPU weight");
  const int64_t N = weight.size(0), K = weight.size(1), groups = N * K / 16;
  if (K % INT4_GROUP_SIZE || N == 0) return std::nullopt;
  auto w = weight.contiguous();
  auto codes = at::empty({N, K}, w.options().dtype(at::kByte));
  auto steps = at::empty({N, K / 16}, w.options());
  const float* x = w.data_ptr<float>();
  uint8_t* q = codes.data_ptr<uint8_t>();
  float* s = steps.data_ptr<float>();
  const float tol = static_cast<float>(tolerance);
  std::atomic<bool> on_grids{true};
  at::parallel_for(0, groups, 4096, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1 && on_grids.load(std::memory_order_relaxed); ++g) {
      const float* v = x + 16 * g;
      float peak = 0.0f;
      for (int i = 0; i < 16; ++i) peak = std::max(peak, std::abs(v[i]));
      if (peak == 0.0f) peak = 1.0f;  // a group of zeros: any step, code 32
      bool found = false;
      for (int levels = 32; levels >= 1 && !found; --levels) {
        const float step = peak / static_cast<float>(levels);
        int k[16], low = 0, high = 0;
        bool on = true;
        for (int i = 0; i < 16 && on; ++i) {
          const float rel = v[i] / step, rounded = std::nearbyint(rel);
          on = std::abs(rel - rounded) < tol;
          k[i] = static_cast<int>(rounded);
          low = std::min(low, k[i]);
          high = std::max(high, k[i]);
        }
        if (!on || high > 32 || low < -32 || high - low > 63) continue;
        const int sign = high == 32 ? -1 : 1;  // codes -32 to 31: the step's sign flipped where +32 is reached
        s[g] = sign * step;
        for (int i = 0; i < 16; ++i) q[16 * g + i] = static_cast<uint8_t>(sign * k[i] + 32);
        found = true;
      }
      if (!found) on_grids.store(false, std::memory_order_relaxed);
    }
  });
  if (!on_grids.load()) return std::nullopt;
  return std::make_tuple(codes, steps);
}

// x [M, K] (float32) times the packed weight's transpose: [M, N] in float32, the sums in float32. An int8 weight
// takes its rows' scales ([N], float32); a 4- or 6-bit one gives the rows' dtype (float32 or bfloat16, rounded once).
at::Tensor matmul(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                  const std::optional<at::Tensor>& scales) {
  const bool bf16_rows = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (bf16_rows || x.scalar_type() == at::kFloat) && x.device().is_cpu(),
              "few_rows.matmul takes 2-d float32 or bfloat16 CPU rows");
  TORCH_CHECK(!bf16_rows || packed.scalar_type() == at::kByte ||
                  (packed.scalar_type() == at::kBFloat16 && bf16_rows_supported()),
              "few_rows.matmul takes bfloat16 rows with a bfloat16 weight on a CPU with AVX512-BF16 only, or with a "
              "4- or 6-bit one");
  auto X = x.contiguous();
  const int64_t M = X.size(0), K = X.size(1);
  // a uint8 layout holds 4-bit codes (flat) or 6-bit ones (a row of bytes a run's group)
  const bool codes = packed.scalar_type() == at::kByte, int8 = packed.scalar_type() == at::kChar;
  const bool int6 = codes && packed.dim() == 2, int4 = codes && !int6, groups = K % INT4_GROUP_SIZE == 0;
  TORCH_CHECK(!int4 || (N % 16 == 0 && groups && packed.numel() == int4_bytes(N, K)),
              "few_rows.matmul: a 4-bit weight packed for other shapes");
  TORCH_CHECK(!int6 || (groups && packed.size(1) == INT6_RUN_GROUP && packed.numel() == int6_bytes(N, K)),
              "few_rows.matmul: a 6-bit weight packed for other shapes");
  TORCH_CHECK(codes || packed.numel() == (N + NB - 1) / NB * NB * K,
              "few_rows.matmul: a weight packed for other shapes");
  TORCH_CHECK(int8 == scales.has_value(), "few_rows.matmul takes scales with an int8 weight, and only then");
  auto Y = at::empty({M, N}, X.options().dtype(codes ? X.scalar_type() : at::kFloat));  // 4-, 6-bit: the rows' dtype
  if (M == 0) return Y;
  if (codes) {
    const int64_t G = K / INT4_GROUP_SIZE;
    const uint8_t* W = packed.data_ptr<uint8_t>();
    std::vector<float> x_scales(M * G), xsum(M * G);  // a scale a row (AVX512-VNNI) or a group (AVX2); groups' sums
    auto product = [&](const auto* rows, auto* out) {
      if (int4 && int8_vnni_supported()) {
        std::vector<int16_t> xq(M * K);
        round_rows(rows, xq.data(), x_scales.data(), M, K, false);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t g = 0; g < G; ++g) {
            int32_t sum = 0;
            for (int64_t k = g * INT4_GROUP_SIZE; k < (g + 1) * INT4_GROUP_SIZE; ++k) sum += xq[m * K + k];
            xsum[m * G + g] = static_cast<float>(sum);
          }
        multiply_int4(W, xq.data(), xsum.data(), x_scales.data(), out, M, K, N);
        return;
      }
      std::vector<int8_t> xq(M * K);  // AVX2's rows, and a 6-bit weight's: 8 bits, a scale a group
      std::vector<int32_t> x32(int6 ? M * 2 * G : 0);  // a 6-bit weight's: each 16 inputs' sum of bytes, times 32
      round_groups(rows, xq.data(), x_scales.data(), xsum.data(), M * G, int6 ? x32.data() : nullptr);
      if (int4) {
        multiply_int4(W, xq.data(), xsum.data(), x_scales.data(), out, M, K, N);
        return;
      }
      multiply_int6(W, xq.data(), x32.data(), x_scales.data(), out, M, K, N);
    };
    if (bf16_rows)
      product(X.data_ptr<at::BFloat16>(), Y.data_ptr<at::BFloat16>());
    else
      product(X.data_ptr<float>(), Y.data_ptr<float>());
  } else if (int8) {
    auto S = scales->contiguous();
    TORCH_CHECK(S.scalar_type() == at::kFloat && S.numel() == N, "few_rows.matmul takes N float32 scales");
    std::vector<int16_t> xq(M * K);
    std::vector<float> x_scales(M);
    const bool vnni = int8_vnni_supported();
    round_rows(X.data_ptr<float>(), xq.data(), x_scales.data(), M, K, !vnni);
#ifdef DISTILLSPEC_INT8_VNNI
    if (vnni)
      multiply(packed.data_ptr<int8_t>(), reinterpret_cast<const Natural16*>(xq.data()), Y.data_ptr<float>(), M, K, N,
               S.data_ptr<float>(), x_scales.data());
    else
#endif
      multiply(packed.data_ptr<int8_t>(), xq.data(), Y.data_ptr<float>(), M, K, N, S.data_ptr<float>(),
               x_scales.data());
#ifdef DISTILLSPEC_BF16_ROWS
  } else if (bf16_rows && M > 2 * TILE) {  // a prompt's rows (at two tiles or fewer, the tiles are as fast)
    multiply_bf16_rows(reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), X.data_ptr<at::BFloat16>(),
                       Y.data_ptr<float>(), M, K, N);
  } else if (bf16_rows) {
    multiply(reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), X.data_ptr<at::BFloat16>(),
             Y.data_ptr<float>(), M, K, N);
#endif
  } else if (packed.scalar_type() == at::kBFloat16) {
    multiply(reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), X.data_ptr<float>(),
             Y.data_ptr<float>(), M, K, N);
  } else {
    multiply(packed.data_ptr<float>(), X.data_ptr<float>(), Y.data_ptr<float>(), M, K, N);
  }
  return Y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_rows_supported", &bf16_rows_supported, "whether bfloat16 rows run here (AVX512-BF16)");
  m.def("int8_vnni_supported", &int8_vnni_supported, "whether int8 weights run through AVX512-VNNI here");
  m.def("int4_supported", &int4_supported, "whether 4-bit weights run here (AVX2; AVX512-VNNI where the CPU has it)");
  m.def("pack", &pack, "the weight [N, K] in the blocked layout");
  m.def("pack_int4", &pack_int4, "a 4-bit weight's codes and scales in the layout of its products");
  m.def("pack_int6", &pack_int6, "a 6-bit weight's codes and steps in the layout of its products");
  m.def("int6_grid", &int6_grid, "a weight's 6-bit codes and steps where it lies on 6-bit grids of 16 inputs",
        py::arg("weight"), py::arg("tolerance"));
  m.def("matmul", &matmul, "x [M, K] times the packed weight's transpose", py::arg("x"), py::arg("packed"),
        py::arg("N"), py::arg("scales") = py::none());
  m.def("cached_attention", &cached_attention, "a few new queries' attention over a cache, q and k rotated",
        py::arg("q"), py::arg("key"), py::arg("value"), py::arg("cos"), py::arg("sin"), py::arg("keys"),
        py::arg("values"), py::arg("mask"), py::arg("start"), py::arg("scale"));
  m.def("add_rms_norm", &add_rms_norm, "the residual sum h + delta and its RMSNorm", py::arg("h"), py::arg("delta"),
        py::arg("weight"), py::arg("eps"));
  bind_step_layers(m);
}
