// Attention of a few queries (a decode or verify step) over a slot-indexed KV cache, for x86 CPUs.
//
// Why it exists: a step's 1 to 16 queries meet hundreds of cached keys. PyTorch's CPU flash attention reads the
// keys and values once per query head (grouped-query attention shares each among several), splits its work by
// blocks whose boundaries move with the number of queries, and wants an fp32 cache for speed. Here each key and
// value row is read once for all the query heads that share it and all the step's queries, from a cache kept
// in the model's dtype (bf16 or fp32), and every query is computed the same way whatever the other queries, the
// other rows of the batch, and the slots before it:
//   - a score is a dot product over the head dimension in a fixed order (8-lane partial sums, then a fixed tree);
//   - the softmax's maximum is exact, its exponentials are computed lane by lane by the same instructions, and
//     its sum and the weighted sum of values run over the visible keys one after the other, in slot order;
//   - keys a query does not see weigh exactly 0 and are skipped.
// So a query's output depends only on the keys it sees: verifying k tokens gives bit for bit the attention of k
// single steps, and a row's answer does not depend on what else is being served. Built for AVX-512, the scores and
// the weighted values take 16-lane registers for the same sums in the same order: the AVX2 build's bits.
//
// q [b, heads, nq, d] fp32 or bf16; k, v [b, kv_heads, T, d] fp32 or bf16 (rows contiguous, any other strides);
// visible [b, nq, T] bool; out [b, heads, nq, d] in q's dtype (computed in fp32). d must be a multiple of 16.
//
// The same library holds `rms_norm` for bf16 rows (a step's norms: PyTorch spends tens of microseconds and five
// ops on each of a few rows, more than the products around them), computed as HF's RMSNorm computes it: the
// statistics in fp32 (16-lane partial sums in a fixed order, then a fixed tree), the normed row rounded to bf16,
// then times the weight, rounded to bf16. Each row alone, whatever the others.
//
// And `argmax` of logits rows (fp32 or bf16), what torch.argmax(-1) answers (the first of equal maxima, -0 equal
// to +0, a NaN above everything), where PyTorch's CPU argmax takes 1.7 ms for 8 bf16 rows of a 49k vocabulary.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

// bf16 as its bits, in loops the compiler vectorises: widening is exact; rounding is to nearest even with NaN
// kept quiet, as c10::BFloat16 (PyTorch's bf16 ops) rounds
inline float widen(uint16_t h) { return __builtin_bit_cast(float, static_cast<uint32_t>(h) << 16); }
inline uint16_t round_bf16(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : static_cast<uint16_t>(r);
}

// exp(x) for x <= 0: exp(x) = 2^n * p(r), r = x - n ln2, |r| <= ln2/2, p a degree-6 Taylor polynomial (relative
// error below 2e-7); exactly 0 below -87 (and for -inf). Branch-free float arithmetic, inlined into loops the
// compiler vectorises, so every element goes through the same instructions.
inline float exp_nonpositive(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float v = x > -87.0f ? x : -87.0f;
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
  return x >= -87.0f ? p * two_n : 0.0f;
}

// The softmax weights of 16 slots: exp(s - m) for a row whose maximum score m is finite (an unseen slot's -inf
// score weighs exactly 0). Not inlined: every slot of every row goes through these same instructions.
__attribute__((noinline)) void exp16(const float* __restrict s, float m, float* __restrict y) {
#pragma omp simd
  for (int l = 0; l < kLanes; ++l) y[l] = exp_nonpositive(s[l] - m);
}

// Which of the n <= 16 weights at p are not 0, as bits (NaN counts as not 0, as `p[l] != 0.0f` says); p has 16
// readable floats
inline uint32_t nonzero16(const float* p, int64_t n) {
  const __m256 zero = _mm256_setzero_ps();
  const uint32_t bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), zero, _CMP_NEQ_UQ)) |
                        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + 8), zero, _CMP_NEQ_UQ)) << 8;
  return bits & ((1u << n) - 1);
}

// A cached row in fp32: an fp32 cache is read in place, a bf16 row is widened into `buf` (exactly)
inline const float* row_fp32(const float* row, float*, int64_t) { return row; }
inline const float* row_fp32(const at::BFloat16* row, float* buf, int64_t d) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) buf[c] = widen(h[c]);
  return buf;
}

// The dot products of one query with 8 keys. Each is 8 partial sums (lane c % 8 over c in order, one multiply-add
// per element) added by the same tree, ((0+1)+(2+3))+((4+5)+(6+7)), whichever of the 8 places the key takes.
inline __m256 dot8(const float* q, const float* const* key, int64_t d) {
  __m256 acc[8];
  for (int l = 0; l < 8; ++l) acc[l] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
    for (int l = 0; l < 8; ++l) acc[l] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(key[l] + c), acc[l]);
  }
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]: after two rounds the low 128 bits hold
  // keys 0-3's (0+1)+(2+3), the high 128 bits their (4+5)+(6+7); likewise keys 4-7
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define DFLASH_ATTN_512 1
// dot8 for a few rows at once in 16-lane registers, with the same bits: a register holds two keys' 8-lane partial
// sums side by side, each lane taking the same multiply-adds in the same order as dot8's, and the same tree adds
// each key's lanes. Half the instructions per row, and the keys are loaded once for all the rows.
//
// The block's 8 keys as dot8_rows reads them: keys 2p and 2p+1 side by side, 8 dimensions at a time,
// pairs[((c / 8) * 4 + p) * 16 + 8 * (key % 2) + c % 8].
inline void pair_keys(const float* const* key, int64_t d, float* pairs) {
  for (int64_t c = 0; c < d; c += 8)
    for (int p = 0; p < 4; ++p)
      _mm512_storeu_ps(pairs + ((c / 8) * 4 + p) * 16,
                       _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(key[2 * p] + c)),
                                          _mm256_loadu_ps(key[2 * p + 1] + c), 1));
}

