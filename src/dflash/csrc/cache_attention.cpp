// Attention of a few queries (a decode or verify step) over a slot-indexed KV cache, for x86 CPUs.
//
// Why it exists: a step's 1 to 16 queries meet hundreds of cached keys. PyTorch's CPU flash attention reads the
// keys and values once per query head (grouped-query attention shares each among several), splits its work by
// blocks whose boundaries move with the number of queries, and wants an fp32 cache for speed. Here each key and
// value row is read once for all the query heads that share it and all the step's queries, from a cache kept
// in the model's dtype (bf16 or fp32), and every query is computed the same way whatever the other queries, the
// other rows of the batch, and the slots before it:
//   - a score is a dot product over the head dimension in a fixed order (16-lane partial sums, then a fixed tree);
//   - the softmax's maximum is exact, its exponentials are computed lane by lane by the same instructions, and
//     its sum and the weighted sum of values run over the visible keys one after the other, in slot order;
//   - keys a query does not see weigh exactly 0 and are skipped.
// So a query's output depends only on the keys it sees: verifying k tokens gives bit for bit the attention of k
// single steps, and a row's answer does not depend on what else is being served.
//
// q [b, heads, nq, d] fp32 or bf16; k, v [b, kv_heads, T, d] fp32 or bf16 (rows contiguous, any other strides);
// visible [b, nq, T] bool; out [b, heads, nq, d] in q's dtype (computed in fp32). d must be a multiple of 16.
//
// The same library holds `rms_norm` for bf16 rows (a step's norms: PyTorch spends tens of microseconds and five
// ops on each of a few rows, more than the products around them), computed as HF's RMSNorm computes it: the
// statistics in fp32 (16-lane partial sums in a fixed order, then a fixed tree), the normed row rounded to bf16,
// then times the weight, rounded to bf16. Each row alone, whatever the others.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kRowsAtOnce = 4;

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(x) for x <= 0 (x = score - max), lane by lane: exp(x) = 2^n * p(r), r = x - n ln2, |r| <= ln2/2, p a
// degree-6 Taylor polynomial (relative error below 2e-7). Written for a fixed 16-element loop without calls or
// branches, so every element goes through the same vector instructions.
__attribute__((noinline)) void exp16(const float* __restrict x, float* __restrict y) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
#pragma omp simd
  for (int l = 0; l < kLanes; ++l) {
    const float v = x[l] > -87.0f ? x[l] : -87.0f;
    const float n = (v * 1.44269504088896341f + kRound) - kRound;
    const float r = (v - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const float two_n = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
    y[l] = x[l] >= -87.0f ? p * two_n : 0.0f;  // below, and for a masked score (-inf): exactly 0
  }
}

