// y[M, N] = x[M, K] @ W^T for float32 x and a weight matrix W [N, K] kept as GGUF stores it:
// each of its N rows a run of quantized blocks (Q8_0, Q4_0, Q4_1: 32 weights a block; Q4_K,
// Q5_K, Q6_K: 256), read as stored and widened to float32 in registers. No float32 copy of
// the matrix exists: a 4-bit matrix streams about 0.56 bytes a weight instead of 4.
//
// Where the CPU has AVX512-VNNI, every format takes integer products instead (integer_blocks.h:
// the input rows split into three int8 digits a block of 32, the weights never widened),
// 1.3-2.7x the float route's speed at 1-5 rows; SPECLM_QUANTIZED_FLOAT=1 keeps the float route.
//
// Threads take output rows 16 at a time (`speclm::RunTasks`, parallel_tasks.h: the calling
// thread from the first rows on, a helper on XLA's own thread pool from the middle, each
// forward, and whoever runs out steals the back half of what the other has left).
// Where the integer route is taken, matrices load with sixteen rows interleaved (the '_x16'
// targets; `quantized.interleave`). With up to five input rows (a decode step, or
// a verification of γ ≤ 4 drafted tokens), the thread widens 64 weights of an output row at a
// time into registers and multiplies them into every input row at once (one input row takes
// four output rows at a time, two take two); with more input rows it widens the output row's
// K weights once into a buffer that stays in L1/L2 and takes the input rows five at a time.
// Every dot product runs the same code in the same order, whatever M and whichever thread
// (`DotRows`), so a row's result does not depend on how many rows share the call: speculative
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
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "integer_blocks.h"
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

// Each format: its block's weights and bytes, and how its weights widen into vectors of 16
// floats, with the products and sums in the order of ggml's reference, so the values are
// equal. The 32-weight formats: `Widen32(block, dm, w)`, one block's 32 weights, its float16
// scale d (and Q4_1's offset m) given as float32 in dm[0] (dm[1]) by `BlockScales`. The
// K-quants: `Widen64(row, k, w)`, the row's weights k … k + 63. Widening in registers, 64
// weights at a time, lets the products use them without a store and a reload.
struct Q8_0 {
  static constexpr int64_t kWeights = 32, kBytes = 34;
  static void Widen32(const uint8_t* b, const float* dm, Lanes* w) {
    w[0] = dm[0] * AsFloat(Signed16(b + 2));
    w[1] = dm[0] * AsFloat(Signed16(b + 18));
  }
};

struct Q4_0 {
  static constexpr int64_t kWeights = 32, kBytes = 18;
  static void Widen32(const uint8_t* b, const float* dm, Lanes* w) {
    const Ints q = Unsigned16(b + 2);
    w[0] = dm[0] * AsFloat((q & 0xf) - 8);
    w[1] = dm[0] * AsFloat((q >> 4) - 8);
  }
};

struct Q4_1 {
  static constexpr int64_t kWeights = 32, kBytes = 20;
  static void Widen32(const uint8_t* b, const float* dm, Lanes* w) {
    const Ints q = Unsigned16(b + 4);
    w[0] = dm[0] * AsFloat(q & 0xf) + dm[1];
    w[1] = dm[0] * AsFloat(q >> 4) + dm[1];
  }
};

// The two float16 values that open each of `blocks` consecutive 32-weight blocks from `first`
// (d, and Q4_1's m; for Q8_0 and Q4_0 the second is a quant byte pair, never used) as float32:
// dm[2b], dm[2b + 1]. Converted one by one inside the product loop, they took a load, a
// conversion and a broadcast each: six of the fifteen vector instructions of a Q4_1 block's
// widening and one-row product. Here sixteen blocks take one gather and two conversions.
template <typename F>
inline void BlockScales(const uint8_t* first, int64_t blocks, float* dm) {
  int64_t b = 0;
#if defined(__AVX512F__)
  const __m512i offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(F::kBytes)));
  for (; b + 16 <= blocks; b += 16) {
    const __m512i pairs = _mm512_i32gather_epi32(offsets, first + b * F::kBytes, 1);
    _mm512_storeu_ps(dm + 2 * b, _mm512_cvtph_ps(_mm512_castsi512_si256(pairs)));
    _mm512_storeu_ps(dm + 2 * b + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(pairs, 1)));
  }
