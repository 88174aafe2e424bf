// Products with GGUF's blocks (Q8_0, Q4_0, Q4_1 and the K-quants Q4_K, Q5_K, Q6_K) on integer
// dot-product instructions (AVX512-VNNI's vpdpbusd: 64 byte products an instruction), for
// quantized_matmul.cc.
//
// The widening to float32 costs more than the products it feeds: about twelve vector
// instructions for every 64 weights of a 4-bit row, against four multiply-adds for each input
// row. Here the weights stay integers and the input rows become integers instead, once a call:
//
//   each block of 32 inputs x_j, with s = max|x_j| / 127 and u = s / 2^16, is written as
//   X_j = 2^16 a_j + 2^8 b_j + c_j (three int8 digits: a = round(x / s), b and c the rounded
//   remainders in steps of s / 2^8 and s / 2^16), so x_j = u X_j + e_j, |e_j| ≤ s / 2^16;
//
// a block's integer sum T = Σ q_j X_j is exact (three vpdpbusd per 64 products, shifted and
// added in int32; vpdpbusd takes unsigned weights, so 4-6-bit quants go in as stored and Q8_0's
// as q + 128, and the sums are centred back in integers), and the block adds its share to the
// float sum:
//   Q4_0 (w = d (q − 8))    u d Σ (q − 8) X
//   Q4_1 (w = d q + m)      u d Σ (q − 8) X + (m + 8 d) · u ΣX
//   Q8_0 (w = d q, q int8)  u d Σ q X
//   Q4_K, Q5_K (w = d s_j q − dmin m_j per 32 of a superblock of 256)
//                           u d s_j Σ (q − z) X + (z d s_j − dmin m_j) · u ΣX, z = 8, 16
//   Q6_K (w = d s_i (q − 32) per 16)   u d s_i Σ (q − 32) X over each half of the block
// Each input is thus exact to 1.2e-7 of its block's largest |x| (23 bits), about float32's own
// precision: products stay within 1e-6 of Σ|x||w| of the float64 product of the
// widened weights (tests/test_quantized.py), as the float kernel's do.
//
// Lanes are output rows: for sixteen stored rows (a task of quantized_matmul.cc), each 32-bit
// lane holds four consecutive weights of one row, and every vpdpbusd multiplies them by four
// digits of one input row broadcast to all lanes. Rows as the file stores them have a block's
// quant bytes transposed in registers and its scales gathered; rows interleaved at load time
// (`quantized.interleave`, the '_x16' formats) already hold them in that order, and a block of
// the sixteen rows is a few plain loads from one run of memory (2-3x faster a decode step).
// Each input row's arithmetic is the same whatever the number of rows in the call (rows are
// taken five at a time, each with its own sums), so a row's product does not depend on the
// call's row count. Sums go to float64 every 32 blocks.

#ifndef SPECLM_KERNELS_INTEGER_BLOCKS_H_
#define SPECLM_KERNELS_INTEGER_BLOCKS_H_

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPECLM_INTEGER_BLOCKS 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

namespace speclm {
namespace integer_blocks {

// Whether the products take this route: yes unless SPECLM_QUANTIZED_FLOAT is set to something
// other than 0 (then the blocks are widened to float32 as on CPUs without VNNI; tests and A/B
// timings use it). Read once a process.
inline bool Enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("SPECLM_QUANTIZED_FLOAT");
    return value == nullptr || value[0] == '\0' || (value[0] == '0' && value[1] == '\0');
  }();
  return enabled;
}

constexpr int64_t kBlock = 32;         // weights (and input values) a block
constexpr int64_t kGroup = 16;         // stored rows a group: one lane each
constexpr int64_t kMaxRows = 5;        // input rows a pass over the group
constexpr int64_t kFlushBlocks = 32;   // blocks summed in float32 before a float64 flush
constexpr int64_t kDigitBytes = 3 * kBlock;  // a block's digits a, b, c of one input row

