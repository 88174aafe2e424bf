// Sixteen float32 lanes as one value, shared by speclm's CPU kernels, with the few operations
// on them that more than one kernel needs (a sum, a broadcast, a multiply-add, e^x).
//
// A GCC/Clang vector extension: the compiler maps it to one AVX-512 register, two AVX2 ones,
// or four SSE ones; each lane's arithmetic is the same. Loads and stores go through memcpy
// (no alignment assumed).

#ifndef SPECLM_KERNELS_LANES_H_
#define SPECLM_KERNELS_LANES_H_

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace speclm {

typedef float Lanes __attribute__((vector_size(64)));
typedef int32_t Ints __attribute__((vector_size(64)));
typedef uint8_t Bytes __attribute__((vector_size(16)));

inline Lanes Load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(float* p, Lanes v) { std::memcpy(p, &v, sizeof(v)); }

// The lanes' sum, first to last (one fixed order, so the same lanes give the same bits).
inline float SumLanes(Lanes v) {
  float total = 0.0f;
  for (int i = 0; i < 16; ++i) total += v[i];
  return total;
}

inline Lanes Broadcast(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<Lanes>(_mm512_set1_ps(x));  // one broadcast, no add of zero
#else
  return Lanes{} + x;
#endif
}

// a · b + c, fused where the CPU has AVX-512 (one rounding), else multiplied and added.
inline Lanes MulAdd(Lanes a, Lanes b, Lanes c) {
#if defined(__AVX512F__)
  return reinterpret_cast<Lanes>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                                 reinterpret_cast<__m512>(b),
                                                 reinterpret_cast<__m512>(c)));
#else
  return a * b + c;
#endif
}

// e^x for x <= 0, 16 lanes (Cephes' single-precision polynomial, within 2 ulp); below
// -87.3, where e^x leaves float32's normal range, it returns e^-87.3 (about 1e-38: beside the
// largest softmax term, which is 1, nothing).
inline Lanes Exp(Lanes x) {
  const Lanes lo = Broadcast(-87.3f);
  x = x < lo ? lo : x;
  const Lanes magic = Broadcast(12582912.0f);  // 1.5 · 2^23: adding it rounds to an integer
  const Lanes n = (x * 1.44269504088896341f + magic) - magic;
  const Lanes r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  Lanes p = Broadcast(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * (r * r) + r) + 1.0f;
  const Ints bits = (__builtin_convertvector(n, Ints) + 127) << 23;
  Lanes scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace speclm

#endif  // SPECLM_KERNELS_LANES_H_