#endif
  for (; b < blocks; ++b) {
    dm[2 * b] = Half(first + b * F::kBytes);
    dm[2 * b + 1] = Half(first + b * F::kBytes + 2);
  }
}

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

// Q4_K's and Q5_K's scales of sub-blocks j and j + 1 (j even) of the block at b: their
// weights are d1·q − c1 and d2·q − c2.
struct SubBlockScales {
  float d1, c1, d2, c2;
};

inline SubBlockScales ScalesOf(const uint8_t* b, int j) {
  const float d = Half(b), dmin = Half(b + 2);
  int s1, m1, s2, m2;
  ScaleMin(j, b + 4, &s1, &m1);
  ScaleMin(j + 1, b + 4, &s2, &m2);
  return {d * s1, dmin * m1, d * s2, dmin * m2};
}

// Q4_K and Q5_K: 64 weights are sub-blocks j and j + 1 (j even), the low and the high nibbles
// of the same 32 bytes.
struct Q4_K {
  static constexpr int64_t kWeights = 256, kBytes = 144;
  static void Widen64(const uint8_t* row, int64_t k, Lanes* w) {
    const uint8_t* b = row + k / kWeights * kBytes;
    const int j = static_cast<int>(k % kWeights) / 32;
    const uint8_t* q = b + 16 + 16 * j;
    const SubBlockScales s = ScalesOf(b, j);
    for (int h = 0; h < 2; ++h) {
      const Ints v = Unsigned16(q + 16 * h);
      w[h] = s.d1 * AsFloat(v & 0xf) - s.c1;
      w[2 + h] = s.d2 * AsFloat(v >> 4) - s.c2;
    }
  }
};

struct Q5_K {
  static constexpr int64_t kWeights = 256, kBytes = 176;
  static void Widen64(const uint8_t* row, int64_t k, Lanes* w) {
    const uint8_t* b = row + k / kWeights * kBytes;
    const int j = static_cast<int>(k % kWeights) / 32, bit = j;
    const uint8_t* high = b + 16;
    const uint8_t* q = b + 48 + 16 * j;
    const SubBlockScales s = ScalesOf(b, j);
    for (int h = 0; h < 2; ++h) {
      const Ints v = Unsigned16(q + 16 * h), top = Unsigned16(high + 16 * h);
      w[h] = s.d1 * AsFloat((v & 0xf) + (((top >> bit) & 1) << 4)) - s.c1;
      w[2 + h] = s.d2 * AsFloat((v >> 4) + (((top >> (bit + 1)) & 1) << 4)) - s.c2;
    }
  }
};

// Q6_K: a half block (128 weights) is four runs of 32 from 64 bytes of low nibbles and 32 of
// high bit pairs; the first 64 weights take the low nibbles, the second 64 the high ones.
struct Q6_K {
  static constexpr int64_t kWeights = 256, kBytes = 210;
  static void Widen64(const uint8_t* row, int64_t k, Lanes* w) {
    const uint8_t* b = row + k / kWeights * kBytes;
    const int part = static_cast<int>(k % kWeights) / 64, half = part / 2, upper = part % 2;
    const uint8_t* low = b + 64 * half;
    const uint8_t* high = b + 128 + 32 * half;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192) + 8 * half + 4 * upper;
    const float d = Half(b + 208);
    for (int h = 0; h < 2; ++h) {  // l = 16h … 16h + 15, scale index h
      const Ints l1 = Unsigned16(low + 16 * h), l2 = Unsigned16(low + 32 + 16 * h);
      const Ints top = Unsigned16(high + 16 * h) >> (4 * upper);
      const Ints q1 = ((upper ? l1 >> 4 : l1 & 0xf) | ((top & 3) << 4)) - 32;
      const Ints q2 = ((upper ? l2 >> 4 : l2 & 0xf) | (((top >> 2) & 3) << 4)) - 32;
      w[h] = (d * static_cast<float>(scales[h])) * AsFloat(q1);
      w[2 + h] = (d * static_cast<float>(scales[h + 2])) * AsFloat(q2);
    }
  }
};