// An input block's scale u and its digit sums: ΣX = 2^16 Σa + Σbc, Σbc = 2^8 Σb + Σc; also
// over its first 16 inputs (Q6_K scales halves of blocks).
struct BlockScale {
  float unit, unit_sum;  // u, u · ΣX
  int32_t sum_a, sum_bc, first_a, first_bc;
};

// The m input rows split into digits: row r's block b has its digits at
// digits[(b · m + r) · 96] (a[32], b[32], c[32]; a block's rows are consecutive) and its scale
// at scales[r · blocks + b].
struct Digits {
  std::vector<int8_t> digits;
  std::vector<BlockScale> scales;
  int64_t blocks = 0;
};

// Rounds to the nearest integer (ties to even) in int32 lanes.
inline __m512i Round(__m512 v) {
  return _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// v limited to −below … above.
inline __m512i Clamp(__m512i v, int below, int above) {
  return _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(above)),
                          _mm512_set1_epi32(-below));
}

// Splits the m rows of x [m, k] (k a multiple of 32) into `out`.
inline void Split(const float* x, int64_t m, int64_t k, Digits* out) {
  const int64_t blocks = k / kBlock;
  out->blocks = blocks;
  out->digits.resize(m * blocks * kDigitBytes);
  out->scales.resize(m * blocks);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + i * k + b * kBlock;
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
      const float largest = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const bool finite = (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) |
                           _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) == 0 &&
                          largest <= 3.4e38f;
      int8_t* d = out->digits.data() + (b * m + i) * kDigitBytes;
      BlockScale* scale = out->scales.data() + i * blocks + b;
      if (!finite || largest == 0.0f) {  // a NaN or infinite input makes the row's sums NaN
        std::memset(d, 0, kDigitBytes);
        const float unit = finite ? 0.0f : __builtin_nanf("");
        *scale = {unit, unit, 0, 0, 0, 0};
        continue;
      }
      const float s = largest / 127.0f, steps = 127.0f / largest;
      __m512i sum_a = _mm512_setzero_si512(), sum_bc = _mm512_setzero_si512();
      const __m512 halves[2] = {v0, v1};
      for (int h = 0; h < 2; ++h) {
        __m512i a = Clamp(Round(_mm512_mul_ps(halves[h], _mm512_set1_ps(steps))), 127, 127);
        const __m512 r1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(s), halves[h]);
        // |r1| ≤ s / 2, so b is −128 … 128; 128 carries into a (then below 127: a = 127 leaves
        // r1 ≤ 0) as a + 1 and b = −128, the same X.
        __m512i bb = Round(_mm512_mul_ps(r1, _mm512_set1_ps(steps * 256.0f)));
        const __m512 r2 =
            _mm512_fnmadd_ps(_mm512_cvtepi32_ps(bb), _mm512_set1_ps(s / 256.0f), r1);
        const __mmask16 carry = _mm512_cmpgt_epi32_mask(bb, _mm512_set1_epi32(127));
        a = _mm512_mask_add_epi32(a, carry, a, _mm512_set1_epi32(1));
        bb = Clamp(_mm512_mask_sub_epi32(bb, carry, bb, _mm512_set1_epi32(256)), 128, 127);
        // |r2| ≤ s / 2^9: c is −128 … 128, and 128 is taken as 127 (one step of s / 2^16).
        const __m512i c =
            Clamp(Round(_mm512_mul_ps(r2, _mm512_set1_ps(steps * 65536.0f))), 128, 127);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16 * h), _mm512_cvtepi32_epi8(a));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 32 + 16 * h), _mm512_cvtepi32_epi8(bb));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 64 + 16 * h), _mm512_cvtepi32_epi8(c));
        sum_a = _mm512_add_epi32(sum_a, a);
        sum_bc = _mm512_add_epi32(sum_bc, _mm512_add_epi32(_mm512_slli_epi32(bb, 8), c));
        if (h == 0) {
          scale->first_a = _mm512_reduce_add_epi32(sum_a);
          scale->first_bc = _mm512_reduce_add_epi32(sum_bc);
        }
      }
      scale->unit = s / 65536.0f;
      scale->sum_a = _mm512_reduce_add_epi32(sum_a);
      scale->sum_bc = _mm512_reduce_add_epi32(sum_bc);
      scale->unit_sum =
          scale->unit * static_cast<float>(65536 * scale->sum_a + scale->sum_bc);
    }
  }
}

