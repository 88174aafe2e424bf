// Attention of a few new queries over one layer of the stacked KV cache, read where it lies.
//
//   out[b, k, n, g, :] = Σ_l softmax_l(s[l]) · values[layer, b, n, l, :]   over visible l,
//   s[l] = softcap(scale · q[b, k, n, g, :] · keys[layer, b, n, l, :])
//
// q `[B, K, Nkv, G, H]`, keys and values `[layers, B, Nkv, L, H]` (the decode loop's whole
// cache), visible `[B, K, L]` (the slots each query attends to), all float32 but the mask.
// XLA's own attention first copies the layer out of the stacked cache and then reads every
// slot, empty ones included, several times (docs/performance.md, change 15); this reads only
// the visible slots of the one layer, in place.
//
// Each (row, key-value head) is one task, which reads each visible key and value once for all
// the queries and query heads that see it (the weighted values: every such query head's partial
// sums held in registers while a slot's values are loaded once, `AddWeightedValues`). A
// query's own arithmetic is the same whatever K and B are, so its output does not depend on
// how many queries share the call: speculative verification gets the numbers of a one-token
// step bit for bit. Sums run in float32 in a fixed order (a score's H products as 16-lane
// partial sums, then the lanes as a tree; the softmax denominator and the weighted values over
// l in slot order).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "lanes.h"
#include "parallel_tasks.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;
using speclm::Broadcast;
using speclm::Bytes;
using speclm::Exp;
using speclm::Ints;
using speclm::Lanes;
using speclm::Load;
using speclm::MulAdd;
using speclm::Store;
using speclm::SumLanes;