// One key/value head of one batch row: its `groups` query heads x `nq` queries. D: the head size when it is a
// compile-time constant (64, 128: loops unrolled, a query's output block kept in registers), else 0 and `d`.
template <typename KV, int D>
void one_group(const float* q, const KV* k, const KV* v, const bool* visible, float* out, int64_t groups,
               int64_t nq, int64_t T, int64_t d_runtime, int64_t k_stride, int64_t v_stride, float scale) {
  const int64_t d = D ? D : d_runtime;
  // rows r = g * nq + i: query i of the g-th query head of this key/value head
  const int64_t R = groups * nq, Tpad = (T + kLanes - 1) / kLanes * kLanes;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> scores(R * Tpad, neg_inf), block(kLanes * d);
  // scores, 16 keys at a time: the block of keys transposed to [d][16], then each lane's dot product runs over
  // the head dimension in order, one multiply-add per element, the same for every key in every lane
  for (int64_t j0 = 0; j0 < T; j0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, T - j0);
    for (int64_t l = 0; l < kLanes; ++l) {
      const KV* kj = k + (j0 + (l < n ? l : 0)) * k_stride;
      for (int64_t c = 0; c < d; ++c) block[c * kLanes + l] = l < n ? to_float(kj[c]) : 0.0f;
    }
    // rows four at a time: four independent chains of multiply-adds share each loaded key element
    for (int64_t r0 = 0; r0 < R; r0 += kRowsAtOnce) {
      const int64_t rows = std::min<int64_t>(kRowsAtOnce, R - r0);
      bool any = false;
      for (int64_t r = r0; r < r0 + rows; ++r)
        for (int64_t l = 0; l < n; ++l) any |= visible[(r % nq) * T + j0 + l];
      if (!any) continue;
      float acc[kRowsAtOnce][kLanes] = {};
      const float* qr[kRowsAtOnce];
      for (int64_t m = 0; m < kRowsAtOnce; ++m) qr[m] = q + (r0 + (m < rows ? m : 0)) * d;
      for (int64_t c = 0; c < d; ++c) {
        const float* kc = block.data() + c * kLanes;
        for (int m = 0; m < kRowsAtOnce; ++m) {
          const float qc = qr[m][c];
#pragma omp simd
          for (int l = 0; l < kLanes; ++l) acc[m][l] += qc * kc[l];
        }
      }
      for (int64_t m = 0; m < rows; ++m) {
        const bool* seen = visible + ((r0 + m) % nq) * T + j0;
        float* s = scores.data() + (r0 + m) * Tpad + j0;
        for (int64_t l = 0; l < n; ++l) s[l] = seen[l] ? acc[m][l] * scale : neg_inf;
      }
    }
  }
  // softmax weights; each row's sum runs over its keys in slot order (rows side by side, lanes = rows)
  std::vector<float> weights(R * Tpad), maxima(R, neg_inf), total(R, 0.0f);
  for (int64_t r = 0; r < R; ++r) {
    const float* s = scores.data() + r * Tpad;
    float m = neg_inf;
    for (int64_t j = 0; j < T; ++j) m = s[j] > m ? s[j] : m;
    maxima[r] = m;
    float* w = weights.data() + r * Tpad;
    for (int64_t j = 0; j < Tpad; j += kLanes) {
      float shifted[kLanes];
      for (int l = 0; l < kLanes; ++l) shifted[l] = m == neg_inf ? neg_inf : s[j + l] - m;
      exp16(shifted, w + j);
    }
  }
  for (int64_t j = 0; j < T; ++j)
    for (int64_t r = 0; r < R; ++r) total[r] += weights[r * Tpad + j];
  // weighted values, 16 keys at a time: each query's output block stays in registers over the 16 keys, and
  // every output element adds its terms in slot order
  std::vector<float> acc(R * d, 0.0f);
  for (int64_t j0 = 0; j0 < T; j0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, T - j0);
    for (int64_t l = 0; l < n; ++l) {
      const KV* vj = v + (j0 + l) * v_stride;
      for (int64_t c = 0; c < d; ++c) block[l * d + c] = to_float(vj[c]);
    }
    for (int64_t r = 0; r < R; ++r) {
      const float* p = weights.data() + r * Tpad + j0;
      bool any = false;
      for (int64_t l = 0; l < n; ++l) any |= p[l] != 0.0f;
      if (!any) continue;
      float* a = acc.data() + r * d;
      if constexpr (D != 0) {
        float o[D];
        for (int c = 0; c < D; ++c) o[c] = a[c];
        for (int64_t l = 0; l < n; ++l) {
          if (p[l] == 0.0f) continue;
          const float* vl = block.data() + l * D;
#pragma omp simd
          for (int c = 0; c < D; ++c) o[c] += p[l] * vl[c];
        }
        for (int c = 0; c < D; ++c) a[c] = o[c];
      } else {
        for (int64_t l = 0; l < n; ++l) {
          if (p[l] == 0.0f) continue;
          const float* vl = block.data() + l * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) a[c] += p[l] * vl[c];
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
    for (int64_t c = 0; c < d; ++c) out[r * d + c] = acc[r * d + c] * inv;
  }
}