// Each format: its block bytes, where a block's quants start, the centre z its sums are taken
// about (Σ (q' − z) X: the middle of the unsigned quants q'), whether the block has an offset
// term (w = d q + m, or the K-quants' d s q − dmin m) and whether its superblock's 6-bit scales
// and mins are ggml's 12 packed bytes (Q4_K, Q5_K).
template <int64_t Bytes, int64_t Quants, int64_t Centre, bool Offset, bool PackedScales>
struct Layout {
  static constexpr int64_t kBytes = Bytes, kQuants = Quants, kCentre = Centre;
  static constexpr bool kOffset = Offset, kPackedScales = PackedScales;
};
//                        bytes  quants  z  offset packed scales
using Q8_0Layout = Layout<34,    2,    128, false, false>;
using Q4_0Layout = Layout<18,    2,      8, false, false>;
using Q4_1Layout = Layout<20,    4,      8, true,  false>;
// Q4_K: superblocks of 256 weights (144 bytes: d, dmin, 12 bytes of 6-bit scales and mins,
// 128 bytes of nibbles), each eight blocks of 32 with w = d s_j q − dmin m_j. Q5_K: as Q4_K,
// with 32 bytes of fifth bits (bit j of byte l: weight l of block j) before the nibbles.
using Q4_KLayout = Layout<144,   16,     8, true,  true>;
using Q5_KLayout = Layout<176,   48,    16, true,  true>;
// Q6_K: superblocks of 256 weights (210 bytes: 128 of low nibbles, 64 of high bit pairs, 16
// int8 scales, d), sixteen runs of 16 with w = d s (q − 32); q is 6 bits.
using Q6_KLayout = Layout<210,   0,     32, false, false>;

// Sixteen bytes at the same offset of sixteen rows, transposed: lane l of out[i] holds bytes
// 4i … 4i + 3 of row l (rows `offsets` bytes from `p`).
inline void Transpose16(const uint8_t* p, const int64_t* offsets, __m512i* out) {
  __m512i z[4];
  for (int j = 0; j < 4; ++j) {
    __m512i v = _mm512_castsi128_si512(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + offsets[4 * j])));
    for (int t = 1; t < 4; ++t)
      v = _mm512_inserti32x4(
          v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + offsets[4 * j + t])), t);
    z[j] = v;  // rows 4j … 4j + 3, four 32-bit words each
  }
  const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
  const __m512i second = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23,
                                           27, 31);
  const __m512i a01 = _mm512_permutex2var_epi32(z[0], first, z[1]);  // rows 0–7: words 0, 1
  const __m512i a23 = _mm512_permutex2var_epi32(z[0], second, z[1]);
  const __m512i b01 = _mm512_permutex2var_epi32(z[2], first, z[3]);  // rows 8–15
  const __m512i b23 = _mm512_permutex2var_epi32(z[2], second, z[3]);
  out[0] = _mm512_shuffle_i64x2(a01, b01, 0x44);
  out[1] = _mm512_shuffle_i64x2(a01, b01, 0xEE);
  out[2] = _mm512_shuffle_i64x2(a23, b23, 0x44);
  out[3] = _mm512_shuffle_i64x2(a23, b23, 0xEE);
}