// _mm256_hadd_ps in each 128-bit lane: [a0+a1, a2+a3, b0+b1, b2+b3]
inline __m512 hadd_lanes(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The dot products of NR queries with the 8 keys of `pairs`, as dot8 computes each
template <int NR>
inline void dot8_rows(const float* const* q, const float* pairs, int64_t d, __m256* out) {
  __m512 acc[NR][4];
  for (int i = 0; i < NR; ++i)
    for (int p = 0; p < 4; ++p) acc[i][p] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    const float* kp = pairs + (c / 8) * 64;
    for (int i = 0; i < NR; ++i) {
      const __m512 qc = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[i] + c));
      for (int p = 0; p < 4; ++p) acc[i][p] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kp + 16 * p), acc[i][p]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    // per 128-bit lane: lane 0 holds keys 0, 2, 4, 6's (l0+l1)+(l2+l3), lane 1 their (l4+l5)+(l6+l7), lanes 2
    // and 3 the same of keys 1, 3, 5, 7; then the halves are added and the keys put in order
    const __m512 g = hadd_lanes(hadd_lanes(acc[i][0], acc[i][1]), hadd_lanes(acc[i][2], acc[i][3]));
    const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(g, g, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(g, g, _MM_SHUFFLE(3, 1, 3, 1)));
    out[i] = _mm256_permutevar8x32_ps(_mm512_castps512_ps256(s), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
}
#endif