// Where a product's weights come from: a stored row widened as it is read (`Blocks`), or a
// row widened once into a buffer (`Widened`: calls of more rows than fit in registers). Both
// give weights k … k + 63 (`Get64`) or a row's last 32 when K is not a multiple of 64 (`Get32`,
// 32-weight formats only: the K-quants' K is a multiple of 256).
template <typename F>
struct Blocks {
  const uint8_t* row;
  const float* dm;  // the 32-weight formats' block scales (`TaskScales`), K / 16 floats

  void Get64(int64_t k, Lanes* w) const {
    if constexpr (F::kWeights == 32) {
      Get32(k, w);
      Get32(k + 32, w + 2);
    } else {
      F::Widen64(row, k, w);
    }
  }
  void Get32(int64_t k, Lanes* w) const {
    if constexpr (F::kWeights == 32) F::Widen32(row + k / 32 * F::kBytes, dm + k / 16, w);
  }
};

// The block scales of `rows` consecutive stored rows (consecutive blocks: a row is whole
// blocks), converted once for a task's rows: dm + r · K / 16 holds row r's. The K-quants read
// theirs as they widen.
template <typename F>
inline void TaskScales(const uint8_t* first_row, int64_t rows, int64_t k_dim, float* dm) {
  if constexpr (F::kWeights == 32) BlockScales<F>(first_row, rows * (k_dim / 32), dm);
}

struct Widened {
  const float* w;
  void Get64(int64_t k, Lanes* out) const {
    for (int i = 0; i < 4; ++i) out[i] = Load(w + k + 16 * i);
  }
  void Get32(int64_t k, Lanes* out) const {
    for (int i = 0; i < 2; ++i) out[i] = Load(w + k + 16 * i);
  }
};

// A stored row widened to float32 into out[0 … K).
template <typename F>
void WidenRow(const Blocks<F>& blocks, int64_t k_dim, float* out) {
  int64_t k = 0;
  for (; k + 64 <= k_dim; k += 64) {
    Lanes w[4];
    blocks.Get64(k, w);
    for (int i = 0; i < 4; ++i) Store(out + k + 16 * i, w[i]);
  }
  if (k < k_dim) {
    Lanes w[2];
    blocks.Get32(k, w);
    for (int i = 0; i < 2; ++i) Store(out + k + 16 * i, w[i]);
  }
}

typedef float HalfLanes __attribute__((vector_size(32)));
typedef double Doubles __attribute__((vector_size(64)));