// Where a group of sixteen stored rows keeps its blocks. As the file stores them (`Stored`),
// row l's block starts `offsets[l]` bytes after row 0's, and sixteen rows' bytes at one offset
// are transposed in registers or gathered. Interleaved at load time (`Interleaved`,
// `quantized.interleave`): each block of the group's sixteen rows is one run of 16 × block
// bytes, in which byte o of row l's block (o a multiple of the field's unit u, 4 bytes, or 2
// for a 16-bit scale field) is at 16 o + u l, so that a field of the sixteen rows is one or a
// few plain vector loads and the group is read front to back.
struct Stored {
  const int64_t* offsets;
  __m512i gather;  // offsets as int32 lanes
  static constexpr int64_t kSpan = 1;  // bytes of the group a block byte takes
  // Sixteen bytes at block offset o of each row: lane l of out[i] holds bytes 4i … 4i + 3.
  void Quad(const uint8_t* p, int64_t o, __m512i* out) const { Transpose16(p + o, offsets, out); }
  // Four bytes at o of each row, lane l row l's.
  __m512i Word(const uint8_t* p, int64_t o) const {
    return _mm512_i32gather_epi32(gather, p + o, 1);
  }
  // Two bytes at o of each row, in the low half of lane l (the high half is not defined);
  // `block_bytes` keeps the read inside the block.
  __m512i Half(const uint8_t* p, int64_t o, int64_t block_bytes) const {
    if (o + 4 <= block_bytes) return Word(p, o);
    return _mm512_srli_epi32(Word(p, o - 2), 16);
  }
};

struct Interleaved {
  static constexpr int64_t kSpan = kGroup;
  void Quad(const uint8_t* p, int64_t o, __m512i* out) const {
    for (int i = 0; i < 4; ++i) out[i] = _mm512_loadu_si512(p + kGroup * o + 64 * i);
  }
  __m512i Word(const uint8_t* p, int64_t o) const { return _mm512_loadu_si512(p + kGroup * o); }
  __m512i Half(const uint8_t* p, int64_t o, int64_t) const {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        p + kGroup * o)));
  }
};

