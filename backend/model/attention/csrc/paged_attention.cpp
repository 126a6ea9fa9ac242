// Paged attention for the CPU: each sequence's K/V is read through its block table, once, with no
// gather of whole contexts and no mask tensor.
//
// Cache layout (backend/model/kv_cache.py): one tensor [layers, 2, num_blocks, kv_heads, head_dim,
// block_size]; the op reads and writes layer `layer` of it, whose keys are [num_blocks, kv_heads,
// head_dim, block_size] (each block's keys transposed, so that the scores of a run of keys come
// from head_dim vector FMAs with no horizontal sums) and values [num_blocks, kv_heads, block_size,
// head_dim] (value rows, added with vector FMAs). Taking the whole cache and a layer number, not
// views of it, keeps a compiled graph's view of the mutated storage simple.
//
// Tokens are flat: sequence b owns the new tokens [query_start_loc[b], query_start_loc[b + 1]),
// which sit at the last positions of its context of seq_lens[b] tokens. The op first writes the
// new tokens' K/V into the cache (slot_mapping[t] < 0: padding, not written), then computes the
// causal attention of every new token over its sequence's context. A sequence's query rows (its
// new tokens times all heads) are processed together, block after block, so each block of K and
// V is loaded from memory once per sequence; softmax is online (flash-attention style), in
// float32, and each row's result depends only on its own query and visible keys (not on what
// else is in the batch).
//
// Registered as torch.ops.nightdraft.paged_attention (a schema with the cache marked mutated),
// so that a compiled graph calls it as one opaque kernel.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t ROWS = 64;       // query rows of a sequence kept in flight over one pass of its blocks
constexpr int TILE = 4;            // query rows computed together: independent FMA chains
constexpr int CHUNK = 16;
#ifndef PREFETCH_STEP
#define PREFETCH_STEP 64
#endif          // keys scored together (one 512-bit vector of scores per row)
constexpr float NEG_BIG = -1e30f;  // "no key seen yet": finite, so exp(NEG_BIG - m) is exactly 0

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(c10::Half x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (Cephes' single-precision polynomial, about 1 ulp), written without branches
// or library calls so that the compiler vectorizes the loops that use it.
inline float exp_nonpositive(float x) {
  x = x > -87.0f ? x : -87.0f;                       // exp(-87) ~ 1.6e-38: 2^n stays a normal float
  const float t = x * 1.44269504088896341f;          // x / ln 2
  const int32_t n = static_cast<int32_t>(t - 0.5f);  // round(t) for t <= 0
  const float fn = static_cast<float>(n);
  const float r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  return y * std::bit_cast<float>((n + 127) << 23);
}

struct Layout {
  int64_t q_tok_stride, q_head_stride, kv_heads, block_size, group, d, out_tok_stride;
  // a block's keys (or values) for one KV head, and for all of them
  int64_t head_elems() const { return d * block_size; }
  int64_t block_elems() const { return kv_heads * d * block_size; }
};

// Keys of a block as float rows of kt_stride(block_size) entries, whole CHUNKs: scoring a
// partial chunk then reads (and ignores) initialised memory, never past a buffer.
inline int64_t kt_stride(int64_t block_size) { return (block_size + CHUNK - 1) / CHUNK * CHUNK; }

// Scratch per thread, reused across calls (no allocation on the hot path).
struct Scratch {
  std::vector<float> q, acc, m, l, kt, v;
  std::vector<int64_t> limit, head;
  void fit(const Layout& L) {
    if (static_cast<int64_t>(q.size()) < ROWS * L.d) {
      q.resize(ROWS * L.d);
      acc.resize(ROWS * L.d);
    }
    const int64_t kt_size = L.kv_heads * L.d * kt_stride(L.block_size);
    if (static_cast<int64_t>(kt.size()) < kt_size) kt.assign(kt_size, 0.f);
    if (static_cast<int64_t>(v.size()) < L.block_elems()) v.resize(L.block_elems());
    m.resize(ROWS);
    l.resize(ROWS);
    limit.resize(ROWS);
    head.resize(ROWS);
  }
};

// 16 floats (one 512-bit register where the machine has them; GCC splits it elsewhere). The
// tile below is written with these vector types rather than left to the auto-vectoriser, which
// kept the scores in memory and ran the softmax scalar: 2x the time per tile.
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
static_assert(CHUNK == 16, "a chunk of keys is one v16f of scores");

inline v16f load16(const float* p) { v16f r; __builtin_memcpy(&r, p, sizeof(r)); return r; }
inline void store16(float* p, v16f v) { __builtin_memcpy(p, &v, sizeof(v)); }
inline v16f splat(float x) { return (v16f){} + x; }

// exp_nonpositive, 16 lanes at a time.
inline v16f exp_np16(v16f x) {
  x = x > -87.0f ? x : splat(-87.0f);
  v16f t = x * 1.44269504088896341f;
  v16i n = __builtin_convertvector(t - 0.5f, v16i);
  v16f fn = __builtin_convertvector(n, v16f);
  v16f r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  v16f y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  v16i bits = (n + 127) << 23;
  v16f scale; __builtin_memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// Horizontal max / sum in log2(16) = 4 shuffle steps (a serial scalar loop is a 16-deep chain).
inline float hmax16(v16f v) {
  v16f w = __builtin_shufflevector(v, v, 8,9,10,11,12,13,14,15,0,1,2,3,4,5,6,7); v = v > w ? v : w;
  w = __builtin_shufflevector(v, v, 4,5,6,7,0,1,2,3,12,13,14,15,8,9,10,11); v = v > w ? v : w;
  w = __builtin_shufflevector(v, v, 2,3,0,1,6,7,4,5,10,11,8,9,14,15,12,13); v = v > w ? v : w;
  w = __builtin_shufflevector(v, v, 1,0,3,2,5,4,7,6,9,8,11,10,13,12,15,14); v = v > w ? v : w;
  return v[0];
}
inline float hsum16(v16f v) {
  v += __builtin_shufflevector(v, v, 8,9,10,11,12,13,14,15,0,1,2,3,4,5,6,7);
  v += __builtin_shufflevector(v, v, 4,5,6,7,0,1,2,3,12,13,14,15,8,9,10,11);
  v += __builtin_shufflevector(v, v, 2,3,0,1,6,7,4,5,10,11,8,9,14,15,12,13);
  v += __builtin_shufflevector(v, v, 1,0,3,2,5,4,7,6,9,8,11,10,13,12,15,14);
  return v[0];
}

// tile_block for a head size that is a multiple of 16, known at compile time: the scores of a
// row are one v16f, its accumulator DIM / 16 of them, all in registers.
template <int DIM>
inline void tile_block_vec(const float* q, const float* const* kt, int64_t kt_stride, const float* const* v,
                           int64_t n, const int64_t* visible, float* m, float* l, float* acc) {
  static_assert(DIM % 16 == 0 && DIM > 0);
  constexpr int NV = DIM / 16;
  const v16i lane = {0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15};
  v16f a[TILE][NV];
  for (int t = 0; t < TILE; ++t) for (int k = 0; k < NV; ++k) a[t][k] = load16(acc + t * DIM + 16 * k);
  for (int64_t j0 = 0; j0 < n; j0 += CHUNK) {
    v16f s[TILE] = {};
    for (int e = 0; e < DIM; ++e) {
      for (int t = 0; t < TILE; ++t) s[t] += q[t * DIM + e] * load16(kt[t] + e * kt_stride + j0);
    }
    int64_t top = 0;
    float p_all[TILE][CHUNK];
    for (int t = 0; t < TILE; ++t) {
      const int64_t vis = std::max<int64_t>(0, std::min<int64_t>(CHUNK, std::min(n, visible[t]) - j0));
      top = std::max(top, vis);
      const v16i live = lane < (int32_t)vis;
      v16f x = live ? s[t] : splat(NEG_BIG);
      const float cm = hmax16(x);
      const float m_new = m[t] > cm ? m[t] : cm;
      const float corr = vis > 0 ? exp_np16(splat(m[t] - m_new))[0] : 1.f;
      v16f d = x - m_new;
      d = d < 0.f ? d : splat(0.f);
      v16f p = exp_np16(d);
      p = live ? p : splat(0.f);
      store16(p_all[t], p);
      if (vis > 0) {
        l[t] = l[t] * corr + hsum16(p);
        m[t] = m_new;
        for (int k = 0; k < NV; ++k) a[t][k] *= corr;
      }
    }
    for (int64_t jj = 0; jj < top; ++jj) {
      for (int t = 0; t < TILE; ++t) {
        const float pj = p_all[t][jj];
        const float* vj = v[t] + (j0 + jj) * DIM;
        for (int k = 0; k < NV; ++k) a[t][k] += pj * load16(vj + 16 * k);
      }
    }
  }
  for (int t = 0; t < TILE; ++t) for (int k = 0; k < NV; ++k) store16(acc + t * DIM + 16 * k, a[t][k]);
}

// A tile of TILE query rows against keys [0, n) of one block, online softmax: any head size.
// Row t reads its KV head's keys transposed (kt[t]: [d][kt_stride]) and values as rows (v[t]:
// [n][d]). Rows whose `visible` is <= 0 see no key of this block (or are padding) and are left
// unchanged.
inline void tile_block(const float* q, const float* const* kt, int64_t kt_stride, const float* const* v,
                       int64_t n, const int64_t* visible, int64_t d, float* m, float* l, float* acc) {
  for (int64_t j0 = 0; j0 < n; j0 += CHUNK) {
    float s[TILE][CHUNK] = {};
    for (int64_t e = 0; e < d; ++e) {
      for (int t = 0; t < TILE; ++t) {
        const float qe = q[t * d + e];
        const float* ke = kt[t] + e * kt_stride + j0;
#pragma omp simd
        for (int jj = 0; jj < CHUNK; ++jj) s[t][jj] += qe * ke[jj];
      }
    }
    float corr[TILE];
    int64_t top = 0;
    for (int t = 0; t < TILE; ++t) {
      const int64_t vis = std::max<int64_t>(0, std::min<int64_t>(CHUNK, std::min(n, visible[t]) - j0));
      top = std::max(top, vis);
      float chunk_max = NEG_BIG;
      for (int jj = 0; jj < vis; ++jj) chunk_max = chunk_max > s[t][jj] ? chunk_max : s[t][jj];
      const float m_new = m[t] > chunk_max ? m[t] : chunk_max;
      corr[t] = vis > 0 ? exp_nonpositive(m[t] - m_new) : 1.f;
      float sum = 0.f;
      for (int jj = 0; jj < CHUNK; ++jj) {
        const float x = s[t][jj] - m_new;
        const float p = jj < vis ? exp_nonpositive(x < 0.f ? x : 0.f) : 0.f;
        s[t][jj] = p;  // 0 past the row's visible keys
        sum += p;
      }
      if (vis > 0) {
        l[t] = l[t] * corr[t] + sum;
        m[t] = m_new;
      }
    }
    for (int t = 0; t < TILE; ++t)
      for (int64_t e = 0; e < d; ++e) acc[t * d + e] *= corr[t];
    for (int64_t jj = 0; jj < top; ++jj) {
      for (int t = 0; t < TILE; ++t) {
        const float p = s[t][jj];
        const float* vj = v[t] + (j0 + jj) * d;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) acc[t * d + e] += p * vj[e];
      }
    }
  }
}

// One block's keys and values as float32 the tiles can read: the cache itself where its dtype
// and block size allow, else a converted (and, for keys, re-strided) copy in scratch.
template <typename T>
inline void block_views(const T* kb, const T* vb, const Layout& L, int64_t n, Scratch& sc, const float** k_out,
                        int64_t* kt_str, const float** v_out) {
  const int64_t bs = L.block_size, kts = kt_stride(bs);
  if constexpr (std::is_same_v<T, float>) {
    *v_out = vb;
    if (kts == bs) {
      *k_out = kb;
      *kt_str = bs;
      return;
    }
  } else {
    float* vbuf = sc.v.data();
    for (int64_t g = 0; g < L.kv_heads; ++g)
      for (int64_t x = 0; x < n * L.d; ++x) vbuf[g * L.head_elems() + x] = to_f(vb[g * L.head_elems() + x]);
    *v_out = vbuf;
  }
  float* kbuf = sc.kt.data();  // [kv_heads][d][kts]
  for (int64_t row = 0; row < L.kv_heads * L.d; ++row)
    for (int64_t j = 0; j < n; ++j) kbuf[row * kts + j] = to_f(kb[row * bs + j]);
  *k_out = kbuf;
  *kt_str = kts;
}

// Attention of one sequence's new tokens [first_tok, first_tok + q_len), context `ctx`, all heads.
template <typename T, int DIM>
void attend_sequence(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, const Layout& L,
                     int64_t first_tok, int64_t q_len, int64_t ctx, float scale, T* out) {
  thread_local Scratch sc;
  sc.fit(L);
  const int64_t d = L.d, bs = L.block_size, group = L.group;
  float *qf = sc.q.data(), *acc = sc.acc.data(), *m = sc.m.data(), *l = sc.l.data();
  int64_t *limit = sc.limit.data(), *head = sc.head.data();
  const int64_t rows = q_len * L.kv_heads * group;  // row: KV head g, token i, query head g * group + hh
  auto place = [&](int64_t row, int64_t* g, int64_t* i, int64_t* h) {
    *g = row / (q_len * group);
    *i = (row / group) % q_len;
    *h = *g * group + row % group;
  };
  for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
    const int64_t nr = std::min(ROWS, rows - r0);
    const int64_t padded = (nr + TILE - 1) / TILE * TILE;
    int64_t max_limit = 0;
    for (int64_t r = 0; r < padded; ++r) {
      m[r] = NEG_BIG;
      l[r] = 0.f;
      std::fill(acc + r * d, acc + (r + 1) * d, 0.f);
      if (r >= nr) {  // a tile's padding row: sees no key
        std::fill(qf + r * d, qf + (r + 1) * d, 0.f);
        limit[r] = 0;
        head[r] = 0;
        continue;
      }
      int64_t g, i, h;
      place(r0 + r, &g, &i, &h);
      const T* src = q + (first_tok + i) * L.q_tok_stride + h * L.q_head_stride;
      for (int64_t e = 0; e < d; ++e) qf[r * d + e] = to_f(src[e]) * scale;
      limit[r] = ctx - q_len + i + 1;  // keys at positions < limit are visible to this row
      head[r] = g;
      max_limit = std::max(max_limit, limit[r]);
    }
    for (int64_t start = 0; start < max_limit; start += bs) {
      const int64_t n = std::min(bs, max_limit - start);
      const int64_t base = table[start / bs] * L.block_elems();
      if (start + bs < max_limit) {
        // The next block sits anywhere in the pool: ask for it now, so that its loads overlap
        // this block's arithmetic instead of stalling one by one.
        const int64_t next = table[start / bs + 1] * L.block_elems();
        const int64_t bytes = L.block_elems() * static_cast<int64_t>(sizeof(T));
        for (int64_t off = 0; off < bytes; off += PREFETCH_STEP) {
          __builtin_prefetch(reinterpret_cast<const char*>(k_cache + next) + off);
          __builtin_prefetch(reinterpret_cast<const char*>(v_cache + next) + off);
        }
      }
      const float *kb, *vb;
      int64_t kts;
      block_views<T>(k_cache + base, v_cache + base, L, n, sc, &kb, &kts, &vb);
      for (int64_t r = 0; r < padded; r += TILE) {
        int64_t visible[TILE];
        const float* kt_rows[TILE];
        const float* v_rows[TILE];
        bool any = false;
        for (int t = 0; t < TILE; ++t) {
          visible[t] = limit[r + t] - start;
          kt_rows[t] = kb + head[r + t] * d * kts;
          v_rows[t] = vb + head[r + t] * L.head_elems();
          any = any || visible[t] > 0;
        }
        if (!any) continue;
        if constexpr (DIM > 0) {
          tile_block_vec<DIM>(qf + r * d, kt_rows, kts, v_rows, n, visible, m + r, l + r, acc + r * d);
        } else {
          tile_block(qf + r * d, kt_rows, kts, v_rows, n, visible, d, m + r, l + r, acc + r * d);
        }
      }
    }
    for (int64_t r = 0; r < nr; ++r) {
      int64_t g, i, h;
      place(r0 + r, &g, &i, &h);
      T* o = out + (first_tok + i) * L.out_tok_stride + h * d;
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      for (int64_t e = 0; e < d; ++e) o[e] = static_cast<T>(acc[r * d + e] * inv);
    }
  }
}

// The new tokens' K and V into their cache slots (keys transposed within the block).
template <typename T>
void write_kv(const at::Tensor& k, const at::Tensor& v, T* k_cache, T* v_cache, const int64_t* slots,
              int64_t first, int64_t last, const Layout& L) {
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t bs = L.block_size;
  for (int64_t t = first; t < last; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t block = slot / bs, j = slot % bs;
    for (int64_t g = 0; g < L.kv_heads; ++g) {
      const T* ks = kp + t * k.stride(0) + g * k.stride(1);
      T* kd = k_cache + block * L.block_elems() + g * L.head_elems() + j;
      for (int64_t e = 0; e < L.d; ++e) kd[e * bs] = ks[e];
      std::memcpy(v_cache + block * L.block_elems() + g * L.head_elems() + j * L.d,
                  vp + t * v.stride(0) + g * v.stride(1), L.d * sizeof(T));
    }
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
         at::Tensor& v_cache, const int64_t* slots, const int64_t* tables, int64_t width,
         const int64_t* qsl, const int64_t* lens, int64_t B, float scale, at::Tensor& out, const Layout& L) {
  const T* qp = q.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t first = qsl[b], q_len = qsl[b + 1] - qsl[b];
      if (q_len == 0) continue;
      write_kv<T>(k, v, kc, vc, slots, first, first + q_len, L);
      const int64_t* table = tables + b * width;
      switch (L.d) {
        case 32: attend_sequence<T, 32>(qp, kc, vc, table, L, first, q_len, lens[b], scale, op); break;
        case 64: attend_sequence<T, 64>(qp, kc, vc, table, L, first, q_len, lens[b], scale, op); break;
        case 128: attend_sequence<T, 128>(qp, kc, vc, table, L, first, q_len, lens[b], scale, op); break;
        default: attend_sequence<T, 0>(qp, kc, vc, table, L, first, q_len, lens[b], scale, op);
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
                           int64_t layer, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "nightdraft::paged_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v: [tokens, heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "kv_cache: contiguous [layers, 2, num_blocks, kv_heads, head_dim, block_size]");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), "layer ", layer, " is outside the cache's ", kv_cache.size(0));
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && k.scalar_type() == kv_cache.scalar_type() &&
                  v.scalar_type() == kv_cache.scalar_type(),
              "q, k, v and the cache must share one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous");
  for (const auto* t : {&slot_mapping, &block_tables, &query_start_loc, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors: contiguous int64");
  }
  const int64_t T_ = q.size(0), H = q.size(1), d = q.size(2);
  const int64_t num_blocks = kv_cache.size(2), KVH = kv_cache.size(3), block_size = kv_cache.size(5);
  TORCH_CHECK(H % KVH == 0 && k.size(1) == KVH && v.size(1) == KVH && kv_cache.size(4) == d,
              "head counts or head_dim do not match the cache");
  TORCH_CHECK(k.size(0) == T_ && v.size(0) == T_ && slot_mapping.size(0) == T_,
              "q, k, v and slot_mapping need one row per token");
  const int64_t B = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == B + 1 && block_tables.size(0) >= B, "metadata sizes do not match");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1);
  TORCH_CHECK(qsl[0] == 0 && qsl[B] <= T_, "query_start_loc must start at 0 and end within the tokens");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t ql = qsl[b + 1] - qsl[b];
    TORCH_CHECK(ql >= 0 && ql <= lens[b] && lens[b] <= width * block_size, "sequence ", b, ": ", ql,
                " new tokens, context ", lens[b], ", a table of ", width, " blocks");
    for (int64_t x = 0; x < (lens[b] + block_size - 1) / block_size; ++x) {
      TORCH_CHECK(tables[b * width + x] >= 0 && tables[b * width + x] < num_blocks, "sequence ", b,
                  ": block ", tables[b * width + x], " is outside the pool of ", num_blocks);
    }
    for (int64_t t = qsl[b]; t < qsl[b + 1]; ++t) {
      TORCH_CHECK(slots[t] < num_blocks * block_size, "token ", t, ": slot ", slots[t], " is outside the pool");
    }
  }
  at::Tensor out = at::empty({T_, H, d}, q.options());
  if (qsl[B] < T_) out.narrow(0, qsl[B], T_ - qsl[B]).zero_();  // padding rows: defined, unused
  at::Tensor k_cache = kv_cache.select(0, layer).select(0, 0);
  at::Tensor v_cache = kv_cache.select(0, layer).select(0, 1);
  const Layout L{q.stride(0), q.stride(1), KVH, block_size, H / KVH, d, H * d};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    run<scalar_t>(q, k, v, k_cache, v_cache, slots, tables, width, qsl, lens, B, static_cast<float>(scale), out, L);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(nightdraft, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, int layer, "
      "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(nightdraft, CPU, m) { m.impl("paged_attention", &paged_attention); }