// x[i][l] -> x[l][i]
inline void transpose8(__m256* x) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2)
    t[i] = _mm256_unpacklo_ps(x[i], x[i + 1]), t[i + 1] = _mm256_unpackhi_ps(x[i], x[i + 1]);
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    x[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// NR rows' output blocks [NR, D] at acc (fp32, rows D apart) plus the n <= 16 value rows weighed by p[i][l]: each
// element adds its terms in slot order, one multiply-add each, as a row alone does.
template <int NR, int D>
inline void weigh_values(const float* const* p, const float* const* value, int64_t n, float* acc) {
#ifdef DFLASH_ATTN_512
  if constexpr (D % 64 == 0) {  // 16 lanes at a time and 64 elements per pass
    for (int c = 0; c < D; c += 64) {
      __m512 o[NR][4];
      for (int i = 0; i < NR; ++i)
        for (int e = 0; e < 4; ++e) o[i][e] = _mm512_loadu_ps(acc + i * D + c + 16 * e);
      for (int64_t l = 0; l < n; ++l) {
        __m512 vl[4];
        for (int e = 0; e < 4; ++e) vl[e] = _mm512_loadu_ps(value[l] + c + 16 * e);
        for (int i = 0; i < NR; ++i) {
          const __m512 w = _mm512_set1_ps(p[i][l]);
          for (int e = 0; e < 4; ++e) o[i][e] = _mm512_fmadd_ps(w, vl[e], o[i][e]);
        }
      }
      for (int i = 0; i < NR; ++i)
        for (int e = 0; e < 4; ++e) _mm512_storeu_ps(acc + i * D + c + 16 * e, o[i][e]);
    }
    return;
  }
#endif
  for (int c = 0; c < D; c += 16) {
    __m256 o[NR][2];
    for (int i = 0; i < NR; ++i) {
      o[i][0] = _mm256_loadu_ps(acc + i * D + c);
      o[i][1] = _mm256_loadu_ps(acc + i * D + c + 8);
    }
    for (int64_t l = 0; l < n; ++l) {
      const __m256 v0 = _mm256_loadu_ps(value[l] + c), v1 = _mm256_loadu_ps(value[l] + c + 8);
      for (int i = 0; i < NR; ++i) {
        const __m256 w = _mm256_set1_ps(p[i][l]);
        o[i][0] = _mm256_fmadd_ps(w, v0, o[i][0]);
        o[i][1] = _mm256_fmadd_ps(w, v1, o[i][1]);
      }
    }
    for (int i = 0; i < NR; ++i) {
      _mm256_storeu_ps(acc + i * D + c, o[i][0]);
      _mm256_storeu_ps(acc + i * D + c + 8, o[i][1]);
    }
  }
}

// Rows [r0, r1) of one key/value head of one batch row: row r = g * nq + i is query i of the g-th query head that
// shares this key/value head. q, out: that head's rows [groups * nq, d]. D: the head size when it is a
// compile-time constant (64, 128: a query's output block kept in registers), else 0 and `d`.
template <typename KV, int D>
void head_rows(const float* q, const KV* k, const KV* v, const bool* visible, float* out, int64_t r0, int64_t r1,
               int64_t nq, int64_t T, int64_t d_runtime, int64_t k_stride, int64_t v_stride, float scale) {
  const int64_t d = D ? D : d_runtime, R = r1 - r0;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // the slots any of these rows sees lie in [lo, hi): a row that joined a running batch, or a short row beside long
  // ones, has many slots it never sees before its first, and a cache has room past every row's end; nothing below
  // reads outside the span (an unseen slot only ever added an exact 0), so the results are the same bits. Rows
  // g * nq + i share query i's mask: each mask is scanned once, its tail a word at a time.
  int64_t lo = T, hi = 0;
  for (int64_t r = r0; r < std::min(r1, r0 + nq); ++r) {
    const bool* row = visible + (r % nq) * T;
    const int64_t first = std::find(row, row + T, true) - row;
    int64_t end = T;
    for (uint64_t word = 0; end - 8 >= first; end -= 8) {
      std::memcpy(&word, row + end - 8, 8);
      if (word != 0) break;
    }
    while (end > first && !row[end - 1]) --end;
    if (first < end) lo = std::min(lo, first), hi = std::max(hi, end);
  }
  if (lo >= hi) lo = hi = 0;
  lo -= lo % kLanes;  // blocks of 16 (and of 8) start where they did
  const int64_t S = (hi - lo + kLanes - 1) / kLanes * kLanes;  // the span, padded with -inf scores
  std::vector<float> scores(R * S, neg_inf), kbuf(8 * d), zeros(d, 0.0f), block(kLanes * d);
#ifdef DFLASH_ATTN_512
  std::vector<float> pairs(8 * d);
#endif
  // scores, 8 keys at a time (each widened once for all the rows); a row skips the keys it sees none of
  for (int64_t j0 = lo; j0 < hi; j0 += 8) {
    const int64_t n = std::min<int64_t>(8, hi - j0);
    const float* key[8];
    for (int64_t l = 0; l < 8; ++l)
      key[l] = l < n ? row_fp32(k + (j0 + l) * k_stride, kbuf.data() + l * d, d) : zeros.data();
    uint64_t seen[2] = {};  // a row's 8 flags (bool is one byte, 0 or 1); past the last key none
    const auto put = [&](int64_t r, uint64_t flags8, __m256 dots) {
      const __m256i flags = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(flags8)));
      const __m256 shown = _mm256_castsi256_ps(_mm256_cmpgt_epi32(flags, _mm256_setzero_si256()));
      _mm256_storeu_ps(scores.data() + (r - r0) * S + (j0 - lo),
                       _mm256_blendv_ps(_mm256_set1_ps(neg_inf), _mm256_mul_ps(dots, _mm256_set1_ps(scale)), shown));
    };
    int64_t r = r0;
#ifdef DFLASH_ATTN_512
    pair_keys(key, d, pairs.data());
    for (; r + 2 <= r1; r += 2) {  // two rows at a time: eight independent chains of multiply-adds
      std::memcpy(&seen[0], visible + (r % nq) * T + j0, n);
      std::memcpy(&seen[1], visible + ((r + 1) % nq) * T + j0, n);
      if ((seen[0] | seen[1]) == 0) continue;
      const float* rows[2] = {q + r * d, q + (r + 1) * d};
      __m256 dots[2];
      dot8_rows<2>(rows, pairs.data(), d, dots);
      for (int i = 0; i < 2; ++i)
        if (seen[i] != 0) put(r + i, seen[i], dots[i]);
    }
#endif
    for (; r < r1; ++r) {
      std::memcpy(&seen[0], visible + (r % nq) * T + j0, n);
      if (seen[0] == 0) continue;
#ifdef DFLASH_ATTN_512
      const float* row = q + r * d;
      __m256 dots;
      dot8_rows<1>(&row, pairs.data(), d, &dots);
      put(r, seen[0], dots);
#else
      put(r, seen[0], dot8(q + r * d, key, d));
#endif
    }
  }
  // softmax weights (the maximum is exact in any order)
  std::vector<float> weights(R * S, 0.0f), total(R, 0.0f);
  for (int64_t r = 0; r < R; ++r) {
    const float* s = scores.data() + r * S;
    __m256 mv = _mm256_set1_ps(neg_inf);
    for (int64_t j = 0; j < S; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    float m = neg_inf;
    for (int l = 0; l < 8; ++l) m = lanes[l] > m ? lanes[l] : m;
    if (m == neg_inf) continue;  // a row that sees nothing: weights 0, output 0
    for (int64_t j = 0; j < S; j += kLanes) exp16(s + j, m, weights.data() + r * S + j);
  }
  // each row's sum of weights runs over its slots one after the other, in slot order (so a key's place in the
  // cache, and unseen slots between keys, as in a candidate tree, change nothing); 8 rows side by side, their
  // weights transposed 8 slots at a time
  for (int64_t r8 = 0; r8 < R; r8 += 8) {
    const int64_t rows = std::min<int64_t>(8, R - r8);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < S; j += 8) {
      __m256 x[8];
      for (int64_t i = 0; i < 8; ++i)
        x[i] = i < rows ? _mm256_loadu_ps(weights.data() + (r8 + i) * S + j) : _mm256_setzero_ps();
      transpose8(x);
      for (int i = 0; i < 8; ++i) sum = _mm256_add_ps(sum, x[i]);
    }
    float t[8];
    _mm256_storeu_ps(t, sum);
    for (int64_t i = 0; i < rows; ++i) total[r8 + i] = t[i];
  }
  // weighted values, 16 keys at a time: each query's output block stays in registers over the 16 keys, and
  // every output element adds its terms in slot order
  std::vector<float> acc(R * d, 0.0f);
  for (int64_t j0 = lo; j0 < hi; j0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, hi - j0);
    const float* value[kLanes];
    for (int64_t l = 0; l < n; ++l) value[l] = row_fp32(v + (j0 + l) * v_stride, block.data() + l * d, d);
    const auto one_row = [&](int64_t r) {
      const float* p = weights.data() + r * S + (j0 - lo);
      const uint32_t used = nonzero16(p, n);  // the keys it weighs, taken in slot order
      if (used == 0) return;
      float* a = acc.data() + r * d;
      if constexpr (D != 0) {
        float o[D];
        for (int c = 0; c < D; ++c) o[c] = a[c];
        for (uint32_t left = used; left != 0; left &= left - 1) {
          const int l = __builtin_ctz(left);
          const float* vl = value[l];
#pragma omp simd
          for (int c = 0; c < D; ++c) o[c] += p[l] * vl[c];
        }
        for (int c = 0; c < D; ++c) a[c] = o[c];
      } else {
        for (uint32_t left = used; left != 0; left &= left - 1) {
          const int l = __builtin_ctz(left);
          const float* vl = value[l];
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) a[c] += p[l] * vl[c];
        }
      }
    };
    int64_t r = 0;
    if constexpr (D != 0) {
      // rows that all see every key of the block, up to four at once (each value chunk loaded once for them, and
      // their output blocks' sums independent chains: a row alone waits on the multiply-add before at every key),
      // every element taking the same multiply-adds in the same order as row by row (so the same bits). Rows where
      // one skips a key go alone.
      while (R - r >= 2) {
        const int64_t rows = std::min<int64_t>(4, R - r);
        const float* p[4];
        bool all = true;
        for (int64_t i = 0; i < rows; ++i) {
          p[i] = weights.data() + (r + i) * S + (j0 - lo);
          all &= nonzero16(p[i], n) == (1u << n) - 1;
        }
        float* a = acc.data() + r * d;
        if (!all)
          for (int64_t i = 0; i < rows; ++i) one_row(r + i);
        else if (rows == 4)
          weigh_values<4, D>(p, value, n, a);
        else if (rows == 3)
          weigh_values<3, D>(p, value, n, a);
        else
          weigh_values<2, D>(p, value, n, a);
        r += rows;
      }
    }
    for (; r < R; ++r) one_row(r);
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
    for (int64_t c = 0; c < d; ++c) out[(r0 + r) * d + c] = acc[r * d + c] * inv;
  }
}

