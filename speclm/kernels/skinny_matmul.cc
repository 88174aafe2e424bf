// y[M, N] = x[M, K] @ w for float32 x and a weight matrix packed in column panels, stored as
// float32 or as bfloat16 (widened to float32 as it is read: half the bytes, the same sums).
//
// XLA's CPU backend multiplies one row by a weight matrix with its own matrix-vector kernel,
// at memory bandwidth, but hands 2 to 8 rows to a general matrix-matrix kernel that runs at
// about half that bandwidth. Speculative decoding's verification call is exactly such a
// product (γ + 1 rows per sequence), so on CPU it cost r ≈ 1.4 single-token calls instead of
// ≈ 1. This kernel streams the weights once whatever the number of rows: the weight matrix
// [K, N] is stored as [ceil(N / 64), K, 64] (panel p holds columns 64p … 64p + 63, zero
// padded), threads take whole panels, and each panel is multiplied into every row while it
// sits in cache, up to five rows at a time in registers.
//
// Each output element is summed over k in the same order for any number of rows, and by one
// thread, so a row's result does not depend on which other rows share the call or on how the
// panels were shared among threads.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "parallel_tasks.h"
#include "zero_rows.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 64;
// At most this many rows share one pass over a panel: 5 rows use 20 of the 32 vector
// registers for partial sums. More rows take further passes, the panel then in cache.
constexpr int64_t kRowBlock = 5;
constexpr int64_t kSumBlock = 32;

// A bfloat16 weight (raw bits) as float32: bfloat16 is the top half of the float32 with the
// same value, so widening is exact.
inline float Widen(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// How far ahead (in k) a panel is prefetched. The weights are read once, in order, so the
// hardware prefetcher alone should keep up; but with several rows the loop issues more
// instructions per cache line, the core looks fewer lines ahead, and the stream stalls (5 rows
// of SmolLM2's products took 2.3x one row; prefetched 32 k ahead, 1.25x: docs/performance.md).
constexpr int64_t kPrefetchAhead = 32;

template <typename W>
inline void PrefetchAhead(const W* panel, int64_t k) {
  const char* ahead = reinterpret_cast<const char*>(panel + (k + kPrefetchAhead) * kPanel);
  // Past the panel's end this touches the next panel (or nothing): a prefetch never faults.
  for (int64_t byte = 0; byte < kPanel * static_cast<int64_t>(sizeof(W)); byte += 64)
    __builtin_prefetch(ahead + byte, 0, 3);
}

#if defined(__AVX512F__)

// One k of a panel as four float32 vectors of 16 columns.
template <typename W>
inline void LoadPanelRow(const W* weights, __m512 w[4]) {
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<W, float>) {
      w[i] = _mm512_loadu_ps(weights + 16 * i);
    } else {  // bfloat16 bits -> the top half of a float32: exact
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + 16 * i));
      w[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
  }
}

// kRows rows times one panel, the 4 * kRows float32 partial sums held in registers (GCC kept
// the portable loop's in memory, a load and a store around every multiply-add).
//
// Blocked summation: float32 partial sums over 32 consecutive k, added to a float64 total
// that is rounded once at the end. Long sums of large terms with cancellation (SmolLM2's
// "massive activations" reach 2e4) then round like a short sum: about 5x less error than a
// float32 running total. Every output element is the same chain of fused multiply-adds
// whatever kRows is, so a row's result does not depend on the rows beside it.
template <int64_t kRows, typename W>
void PanelRows(const float* x, int64_t k_dim, const W* panel, float* out) {
  double total[kRows][kPanel] __attribute__((aligned(64))) = {};
  for (int64_t k0 = 0; k0 < k_dim; k0 += kSumBlock) {
    const int64_t k1 = k0 + kSumBlock < k_dim ? k0 + kSumBlock : k_dim;
    __m512 acc[kRows][4];
    for (int64_t r = 0; r < kRows; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      PrefetchAhead(panel, k);
      __m512 w[4];
      LoadPanelRow(panel + k * kPanel, w);
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * k_dim + k]);
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_fmadd_ps(xv, w[i], acc[r][i]);
      }
    }
    for (int64_t r = 0; r < kRows; ++r)
      for (int i = 0; i < 4; ++i) {
        const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][i]), 1));
        double* sums = total[r] + 16 * i;
        _mm512_store_pd(sums, _mm512_add_pd(_mm512_load_pd(sums),
                                            _mm512_cvtps_pd(_mm512_castps512_ps256(acc[r][i]))));
        _mm512_store_pd(sums + 8, _mm512_add_pd(_mm512_load_pd(sums + 8), _mm512_cvtps_pd(high)));
      }
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t j = 0; j < kPanel; ++j) out[r * kPanel + j] = static_cast<float>(total[r][j]);
}

