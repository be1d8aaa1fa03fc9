// A decoding step's work around its products on an x86 CPU with AVX2 and FMA, for a few new tokens (a decoding step,
// a verification of gamma + 1 positions) of a Llama-like decoder: one call where torch takes tens of small operators.
//
// add_rms_norm: the residual sum h + delta and its RMSNorm, as the models' own norm computes it (the row in float32,
// x / sqrt(mean(x^2) + eps) rounded to the model's dtype, times the weight, rounded again).
//
// cached_attention: attention of the new queries over the model's cached keys and values, for a Llama-like layer
// (rotary q and k, each key and value head serving a group of query heads). One call takes a layer's q, k and v
// projections as the products give them ([B, k, heads x head_dim], not yet rotated), rotates q and k as the models'
// own apply_rotary_pos_emb does (each operation rounded to the model's dtype, as torch rounds it), writes the new
// keys and values into the cache, and returns the attention output in the layout o_proj takes ([B, k, heads x
// head_dim]). A thread takes whole key/value heads (or a slice of a head's group of query heads, where there are more
// threads than heads): it widens 8 cached keys at a time to float32 once for all its queries, sums their products in
// float32 (8 accumulators, one a key, reduced together; bfloat16 keys and queries on a CPU with AVX512-BF16 go
// through vdpbf16ps as they are, each pair of products exact: DISTILLSPEC_DOT_BF16=0 widens them), takes the softmax
// over the visible columns (exp by Cephes' polynomial, 8 at a time), and sums the values the same way, in float32.
// Built with the few-row kernel (distillspec/models/few_rows.py, which documents the figures).

#include "few_rows.h"

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// Whether bfloat16 scores take vdpbf16ps here; DISTILLSPEC_DOT_BF16=0 keeps the float32 sums of widened keys.
bool dot_bf16_supported() {
  static const bool supported = [] {
    const char* off = std::getenv("DISTILLSPEC_DOT_BF16");
    return !(off && std::string(off) == "0") && bf16_rows_supported();
  }();
  return supported;
}

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

// A float32 rounded to the model's dtype: bfloat16 to the nearest, ties to even (c10's conversion), as torch rounds.
template <typename T>
inline T narrow(float x) {
  return static_cast<T>(x);
}

// e^x, 8 at a time (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, e^r by a polynomial), within about an ulp; inputs
// are taken within [-87, 88] (a visible column's softmax input is <= 0; a hidden one's weight is set to 0 apart).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// The sums of 8 vectors, one a lane.
inline __m256 sums8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// x rotated as apply_rotary_pos_emb rotates it: x * cos + rotate_half(x) * sin, each operation rounded to T.
template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, T* y, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < d; ++j) {
    const float turned = j < half ? -widen(x[j + half]) : widen(x[j - half]);
    const T a = narrow<T>(widen(x[j]) * widen(cos[j]));
    const T b = narrow<T>(turned * widen(sin[j]));
    y[j] = narrow<T>(widen(a) + widen(b));
  }
}

// 8 rows of d values (from row c0 of a cache head, those at or past `end` as zeros) as float32 in `out` [8][d].
template <typename T>
inline void widen_rows(const T* head, int64_t c0, int64_t end, int64_t d, float* out) {
  for (int64_t c = 0; c < 8; ++c) {
    float* row = out + c * d;
    if (c0 + c < end) {
      const T* src = head + (c0 + c) * d;
      for (int64_t e = 0; e < d; e += 8) _mm256_storeu_ps(row + e, load8(src + e));
    } else {
      std::fill(row, row + d, 0.0f);
    }
  }
}