template <typename KV>
void head_rows_any(const float* q, const KV* k, const KV* v, const bool* visible, float* out, int64_t r0, int64_t r1,
                   int64_t nq, int64_t T, int64_t d, int64_t k_stride, int64_t v_stride, float scale) {
  if (d == 64)
    head_rows<KV, 64>(q, k, v, visible, out, r0, r1, nq, T, d, k_stride, v_stride, scale);
  else if (d == 128)
    head_rows<KV, 128>(q, k, v, visible, out, r0, r1, nq, T, d, k_stride, v_stride, scale);
  else
    head_rows<KV, 0>(q, k, v, visible, out, r0, r1, nq, T, d, k_stride, v_stride, scale);
}

struct Strides {
  int64_t row, head, slot;  // of a key or value cache [b, kv_heads, T, d], in elements
};

// A step's attention: q and out [b, heads, nq, d] fp32 contiguous, visible [b, nq, T]. One task per batch row,
// key/value head and part of its rows: with fewer (row, head) pairs than twice the threads (one sequence of a
// small model: 3 key/value heads on 2 threads), each pair's rows are split so that the threads share the work
// evenly; a split only repeats the widening of the keys and values. A row's result is the same in any part.
template <typename KV>
void attend(const float* q, const KV* k, const KV* v, Strides ks, Strides vs, const bool* visible, float* out,
            int64_t b, int64_t heads, int64_t kv_heads, int64_t nq, int64_t T, int64_t d, float scale) {
  const int64_t groups = heads / kv_heads, R = groups * nq, pairs = b * kv_heads;
  const int64_t parts = std::clamp<int64_t>((2 * at::get_num_threads() + pairs - 1) / pairs, 1, R);
  at::parallel_for(0, pairs * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end;) {
      // the parts of one pair a thread takes one after the other are one call: its keys widened once
      const int64_t pair = task / parts, part = task % parts, bi = pair / kv_heads, h = pair % kv_heads;
      const int64_t last = std::min(end, (pair + 1) * parts), off = (bi * heads + h * groups) * nq * d;
      head_rows_any(q + off, k + bi * ks.row + h * ks.head, v + bi * vs.row + h * vs.head, visible + bi * nq * T,
                    out + off, part * R / parts, (last - pair * parts) * R / parts, nq, T, d, ks.slot, vs.slot, scale);
      task = last;
    }
  });
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
  const float* qp = qc.data_ptr<float>();
  const bool* mp = vis.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const Strides ks{k.stride(0), k.stride(1), k.stride(2)}, vs{v.stride(0), v.stride(1), v.stride(2)};
  if (k.scalar_type() == at::kFloat)
    attend(qp, k.data_ptr<float>(), v.data_ptr<float>(), ks, vs, mp, op, b, heads, kv_heads, nq, T, d,
           static_cast<float>(scale));
  else
    attend(qp, k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), ks, vs, mp, op, b, heads, kv_heads, nq, T, d,
           static_cast<float>(scale));
  return out.to(q.scalar_type());
}