// Block b (32 weights) of sixteen rows as eight vectors of unsigned weights q', lane l of w[i]
// weights 4i … 4i + 3 of row l (q' = q for 4 and 6 bits, q + 128 for Q8_0), with its scale d
// (Q6_K: d[0] and d[1], of its two halves) and, where the format has one, the weight of the
// centred offset: w = d (q − 8) + (m + 8 d). `first` is the group's first byte.
template <typename L, typename Rows>
inline void LoadBlock(const uint8_t* first, int64_t b, const Rows& rows, __m512i* w, __m512* d,
                      __m512* offset) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  *offset = _mm512_setzero_ps();
  if constexpr (L::kBytes == Q6_KLayout::kBytes) {
    // Within a half of 128 weights (n), block k takes the low (k < 2) or high nibbles of bytes
    // 32 (k % 2) … of its 64, bits 2k and 2k + 1 of its 32 high bytes, scales 2k and 2k + 1.
    const uint8_t* p = first + b / 8 * L::kBytes * Rows::kSpan;
    const int n = static_cast<int>(b % 8) / 4, k = static_cast<int>(b % 4);
    const int64_t nibbles = 64 * n + 32 * (k % 2), high = 128 + 32 * n;
    __m512i pairs[8];
    rows.Quad(p, nibbles, w);
    rows.Quad(p, nibbles + 16, w + 4);
    rows.Quad(p, high, pairs);
    rows.Quad(p, high + 16, pairs + 4);
    const __m512i two = _mm512_set1_epi8(3);
    for (int i = 0; i < 8; ++i) {
      const __m512i q = _mm512_and_si512(k / 2 ? _mm512_srli_epi16(w[i], 4) : w[i], low);
      const __m512i top = _mm512_and_si512(_mm512_srli_epi16(pairs[i], 2 * k), two);
      w[i] = _mm512_or_si512(q, _mm512_slli_epi16(top, 4));
    }
    const __m512i scales = rows.Half(p, 192 + 8 * n + 2 * k, L::kBytes);
    const __m512 dd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(rows.Half(p, 208, L::kBytes)));
    d[0] = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(scales, 24),
                                                                  24)));
    d[1] = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(scales, 16),
                                                                  24)));
    return;
  }
  if constexpr (L::kPackedScales) {
    const uint8_t* p = first + b / 8 * L::kBytes * Rows::kSpan;
    const int j = static_cast<int>(b % 8), shift = 8 * (j % 4);
    const auto word = [&](int at) {  // bytes at … at + 3 of each row, shifted to byte j % 4
      return _mm512_srli_epi32(rows.Word(p, at), shift);
    };
    const __m512i halves = rows.Word(p, 0);
    const __m512i s0 = word(4), s1 = word(8), six = _mm512_set1_epi32(63);
    __m512i scale, min;  // the 6-bit s_j and m_j, as ggml's get_scale_min_k4 reads them
    if (j < 4) {
      scale = _mm512_and_si512(s0, six);
      min = _mm512_and_si512(s1, six);
    } else {
      const __m512i s2 = word(12), four = _mm512_set1_epi32(0xf), top = _mm512_set1_epi32(0x30);
      scale = _mm512_or_si512(_mm512_and_si512(s2, four),
                              _mm512_and_si512(_mm512_srli_epi32(s0, 2), top));
      min = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, 4), four),
                            _mm512_and_si512(_mm512_srli_epi32(s1, 2), top));
    }
    d[0] = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(halves)),
                         _mm512_cvtepi32_ps(scale));
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(halves, 16)));
    *offset = _mm512_fmsub_ps(d[0], _mm512_set1_ps(static_cast<float>(L::kCentre)),
                              _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(min)));
    // Blocks 2c and 2c + 1 are the low and the high nibbles of the same 32 bytes.
    const int64_t quants = L::kQuants + 32 * (j / 2);
    rows.Quad(p, quants, w);
    rows.Quad(p, quants + 16, w + 4);
    for (int i = 0; i < 8; ++i)
      w[i] = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(w[i], 4) : w[i], low);
    if constexpr (L::kCentre == 16) {  // Q5_K: bit j of the 32 bytes at 16 is the fifth bit
      __m512i fifth[8];
      rows.Quad(p, 16, fifth);
      rows.Quad(p, 32, fifth + 4);
      const __m512i one = _mm512_set1_epi8(1);
      for (int i = 0; i < 8; ++i) {
        const __m512i bit = _mm512_and_si512(_mm512_srli_epi16(fifth[i], j), one);
        w[i] = _mm512_or_si512(w[i], _mm512_slli_epi16(bit, 4));
      }
    }
    return;
  }
  const uint8_t* p = first + b * L::kBytes * Rows::kSpan;
  // d (and Q4_1's m above it): Q4_1's two scales are one 4-byte field, Q4_0's and Q8_0's d a
  // 2-byte one.
  const __m512i halves = L::kOffset ? rows.Word(p, 0) : rows.Half(p, 0, L::kBytes);
  d[0] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(halves));
  if constexpr (L::kCentre == 8) {
    __m512i packed[4];
    rows.Quad(p, L::kQuants, packed);
    for (int i = 0; i < 4; ++i) {  // low nibbles: weights 0–15, high: 16–31
      w[i] = _mm512_and_si512(packed[i], low);
      w[4 + i] = _mm512_and_si512(_mm512_srli_epi16(packed[i], 4), low);
    }
    if constexpr (L::kOffset) {
      *offset = _mm512_fmadd_ps(d[0], _mm512_set1_ps(8.0f),
                                _mm512_cvtph_ps(_mm512_cvtepi32_epi16(
                                    _mm512_srli_epi32(halves, 16))));
    }
  } else {
    rows.Quad(p, L::kQuants, w);
    rows.Quad(p, L::kQuants + 16, w + 4);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int i = 0; i < 8; ++i) w[i] = _mm512_xor_si512(w[i], flip);  // q + 128
  }
}