// The dot products of kRows input rows x[r] (`stride` apart) with kOuts weight rows (from
// `sources`) over k_dim (a multiple of 32), each weight used for every input row:
// out[o · kRows + r]. Each product's sum is the same whatever kRows, kOuts and the source (no
// two products' lanes mix, and both sources give the same widened values), so it is the one
// summation order of this file: four independent chains of 16 float32 lanes (the multiply-adds
// overlap instead of waiting on one another), added pairwise into 16 lanes and those into 16
// float64 lanes every kFlushEvery weights (16 terms a lane), the float64 lanes summed in a
// fixed order.
template <int kRows, int kOuts, typename Source>
inline void DotRows(const float* __restrict x, int64_t stride, const Source* sources,
                    int64_t k_dim, float* out) {
  Doubles lo[kOuts][kRows] = {}, hi[kOuts][kRows] = {};
  for (int64_t k0 = 0; k0 < k_dim; k0 += kFlushEvery) {
    const int64_t k1 = std::min(k0 + kFlushEvery, k_dim);
    Lanes a[kOuts][kRows][4] = {};
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {
      for (int o = 0; o < kOuts; ++o) {
        Lanes w[4];
        sources[o].Get64(k, w);
        for (int r = 0; r < kRows; ++r) {
          const float* xr = x + r * stride + k;
          a[o][r][0] += Load(xr) * w[0];
          a[o][r][1] += Load(xr + 16) * w[1];
          a[o][r][2] += Load(xr + 32) * w[2];
          a[o][r][3] += Load(xr + 48) * w[3];
        }
      }
    }
    if (k < k1) {  // a last 32
      for (int o = 0; o < kOuts; ++o) {
        Lanes w[2];
        sources[o].Get32(k, w);
        for (int r = 0; r < kRows; ++r) {
          a[o][r][0] += Load(x + r * stride + k) * w[0];
          a[o][r][1] += Load(x + r * stride + k + 16) * w[1];
        }
      }
    }
    for (int o = 0; o < kOuts; ++o)
      for (int r = 0; r < kRows; ++r) {
        const Lanes sum = (a[o][r][0] + a[o][r][1]) + (a[o][r][2] + a[o][r][3]);
        HalfLanes first, second;
        std::memcpy(&first, &sum, sizeof(first));
        std::memcpy(&second, reinterpret_cast<const char*>(&sum) + sizeof(first),
                    sizeof(second));
        lo[o][r] += __builtin_convertvector(first, Doubles);
        hi[o][r] += __builtin_convertvector(second, Doubles);
      }
  }
  for (int o = 0; o < kOuts; ++o)
    for (int r = 0; r < kRows; ++r) {
      const Doubles t = lo[o][r] + hi[o][r];
      out[o * kRows + r] = static_cast<float>(((t[0] + t[1]) + (t[2] + t[3])) +
                                              ((t[4] + t[5]) + (t[6] + t[7])));
    }
}

// Up to kMaxRowsInRegisters input rows take their products in one pass over the stored row,
// its blocks widened in registers (20 partial sums and 4 widened vectors of the 32 vector
// registers); more rows share a row widened once into a buffer.
constexpr int64_t kMaxRowsInRegisters = 5;

template <typename Source>
inline void DotSomeRows(const float* x, int64_t m, int64_t k_dim, const Source& source,
                        float* out) {
  switch (m) {
    case 1: return DotRows<1, 1>(x, k_dim, &source, k_dim, out);
    case 2: return DotRows<2, 1>(x, k_dim, &source, k_dim, out);
    case 3: return DotRows<3, 1>(x, k_dim, &source, k_dim, out);
    case 4: return DotRows<4, 1>(x, k_dim, &source, k_dim, out);
    default: return DotRows<5, 1>(x, k_dim, &source, k_dim, out);
  }
}

// Every input row's dot product with one stored weight row (`buffer`: K floats).
template <typename F>
inline void DotAllRows(const float* x, int64_t m, int64_t k_dim, const Blocks<F>& row,
                       float* buffer, float* out) {
  if (m <= kMaxRowsInRegisters) return DotSomeRows(x, m, k_dim, row, out);
  WidenRow(row, k_dim, buffer);
  for (int64_t r = 0; r < m; r += kMaxRowsInRegisters)
    DotSomeRows(x + r * k_dim, std::min(kMaxRowsInRegisters, m - r), k_dim, Widened{buffer},
                out + r);
}