inline const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
inline uint16_t* bits(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// one row of HF's RMSNorm in bf16 (see the header): statistics in fp32, the normed row rounded, times the weight
void norm_row(const uint16_t* in, const uint16_t* w, uint16_t* out, int64_t K, float eps) {
  float part[kLanes] = {};
  for (int64_t k = 0; k < K; k += kLanes)
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) part[l] += widen(in[k + l]) * widen(in[k + l]);
  for (int64_t h = kLanes / 2; h > 0; h /= 2)
    for (int64_t l = 0; l < h; ++l) part[l] += part[l + h];
  const float inv = 1.0f / std::sqrt(part[0] / static_cast<float>(K) + eps);
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) out[k] = round_bf16(widen(round_bf16(widen(in[k]) * inv)) * widen(w[k]));
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
  const uint16_t *xp = bits(xc), *wp = bits(wc);
  uint16_t* yp = bits(y);
  // a step's few rows are done by one thread: waking the others costs more than the work
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * K, wp, yp + r * K, K, static_cast<float>(eps));
  });
  return y;
}

// ---- decoder_layers: a step's whole stack of decoder layers in one call ----
// A decode or verify step of a small model on a CPU spends more time dispatching some thirty small PyTorch ops
// per layer (views, copies, RoPE's five, residual adds) from Python than in its products. This runs the layers
// of a Llama-family model (Llama, Qwen2, Qwen3, Mistral) with bf16 activations here, op for op as the fast
// runtime's Python forward does them: RMSNorm (norm_row), the fused q/k/v product, per-head q/k norms (Qwen3),
// RoPE, the keys and values written at slots pointer.. of the cache, attention (head_rows), the output
// product, the residual, the fused gate/up product, SiLU(gate) * up, the down product, the residual. Every
// elementwise step rounds to bf16 where PyTorch's bf16 op would, and the products go to the library's linear
// op (dflash's int4 kernel) through the dispatcher. Each row and query is computed alone, as everywhere here.
//
// weights: per layer kPerLayer tensors (absent ones None), in the order of the W enum below.
enum W { kLn1, kQkv, kQkvS, kQkvB, kQNorm, kKNorm, kO, kOS, kOB, kLn2, kGu, kGuS, kGuB, kDown, kDownS, kDownB, kPerLayer };

// A step's per-row work is split between the threads from this many rows (elements for SiLU) on: below that,
// waking them costs more than the work (about 1.2 us a parallel region on 2 threads of an AMD EPYC VM).
constexpr int64_t kParallelRows = 4, kParallelElements = 4096;

using LinearOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>;

// y = x @ W^T (+ bias, added in bf16 as PyTorch's bf16 add rounds it)
at::Tensor product(const LinearOp& op, const at::Tensor& x, const std::optional<at::Tensor>& q,
                   const std::optional<at::Tensor>& s, const std::optional<at::Tensor>& bias) {
  at::Tensor y = op.call(x, *q, *s);
  if (bias.has_value()) {
    const int64_t N = y.size(1);
    uint16_t* yp = bits(y);
    const uint16_t* bp = bits(*bias);
    for (int64_t m = 0; m < y.size(0); ++m)
#pragma omp simd
      for (int64_t n = 0; n < N; ++n) yp[m * N + n] = round_bf16(widen(yp[m * N + n]) + widen(bp[n]));
  }
  return y;
}

// x += y in bf16, row by row
void add_rows(uint16_t* x, const uint16_t* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = round_bf16(widen(x[i]) + widen(y[i]));
}

// silu(g) * u for one row of g and u, each rounded to bf16 as PyTorch's two bf16 ops round. silu(g) =
// g / (1 + e^-g), through e^-|g| so that no exponential overflows: for g < 0 it is g e^g / (1 + e^g)
void silu_mul_row(const uint16_t* g, const uint16_t* u, uint16_t* out, int64_t I) {
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    const float gv = widen(g[i]);
    const float e = exp_nonpositive(-std::fabs(gv));
    const float silu = (gv >= 0.0f ? gv : gv * e) / (1.0f + e);
    out[i] = round_bf16(widen(round_bf16(silu)) * widen(u[i]));
  }
}

// SiLU(gate) * up of a fused gate/up product [..., 2I] (gate first), bf16: the arithmetic decoder_layers uses,
// for the Python forward too, so that both compute the same bits
at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.device().is_cpu() && gu.scalar_type() == at::kBFloat16 && gu.size(-1) % 2 == 0,
              "silu_mul: expected a bf16 CPU tensor [..., 2I], got ", gu.sizes(), " ", gu.scalar_type());
  const at::Tensor c = gu.contiguous();
  const int64_t I = c.size(-1) / 2, rows = I ? c.numel() / (2 * I) : 0;
  std::vector<int64_t> shape(c.sizes().begin(), c.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, c.options());
  const uint16_t* gp = bits(c);
  uint16_t* op = bits(out);
  at::parallel_for(0, rows, rows * I >= kParallelElements ? 1 : rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(gp + r * 2 * I, gp + r * 2 * I + I, op + r * I, I);
  });
  return out;
}

// RoPE of one head as the Python forward's x * cos + roll(x, d/2) * sin (`sin` comes with its first half
// negated), each product and the sum rounded to bf16
void rope_row(const uint16_t* in, const uint16_t* c, const uint16_t* sn, uint16_t* out, int64_t d) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i)
    out[i] = round_bf16(widen(round_bf16(widen(in[i]) * widen(c[i]))) +
                        widen(round_bf16(widen(in[i + half]) * widen(sn[i]))));