#else  // portable: the same sums in the same order, vectorized as the compiler can

template <int64_t kRows, typename W>
void PanelRows(const float* x, int64_t k_dim, const W* panel, float* out) {
  double total[kRows][kPanel] __attribute__((aligned(64))) = {};
  for (int64_t k0 = 0; k0 < k_dim; k0 += kSumBlock) {
    const int64_t k1 = k0 + kSumBlock < k_dim ? k0 + kSumBlock : k_dim;
    float acc[kRows][kPanel] __attribute__((aligned(64))) = {};
    for (int64_t k = k0; k < k1; ++k) {
      PrefetchAhead(panel, k);
      const float* w;
      float widened[kPanel] __attribute__((aligned(64)));
      if constexpr (std::is_same_v<W, float>) {
        w = panel + k * kPanel;
      } else {
#pragma omp simd
        for (int64_t j = 0; j < kPanel; ++j) widened[j] = Widen(panel[k * kPanel + j]);
        w = widened;
      }
      for (int64_t r = 0; r < kRows; ++r) {
        const float xv = x[r * k_dim + k];
#pragma omp simd
        for (int64_t j = 0; j < kPanel; ++j) acc[r][j] += xv * w[j];
      }
    }
    for (int64_t r = 0; r < kRows; ++r)
#pragma omp simd
      for (int64_t j = 0; j < kPanel; ++j) total[r][j] += static_cast<double>(acc[r][j]);
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t j = 0; j < kPanel; ++j) out[r * kPanel + j] = static_cast<float>(total[r][j]);
}

#endif  // __AVX512F__

template <typename W>
void PanelAnyRows(int64_t rows, const float* x, int64_t k_dim, const W* panel, float* out) {
  switch (rows) {
    case 1: return PanelRows<1>(x, k_dim, panel, out);
    case 2: return PanelRows<2>(x, k_dim, panel, out);
    case 3: return PanelRows<3>(x, k_dim, panel, out);
    case 4: return PanelRows<4>(x, k_dim, panel, out);
    default: return PanelRows<kRowBlock>(x, k_dim, panel, out);
  }
}

// Panels are shared between threads one at a time (`speclm::RunTasks`, parallel_tasks.h).

template <ffi::DataType kWeightType>
ffi::Error SkinnyMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<kWeightType> packed, ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  const auto p_dims = packed.dimensions();
  if (x_dims.size() != 2 || p_dims.size() != 3 || p_dims[2] != kPanel ||
      p_dims[1] != x_dims[1]) {
    return ffi::Error::InvalidArgument("skinny_matmul: expects x [M, K] and packed [P, K, 64]");
  }
  const int64_t k_dim = x_dims[1], panels = p_dims[0];
  const int64_t n_padded = panels * kPanel;
  // All-zero rows are not multiplied (zero_rows.h): m counts the others.
  const speclm::LiveRows live = speclm::FindLiveRows(x.typed_data(), x_dims[0], k_dim);
  const int64_t m = live.count();
  const int64_t* row_index = live.index.data();
  const float* x_data = live.data;
  const auto* p_data = packed.typed_data();
  float* y_data = y->typed_data();
  speclm::ZeroDeadRows(live, x_dims[0], n_padded, y_data);
  if (m == 0) return ffi::Error::Success();

  speclm::RunTasks(pool, panels, 1, [=](int64_t first, int64_t end) {
    for (int64_t p = first; p < end; ++p) {
      float block[kRowBlock * kPanel] __attribute__((aligned(64)));
      const auto* panel = p_data + p * k_dim * kPanel;
      // The rows in passes of at most kRowBlock, as even as possible (8 rows: 4 + 4).
      const int64_t passes = (m + kRowBlock - 1) / kRowBlock;
      for (int64_t pass = 0, r0 = 0; pass < passes; ++pass) {
        const int64_t rows = (m - r0) / (passes - pass);
        PanelAnyRows(rows, x_data + r0 * k_dim, k_dim, panel, block);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < kPanel; ++j)
            y_data[row_index[r0 + r] * n_padded + p * kPanel + j] = block[r * kPanel + j];
        r0 += rows;
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SkinnyMatmul, SkinnyMatmulImpl<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SkinnyMatmulBf16, SkinnyMatmulImpl<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