// acc += the byte products of w's lanes with the four bytes at p (the same in every lane),
// taken as a broadcast memory operand: no instruction of its own to broadcast them.
inline __m512i DotBroadcast(__m512i acc, __m512i w, const int8_t* p) {
  __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[acc]"
          : [acc] "+v"(acc)
          : [w] "v"(w), [x] "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// A block's share of an input row's sum, added to `sum`: the digit sums over the stored q'
// (int32 lanes, one a stored row) taken with vpdpbusd from the row's digits at `xr`, scaled by
// the stored rows' d and the input block's unit, plus the offset weight times u ΣX. The sums
// are centred in integers (q − 8, q, q − 32), so that no float subtraction of two large terms
// cancels: Σ (q' − z) X = 2^16 (Σ q' a − z Σa) + (2^8 Σ q' b + Σ q' c − z Σbc), the chains of
// a and c starting at −z Σa and −z Σbc. Both parts are exact in int32 and in float32 (below
// 2^24 for the b, c part of 4-bit quants, where the whole is then rounded once, as a conversion
// of the exact sum would be), and 2^16 times the first part may pass 2^31 (Q8_0, Q5_K, Q6_K),
// so they are joined by one float multiply-add. Three chains of eight vpdpbusd (Q6_K: two
// halves of four, each with its own scale); consecutive blocks overlap.
template <typename L>
inline __m512 AddBlock(__m512 sum, const __m512i* w, const int8_t* xr, const __m512* d,
                       __m512 offset, const BlockScale& s) {
  const __m512 unit = _mm512_set1_ps(s.unit);
  const auto centred = [&](int first, int count, int32_t za, int32_t zbc) {
    __m512i ta = _mm512_set1_epi32(-za), tb = _mm512_setzero_si512(),
            tc = _mm512_set1_epi32(-zbc);
    for (int i = first; i < first + count; ++i) {
      ta = DotBroadcast(ta, w[i], xr + 4 * i);
      tb = DotBroadcast(tb, w[i], xr + 32 + 4 * i);
      tc = DotBroadcast(tc, w[i], xr + 64 + 4 * i);
    }
    const __m512i bc = _mm512_add_epi32(_mm512_slli_epi32(tb, 8), tc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(ta), _mm512_set1_ps(65536.0f),
                           _mm512_cvtepi32_ps(bc));
  };
  if constexpr (L::kBytes == Q6_KLayout::kBytes) {  // two halves, each with its own scale
    const int32_t a[2] = {s.first_a, s.sum_a - s.first_a};
    const int32_t bc[2] = {s.first_bc, s.sum_bc - s.first_bc};
    for (int h = 0; h < 2; ++h) {
      const __m512 total = centred(4 * h, 4, 32 * a[h], 32 * bc[h]);
      sum = _mm512_fmadd_ps(total, _mm512_mul_ps(d[h], unit), sum);
    }
    return sum;
  }
  const __m512 total = centred(0, 8, L::kCentre * s.sum_a, L::kCentre * s.sum_bc);
  sum = _mm512_fmadd_ps(total, _mm512_mul_ps(d[0], unit), sum);
  if constexpr (L::kOffset) sum = _mm512_fmadd_ps(offset, _mm512_set1_ps(s.unit_sum), sum);
  return sum;
}

// The products of kRows input rows (digits from `x`: block b's at x + b · stride, the rows 96
// bytes apart; scales `scales[r]`) with a group of sixteen stored rows, `blocks` blocks each:
// out[16 r + l] for stored row l. `first` is the group's first byte, its rows read through
// `rows` (`Stored` or `Interleaved`).
template <typename L, int kRows, typename Rows>
inline void GroupProducts(const uint8_t* first, const Rows& rows, int64_t blocks,
                          const int8_t* x, int64_t stride, const BlockScale* const* scales,
                          float* out) {
  __m512d lo[kRows], hi[kRows];
  for (int r = 0; r < kRows; ++r) lo[r] = hi[r] = _mm512_setzero_pd();
  for (int64_t b0 = 0; b0 < blocks; b0 += kFlushBlocks) {
    __m512 sum[kRows];
    for (int r = 0; r < kRows; ++r) sum[r] = _mm512_setzero_ps();
    for (int64_t b = b0; b < std::min(b0 + kFlushBlocks, blocks); ++b) {
      __m512i w[8];
      __m512 d[2], offset;
      LoadBlock<L>(first, b, rows, w, d, &offset);
      const int8_t* xb = x + b * stride;
      for (int r = 0; r < kRows; ++r)
        sum[r] = AddBlock<L>(sum[r], w, xb + r * kDigitBytes, d, offset, scales[r][b]);
    }
    for (int r = 0; r < kRows; ++r) {
      lo[r] = _mm512_add_pd(lo[r], _mm512_cvtps_pd(_mm512_castps512_ps256(sum[r])));
      hi[r] = _mm512_add_pd(hi[r], _mm512_cvtps_pd(_mm512_extractf32x8_ps(sum[r], 1)));
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(out + 16 * r, _mm512_cvtpd_ps(lo[r]));
    _mm256_storeu_ps(out + 16 * r + 8, _mm512_cvtpd_ps(hi[r]));
  }
}

// Products of the m split rows with stored rows [first, end) (at most 16), written to
// y[row_index[i] · n + row]. With `interleaved`, the matrix is stored as
// `quantized.interleave` writes it (then n is a multiple of 16 and every group whole).
template <typename L>
inline void TaskProducts(const uint8_t* w, int64_t row_bytes, int64_t first, int64_t end,
                         bool interleaved, const Digits& digits, int64_t m,
                         const int64_t* row_index, int64_t n, float* y) {
  int64_t offsets[kGroup];
  alignas(64) int32_t scale_offsets[kGroup];
  for (int64_t l = 0; l < kGroup; ++l) {  // a short last group repeats its last row
    offsets[l] = std::min(l, end - first - 1) * row_bytes;
    scale_offsets[l] = static_cast<int32_t>(offsets[l]);
  }
  const __m512i gather = _mm512_load_si512(scale_offsets);
  const uint8_t* rows_start = w + first * row_bytes;
  const int64_t blocks = digits.blocks, stride = m * kDigitBytes;
  float out[kGroup * kMaxRows];
  for (int64_t i0 = 0; i0 < m; i0 += kMaxRows) {
    const int64_t count = std::min(kMaxRows, m - i0);
    const int8_t* x = digits.digits.data() + i0 * kDigitBytes;
    const BlockScale* scales[kMaxRows];
    for (int64_t r = 0; r < count; ++r) scales[r] = digits.scales.data() + (i0 + r) * blocks;
    const auto run = [&](auto rows) {
      constexpr int kRows = decltype(rows)::value;
      if (interleaved) {
        GroupProducts<L, kRows>(rows_start, Interleaved{}, blocks, x, stride, scales, out);
      } else {
        GroupProducts<L, kRows>(rows_start, Stored{offsets, gather}, blocks, x, stride, scales,
                                out);
      }
    };
    switch (count) {
      case 1: run(std::integral_constant<int, 1>()); break;
      case 2: run(std::integral_constant<int, 2>()); break;
      case 3: run(std::integral_constant<int, 3>()); break;
      case 4: run(std::integral_constant<int, 4>()); break;
      default: run(std::integral_constant<int, 5>());
    }
    for (int64_t r = 0; r < count; ++r)
      for (int64_t l = 0; l < end - first; ++l)
        y[row_index[i0 + r] * n + first + l] = out[kGroup * r + l];
  }
}

}  // namespace integer_blocks
}  // namespace speclm

#endif  // AVX512-VNNI
#endif  // SPECLM_KERNELS_INTEGER_BLOCKS_H_