template <typename KV>
void head_group(const float* q, const KV* k, const KV* v, const bool* visible, float* out, int64_t groups,
                int64_t nq, int64_t T, int64_t d, int64_t k_stride, int64_t v_stride, float scale) {
  if (d == 64)
    one_group<KV, 64>(q, k, v, visible, out, groups, nq, T, d, k_stride, v_stride, scale);
  else if (d == 128)
    one_group<KV, 128>(q, k, v, visible, out, groups, nq, T, d, k_stride, v_stride, scale);
  else
    one_group<KV, 0>(q, k, v, visible, out, groups, nq, T, d, k_stride, v_stride, scale);
}

at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& visible,
                           double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && visible.dim() == 3, "cache_attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "cache_attention: q must be fp32 or bf16");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "cache_attention: k and v must both be fp32 or both bf16");
  TORCH_CHECK(visible.scalar_type() == at::kBool, "cache_attention: visible must be bool");
  const int64_t b = q.size(0), heads = q.size(1), nq = q.size(2), d = q.size(3);
  const int64_t kv_heads = k.size(1), T = k.size(2);
  TORCH_CHECK(d % kLanes == 0, "cache_attention: head size must be a multiple of 16");
  TORCH_CHECK(heads % kv_heads == 0 && k.size(0) == b && k.size(3) == d && v.sizes() == k.sizes(),
              "cache_attention: shapes do not agree");
  TORCH_CHECK(visible.size(0) == b && visible.size(1) == nq && visible.size(2) == T, "cache_attention: bad mask");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "cache_attention: key/value rows must be contiguous");
  // a bf16 q widens exactly and the output rounds back to it here, as the caller would (two ops fewer per layer)
  const at::Tensor qc = q.to(at::kFloat).contiguous(), vis = visible.contiguous();
  at::Tensor out = at::empty({b, heads, nq, d}, qc.options());
  const int64_t groups = heads / kv_heads;
  const float* qp = qc.data_ptr<float>();
  const bool* mp = vis.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bi = task / kv_heads, h = task % kv_heads;
      const float* qg = qp + (bi * heads + h * groups) * nq * d;
      float* og = op + (bi * heads + h * groups) * nq * d;
      const bool* mg = mp + bi * nq * T;
      if (k.scalar_type() == at::kFloat) {
        head_group(qg, k.data_ptr<float>() + bi * k.stride(0) + h * k.stride(1),
                   v.data_ptr<float>() + bi * v.stride(0) + h * v.stride(1), mg, og, groups, nq, T, d, k.stride(2),
                   v.stride(2), static_cast<float>(scale));
      } else {
        head_group(qg, k.data_ptr<at::BFloat16>() + bi * k.stride(0) + h * k.stride(1),
                   v.data_ptr<at::BFloat16>() + bi * v.stride(0) + h * v.stride(1), mg, og, groups, nq, T, d,
                   k.stride(2), v.stride(2), static_cast<float>(scale));
      }
    }
  });
  return out.to(q.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t K = x.size(-1);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  weight.numel() == K && K % kLanes == 0,
              "rms_norm: x must be a bf16 CPU tensor whose last size is a multiple of 16 and the weight's size, got ",
              x.sizes(), " ", x.scalar_type(), " and ", weight.sizes(), " ", weight.scalar_type());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = K ? xc.numel() / K : 0;
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = wc.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // a step's few rows are done by one thread: waking the others costs more than the work
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const at::BFloat16* in = xp + r * K;
      float part[kLanes] = {};
      for (int64_t k = 0; k < K; k += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) {
          const float v = to_float(in[k + l]);
          part[l] += v * v;
        }
      for (int64_t w = kLanes / 2; w > 0; w /= 2)
        for (int64_t l = 0; l < w; ++l) part[l] += part[l + w];
      const float inv = 1.0f / std::sqrt(part[0] / static_cast<float>(K) + static_cast<float>(eps));
      for (int64_t k = 0; k < K; ++k) {
        const at::BFloat16 normed(to_float(in[k]) * inv);
        yp[r * K + k] = at::BFloat16(to_float(normed) * to_float(wp[k]));
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(dflash_attn, m) {
  m.def("cache_attention(Tensor q, Tensor k, Tensor v, Tensor visible, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(dflash_attn, CPU, m) {
  m.impl("cache_attention", &cache_attention);
  m.impl("rms_norm", &rms_norm);
}