#pragma omp simd
  for (int64_t i = half; i < d; ++i)
    out[i] = round_bf16(widen(round_bf16(widen(in[i]) * widen(c[i]))) +
                        widen(round_bf16(widen(in[i - half]) * widen(sn[i]))));
}

std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_layers(
    const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& visible, int64_t pointer,
    at::TensorList keys, at::TensorList values, const c10::List<std::optional<at::Tensor>>& weights,
    at::IntArrayRef taps, int64_t heads, int64_t kv_heads, double eps_d, double scale_d, c10::string_view linear) {
  const int64_t L = static_cast<int64_t>(keys.size());
  TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
              "decoder_layers: x must be a bf16 CPU tensor [b, q, hidden], got ", x_in.sizes(), " ", x_in.scalar_type());
  TORCH_CHECK(values.size() == keys.size() && static_cast<int64_t>(weights.size()) == L * kPerLayer,
              "decoder_layers: ", L, " layers' caches need ", L * kPerLayer, " weights and as many value caches");
  const int64_t b = x_in.size(0), nq = x_in.size(1), H = x_in.size(2), M = b * nq;
  const int64_t d = cos.size(-1), T = pointer + nq, groups = heads / kv_heads, width = (heads + 2 * kv_heads) * d;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == M * d && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16,
              "decoder_layers: cos and sin must be bf16 [b, q, head_dim]");
  TORCH_CHECK(d % kLanes == 0 && heads % kv_heads == 0 && H % kLanes == 0, "decoder_layers: bad head sizes");
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.dim() == 3 && visible.size(0) == b &&
                  visible.size(1) == nq && visible.size(2) == T,
              "decoder_layers: visible must be bool [b, q, pointer + q]");
  for (int64_t i = 0; i < L; ++i)
    TORCH_CHECK(keys[i].scalar_type() == at::kBFloat16 && values[i].scalar_type() == at::kBFloat16 &&
                    keys[i].is_contiguous() && values[i].is_contiguous() && keys[i].dim() == 4 &&
                    keys[i].size(0) >= b && keys[i].size(1) == kv_heads && keys[i].size(2) >= T &&
                    keys[i].size(3) == d && values[i].sizes() == keys[i].sizes(),
                "decoder_layers: layer ", i, "'s cache must be contiguous bf16 [>= b, kv_heads, >= pointer + q, d]");
  const LinearOp op = c10::Dispatcher::singleton()
                          .findSchemaOrThrow(std::string(linear).c_str(), "")
                          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  const float eps = static_cast<float>(eps_d), scale = static_cast<float>(scale_d);
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous(), vis = visible.contiguous();
  const uint16_t *cp = bits(cos_c), *sp = bits(sin_c);
  const bool* mp = vis.data_ptr<bool>();
  const auto opts = x_in.options();
  at::Tensor x = x_in.reshape({M, H}).clone();
  at::Tensor h = at::empty({M, H}, opts), o = at::empty({M, heads * d}, opts);
  at::Tensor qf = at::empty({b, heads, nq, d}, opts.dtype(at::kFloat)), of = at::empty_like(qf);
  uint16_t *xp = bits(x), *hp = bits(h), *opp = bits(o);
  float *qfp = qf.data_ptr<float>(), *ofp = of.data_ptr<float>();
  std::vector<at::Tensor> tapped;
  // a step's per-row work (norms, RoPE, the cache writes, residuals), split between the threads from
  // kParallelRows rows on
  const auto each_row = [&](const auto& f) {
    at::parallel_for(0, M, M >= kParallelRows ? 1 : M, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) f(m);
    });
  };
  const auto weight = [&](int64_t layer, W k) { return weights.get(layer * kPerLayer + k); };
  each_row([&](int64_t m) { norm_row(xp + m * H, bits(*weight(0, kLn1)), hp + m * H, H, eps); });
  for (int64_t li = 0; li < L; ++li) {
    const auto w = [&](W k) { return weight(li, k); };
    at::Tensor qkv = product(op, h, w(kQkv), w(kQkvS), w(kQkvB));  // [M, (heads + 2 kv_heads) d]
    uint16_t* qkvp = bits(qkv);
    // per row: the q/k norms (Qwen3), in place per head; queries rotated and widened to fp32 for attention; keys
    // rotated and values into the cache
    uint16_t* kc = bits(const_cast<at::Tensor&>(keys[li]));
    uint16_t* vc = bits(const_cast<at::Tensor&>(values[li]));
    const int64_t cap = keys[li].size(2), kvs = kv_heads * cap * d;
    each_row([&](int64_t m) {
      thread_local std::vector<uint16_t> rot;  // one head, per thread
      rot.resize(d);
      if (w(kQNorm).has_value()) {  // each normed head is read only by RoPE below
        for (int64_t hh = 0; hh < heads + kv_heads; ++hh) {
          uint16_t* row = qkvp + m * width + hh * d;
          std::copy(row, row + d, rot.begin());
          norm_row(rot.data(), bits(*w(hh < heads ? kQNorm : kKNorm)), row, d, eps);
        }
      }
      const int64_t bi = m / nq, t = m % nq;
      for (int64_t hh = 0; hh < heads + kv_heads; ++hh) {
        const uint16_t* in = qkvp + m * width + hh * d;
        if (hh < heads) {
          rope_row(in, cp + m * d, sp + m * d, rot.data(), d);
          float* qrow = qfp + ((bi * heads + hh) * nq + t) * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) qrow[i] = widen(rot[i]);
        } else {
          rope_row(in, cp + m * d, sp + m * d, kc + bi * kvs + ((hh - heads) * cap + pointer + t) * d, d);
        }
      }
      for (int64_t g = 0; g < kv_heads; ++g) {
        const uint16_t* in = qkvp + m * width + (heads + kv_heads + g) * d;
        std::copy(in, in + d, vc + bi * kvs + (g * cap + pointer + t) * d);
      }
    });
    const Strides cache{kvs, cap * d, d};
    attend(qfp, reinterpret_cast<const at::BFloat16*>(kc), reinterpret_cast<const at::BFloat16*>(vc), cache, cache, mp,
           ofp, b, heads, kv_heads, nq, T, d, scale);
    each_row([&](int64_t m) {  // to [b, q, heads * d], rounded to bf16 as the Python path's .to() rounds
      const int64_t bi = m / nq, t = m % nq;
      for (int64_t hh = 0; hh < heads; ++hh) {
        const float* src = ofp + ((bi * heads + hh) * nq + t) * d;
        uint16_t* dst = opp + (m * heads + hh) * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) dst[i] = round_bf16(src[i]);
      }
    });
    const at::Tensor attn_out = product(op, o, w(kO), w(kOS), w(kOB));
    each_row([&](int64_t m) {
      add_rows(xp + m * H, bits(attn_out) + m * H, H);
      norm_row(xp + m * H, bits(*w(kLn2)), hp + m * H, H, eps);
    });
    const at::Tensor act = silu_mul(product(op, h, w(kGu), w(kGuS), w(kGuB)));  // of [M, 2I]: gate, then up
    const at::Tensor mlp_out = product(op, act, w(kDown), w(kDownS), w(kDownB));
    const bool next = li + 1 < L;
    each_row([&](int64_t m) {  // the residual, and the next layer's first norm
      add_rows(xp + m * H, bits(mlp_out) + m * H, H);
      if (next) norm_row(xp + m * H, bits(*weight(li + 1, kLn1)), hp + m * H, H, eps);
    });
    if (std::find(taps.begin(), taps.end(), li) != taps.end()) tapped.push_back(x.view({b, nq, H}).clone());
  }
  return {x.view({b, nq, H}), tapped};
}

