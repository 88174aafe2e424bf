// y[M, N] = x[M, K] @ W^T for float32 x and a weight matrix W [N, K] kept as GGUF stores it:
// each of its N rows a run of quantized blocks (Q8_0, Q4_0, Q4_1: 32 weights a block; Q4_K,
// Q5_K, Q6_K: 256), read as stored and widened to float32 in registers. No float32 copy of
// the matrix exists: a 4-bit matrix streams about 0.56 bytes a weight instead of 4.
//
// Threads take output rows 16 at a time (`speclm::RunTasks`, parallel_tasks.h: the calling
// thread and helpers on XLA's own thread pool). For one output row the thread widens the
// row's K weights once into a buffer that stays in L1/L2, then takes the dot product with each
// of the M input rows (four at a time, each widened weight used for all four). Every dot
// product runs the same code in the same order, whatever M and whichever thread (`DotRows`),
// so a row's result does not depend on how many rows share the call: speculative
// verification of γ + 1 rows gives the single-row decode's numbers. Float64 flushes every
// 1,024 weights keep long sums accurate, as the float kernel's blocked sums do.
//
// The widening follows ggml's reference dequantization (dequantize_row_* in ggml-quants.c):
//   Q8_0  [f16 d][32 × int8 q]                        w = d·q
//   Q4_0  [f16 d][16 bytes: low nibbles 0–15, high 16–31]  w = d·(q − 8)
//   Q4_1  [f16 d][f16 m][16 bytes]                   w = d·q + m
//   Q4_K  [f16 d][f16 dmin][12 bytes: 6-bit scales s and mins m][128 bytes]
//                                                    per 32 weights: w = d·s·q − dmin·m
//   Q5_K  as Q4_K plus [32 bytes] of fifth bits, before the 128 bytes of nibbles
//   Q6_K  [128 bytes low nibbles][64 bytes high 2-bit pairs][16 × int8 scales s][f16 d]
//                                                    per 16 weights: w = d·s·(q − 32)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "lanes.h"
#include "parallel_tasks.h"
#include "zero_rows.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kFlushEvery = 1024;  // weights summed in float32 before a float64 flush
constexpr int64_t kRowsPerTask = 16;

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while (!(mantissa & 0x400)) { mantissa <<= 1; --exponent; }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
#endif
}

// The widening below works on 16 weights at a time in `speclm::Lanes` (lanes.h).
using speclm::Bytes;
using speclm::Ints;
using speclm::Lanes;
using speclm::Load;
using speclm::Store;
typedef int8_t SignedBytes __attribute__((vector_size(16)));

// 16 bytes from `p`, each widened to an int32 lane (zero- or sign-extended). With AVX-512 one
// instruction; the portable conversion is what other machines get (GCC 12 lowers it to scalar
// code at this width, hence the intrinsic).
inline Ints Unsigned16(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<Ints>(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  Bytes b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, Ints);
#endif
}

inline Ints Signed16(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<Ints>(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  SignedBytes b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, Ints);
#endif
}

inline Lanes AsFloat(Ints v) { return __builtin_convertvector(v, Lanes); }

// Each format: its block's weights and bytes, and the widening of one block into 32 or 256
// floats (the products and sums in the order of ggml's reference, so the values are equal).
struct Q8_0 {
  static constexpr int64_t kWeights = 32, kBytes = 34;
  static void Widen(const uint8_t* b, float* y) {
    const float d = Half(b);
    Store(y, d * AsFloat(Signed16(b + 2)));
    Store(y + 16, d * AsFloat(Signed16(b + 18)));
  }
};

struct Q4_0 {
  static constexpr int64_t kWeights = 32, kBytes = 18;
  static void Widen(const uint8_t* b, float* y) {
    const float d = Half(b);
    const Ints q = Unsigned16(b + 2);
    Store(y, d * AsFloat((q & 0xf) - 8));
    Store(y + 16, d * AsFloat((q >> 4) - 8));
  }
};

struct Q4_1 {
  static constexpr int64_t kWeights = 32, kBytes = 20;
  static void Widen(const uint8_t* b, float* y) {
    const float d = Half(b), m = Half(b + 2);
    const Ints q = Unsigned16(b + 4);
    Store(y, d * AsFloat(q & 0xf) + m);
    Store(y + 16, d * AsFloat(q >> 4) + m);
  }
};