#ifdef DISTILLSPEC_AVX512_EXTENSIONS
#define DISTILLSPEC_DOT_BF16 1
// Scores of bfloat16 queries qb [nq][d] (d a multiple of 32) against the cached keys, 8 at a time, on a CPU with
// AVX512-BF16: each pair of products exact (vdpbf16ps) and summed in float32, the keys read as they are.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void scores_bf16(
    const at::BFloat16* qb, const at::BFloat16* key_head, int64_t nq, int64_t end, int64_t d, int64_t width,
    float scale, float* scores) {
  for (int64_t c0 = 0; c0 < end; c0 += 8)
    for (int64_t j = 0; j < nq; ++j) {
      __m512 acc[8];
      for (auto& a : acc) a = _mm512_setzero_ps();
      const at::BFloat16* qj = qb + j * d;
      for (int64_t e = 0; e < d; e += 32) {
        const __m512i qv = _mm512_loadu_si512(qj + e);
        for (int c = 0; c < 8; ++c)
          if (c0 + c < end)
            acc[c] = _mm512_dpbf16_ps(acc[c], (__m512bh)qv, (__m512bh)_mm512_loadu_si512(key_head + (c0 + c) * d + e));
      }
      __m256 halves[8];
      for (int c = 0; c < 8; ++c)
        halves[c] = _mm256_add_ps(_mm512_castps512_ps256(acc[c]),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[c]), 1)));
      _mm256_storeu_ps(scores + j * width + c0, _mm256_mul_ps(sums8(halves), _mm256_set1_ps(scale)));
    }
}
#endif

struct Strided {  // a [B, k, n x d] tensor's data and its batch and row strides (its last dimension contiguous)
  int64_t batch, row;
};

template <typename T>
void attend(const T* q, Strided qs, const T* key, Strided ks, const T* value, Strided vs, const T* cos,
            const T* sin, Strided rs, T* keys, T* values, int64_t cap, const int64_t* mask, int64_t mask_batch, T* out,
            int64_t B, int64_t k, int64_t H, int64_t Hkv, int64_t d, int64_t start, float scale, bool dot_bf16) {
  const int64_t end = start + k, width = (end + 7) / 8 * 8, group = H / Hkv;
  // The new keys, rotated, and values into the cache.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < k; ++i)
      for (int64_t g = 0; g < Hkv; ++g) {
        const int64_t at = ((b * Hkv + g) * cap + start + i) * d;
        rotate(key + b * ks.batch + i * ks.row + g * d, cos + b * rs.batch + i * rs.row,
               sin + b * rs.batch + i * rs.row, keys + at, d);
        std::copy_n(value + b * vs.batch + i * vs.row + g * d, d, values + at);
      }
  // Which columns each query sees (1) or not (0): the valid ones up to its own, and always itself.
  std::vector<float> seen(B * k * width, 0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < k; ++i)
      for (int64_t c = 0; c < end; ++c)
        seen[(b * k + i) * width + c] = (mask[b * mask_batch + c] != 0 && c <= start + i) || c == start + i;
  // Units of work: a key/value head's group of query heads, in slices where there are more threads than heads.
  const int64_t slices = std::clamp<int64_t>((at::get_num_threads() + B * Hkv - 1) / (B * Hkv), 1, group);
  const int64_t per_slice = (group + slices - 1) / slices, units = B * Hkv * slices;
  const int64_t grain = B * H * k * end * d < (int64_t{1} << 16) ? units : 1;  // tiny: not worth waking threads
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    std::vector<T> qt;  // the queries rotated, in the model's dtype (the scores' inputs through vdpbf16ps)
    std::vector<float> qf, scores, rows(8 * d), of, inverse;  // qf: the same widened (the other scores' inputs)
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / (Hkv * slices), g = u / slices % Hkv, h0 = u % slices * per_slice;
      const int64_t heads = std::min(per_slice, group - h0), nq = heads * k;
      if (heads <= 0) continue;
      const bool dot = std::is_same_v<T, at::BFloat16> && dot_bf16;
      qt.resize(nq * d);
      scores.assign(nq * width, 0.0f);
      of.assign(nq * d, 0.0f);
      inverse.assign(nq, 0.0f);
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < k; ++i) {
          rotate(q + b * qs.batch + i * qs.row + (g * group + h0 + h) * d, cos + b * rs.batch + i * rs.row,
                 sin + b * rs.batch + i * rs.row, qt.data() + (h * k + i) * d, d);
        }
      if (!dot) {
        qf.resize(nq * d);
        for (int64_t e = 0; e < nq * d; ++e) qf[e] = widen(qt[e]);
      }
      const T* key_head = keys + (b * Hkv + g) * cap * d;
      const T* value_head = values + (b * Hkv + g) * cap * d;
      const __m256 scaled = _mm256_set1_ps(scale);
