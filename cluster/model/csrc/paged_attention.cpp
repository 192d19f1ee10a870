// Paged decode attention for CPU: one query per sequence, keys and values read in place through
// the block table (no gather, no mask), each KV head's group of query heads computed together so
// every key/value row is read once, online softmax over blocks, fp32 accumulation.
//
// Built by cluster/decode_attention.py with torch.utils.cpp_extension. The inner loop is cloned
// per instruction set on x86-64 (target_clones, picked at load time by the CPU's features), so
// the same binary runs on any x86-64 CPU and uses AVX-512 where there is one. Needs GCC >= 12 or
// Clang (__builtin_shufflevector); where it does not build, the torch path serves instead.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace pdserve {

inline float to_float(float x) { return x; }

inline float to_float(uint16_t bf16_bits) {
  const uint32_t u = uint32_t(bf16_bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void store(float* out, float x) { *out = x; }

inline void store(uint16_t* out, float x) { *out = c10::detail::round_to_nearest_even(x); }

// 16 floats: one AVX-512 register, two AVX2 ones, four SSE ones; each target_clones clone
// lowers these operations to its own instruction set.
typedef float vfloat __attribute__((vector_size(64)));
typedef uint16_t vbf16 __attribute__((vector_size(32)));
typedef uint32_t vuint __attribute__((vector_size(64)));
constexpr int64_t W = 16;

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vfloat load(const uint16_t* p) {
  vbf16 h;
  std::memcpy(&h, p, sizeof h);
  return (vfloat)(__builtin_convertvector(h, vuint) << 16);
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

inline float hsum(vfloat v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x) for x <= 0 (scores minus their running max), Cephes' expf: 2^n * e^r with
// |r| <= ln(2)/2 and a degree-6 polynomial for e^r; within 2 ulp of std::exp.
inline vfloat exp_nonpositive(vfloat x) {
  typedef int32_t vint __attribute__((vector_size(64)));
  const vfloat lo = vfloat{} - 87.3f;  // below this e^x is under the smallest normal float
  x = x < lo ? lo : x;
  const vfloat t = x * 1.44269504088896341f + 0.5f;
  vint n = __builtin_convertvector(t, vint);  // truncates toward zero: floor for t < 0
  n += (__builtin_convertvector(n, vfloat) > t);  // the comparison is -1 where true
  const vfloat fn = __builtin_convertvector(n, vfloat);
  const vfloat r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  vfloat y = 1.9875691500e-4f * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  return y * (vfloat)((n + 127) << 23);
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  vfloat acc = {};
  int64_t d = 0;
  for (; d + W <= n; d += W) acc += load(q + d) * load(k + d);
  float s = hsum(acc);
  for (; d < n; ++d) s += q[d] * to_float(k[d]);
  return s;
}

// acc[0:n] = acc * scale + w * v
template <typename T>
inline void scale_add(float* acc, float scale, float w, const T* v, int64_t n) {
  int64_t d = 0;
  for (; d + W <= n; d += W) store(acc + d, load(acc + d) * scale + w * load(v + d));
  for (; d < n; ++d) acc[d] = acc[d] * scale + w * to_float(v[d]);
}

struct Geometry {
  int64_t block_size;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t window;  // sliding window; 0 = none
  float scale;
};

// Scratch floats one sequence needs.
inline int64_t scratch_size(const Geometry& g) {
  return 2 * g.num_heads * g.head_dim + g.num_heads * g.block_size + 2 * g.num_heads;
}

// Attend the query heads of one sequence to its `ctx` keys, a block at a time: block rows are
// [num_kv_heads, head_dim] and contiguous, so each block is one sequential read.
// q, out: [num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim].
template <typename T>
inline __attribute__((always_inline)) void attend(const T* q, const T* k_cache, const T* v_cache,
                                                  const int32_t* table, int64_t ctx,
                                                  const Geometry& geo, float* scratch, T* out) {
  const int64_t H = geo.num_heads, D = geo.head_dim, bs = geo.block_size;
  const int64_t G = H / geo.num_kv_heads;  // query heads per KV head
  const int64_t row = geo.num_kv_heads * D;
  float* qf = scratch;      // [H, D] scaled query
  float* acc = qf + H * D;  // [H, D] unnormalised output
  float* p = acc + H * D;   // [H, bs] scores, then probabilities, of one block
  float* m = p + H * bs;    // [H] running max
  float* l = m + H;         // [H] running sum of exp
  for (int64_t i = 0; i < H * D; ++i) {
    qf[i] = to_float(q[i]) * geo.scale;
    acc[i] = 0.f;
  }
  for (int64_t h = 0; h < H; ++h) {
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.f;
  }
  // Keys at positions [start, ctx): the query sits at ctx - 1 and sees keys > ctx - 1 - window.
  const int64_t start = geo.window > 0 ? std::max<int64_t>(0, ctx - geo.window) : 0;
  for (int64_t blk = start / bs; blk * bs < ctx; ++blk) {
    const int64_t t0 = std::max(start, blk * bs), t1 = std::min(ctx, (blk + 1) * bs);
    const int64_t n = t1 - t0;
    const int64_t base = (int64_t(table[blk]) * bs + (t0 - blk * bs)) * row;
    const T* kb = k_cache + base;
    const T* vb = v_cache + base;
    // The next block is elsewhere in the pool: fetch it while this one is computed on.
    const bool more = (blk + 1) * bs < ctx;
    const int64_t next = more ? int64_t(table[blk + 1]) * bs * row : 0;
    constexpr int64_t line = 64 / sizeof(T);
    for (int64_t j = 0; j < n; ++j) {
      if (more) {
        for (int64_t i = j * row; i < (j + 1) * row && i < bs * row; i += line) {
          __builtin_prefetch(k_cache + next + i);
          __builtin_prefetch(v_cache + next + i);
        }
      }
      for (int64_t h = 0; h < H; ++h) p[h * bs + j] = dot(qf + h * D, kb + j * row + h / G * D, D);
    }
    for (int64_t h = 0; h < H; ++h) {
      float* ph = p + h * bs;
      float mx = m[h];
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, ph[j]);
      const float alpha = std::exp(m[h] - mx);  // 0 on the first block (m = -inf)
      vfloat sums = {};
      int64_t j = 0;
      for (; j + W <= n; j += W) {
        const vfloat e = exp_nonpositive(load(ph + j) - mx);
        store(ph + j, e);
        sums += e;
      }
      float sum = hsum(sums);
      for (; j < n; ++j) {
        ph[j] = std::exp(ph[j] - mx);
        sum += ph[j];
      }
      m[h] = mx;
      l[h] = l[h] * alpha + sum;
      // Rescale the running output once per block, folded into the first row's update.
      scale_add(acc + h * D, alpha, ph[0], vb + h / G * D, D);
    }
    for (int64_t j = 1; j < n; ++j) {
      for (int64_t h = 0; h < H; ++h) {
        scale_add(acc + h * D, 1.f, p[h * bs + j], vb + j * row + h / G * D, D);
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    const float inv = 1.f / l[h];
    for (int64_t d = 0; d < D; ++d) store(out + h * D + d, acc[h * D + d] * inv);
  }
}

#if defined(__x86_64__)
#define PDSERVE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PDSERVE_CLONES
#endif

PDSERVE_CLONES void attend_f32(const float* q, const float* k, const float* v,
                               const int32_t* table, int64_t ctx, const Geometry& geo,
                               float* scratch, float* out) {
  attend(q, k, v, table, ctx, geo, scratch, out);
}

PDSERVE_CLONES void attend_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                const int32_t* table, int64_t ctx, const Geometry& geo,
                                float* scratch, uint16_t* out) {
  attend(q, k, v, table, ctx, geo, scratch, out);
}

template <typename T, typename F>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const torch::Tensor& context_lens,
         const Geometry& geo, torch::Tensor& out, F attend_one) {
  const int64_t B = q.size(0), max_blocks = block_tables.size(1);
  const int64_t seq_stride = geo.num_heads * geo.head_dim;
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k_cache.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_cache.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(scratch_size(geo));
    for (int64_t b = begin; b < end; ++b) {
      attend_one(qp + b * seq_stride, kp, vp, tables + b * max_blocks, lens[b], geo,
                 scratch.data(), op + b * seq_stride);
    }
  });
}