// ---- context_kv: a DFlash draft's context write in one call ----
// Every step hands the draft the target's features of the tokens just committed, and each draft layer gets them
// as keys and values: ctx = hidden_norm(fc(features)), then per layer k = RoPE(k_norm(k_proj(ctx))) and
// v = v_proj(ctx), written at slots pointer.. of that layer's cache. The Python path (DFlashDraftModel.context_kv)
// spends some forty small PyTorch ops on a few rows; here they are the same arithmetic op for op, as
// decoder_layers does it (norm_row, rope_row, the products through the dispatcher, k and v in one product).
// weights: fc (q, scales, bias), hidden_norm, then per layer k|v (q, scales, bias) and k_norm.
enum CW { kFc, kFcS, kFcB, kHiddenNorm, kCtxHead };
enum LW { kKv, kKvS, kKvB, kKvNorm, kCtxPerLayer };

void context_kv(const at::Tensor& feats, const at::Tensor& cos, const at::Tensor& sin, int64_t pointer,
                at::TensorList keys, at::TensorList values, const c10::List<std::optional<at::Tensor>>& weights,
                int64_t kv_heads, double eps_d, c10::string_view linear) {
  const int64_t L = static_cast<int64_t>(keys.size());
  TORCH_CHECK(feats.dim() == 3 && feats.scalar_type() == at::kBFloat16 && feats.device().is_cpu(),
              "context_kv: features must be a bf16 CPU tensor [b, n, F], got ", feats.sizes(), " ", feats.scalar_type());
  TORCH_CHECK(values.size() == keys.size() && static_cast<int64_t>(weights.size()) == kCtxHead + L * kCtxPerLayer,
              "context_kv: ", L, " layers' caches need ", kCtxHead + L * kCtxPerLayer, " weights");
  const int64_t b = feats.size(0), n = feats.size(1), M = b * n, d = cos.size(-1);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == M * d && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16 && d % kLanes == 0,
              "context_kv: cos and sin must be bf16 [b, n, head_dim], head_dim a multiple of 16");
  for (int64_t i = 0; i < L; ++i)
    TORCH_CHECK(keys[i].scalar_type() == at::kBFloat16 && values[i].scalar_type() == at::kBFloat16 &&
                    keys[i].is_contiguous() && values[i].is_contiguous() && keys[i].dim() == 4 &&
                    keys[i].size(0) >= b && keys[i].size(1) == kv_heads && keys[i].size(2) >= pointer + n &&
                    keys[i].size(3) == d && values[i].sizes() == keys[i].sizes(),
                "context_kv: layer ", i, "'s cache must be contiguous bf16 [>= b, kv_heads, >= pointer + n, d]");
  if (M == 0) return;
  const LinearOp op = c10::Dispatcher::singleton()
                          .findSchemaOrThrow(std::string(linear).c_str(), "")
                          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  const float eps = static_cast<float>(eps_d);
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
  const uint16_t *cp = bits(cos_c), *sp = bits(sin_c);
  at::Tensor ctx = product(op, feats.reshape({M, feats.size(2)}).contiguous(), weights.get(kFc), weights.get(kFcS),
                           weights.get(kFcB));  // [M, H]
  const int64_t H = ctx.size(1);
  TORCH_CHECK(H % kLanes == 0, "context_kv: hidden size must be a multiple of 16");
  uint16_t* xp = bits(ctx);
  for (int64_t m = 0; m < M; ++m) norm_row(xp + m * H, bits(*weights.get(kHiddenNorm)), xp + m * H, H, eps);
  std::vector<uint16_t> normed(d);
  for (int64_t li = 0; li < L; ++li) {
    const auto w = [&](LW k) { return weights.get(kCtxHead + li * kCtxPerLayer + k); };
    const at::Tensor kv = product(op, ctx, w(kKv), w(kKvS), w(kKvB));  // [M, 2 kv_heads d]: keys, then values
    const uint16_t* kvp = bits(kv);
    uint16_t* kc = bits(const_cast<at::Tensor&>(keys[li]));
    uint16_t* vc = bits(const_cast<at::Tensor&>(values[li]));
    const int64_t cap = keys[li].size(2), kvs = kv_heads * cap * d;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t bi = m / n, t = m % n;
      for (int64_t g = 0; g < kv_heads; ++g) {
        norm_row(kvp + m * 2 * kv_heads * d + g * d, bits(*w(kKvNorm)), normed.data(), d, eps);
        rope_row(normed.data(), cp + m * d, sp + m * d, kc + bi * kvs + (g * cap + pointer + t) * d, d);
        const uint16_t* value = kvp + m * 2 * kv_heads * d + (kv_heads + g) * d;
        std::copy(value, value + d, vc + bi * kvs + (g * cap + pointer + t) * d);
      }
    }
  }
}

}  // namespace

