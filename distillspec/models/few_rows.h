// What the few-row kernel's sources (few_rows.cpp, decoder_step.cpp: one module, built by few_rows.py) share.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
// pybind11 with torch's casters (tensors, dtypes), and each ATen operator the sources call by its own header: a
// fraction of torch/extension.h's compile time (the whole C++ frontend), which the first use waits for.
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <optional>
#include <tuple>

// AVX512-BF16 and AVX512-VNNI code is compiled for those units alone (target attributes) and called only where the
// CPU has them; compilers older than GCC 10 and Clang 9 do not know them, and the kernel then builds without it.
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10)
#define DISTILLSPEC_AVX512_EXTENSIONS 1
#endif

// 8 values as floats: float32 as they are, bfloat16 (its 16 bits the high half of a float32) shifted into place.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const at::BFloat16* p) { return load8(reinterpret_cast<const uint16_t*>(p)); }

// few_rows.cpp: whether this CPU has AVX512-BF16 (and the kernel was compiled for it).
bool bf16_rows_supported();

// few_rows.cpp: x [M, K] times a packed weight's transpose (see matmul there).
at::Tensor matmul(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                  const std::optional<at::Tensor>& scales);

// decoder_step.cpp: a decoding step's work around its products.
at::Tensor cached_attention(const at::Tensor& q_in, const at::Tensor& key_in, const at::Tensor& value_in,
                            const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor& keys,
                            at::Tensor& values, const at::Tensor& mask, int64_t start, double scale);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h_in,
                                                const std::optional<at::Tensor>& delta_in,
                                                const at::Tensor& weight, double eps);
// ... and a step's decoder layers in one call (StepLayers), bound into the module.
void bind_step_layers(pybind11::module_& m);