// q: [B, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim], same
// dtype as q (float32 or bfloat16); block_tables: [B, max_blocks] int32; context_lens: [B] int32,
// the query of sequence b sits at position context_lens[b] - 1. window 0 means no sliding window.
// Returns [B, num_heads, head_dim] in q's dtype. Everything is validated before any memory is read.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& context_lens, double scale,
                                     int64_t window) {
  for (const auto* t : {&q, &k_cache, &v_cache, &block_tables, &context_lens}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention: tensors must be on the CPU");
    TORCH_CHECK(t->is_contiguous(), "paged_decode_attention: tensors must be contiguous");
  }
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be 3-D and the caches 4-D");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2,
              "block_tables must be 2-D int32");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.dim() == 1,
              "context_lens must be 1-D int32");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim of q and the caches differ");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B,
              "block_tables and context_lens need one row per sequence");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t ctx = lens[b];
    TORCH_CHECK(ctx >= 1 && ctx <= max_blocks * bs, "context length ", ctx, " of sequence ", b,
                " is outside [1, ", max_blocks * bs, "]");
    const int64_t start = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
    for (int64_t blk = start / bs; blk * bs < ctx; ++blk) {
      const int32_t id = tables[b * max_blocks + blk];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " of sequence ", b,
                  " is outside the pool of ", num_blocks);
    }
  }
  auto out = torch::empty_like(q);
  if (B == 0) return out;
  const Geometry geo{bs, H, Hkv, D, window, static_cast<float>(scale)};
  if (dtype == at::kFloat) {
    run<float>(q, k_cache, v_cache, block_tables, context_lens, geo, out, attend_f32);
  } else {
    run<uint16_t>(q, k_cache, v_cache, block_tables, context_lens, geo, out, attend_bf16);
  }
  return out;
}

}  // namespace pdserve

// Runs without the GIL, as torch's own ops do (see packed_gemm.cpp).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &pdserve::paged_decode_attention,
        "Paged decode attention over a block table (CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