#ifdef DISTILLSPEC_DOT_BF16
      if constexpr (std::is_same_v<T, at::BFloat16>)
        if (dot) scores_bf16(qt.data(), key_head, nq, end, d, width, scale, scores.data());
#endif
      for (int64_t c0 = 0; c0 < end && !dot; c0 += 8) {  // 8 keys at a time
        widen_rows(key_head, c0, end, d, rows.data());
        for (int64_t j = 0; j < nq; ++j) {
          __m256 acc[8];
          for (auto& a : acc) a = _mm256_setzero_ps();
          const float* qj = qf.data() + j * d;
          for (int64_t e = 0; e < d; e += 8) {
            const __m256 qv = _mm256_loadu_ps(qj + e);
            for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows.data() + c * d + e), acc[c]);
          }
          _mm256_storeu_ps(scores.data() + j * width + c0, _mm256_mul_ps(sums8(acc), scaled));
        }
      }
      for (int64_t j = 0; j < nq; ++j) {  // softmax over the columns the query sees
        float* s = scores.data() + j * width;
        const float* sees = seen.data() + (b * k + j % k) * width;
        const __m256 hidden = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        __m256 top = hidden;
        for (int64_t c = 0; c < width; c += 8) {
          const __m256 visible = _mm256_cmp_ps(_mm256_loadu_ps(sees + c), _mm256_setzero_ps(), _CMP_GT_OQ);
          top = _mm256_max_ps(top, _mm256_blendv_ps(hidden, _mm256_loadu_ps(s + c), visible));
        }
        top = _mm256_max_ps(top, _mm256_permute2f128_ps(top, top, 1));
        top = _mm256_max_ps(top, _mm256_permute_ps(top, 0x4e));
        top = _mm256_max_ps(top, _mm256_permute_ps(top, 0xb1));
        __m256 total = _mm256_setzero_ps();
        for (int64_t c = 0; c < width; c += 8) {  // a hidden column's weight is 0 (whatever its score)
          const __m256 visible = _mm256_cmp_ps(_mm256_loadu_ps(sees + c), _mm256_setzero_ps(), _CMP_GT_OQ);
          const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + c), top)), visible);
          _mm256_storeu_ps(s + c, p);
          total = _mm256_add_ps(total, p);
        }
        float sum8[8];
        _mm256_storeu_ps(sum8, total);
        float sum = 0.0f;
        for (float x : sum8) sum += x;
        inverse[j] = 1.0f / sum;
      }
      for (int64_t c0 = 0; c0 < end; c0 += 8) {  // the weighted values: 8 at a time, widened once for every query
        widen_rows(value_head, c0, end, d, rows.data());
        for (int64_t j = 0; j < nq; ++j) {
          const float* p = scores.data() + j * width + c0;
          float* o = of.data() + j * d;
          for (int64_t e = 0; e < d; e += 8) {
            __m256 acc = _mm256_loadu_ps(o + e);
            for (int c = 0; c < 8; ++c)
              acc = _mm256_fmadd_ps(_mm256_set1_ps(p[c]), _mm256_loadu_ps(rows.data() + c * d + e), acc);
            _mm256_storeu_ps(o + e, acc);
          }
        }
      }
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < k; ++i) {
          const int64_t j = h * k + i;
          T* dst = out + (b * k + i) * H * d + (g * group + h0 + h) * d;
          for (int64_t e = 0; e < d; ++e) dst[e] = narrow<T>(of[j * d + e] * inverse[j]);
        }
    }
  });
}

