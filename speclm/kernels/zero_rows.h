// The input rows of a product that are not all zero, shared by speclm's product kernels.
//
// An all-zero input row has an all-zero product row (with finite weights: 0 · w = 0 in every
// term, and a sum of zeros is +0 in any order), so the kernels multiply only the other rows
// and write zeros for it. A verification call whose later positions are not needed
// (`LanguageModel.extend_live`) zeroes those positions' hidden states, and then costs what a
// call of the needed positions alone costs. Each computed row's sums are unchanged, so the
// row-invariance of the kernels holds.

#ifndef SPECLM_KERNELS_ZERO_ROWS_H_
#define SPECLM_KERNELS_ZERO_ROWS_H_

#include <cstdint>
#include <cstring>
#include <vector>

namespace speclm {

struct LiveRows {
  std::vector<int64_t> index;  // the rows with a nonzero entry, in order
  std::vector<float> compact;  // their values, when some row was left out
  const float* data = nullptr;  // [index.size(), K]: x itself when no row was left out
  int64_t count() const { return static_cast<int64_t>(index.size()); }
};

// The rows of x [m, k] that have a nonzero entry (NaN counts as nonzero).
inline LiveRows FindLiveRows(const float* x, int64_t m, int64_t k) {
  LiveRows live;
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * k;
    int64_t j = 0;
    while (j < k && row[j] == 0.0f) ++j;
    if (j < k) live.index.push_back(r);
  }
  if (live.count() == m) {
    live.data = x;
    return live;
  }
  live.compact.resize(live.count() * k);
  for (int64_t i = 0; i < live.count(); ++i)
    std::memcpy(live.compact.data() + i * k, x + live.index[i] * k, k * sizeof(float));
  live.data = live.compact.data();
  return live;
}

// Zeroes the rows of y [m, n] that `live` left out.
inline void ZeroDeadRows(const LiveRows& live, int64_t m, int64_t n, float* y) {
  for (int64_t r = 0, i = 0; r < m; ++r) {
    if (i < live.count() && live.index[i] == r) {
      ++i;
    } else {
      std::memset(y + r * n, 0, n * sizeof(float));
    }
  }
}

}  // namespace speclm

#endif  // SPECLM_KERNELS_ZERO_ROWS_H_