// A value's bits as an int32 whose signed order is the values' order (-0 counted as +0, every NaN above +inf)
inline __m256i order_key(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  b = _mm256_andnot_si256(_mm256_cmpeq_epi32(b, _mm256_set1_epi32(std::numeric_limits<int32_t>::min())), b);
  const __m256i k = _mm256_xor_si256(b, _mm256_srli_epi32(_mm256_srai_epi32(b, 31), 1));  // negatives: flip 31 bits
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(k, _mm256_set1_epi32(std::numeric_limits<int32_t>::max()), _mm256_castps_si256(nan));
}
inline int32_t order_key(float v) {
  if (v != v) return std::numeric_limits<int32_t>::max();
  int32_t b = __builtin_bit_cast(int32_t, v == 0.0f ? 0.0f : v);
  return b ^ static_cast<int32_t>(static_cast<uint32_t>(b >> 31) >> 1);
}
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The first index of a row's largest key: per lane the first of its largest (a later slot must be strictly
// larger), then across lanes the largest, the smallest index among equals, then the tail in order
template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  int32_t best = std::numeric_limits<int32_t>::min();  // below every key: the first value is taken
  int64_t at = 0, j = 0;
  if (V >= 8) {
    __m256i bk = _mm256_set1_epi32(best), bi = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    for (; j + 8 <= V; j += 8, idx = _mm256_add_epi32(idx, step)) {
      const __m256i k = order_key(load8(x + j));
      const __m256i gt = _mm256_cmpgt_epi32(k, bk);
      bk = _mm256_blendv_epi8(bk, k, gt);
      bi = _mm256_blendv_epi8(bi, idx, gt);
    }
    int32_t keys[8], index[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(keys), bk);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(index), bi);
    at = index[0], best = keys[0];
    for (int l = 1; l < 8; ++l)
      if (keys[l] > best || (keys[l] == best && index[l] < at)) best = keys[l], at = index[l];
  }
  for (; j < V; ++j) {
    const int32_t k = order_key(static_cast<float>(x[j]));
    if (k > best) best = k, at = j;
  }
  return at;
}

at::Tensor argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.size(1) < std::numeric_limits<int32_t>::max() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "argmax: x must be a 2-D fp32 or bf16 tensor with a last dimension of 1 to 2^31 - 2, got ", x.sizes(),
              " ", x.scalar_type());
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), V = xc.size(1);
  at::Tensor out = at::empty({rows}, xc.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      op[r] = xc.scalar_type() == at::kFloat ? argmax_row(xc.data_ptr<float>() + r * V, V)
                                              : argmax_row(xc.data_ptr<at::BFloat16>() + r * V, V);
  });
  return out;
}

TORCH_LIBRARY(dflash_attn, m) {
  m.def("argmax(Tensor x) -> Tensor");
  m.def("cache_attention(Tensor q, Tensor k, Tensor v, Tensor visible, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("decoder_layers(Tensor x, Tensor cos, Tensor sin, Tensor visible, int pointer, Tensor(a!)[] keys, "
        "Tensor(b!)[] values, Tensor?[] weights, int[] taps, int heads, int kv_heads, float eps, float scale, "
        "str linear) -> (Tensor, Tensor[])");
  m.def("context_kv(Tensor x, Tensor cos, Tensor sin, int pointer, Tensor(a!)[] keys, Tensor(b!)[] values, "
        "Tensor?[] weights, int kv_heads, float eps, str linear) -> ()");
}

TORCH_LIBRARY_IMPL(dflash_attn, CPU, m) {
  m.impl("cache_attention", &cache_attention);
  m.impl("argmax", &argmax);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("decoder_layers", &decoder_layers);
  m.impl("context_kv", &context_kv);
}