// The 16 lanes of acc[0…15] each summed, as one vector (lane i: the sum of acc[i]): four
// rounds of pairing halves, the same tree for every vector.
inline Lanes SumEach(const Lanes* acc) {
  Lanes c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i)
    c[i] = __builtin_shufflevector(acc[2 * i], acc[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                   18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(acc[2 * i], acc[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                   25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                   22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                   22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// Whether a block's later score reads go chunk by chunk (`SlotProducts<false>`). Only where
// MulAdd is an explicit fused multiply-add: elsewhere it is a · b + c, which the compiler may
// contract into fused operations differently in the two loop orders, and a query's numbers
// must not depend on which order its call took.
#if defined(__AVX512F__)
constexpr bool kChunkMajorScores = true;
#else
constexpr bool kChunkMajorScores = false;
#endif

// acc[j] = the 16-lane partial products of a query row and key j of a block of 16 keys (`h`
// floats apart): chunk 0's products, then each next chunk's multiply-added, for every order.
// kSlotBySlot reads the keys in memory order, slot after slot, which the hardware prefetcher
// follows (the block's first read, from memory); otherwise chunk by chunk across the slots, 16
// independent chains of multiply-adds instead of one chain at a time (the block's later reads,
// from the L1 cache, where the chain's latency is what costs). Both give the same numbers.
template <bool kSlotBySlot>
inline void SlotProducts(const float* q_row, const float* key, int64_t chunks, Lanes* acc) {
  const int64_t h = chunks * kLanes;
  if (kSlotBySlot) {
    for (int j = 0; j < kLanes; ++j) {
      acc[j] = Load(q_row) * Load(key + j * h);
      for (int64_t c = 1; c < chunks; ++c)
        acc[j] = MulAdd(Load(q_row + c * kLanes), Load(key + j * h + c * kLanes), acc[j]);
    }
    return;
  }
  const Lanes q0 = Load(q_row);
  for (int j = 0; j < kLanes; ++j) acc[j] = q0 * Load(key + j * h);
  for (int64_t c = 1; c < chunks; ++c) {
    const Lanes qc = Load(q_row + c * kLanes);
    for (int j = 0; j < kLanes; ++j) acc[j] = MulAdd(qc, Load(key + j * h + c * kLanes), acc[j]);
  }
}

// 16 mask bytes as lanes of all ones (visible) or zeros.
inline Ints Visible16(const bool* m) {
  Bytes b;
  std::memcpy(&b, m, sizeof(b));
  return __builtin_convertvector(b, Ints) != 0;
}

// out_r[j] += Σ_{l0 <= l < l1} w_r[l] · v[l, j] for kRows rows r and the kChunks · 16 columns
// j from `column` on (v's slots `stride` floats apart): the partial sums of all rows and chunks
// stay in registers over the slots, and each slot's values are loaded once for all the rows.
// Each (row, chunk) is the same chain of fused multiply-adds in slot order as a row alone, so
// a row's sums do not depend on which rows or chunks share the pass.
template <int kChunks, int kRows>
inline void AddWeightedValues(const float* const* w, float* const* out, int64_t column,
                              const float* v, int64_t stride, int64_t l0, int64_t l1) {
  Lanes acc[kRows][kChunks];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kChunks; ++c) acc[r][c] = Load(out[r] + column + c * kLanes);
  for (int64_t l = l0; l < l1; ++l) {
    Lanes value[kChunks];
    for (int c = 0; c < kChunks; ++c) value[c] = Load(v + l * stride + column + c * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const Lanes weight = Broadcast(w[r][l]);
      for (int c = 0; c < kChunks; ++c) acc[r][c] = MulAdd(weight, value[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kChunks; ++c) Store(out[r] + column + c * kLanes, acc[r][c]);
}

// AddWeightedValues over `rows` rows, 4 at a time (16 partial sums and 4 values fit in the 32
// vector registers), the rest in one smaller pass.
template <int kChunks>
inline void AddWeightedValuesRows(const float* const* w, float* const* out, int64_t rows,
                           int64_t column, const float* v, int64_t stride, int64_t l0,
                           int64_t l1) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    AddWeightedValues<kChunks, 4>(w + r, out + r, column, v, stride, l0, l1);
  switch (rows - r) {
    case 1: AddWeightedValues<kChunks, 1>(w + r, out + r, column, v, stride, l0, l1); break;
    case 2: AddWeightedValues<kChunks, 2>(w + r, out + r, column, v, stride, l0, l1); break;
    case 3: AddWeightedValues<kChunks, 3>(w + r, out + r, column, v, stride, l0, l1); break;
  }
}

// The weighted values of `rows` rows over a head of `chunks` 16-lane chunks: 4 chunks a pass,
// the rest (1–3) in one more.
inline void AddWeightedValuesAll(const float* const* w, float* const* out, int64_t rows,
                          const float* v, int64_t chunks, int64_t l0, int64_t l1) {
  const int64_t stride = chunks * kLanes;
  int64_t c = 0;
  for (; c + 4 <= chunks; c += 4)
    AddWeightedValuesRows<4>(w, out, rows, c * kLanes, v, stride, l0, l1);
  switch (chunks - c) {
    case 1: AddWeightedValuesRows<1>(w, out, rows, c * kLanes, v, stride, l0, l1); break;
    case 2: AddWeightedValuesRows<2>(w, out, rows, c * kLanes, v, stride, l0, l1); break;
    case 3: AddWeightedValuesRows<3>(w, out, rows, c * kLanes, v, stride, l0, l1); break;
  }
}

ffi::Error AttendImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                      ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::PRED> visible,
                      ffi::ResultBuffer<ffi::F32> out, int64_t layer, float scale, float cap) {
  const auto qd = q.dimensions();
  const auto kd = keys.dimensions();
  const auto vd = values.dimensions();
  const auto md = visible.dimensions();
  bool same = vd.size() == kd.size();
  for (size_t i = 0; same && i < kd.size(); ++i) same = vd[i] == kd[i];
  if (qd.size() != 5 || kd.size() != 5 || md.size() != 3 || !same || kd[1] != qd[0] ||
      kd[2] != qd[2] || kd[4] != qd[4] || md[0] != qd[0] || md[1] != qd[1] || md[2] != kd[3] ||
      qd[4] % kLanes != 0 || layer < 0 || layer >= kd[0]) {
    return ffi::Error::InvalidArgument(
        "cache_attention: expects q [B, K, Nkv, G, H], keys and values [layers, B, Nkv, L, H],"
        " visible [B, K, L], H a multiple of 16 and 0 <= layer < layers");
  }
  const int64_t batch = qd[0], queries = qd[1], kv_heads = qd[2], groups = qd[3], h_dim = qd[4];
  const int64_t slots = kd[3], chunks = h_dim / kLanes;
  const float* q_data = q.typed_data();
  const float* k_data = keys.typed_data() + layer * batch * kv_heads * slots * h_dim;
  const float* v_data = values.typed_data() + layer * batch * kv_heads * slots * h_dim;
  const bool* mask = visible.typed_data();
  float* out_data = out->typed_data();
  constexpr float kLowest = -3.4028234663852886e38f;
  // One task per (row, key-value head). Slots are taken 16 at a time from 0 up to the last
  // one any query of the row sees; a block past the cache's end is read from a zero-padded
  // copy. Slots a query does not see get weight exactly 0, so the blocks a call's other
  // queries add change none of its sums: each query's numbers are those of a call of its own.
  speclm::RunTasks(pool, batch * kv_heads, 1, [=](int64_t first, int64_t end) {
    thread_local std::vector<float> weights, tile, tops;
    thread_local std::vector<char> sees;
    thread_local std::vector<const float*> row_weights;
    thread_local std::vector<float*> row_outs;
    for (int64_t task = first; task < end; ++task) {
      const int64_t b = task / kv_heads, n = task % kv_heads;
      const bool* row_mask = mask + b * queries * slots;  // [K, L]
      // Slots up to the last one seen; a query that sees no slot is skipped (its output is 0,
      // as its weights would all be): the positions `LanguageModel.extend_live` leaves out.
      int64_t used = 0;
      sees.assign(queries, 0);
      for (int64_t k = 0; k < queries; ++k)
        for (int64_t l = slots - 1; l >= 0; --l)
          if (row_mask[k * slots + l]) {
            used = std::max(used, l + 1);
            sees[k] = 1;
            break;
          }
      const int64_t blocks = (used + kLanes - 1) / kLanes, width = blocks * kLanes;
      if (static_cast<int64_t>(weights.size()) < queries * groups * width)
        weights.resize(queries * groups * width);
      if (static_cast<int64_t>(tile.size()) < kLanes * h_dim) tile.resize(kLanes * h_dim);
      const float* k_head = k_data + (b * kv_heads + n) * slots * h_dim;
      const float* v_head = v_data + (b * kv_heads + n) * slots * h_dim;
      if (static_cast<int64_t>(tops.size()) < queries * groups * kLanes)
        tops.resize(queries * groups * kLanes);
      auto w_row = [&](int64_t k, int64_t g) { return weights.data() + (k * groups + g) * width; };
      auto row_of = [&](int64_t k, int64_t g) {
        return ((b * queries + k) * kv_heads + n) * groups + g;
      };
      for (int64_t i = 0; i < queries * groups; ++i) Store(tops.data() + i * kLanes,
                                                           Broadcast(kLowest));
      // Scores, 16 slots at a time, each block of keys read once for every query and head:
      // softcap(scale · q · key), the lowest float where the query does not see the slot.
      bool mask_tail[kLanes];
      for (int64_t block = 0; block < blocks; ++block) {
        const int64_t l0 = block * kLanes;
        const float* key = k_head + l0 * h_dim;
        if (l0 + kLanes > slots) {  // past the cache's end: a zero-padded copy
          std::memset(tile.data(), 0, kLanes * h_dim * sizeof(float));
          std::memcpy(tile.data(), key, (slots - l0) * h_dim * sizeof(float));
          key = tile.data();
        }
        bool first_read = true;  // the block's keys still in memory, not yet in the L1 cache
        for (int64_t k = 0; k < queries; ++k) {
          if (!sees[k]) continue;
          const bool* m = row_mask + k * slots + l0;
          if (l0 + kLanes > slots) {
            for (int64_t j = 0; j < kLanes; ++j) mask_tail[j] = l0 + j < slots && m[j];
            m = mask_tail;
          }
          const Ints seen = Visible16(m);
          for (int64_t g = 0; g < groups; ++g) {
            const float* q_row = q_data + row_of(k, g) * h_dim;
            Lanes acc[kLanes];
            if (first_read || !kChunkMajorScores)
              SlotProducts</*kSlotBySlot=*/true>(q_row, key, chunks, acc);
            else
              SlotProducts</*kSlotBySlot=*/false>(q_row, key, chunks, acc);
            first_read = false;
            Lanes s = SumEach(acc) * scale;
            if (cap > 0.0f)
              for (int j = 0; j < kLanes; ++j) s[j] = cap * std::tanh(s[j] / cap);
            s = seen ? s : Broadcast(kLowest);
            float* top = tops.data() + (k * groups + g) * kLanes;
            Store(top, s > Load(top) ? s : Load(top));
            Store(w_row(k, g) + l0, s);
          }
        }
      }
      // Softmax weights: e^(s − max) where seen, exactly 0 elsewhere, over their sum.
      for (int64_t k = 0; k < queries; ++k) {
        if (!sees[k]) {
          for (int64_t g = 0; g < groups; ++g)
            std::memset(out_data + row_of(k, g) * h_dim, 0, h_dim * sizeof(float));
          continue;
        }
        for (int64_t g = 0; g < groups; ++g) {
          const Lanes top = Load(tops.data() + (k * groups + g) * kLanes);
          float most = kLowest;
          for (int j = 0; j < kLanes; ++j) most = top[j] > most ? top[j] : most;
          float* w = w_row(k, g);
          Lanes total = {};
          for (int64_t l0 = 0; l0 < width; l0 += kLanes) {
            const Lanes s = Load(w + l0);
            const Lanes e = s == kLowest ? Broadcast(0.0f) : Exp(s - most);
            total += e;
            Store(w + l0, e);
          }
          const float sum = SumLanes(total);
          const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;  // 0: nothing visible
          for (int64_t l0 = 0; l0 < width; l0 += kLanes) Store(w + l0, Load(w + l0) * inverse);
          std::memset(out_data + row_of(k, g) * h_dim, 0, h_dim * sizeof(float));
        }
      }
      // The weighted values, summed in slot order, each block of values read once for all
      // the rows (queries × heads) that see a slot.
      row_weights.clear();
      row_outs.clear();
      for (int64_t k = 0; k < queries; ++k)
        for (int64_t g = 0; sees[k] && g < groups; ++g) {
          row_weights.push_back(w_row(k, g));
          row_outs.push_back(out_data + row_of(k, g) * h_dim);
        }
      const int64_t rows = static_cast<int64_t>(row_outs.size());
      for (int64_t l0 = 0; l0 < width; l0 += kLanes) {
        const int64_t l1 = std::min(l0 + kLanes, slots);
        AddWeightedValuesAll(row_weights.data(), row_outs.data(), rows, v_head, chunks, l0, l1);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CacheAttention, AttendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer")
                                  .Attr<float>("scale")
                                  .Attr<float>("cap"));