// The K-quants' 6-bit scale and min of sub-block j (0–7) from their 12 packed bytes.
inline void ScaleMin(int j, const uint8_t* s, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

struct Q4_K {
  static constexpr int64_t kWeights = 256, kBytes = 144;
  static void Widen(const uint8_t* b, float* y) {
    const float d = Half(b), dmin = Half(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
      int s1, m1, s2, m2;
      ScaleMin(j, scales, &s1, &m1);
      ScaleMin(j + 1, scales, &s2, &m2);
      const float d1 = d * s1, c1 = dmin * m1, d2 = d * s2, c2 = dmin * m2;
      for (int h = 0; h < 2; ++h) {
        const Ints v = Unsigned16(q + 16 * h);
        Store(y + 16 * h, d1 * AsFloat(v & 0xf) - c1);
        Store(y + 32 + 16 * h, d2 * AsFloat(v >> 4) - c2);
      }
    }
  }
};

struct Q5_K {
  static constexpr int64_t kWeights = 256, kBytes = 176;
  static void Widen(const uint8_t* b, float* y) {
    const float d = Half(b), dmin = Half(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* high = b + 16;
    const uint8_t* q = b + 48;
    int bit = 0;
    for (int j = 0; j < 8; j += 2, q += 32, y += 64, bit += 2) {
      int s1, m1, s2, m2;
      ScaleMin(j, scales, &s1, &m1);
      ScaleMin(j + 1, scales, &s2, &m2);
      const float d1 = d * s1, c1 = dmin * m1, d2 = d * s2, c2 = dmin * m2;
      for (int h = 0; h < 2; ++h) {
        const Ints v = Unsigned16(q + 16 * h), top = Unsigned16(high + 16 * h);
        Store(y + 16 * h, d1 * AsFloat((v & 0xf) + (((top >> bit) & 1) << 4)) - c1);
        Store(y + 32 + 16 * h, d2 * AsFloat((v >> 4) + (((top >> (bit + 1)) & 1) << 4)) - c2);
      }
    }
  }
};

struct Q6_K {
  static constexpr int64_t kWeights = 256, kBytes = 210;
  static void Widen(const uint8_t* b, float* y) {
    const uint8_t* low = b;
    const uint8_t* high = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = Half(b + 208);
    for (int half = 0; half < 2; ++half, low += 64, high += 32, scales += 8, y += 128) {
      for (int h = 0; h < 2; ++h) {  // l = 16h … 16h + 15, scale index h
        const Ints l1 = Unsigned16(low + 16 * h), l2 = Unsigned16(low + 32 + 16 * h);
        const Ints top = Unsigned16(high + 16 * h);
        const Ints q1 = ((l1 & 0xf) | ((top & 3) << 4)) - 32;
        const Ints q2 = ((l2 & 0xf) | (((top >> 2) & 3) << 4)) - 32;
        const Ints q3 = ((l1 >> 4) | (((top >> 4) & 3) << 4)) - 32;
        const Ints q4 = ((l2 >> 4) | (((top >> 6) & 3) << 4)) - 32;
        Store(y + 16 * h, (d * static_cast<float>(scales[h])) * AsFloat(q1));
        Store(y + 32 + 16 * h, (d * static_cast<float>(scales[h + 2])) * AsFloat(q2));
        Store(y + 64 + 16 * h, (d * static_cast<float>(scales[h + 4])) * AsFloat(q3));
        Store(y + 96 + 16 * h, (d * static_cast<float>(scales[h + 6])) * AsFloat(q4));
      }
    }
  }
};

template <typename F>
void WidenRow(const uint8_t* row, int64_t k_dim, float* out) {
  const int64_t blocks = k_dim / F::kWeights;
  for (int64_t i = 0; i < blocks; ++i) F::Widen(row + i * F::kBytes, out + i * F::kWeights);
}

typedef float HalfLanes __attribute__((vector_size(32)));
typedef double Doubles __attribute__((vector_size(64)));

// kRows dot products of input rows x[r] (kRows rows, `stride` apart) with one widened weight
// row w over k_dim (a multiple of 32), each loaded weight used for every row. Each row's sum
// is the same whatever kRows (the rows' lanes never mix), so it is the one summation order
// of this file: four independent chains of 16 float32 lanes (the multiply-adds overlap instead
// of waiting on one another), added pairwise into 16 lanes and those into 16 float64 lanes
// every kFlushEvery weights (16 terms a lane), the float64 lanes summed in a fixed order.
template <int kRows>
inline void DotRows(const float* __restrict x, int64_t stride, const float* __restrict w,
                    int64_t k_dim, float* out) {
  Doubles lo[kRows] = {}, hi[kRows] = {};
  for (int64_t k0 = 0; k0 < k_dim; k0 += kFlushEvery) {
    const int64_t k1 = std::min(k0 + kFlushEvery, k_dim);
    Lanes a[kRows][4] = {};
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {
      const Lanes w0 = Load(w + k), w1 = Load(w + k + 16), w2 = Load(w + k + 32),
                  w3 = Load(w + k + 48);
      for (int r = 0; r < kRows; ++r) {
        const float* xr = x + r * stride + k;
        a[r][0] += Load(xr) * w0;
        a[r][1] += Load(xr + 16) * w1;
        a[r][2] += Load(xr + 32) * w2;
        a[r][3] += Load(xr + 48) * w3;
      }
    }
    if (k < k1) {  // a last 32
      const Lanes w0 = Load(w + k), w1 = Load(w + k + 16);
      for (int r = 0; r < kRows; ++r) {
        a[r][0] += Load(x + r * stride + k) * w0;
        a[r][1] += Load(x + r * stride + k + 16) * w1;
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const Lanes sum = (a[r][0] + a[r][1]) + (a[r][2] + a[r][3]);
      HalfLanes first, second;
      std::memcpy(&first, &sum, sizeof(first));
      std::memcpy(&second, reinterpret_cast<const char*>(&sum) + sizeof(first), sizeof(second));
      lo[r] += __builtin_convertvector(first, Doubles);
      hi[r] += __builtin_convertvector(second, Doubles);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    const Doubles t = lo[r] + hi[r];
    out[r] = static_cast<float>(((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7])));
  }
}

// Every input row's dot product with the widened weight row w, four rows at a time.
inline void DotAllRows(const float* x, int64_t m, int64_t k_dim, const float* w, float* out) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) DotRows<4>(x + r * k_dim, k_dim, w, k_dim, out + r);
  switch (m - r) {
    case 3: DotRows<3>(x + r * k_dim, k_dim, w, k_dim, out + r); break;
    case 2: DotRows<2>(x + r * k_dim, k_dim, w, k_dim, out + r); break;
    case 1: DotRows<1>(x + r * k_dim, k_dim, w, k_dim, out + r); break;
    default: break;
  }
}

template <typename F>
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || x_dims[1] % F::kWeights != 0 ||
      w_dims[1] != x_dims[1] / F::kWeights * F::kBytes) {
    return ffi::Error::InvalidArgument(
        "quantized_matmul: expects x [M, K] and w [N, K / block weights × block bytes]");
  }
  const int64_t k_dim = x_dims[1], n = w_dims[0], row_bytes = w_dims[1];
  // All-zero rows are not multiplied (zero_rows.h): m counts the others.
  const speclm::LiveRows live = speclm::FindLiveRows(x.typed_data(), x_dims[0], k_dim);
  const int64_t m = live.count();
  const int64_t* row_index = live.index.data();
  const float* x_data = live.data;
  const uint8_t* w_data = w.typed_data();
  float* y_data = y->typed_data();
  speclm::ZeroDeadRows(live, x_dims[0], n, y_data);
  if (m == 0) return ffi::Error::Success();
  speclm::RunTasks(pool, n, kRowsPerTask, [=](int64_t first, int64_t end) {
    thread_local std::vector<float> widened, dots;
    if (static_cast<int64_t>(widened.size()) < k_dim) widened.resize(k_dim);
    if (static_cast<int64_t>(dots.size()) < m) dots.resize(m);
    for (int64_t row = first; row < end; ++row) {
      WidenRow<F>(w_data + row * row_bytes, k_dim, widened.data());
      DotAllRows(x_data, m, k_dim, widened.data(), dots.data());
      for (int64_t r = 0; r < m; ++r) y_data[row_index[r] * n + row] = dots[r];
    }
  });
  return ffi::Error::Success();
}