// total = h + delta (delta null: total is h, not written) and y = its norm, row by row.
template <typename T>
void add_rms_norm_rows(const T* h, const T* delta, T* total, const T* weight, T* y, int64_t rows, int64_t D,
                       float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = delta != nullptr ? total + r * D : h + r * D;
    if (delta != nullptr)
      for (int64_t e = 0; e < D; ++e) total[r * D + e] = narrow<T>(widen(h[r * D + e]) + widen(delta[r * D + e]));
    __m256 squares = _mm256_setzero_ps();
    int64_t e = 0;
    for (; e + 8 <= D; e += 8) {
      const __m256 v = load8(x + e);
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    float sum8[8], sum = 0.0f;
    _mm256_storeu_ps(sum8, squares);
    for (float v : sum8) sum += v;
    for (; e < D; ++e) sum += widen(x[e]) * widen(x[e]);
    const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
    for (int64_t j = 0; j < D; ++j)
      y[r * D + j] = narrow<T>(widen(weight[j]) * widen(narrow<T>(widen(x[j]) * inverse)));
  }
}

}  // namespace

// See the top of this file. h [..., D] and delta (None: h alone) in one dtype (float32 or bfloat16), weight [D] in it
// too. Returns (h + delta, its norm): a new tensor for the sum (h is not written), or h itself without a delta.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h_in,
                                                const std::optional<at::Tensor>& delta_in,
                                                const at::Tensor& weight, double eps) {
  const auto dtype = h_in.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && h_in.device().is_cpu() && h_in.dim() >= 1,
              "add_rms_norm takes float32 or bfloat16 CPU rows");
  const int64_t D = h_in.size(-1);
  TORCH_CHECK(weight.scalar_type() == dtype && weight.dim() == 1 && weight.size(0) == D,
              "add_rms_norm: a weight [D] in the rows' dtype");
  TORCH_CHECK(!delta_in || (delta_in->scalar_type() == dtype && delta_in->sizes() == h_in.sizes()),
              "add_rms_norm: a delta of the rows' shape and dtype");
  const auto h = h_in.contiguous();
  const auto delta = delta_in ? delta_in->contiguous() : at::Tensor();
  const auto w = weight.contiguous();
  auto total = delta_in ? at::empty_like(h) : h;
  auto y = at::empty_like(h);
  const int64_t rows = h.numel() / std::max<int64_t>(D, 1);
  if (dtype == at::kFloat)
    add_rms_norm_rows(h.data_ptr<float>(), delta_in ? delta.data_ptr<float>() : nullptr, total.data_ptr<float>(),
                      w.data_ptr<float>(), y.data_ptr<float>(), rows, D, static_cast<float>(eps));
  else
    add_rms_norm_rows(h.data_ptr<at::BFloat16>(), delta_in ? delta.data_ptr<at::BFloat16>() : nullptr,
                      total.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows, D,
                      static_cast<float>(eps));
  return {total, y};
}

