// Sixteen float32 lanes as one value, shared by speclm's CPU kernels.
//
// A GCC/Clang vector extension: the compiler maps it to one AVX-512 register, two AVX2 ones,
// or four SSE ones; each lane's arithmetic is the same. Loads and stores go through memcpy
// (no alignment assumed).

#ifndef SPECLM_KERNELS_LANES_H_
#define SPECLM_KERNELS_LANES_H_

#include <cstdint>
#include <cstring>

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

}  // namespace speclm

#endif  // SPECLM_KERNELS_LANES_H_
