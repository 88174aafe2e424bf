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
// sits in cache, eight rows at a time in registers.
//
// Each output element is summed over k in the same order for any number of rows, and by one
// thread, so a row's result does not depend on which other rows share the call or on how the
// panels were shared among threads.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "xla/ffi/api/ffi.h"
#include "parallel_tasks.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 64;
constexpr int64_t kRowBlock = 8;
constexpr int64_t kSumBlock = 32;

// A bfloat16 weight (raw bits) as float32: bfloat16 is the top half of the float32 with the
// same value, so widening is exact.
inline float Widen(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <int64_t kRows, typename W>
void PanelRows(const float* x, int64_t k_dim, const W* panel, float* acc_out) {
  // Blocked summation: float32 partial sums over 32 consecutive k, added to a float64 total
  // that is rounded once at the end. Long sums of large terms with cancellation (SmolLM2's
  // "massive activations" reach 2e4) then round like a short sum: about 5x less error than a
  // float32 running total, and no more time, since the product is bound by memory bandwidth.
  double total[kRows][kPanel] __attribute__((aligned(64))) = {};
  for (int64_t k0 = 0; k0 < k_dim; k0 += kSumBlock) {
    const int64_t k1 = k0 + kSumBlock < k_dim ? k0 + kSumBlock : k_dim;
    float acc[kRows][kPanel] __attribute__((aligned(64))) = {};
    for (int64_t k = k0; k < k1; ++k) {
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
    for (int64_t j = 0; j < kPanel; ++j) acc_out[r * kPanel + j] = static_cast<float>(total[r][j]);
}

template <typename W>
void PanelAnyRows(int64_t rows, const float* x, int64_t k_dim, const W* panel, float* out) {
  switch (rows) {
    case 1: return PanelRows<1>(x, k_dim, panel, out);
    case 2: return PanelRows<2>(x, k_dim, panel, out);
    case 3: return PanelRows<3>(x, k_dim, panel, out);
    case 4: return PanelRows<4>(x, k_dim, panel, out);
    case 5: return PanelRows<5>(x, k_dim, panel, out);
    case 6: return PanelRows<6>(x, k_dim, panel, out);
    case 7: return PanelRows<7>(x, k_dim, panel, out);
    default: return PanelRows<8>(x, k_dim, panel, out);
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
  const int64_t m = x_dims[0], k_dim = x_dims[1], panels = p_dims[0];
  const int64_t n_padded = panels * kPanel;
  const float* x_data = x.typed_data();
  const auto* p_data = packed.typed_data();
  float* y_data = y->typed_data();

  speclm::RunTasks(pool, panels, 1, [=](int64_t first, int64_t end) {
    for (int64_t p = first; p < end; ++p) {
      float block[kRowBlock * kPanel] __attribute__((aligned(64)));
      const auto* panel = p_data + p * k_dim * kPanel;
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
        const int64_t rows = m - r0 < kRowBlock ? m - r0 : kRowBlock;
        PanelAnyRows(rows, x_data + r0 * k_dim, k_dim, panel, block);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < kPanel; ++j)
            y_data[(r0 + r) * n_padded + p * kPanel + j] = block[r * kPanel + j];
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