// See the top of this file. q [B, k, H x d], key and value [B, k, Hkv x d] (each row's values contiguous), cos and sin
// [B, k, d], the cache's keys and values [B, Hkv, capacity, d] (contiguous; the new tokens go to columns start ..
// start + k - 1), mask [B, start + k] (int64: the valid cache columns), all but the mask in one dtype (float32 or
// bfloat16). Returns [B, k, H x d] in that dtype.
at::Tensor cached_attention(const at::Tensor& q_in, const at::Tensor& key_in, const at::Tensor& value_in,
                            const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor& keys,
                            at::Tensor& values, const at::Tensor& mask, int64_t start, double scale) {
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "cached_attention takes float32 or bfloat16");
  const std::initializer_list<const at::Tensor*> same_dtype{&key_in, &value_in, &cos_in, &sin_in, &keys, &values};
  for (const at::Tensor* t : same_dtype)
    TORCH_CHECK(t->scalar_type() == dtype && t->device().is_cpu(), "cached_attention: one dtype, on the CPU");
  for (const at::Tensor* t : {&q_in, &key_in, &value_in, &cos_in, &sin_in})
    TORCH_CHECK(t->dim() == 3, "cached_attention: [B, k, n] inputs");
  auto rows = [](const at::Tensor& t) { return t.stride(2) == 1 ? t : t.contiguous(); };  // each row contiguous
  const auto q = rows(q_in), key = rows(key_in), value = rows(value_in), cos = rows(cos_in), sin = rows(sin_in);
  TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && values.is_contiguous() && values.sizes() == keys.sizes(),
              "cached_attention: contiguous [B, kv_heads, capacity, head_dim] caches");
  const int64_t B = q.size(0), k = q.size(1), Hkv = keys.size(1), cap = keys.size(2), d = keys.size(3);
  TORCH_CHECK(d % 8 == 0 && q.size(2) % d == 0 && key.size(2) == Hkv * d && value.size(2) == Hkv * d,
              "cached_attention: head_dim a multiple of 8, projections of whole heads");
  const int64_t H = q.size(2) / d;
  TORCH_CHECK(H % Hkv == 0 && keys.size(0) == B && key.size(0) == B && key.size(1) == k && value.size(1) == k,
              "cached_attention: query heads in groups of the key/value heads, one batch");
  TORCH_CHECK(cos.size(0) == B && cos.size(1) == k && cos.size(2) == d && sin.sizes() == cos.sizes() &&
                  sin.stride(0) == cos.stride(0) && sin.stride(1) == cos.stride(1),
              "cached_attention: cos and sin [B, k, head_dim]");
  TORCH_CHECK(mask.scalar_type() == at::kLong && mask.dim() == 2 && mask.size(0) == B && mask.size(1) == start + k &&
                  mask.stride(1) == 1 && start >= 0 && start + k <= cap,
              "cached_attention: an int64 mask [B, start + k] within the cache's capacity");
  auto out = at::empty({B, k, H * d}, q.options());
  if (B == 0 || k == 0) return out;
  const Strided qs{q.stride(0), q.stride(1)}, ks{key.stride(0), key.stride(1)}, vs{value.stride(0), value.stride(1)},
      rs{cos.stride(0), cos.stride(1)};
  if (dtype == at::kFloat)
    attend(q.data_ptr<float>(), qs, key.data_ptr<float>(), ks, value.data_ptr<float>(), vs, cos.data_ptr<float>(),
           sin.data_ptr<float>(), rs, keys.data_ptr<float>(), values.data_ptr<float>(), cap, mask.data_ptr<int64_t>(),
           mask.stride(0), out.data_ptr<float>(), B, k, H, Hkv, d, start, static_cast<float>(scale), false);
  else
    attend(q.data_ptr<at::BFloat16>(), qs, key.data_ptr<at::BFloat16>(), ks, value.data_ptr<at::BFloat16>(), vs,
           cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(), rs, keys.data_ptr<at::BFloat16>(),
           values.data_ptr<at::BFloat16>(), cap, mask.data_ptr<int64_t>(), mask.stride(0),
           out.data_ptr<at::BFloat16>(), B, k, H, Hkv, d, start, static_cast<float>(scale),
           d % 32 == 0 && dot_bf16_supported());
  return out;
}

// A step's linear product as its module computes it (PackedLinear, Int8Linear in distillspec/models/packing.py; their
// step_product() gives these fields): the rows [..., in] (widened to float32 first where float_rows) times the weight
// through matmul, the bias added to its float32 sums before they are rounded to the model's dtype (bias_in_float) or
// after.
struct StepProduct {
  at::Tensor packed;
  int64_t out_features;
  std::optional<at::Tensor> scales, bias;
  bool float_rows, bias_in_float;
  at::ScalarType dtype;

  at::Tensor operator()(const at::Tensor& x) const {
    auto rows = x.reshape({-1, x.size(-1)});
    auto out = matmul(float_rows ? rows.to(at::kFloat) : rows, packed, out_features, scales);
    if (bias && bias_in_float) out.add_(*bias);
    out = out.to(dtype);
    if (bias && !bias_in_float) out = out + *bias;
    auto shape = x.sizes().vec();
    shape.back() = out_features;
    return out.view(shape);
  }
};

// Sibling products that read one input: one product split (sizes) or one product each (sizes empty).
struct StepSiblings {
  std::vector<StepProduct> products;
  std::vector<int64_t> sizes;