// Output rows [row, end) kOuts at a time, for all kRows input rows (y [M, n], input row r
// at y's row_index[r]): more independent sums in flight and less fixed work per output row.
// Returns the first output row it left (fewer than kOuts).
template <int kRows, int kOuts, typename SourceOf>
inline int64_t DotOutputGroups(const float* x, int64_t k_dim, SourceOf source, int64_t row,
                               int64_t end, const int64_t* row_index, int64_t n, float* y) {
  for (; row + kOuts <= end; row += kOuts) {
    decltype(source(row)) group[kOuts];
    for (int o = 0; o < kOuts; ++o) group[o] = source(row + o);
    float outs[kOuts * kRows];
    DotRows<kRows, kOuts>(x, k_dim, group, k_dim, outs);
    for (int o = 0; o < kOuts; ++o)
      for (int r = 0; r < kRows; ++r) y[row_index[r] * n + row + o] = outs[o * kRows + r];
  }
  return row;
}

// Each format's layout for integer_blocks.h, where the CPU has AVX512-VNNI (the kernel is
// compiled for the machine it runs on); other CPUs widen to float.
template <typename F>
struct IntegerLayout {
  using type = void;
};
#if defined(SPECLM_INTEGER_BLOCKS)
#define SPECLM_INTEGER_LAYOUT(F)                   \
  template <>                                      \
  struct IntegerLayout<F> {                        \
    using type = speclm::integer_blocks::F##Layout; \
  };
SPECLM_INTEGER_LAYOUT(Q8_0)
SPECLM_INTEGER_LAYOUT(Q4_0)
SPECLM_INTEGER_LAYOUT(Q4_1)
SPECLM_INTEGER_LAYOUT(Q4_K)
SPECLM_INTEGER_LAYOUT(Q5_K)
SPECLM_INTEGER_LAYOUT(Q6_K)
#undef SPECLM_INTEGER_LAYOUT
#endif

// Whether products take integer_blocks.h's route in this process (AVX512-VNNI compiled in, and
// SPECLM_QUANTIZED_FLOAT unset). Only that route reads interleaved matrices.
bool IntegerRoute() {
#if defined(SPECLM_INTEGER_BLOCKS)
  return speclm::integer_blocks::Enabled();
#else
  return false;
#endif
}

// Matrices one `MatmulManyImpl` call takes (`quantized.MAX_MATRICES_A_CALL`).
constexpr size_t kMaxMatrices = 4;

#if defined(SPECLM_INTEGER_BLOCKS)
// The integer route (integer_blocks.h): the live rows of x split into digits once, then the
// 16-row groups of `count` matrices (rows n[i], each as stored or interleaved) shared out
// between the threads as one call's tasks, y[i] = x @ W_i^T. `MatmulImpl` passes one matrix,
// `MatmulManyImpl` several over the same x; a group's products are the same either way.
template <typename Layout>
void IntegerProducts(ffi::ThreadPool& pool, const speclm::LiveRows& live, int64_t k_dim,
                     int64_t row_bytes, bool interleaved, size_t count,
                     const uint8_t* const* w_data, const int64_t* n, float* const* y_data) {
  namespace ib = speclm::integer_blocks;
  static_assert(kRowsPerTask == ib::kGroup, "a task is one group of lanes");
  int64_t start[kMaxMatrices + 1] = {0};  // rows before matrix i, counting whole groups
  for (size_t i = 0; i < count; ++i)
    start[i + 1] = start[i] + (n[i] + kRowsPerTask - 1) / kRowsPerTask * kRowsPerTask;
  // The calling thread's buffers, reused from call to call; the tasks, on other threads too,
  // read them through `split` (a thread_local named in the lambda would be theirs).
  thread_local ib::Digits digits;
  const int64_t m = live.count();
  ib::Split(live.data, m, k_dim, &digits);
  const ib::Digits& split = digits;
  const int64_t* row_index = live.index.data();
  speclm::RunTasks(pool, start[count], kRowsPerTask, [&](int64_t first, int64_t end) {
    size_t i = 0;
    while (first >= start[i + 1]) ++i;  // a task is one group, within one matrix
    const int64_t row = first - start[i];
    ib::TaskProducts<Layout>(w_data[i], row_bytes, row, std::min(row + kRowsPerTask, n[i]),
                             interleaved, split, m, row_index, n[i], y_data[i]);
  });
}
#endif

