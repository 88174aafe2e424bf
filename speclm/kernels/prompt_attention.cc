// Causal attention of a prompt's K tokens among themselves (prefill into an empty cache):
//
//   out[b, k, n, g, :] = Σ_{l ≤ k} softmax_l(s[l]) · values[b, n, l, :],
//   s[l] = scale · q[b, k, n, g, :] · keys[b, n, l, :]
//
// q `[B, K, Nkv, G, H]`, keys and values `[B, Nkv, K, H]`, float32. XLA runs the tiled
// `speclm.models.attention.prompt_attention` as many small batched products and elementwise
// passes; this is one call per layer, flash attention's loop on the CPU's vector registers.
//
// The keys are first laid out transposed, 16 at a time (`[K/16, H, 16]`: a block's h-th
// components as one vector), so that a query's scores against a block are H multiply-adds of
// a broadcast query component by one vector. A task is one (row, key-value head, 16 queries),
// whose query rows (query × query head, G of them a query) go kRows at a time through every
// key block up to their own position, keeping in registers their running maximum, softmax
// denominator and weighted values (kRows × H / 16 vectors), rescaled whenever the maximum
// grows. Keys after a query's position get weight exactly 0.
//
// A query row's arithmetic is the same whatever K, B and the other rows of its group are:
// the key blocks start at position 0 and are visited in order, each score sums its H products
// in order, and a key the row does not see adds exactly 0. So a prompt's outputs are those of
// any longer prompt it begins, bit for bit. Against XLA's tiled loop the sums run in another
// order, and e^x is a polynomial within 2 ulp (`speclm::Exp`).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "lanes.h"
#include "parallel_tasks.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;     // keys a block
constexpr int64_t kQueries = 16;   // queries a task
constexpr float kLowest = -3.4028234663852886e38f;
using speclm::Broadcast;
using speclm::Exp;
using speclm::Lanes;
using speclm::Load;
using speclm::MulAdd;
using speclm::Store;
using speclm::SumLanes;

inline float MaxLane(Lanes v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#else
  float most = v[0];
  for (int j = 1; j < kLanes; ++j) most = v[j] > most ? v[j] : most;
  return most;
#endif
}

// The transposed keys of one (row, key-value head): block i's h-th vector at
// out[(i · H + h) · 16], lanes past the prompt's end zero.
void TransposeKeys(const float* keys, int64_t length, int64_t h_dim, float* out) {
  const int64_t blocks = (length + kLanes - 1) / kLanes;
  std::memset(out, 0, blocks * h_dim * kLanes * sizeof(float));
  for (int64_t l = 0; l < length; ++l) {
    const float* key = keys + l * h_dim;
    float* block = out + (l / kLanes) * h_dim * kLanes + l % kLanes;
    for (int64_t h = 0; h < h_dim; ++h) block[h * kLanes] = key[h];
  }
}