  std::vector<at::Tensor> operator()(const at::Tensor& x) const {
    if (!sizes.empty()) return products[0](x).split_with_sizes(sizes, -1);
    std::vector<at::Tensor> outputs;
    for (const auto& product : products) outputs.push_back(product(x));
    return outputs;
  }
};

// A Llama-like decoder layer's step: its norms' weights and epsilons, its q/k/v, o, gate/up and down products, its
// attention's scale (a SiLU MLP).
struct StepLayer {
  at::Tensor input_norm;
  double input_eps;
  StepSiblings qkv;
  StepProduct o;
  at::Tensor post_norm;
  double post_eps;
  StepSiblings gate_up;
  StepProduct down;
  double scale;
};

// The decoder layers of a step as distillspec/decoding/kvcache.py's _lean_layers computes them through the kernel (the
// same calls in the same order, so the same bits), in one call: hidden states h [B, k, D], the rotary cos and sin, each
// layer's cache (keys[i], values[i]), the mask and the new tokens' first column. Returns h after the last layer's MLP
// (not yet normed). Built once a speculative call (its products hold the weights' current tensors).
struct StepLayers {
  std::vector<StepLayer> layers;

  at::Tensor operator()(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                      std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                      const at::Tensor& mask, int64_t start) const {
    TORCH_CHECK(keys.size() == layers.size() && values.size() == layers.size(), "step_layers: one cache a layer");
    std::optional<at::Tensor> pending;  // the last layer's MLP output, not yet added to h
    at::Tensor x;
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& layer = layers[i];
      std::tie(h, x) = add_rms_norm(h, pending, layer.input_norm, layer.input_eps);
      const auto qkv = layer.qkv(x);
      TORCH_CHECK(qkv.size() == 3, "step_layers: q, k and v");
      const auto a = cached_attention(qkv[0], qkv[1], qkv[2], cos, sin, keys[i], values[i], mask, start, layer.scale);
      std::tie(h, x) = add_rms_norm(h, layer.o(a), layer.post_norm, layer.post_eps);
      const auto gate_up = layer.gate_up(x);
      TORCH_CHECK(gate_up.size() == 2, "step_layers: gate and up");
      pending = layer.down(at::silu(gate_up[0]) * gate_up[1]);
    }
    return pending ? h + *pending : h;
  }
};

void bind_step_layers(py::module_& m) {
  py::class_<StepProduct>(m, "StepProduct")
      .def(py::init([](at::Tensor packed, int64_t out_features, std::optional<at::Tensor> scales,
                       std::optional<at::Tensor> bias, bool float_rows, bool bias_in_float, at::ScalarType dtype) {
             return StepProduct{std::move(packed), out_features, std::move(scales), std::move(bias),
                                float_rows,        bias_in_float, dtype};
           }),
           py::arg("packed"), py::arg("out_features"), py::arg("scales"), py::arg("bias"), py::arg("float_rows"),
           py::arg("bias_in_float"), py::arg("dtype"))
      .def("__call__", &StepProduct::operator());
  py::class_<StepSiblings>(m, "StepSiblings")
      .def(py::init<std::vector<StepProduct>, std::vector<int64_t>>(), py::arg("products"), py::arg("sizes"));
  py::class_<StepLayer>(m, "StepLayer")
      .def(py::init<at::Tensor, double, StepSiblings, StepProduct, at::Tensor, double, StepSiblings, StepProduct,
                    double>(),
           py::arg("input_norm"), py::arg("input_eps"), py::arg("qkv"), py::arg("o"), py::arg("post_norm"),
           py::arg("post_eps"), py::arg("gate_up"), py::arg("down"), py::arg("scale"));
  py::class_<StepLayers>(m, "StepLayers")
      .def(py::init<std::vector<StepLayer>>(), py::arg("layers"))
      // (torch's operators let other Python threads run while they compute, a server's among them: so does this)
      .def("__call__", &StepLayers::operator(), py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("keys"),
           py::arg("values"), py::arg("mask"), py::arg("start"), py::call_guard<py::gil_scoped_release>());
}