// x @ W^T with W as the file stores it or, with kInterleaved, as `quantized.interleave` wrote
// it (sixteen rows' blocks interleaved; integer route only).
template <typename F, bool kInterleaved>
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
  if (kInterleaved && (n % kRowsPerTask != 0 || !IntegerRoute())) {
    return ffi::Error::InvalidArgument(
        "quantized_matmul: interleaved rows need a multiple of 16 rows and the integer route"
        " (AVX512-VNNI, SPECLM_QUANTIZED_FLOAT unset)");
  }
  // All-zero rows are not multiplied (zero_rows.h): m counts the others.
  const speclm::LiveRows live = speclm::FindLiveRows(x.typed_data(), x_dims[0], k_dim);
  const int64_t m = live.count();
  const int64_t* row_index = live.index.data();
  const float* x_data = live.data;
  const uint8_t* w_data = w.typed_data();
  float* y_data = y->typed_data();
  speclm::ZeroDeadRows(live, x_dims[0], n, y_data);
  if (m == 0) return ffi::Error::Success();
#if defined(SPECLM_INTEGER_BLOCKS)
  // Integer products (integer_blocks.h), where the CPU has VNNI.
  namespace ib = speclm::integer_blocks;
  using Layout = typename IntegerLayout<F>::type;
  if constexpr (!std::is_void_v<Layout>) {
    if (ib::Enabled()) {
      IntegerProducts<Layout>(pool, live, k_dim, row_bytes, kInterleaved, 1, &w_data, &n,
                              &y_data);
      return ffi::Error::Success();
    }
  }
#endif
  speclm::RunTasks(pool, n, kRowsPerTask, [=](int64_t first, int64_t end) {
    thread_local std::vector<float> widened, scales, dots;
    if (static_cast<int64_t>(widened.size()) < k_dim) widened.resize(k_dim);
    if (static_cast<int64_t>(scales.size()) < kRowsPerTask * k_dim / 16)
      scales.resize(kRowsPerTask * k_dim / 16);
    if (static_cast<int64_t>(dots.size()) < m) dots.resize(m);
    TaskScales<F>(w_data + first * row_bytes, end - first, k_dim, scales.data());
    const auto source = [&](int64_t r) {
      return Blocks<F>{w_data + r * row_bytes, scales.data() + (r - first) * (k_dim / 16)};
    };
    // One input row takes four output rows at a time, two take two.
    int64_t row = first;
    if (m == 1) row = DotOutputGroups<1, 4>(x_data, k_dim, source, row, end, row_index, n, y_data);
    if (m == 2) row = DotOutputGroups<2, 2>(x_data, k_dim, source, row, end, row_index, n, y_data);
    for (; row < end; ++row) {
      DotAllRows(x_data, m, k_dim, source(row), widened.data(), dots.data());
      for (int64_t r = 0; r < m; ++r) y_data[row_index[r] * n + row] = dots[r];
    }
  });
  return ffi::Error::Success();
}