// kRows query rows (row r's query at position pos[r], its H components at q[r]) through key
// blocks 0 … last, written normalised to out[r]. kChunks = H / 16.
template <int kChunks, int kRows>
void AttendRows(const float* const* q, const int64_t* pos, const float* keys_t,
                const float* values, float scale, float* const* out) {
  constexpr int64_t h_dim = kChunks * kLanes;
  Lanes acc[kRows][kChunks];
  float top[kRows];
  Lanes total[kRows];  // the denominator's partial sums, lane by lane
  int64_t last = 0;
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kChunks; ++c) acc[r][c] = Broadcast(0.0f);
    top[r] = kLowest;
    total[r] = Broadcast(0.0f);
    last = std::max(last, pos[r]);
  }
  alignas(64) float weights[kRows][kLanes];
  const Lanes lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t l0 = 0; l0 <= last; l0 += kLanes) {
    const float* block = keys_t + l0 * h_dim;  // block l0 / 16: [H, 16]
    Lanes s[kRows];
    for (int r = 0; r < kRows; ++r) s[r] = Broadcast(0.0f);
    for (int64_t h = 0; h < h_dim; ++h) {
      const Lanes k = Load(block + h * kLanes);
      for (int r = 0; r < kRows; ++r) s[r] = MulAdd(Broadcast(q[r][h]), k, s[r]);
    }
    for (int r = 0; r < kRows; ++r) {
      // Keys after the row's position: the lowest score, then weight exactly 0.
      const auto seen = lane + static_cast<float>(l0) <= Broadcast(static_cast<float>(pos[r]));
      const Lanes scores = seen ? s[r] * scale : Broadcast(kLowest);
      const float new_top = std::max(top[r], MaxLane(scores));
      const Lanes e = seen ? Exp(scores - new_top) : Broadcast(0.0f);
      Store(weights[r], e);
      if (new_top > top[r]) {  // earlier sums to the new maximum (the first block: all zero)
        const float rescale = top[r] == kLowest ? 0.0f : Exp(Broadcast(top[r] - new_top))[0];
        for (int c = 0; c < kChunks; ++c) acc[r][c] = acc[r][c] * rescale;
        total[r] = total[r] * rescale;
        top[r] = new_top;
      }
      total[r] += e;
    }
    const int64_t seen_here = std::min(kLanes, last - l0 + 1);
    for (int64_t j = 0; j < seen_here; ++j) {
      const float* value = values + (l0 + j) * h_dim;
      Lanes v[kChunks];
      for (int c = 0; c < kChunks; ++c) v[c] = Load(value + c * kLanes);
      for (int r = 0; r < kRows; ++r) {
        const Lanes w = Broadcast(weights[r][j]);
        for (int c = 0; c < kChunks; ++c) acc[r][c] = MulAdd(w, v[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    const float inverse = 1.0f / SumLanes(total[r]);  // > 0: every row sees its own position
    for (int c = 0; c < kChunks; ++c) Store(out[r] + c * kLanes, acc[r][c] * inverse);
  }
}

// Every row of a task, kRows at a time (a short last group repeats its last row).
template <int kChunks>
void AttendTask(const float* const* q, const int64_t* pos, int64_t rows, const float* keys_t,
                const float* values, float scale, float* const* out) {
  constexpr int kRows = kChunks >= 16 ? 1 : kChunks >= 8 ? 2 : 4;
  const float* q_group[kRows];
  int64_t pos_group[kRows];
  float* out_group[kRows];
  alignas(64) float spare[kRows][kChunks * kLanes];
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = std::min(r0 + r, rows - 1);
      q_group[r] = q[i];
      pos_group[r] = pos[i];
      out_group[r] = r0 + r < rows ? out[i] : spare[r];
    }
    AttendRows<kChunks, kRows>(q_group, pos_group, keys_t, values, scale, out_group);
  }
}

template <int kChunks>
void AttendTaskFor(int64_t chunks, const float* const* q, const int64_t* pos, int64_t rows,
                   const float* keys_t, const float* values, float scale, float* const* out) {
  if constexpr (kChunks > 16) {
    return;  // unreachable: checked before any task runs
  } else if (chunks == kChunks) {
    AttendTask<kChunks>(q, pos, rows, keys_t, values, scale, out);
  } else {
    AttendTaskFor<kChunks + 1>(chunks, q, pos, rows, keys_t, values, scale, out);
  }
}

ffi::Error PromptAttendImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                            ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                            ffi::ResultBuffer<ffi::F32> out, float scale) {
  const auto qd = q.dimensions();
  const auto kd = keys.dimensions();
  const auto vd = values.dimensions();
  bool same = vd.size() == kd.size();
  for (size_t i = 0; same && i < kd.size(); ++i) same = vd[i] == kd[i];
  if (qd.size() != 5 || kd.size() != 4 || !same || kd[0] != qd[0] || kd[1] != qd[2] ||
      kd[2] != qd[1] || kd[3] != qd[4] || qd[4] % kLanes != 0 || qd[4] > 16 * kLanes) {
    return ffi::Error::InvalidArgument(
        "prompt_attention: expects q [B, K, Nkv, G, H], keys and values [B, Nkv, K, H], H a"
        " multiple of 16 up to 256");
  }
  const int64_t batch = qd[0], length = qd[1], kv_heads = qd[2], groups = qd[3], h_dim = qd[4];
  if (batch * length == 0) return ffi::Error::Success();
  const int64_t blocks = (length + kLanes - 1) / kLanes, heads = batch * kv_heads;
  const int64_t head_t = blocks * kLanes * h_dim;  // one head's transposed keys
  static thread_local std::vector<float> keys_t;
  keys_t.resize(heads * head_t);
  const float* k_data = keys.typed_data();
  const float* v_data = values.typed_data();
  const float* q_data = q.typed_data();
  float* o_data = out->typed_data();
  float* kt = keys_t.data();
  speclm::RunTasks(pool, heads, 1, [=](int64_t first, int64_t end) {
    for (int64_t head = first; head < end; ++head)
      TransposeKeys(k_data + head * length * h_dim, length, h_dim, kt + head * head_t);
  });
  // Tasks in order of work: the last queries see the most keys. The helper's range (the back
  // half) holds more of it; whoever runs out first steals halves of what the other has left
  // (parallel_tasks.h), so the two end together.
  const int64_t query_blocks = (length + kQueries - 1) / kQueries;
  speclm::RunTasks(pool, heads * query_blocks, 1, [=](int64_t first, int64_t end) {
    thread_local std::vector<const float*> rows_q;
    thread_local std::vector<float*> rows_out;
    thread_local std::vector<int64_t> rows_pos;
    for (int64_t task = first; task < end; ++task) {
      const int64_t block = task / heads, head = task % heads;
      const int64_t b = head / kv_heads, n = head % kv_heads;
      rows_q.clear();
      rows_out.clear();
      rows_pos.clear();
      for (int64_t k = block * kQueries; k < std::min((block + 1) * kQueries, length); ++k)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t at = (((b * length + k) * kv_heads + n) * groups + g) * h_dim;
          rows_q.push_back(q_data + at);
          rows_out.push_back(o_data + at);
          rows_pos.push_back(k);
        }
      AttendTaskFor<1>(h_dim / kLanes, rows_q.data(), rows_pos.data(),
                       static_cast<int64_t>(rows_q.size()), kt + head * head_t,
                       v_data + head * length * h_dim, scale, rows_out.data());
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PromptAttention, PromptAttendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