template <typename F>
ffi::Error DequantizeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> w,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto w_dims = w.dimensions();
  const auto y_dims = y->dimensions();
  if (w_dims.size() != 2 || y_dims.size() != 2 || y_dims[0] != w_dims[0] ||
      y_dims[1] % F::kWeights != 0 || w_dims[1] != y_dims[1] / F::kWeights * F::kBytes) {
    return ffi::Error::InvalidArgument("quantized_dequantize: expects w [R, bytes] -> [R, K]");
  }
  const int64_t k_dim = y_dims[1], row_bytes = w_dims[1];
  const uint8_t* w_data = w.typed_data();
  float* y_data = y->typed_data();
  speclm::RunTasks(pool, w_dims[0], kRowsPerTask, [=](int64_t first, int64_t end) {
    for (int64_t row = first; row < end; ++row)
      WidenRow<F>(w_data + row * row_bytes, k_dim, y_data + row * k_dim);
  });
  return ffi::Error::Success();
}

}  // namespace

#define SPECLM_QUANTIZED_TARGETS(F)                                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmul_##F, MatmulImpl<F>,                     \
                                ffi::Ffi::Bind()                                        \
                                    .Ctx<ffi::ThreadPool>()                             \
                                    .Arg<ffi::Buffer<ffi::F32>>()                       \
                                    .Arg<ffi::Buffer<ffi::U8>>()                        \
                                    .Ret<ffi::Buffer<ffi::F32>>());                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedDequantize_##F, DequantizeImpl<F>,             \
                                ffi::Ffi::Bind()                                        \
                                    .Ctx<ffi::ThreadPool>()                             \
                                    .Arg<ffi::Buffer<ffi::U8>>()                        \
                                    .Ret<ffi::Buffer<ffi::F32>>());

SPECLM_QUANTIZED_TARGETS(Q8_0)
SPECLM_QUANTIZED_TARGETS(Q4_0)
SPECLM_QUANTIZED_TARGETS(Q4_1)
SPECLM_QUANTIZED_TARGETS(Q4_K)
SPECLM_QUANTIZED_TARGETS(Q5_K)
SPECLM_QUANTIZED_TARGETS(Q6_K)