// x @ W_i^T for a few matrices over the same x (a layer's query, key and value, or its gate
// and up), all interleaved (integer route only): x is split into digits once, and the
// matrices' 16-row groups are shared out between the threads as one call's tasks. Each
// output holds exactly what the one-matrix call gives (the same `TaskProducts` per group).
template <typename F>
ffi::Error MatmulManyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                          ffi::RemainingRets ys) {
#if defined(SPECLM_INTEGER_BLOCKS)
  using Layout = typename IntegerLayout<F>::type;
  if constexpr (!std::is_void_v<Layout>) {
    const auto x_dims = x.dimensions();
    const size_t count = ws.size();
    if (x_dims.size() != 2 || x_dims[1] % F::kWeights != 0 || count == 0 ||
        count > kMaxMatrices || ys.size() != count || !IntegerRoute()) {
      return ffi::Error::InvalidArgument(
          "quantized_matmul_many: expects x [M, K], 1-4 interleaved matrices and as many"
          " outputs, on the integer route (AVX512-VNNI, SPECLM_QUANTIZED_FLOAT unset)");
    }
    const int64_t k_dim = x_dims[1], row_bytes = k_dim / F::kWeights * F::kBytes;
    const uint8_t* w_data[kMaxMatrices];
    float* y_data[kMaxMatrices];
    int64_t n[kMaxMatrices];
    for (size_t i = 0; i < count; ++i) {
      auto w = ws.get<ffi::Buffer<ffi::U8>>(i);
      auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
      if (w.has_error() || y.has_error()) return ffi::Error::InvalidArgument(
          "quantized_matmul_many: matrices must be uint8 and outputs float32");
      const auto w_dims = w->dimensions();
      const auto y_dims = (*y)->dimensions();
      if (w_dims.size() != 2 || w_dims[1] != row_bytes || w_dims[0] % kRowsPerTask != 0 ||
          y_dims.size() != 2 || y_dims[0] != x_dims[0] || y_dims[1] != w_dims[0]) {
        return ffi::Error::InvalidArgument(
            "quantized_matmul_many: matrix i must be [N_i, K / block weights × block bytes]"
            " with N_i a multiple of 16, and output i [M, N_i]");
      }
      w_data[i] = w->typed_data();
      y_data[i] = (*y)->typed_data();
      n[i] = w_dims[0];
    }
    const speclm::LiveRows live = speclm::FindLiveRows(x.typed_data(), x_dims[0], k_dim);
    const int64_t m = live.count();
    for (size_t i = 0; i < count; ++i) speclm::ZeroDeadRows(live, x_dims[0], n[i], y_data[i]);
    if (m == 0) return ffi::Error::Success();
    IntegerProducts<Layout>(pool, live, k_dim, row_bytes, true, count, w_data, n, y_data);
    return ffi::Error::Success();
  }
#endif
  return ffi::Error::InvalidArgument(
      "quantized_matmul_many: needs the integer route (AVX512-VNNI) and a format it serves");
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
    thread_local std::vector<float> scales;
    if (static_cast<int64_t>(scales.size()) < kRowsPerTask * k_dim / 16)
      scales.resize(kRowsPerTask * k_dim / 16);
    TaskScales<F>(w_data + first * row_bytes, end - first, k_dim, scales.data());
    for (int64_t row = first; row < end; ++row)
      WidenRow(Blocks<F>{w_data + row * row_bytes, scales.data() + (row - first) * (k_dim / 16)},
               k_dim, y_data + row * k_dim);
  });
  return ffi::Error::Success();
}

}  // namespace

#define SPECLM_QUANTIZED_TARGETS(F)                                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmul_##F, (MatmulImpl<F, false>),            \
                                ffi::Ffi::Bind()                                        \
                                    .Ctx<ffi::ThreadPool>()                             \
                                    .Arg<ffi::Buffer<ffi::F32>>()                       \
                                    .Arg<ffi::Buffer<ffi::U8>>()                        \
                                    .Ret<ffi::Buffer<ffi::F32>>());                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmul_##F##_x16, (MatmulImpl<F, true>),       \
                                ffi::Ffi::Bind()                                        \
                                    .Ctx<ffi::ThreadPool>()                             \
                                    .Arg<ffi::Buffer<ffi::F32>>()                       \
                                    .Arg<ffi::Buffer<ffi::U8>>()                        \
                                    .Ret<ffi::Buffer<ffi::F32>>());                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmulMany_##F##_x16, MatmulManyImpl<F>,       \
                                ffi::Ffi::Bind()                                        \
                                    .Ctx<ffi::ThreadPool>()                             \
                                    .Arg<ffi::Buffer<ffi::F32>>()                       \
                                    .RemainingArgs()                                    \
                                    .RemainingRets());                                  \
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

// 1 where matrices should be interleaved at load time (`quantized.interleaving`), else 0.
extern "C" int SpeclmQuantizedIntegerRoute() { return IntegerRoute() ? 1 : 0; }
