// Weight-only int4 linear layer for x86 CPUs: y[M, N] = x[M, K] @ w[N, K]^T, bf16 in and out. Built for AVX-512
// VNNI (16 outputs per register, `vpdpbusd`) or, compiled without it, for AVX2 with FMA and F16C (8 outputs per
// register; `vpmaddubsw` + `vpmaddwd` make the same exact int32 sums, since 15 x 127 x 2 fits an int16). Both
// builds do the same arithmetic lane by lane: their results are bitwise equal.
//
// Why it exists: speculative decoding pays off while verifying a block of rows costs little more than
// decoding one. PyTorch's int4 CPU kernel costs about linearly in the rows (8 rows: 3x one row), so verify
// blocks lose. Here each 16-output x 8-input slab of the weight (64 bytes) is unpacked once, in registers, and
// multiplied into every row with two `vpdpbusd` per row (64 multiply-adds each): the weight's bytes, the memory
// traffic that bounds one row, and their unpacking (three instructions) are paid once however many rows.
//
// The arithmetic is llama.cpp's for GGUF Q4_1 weights: weights in groups of 32 inputs, w = q * scale + low
// with q in 0..15; each row's inputs quantised per group of 32 to int8 with one scale (Q8_1's scheme), the
// products summed exactly in int32, then per group  y += xscale * (scale * sum(q * xq) + low * sum(xq)).
//
// Layout (made by `dflash.kernels.Int4Weight`):
//   qweight [N/16, K/8, 64] uint8: for tile t (outputs 16t..16t+15) and input octet o (inputs 8o..8o+7), byte
//     4c + i holds input 8o + i of output 16t + c in its low nibble and input 8o + 4 + i in its high one.
//   scales  [N/16, K/32, 2, 16] fp16 (as Q4_1 stores them): per tile and group, the 16 scales, then the 16 lows.
//
// Every row goes through the same instructions in the same order whatever the number of rows and wherever
// it sits in the batch: a row's result does not depend on the batch, so verifying a block reproduces bit for
// bit the logits of decoding one token at a time.
//
// The same library holds `q8_linear`, for weights in GGUF's Q8_0 layout (groups of 32 int8 with one fp16 scale;
// GGUF files keep the token embedding, which is the tied LM head, that way): llama.cpp's Q8_0 x Q8 arithmetic,
// y += xscale * scale * sum(q * xq) per group, with the same promise. The VNNI builds take two tiles at a time with
// `vpdpbusd` (q8_tile_pair) for 6 rows or more, the AVX2 code otherwise: the same integer sums and float epilogue,
// so the same bits.
//
// An AVX-VNNI build (Alder Lake and later client CPUs, which lack AVX-512) is the AVX2 code with `vpdpbusd` on 8
// lanes in place of each `vpmaddubsw` + `vpmaddwd` pair: the same exact int32 sums, so the same bits, for fewer
// instructions per row. Tests run that code where the CPU lacks AVX-VNNI with vpdpbusd emulated exactly
// (DFLASH_EMULATE_AVX_VNNI: AVX2 instructions making the same sums).
//
// A third build adds AMX (Sapphire Rapids and later) to the VNNI one: for passes of 10 to 16 rows, each group's
// integer sums come from one tile product (`tdpbsud`: signed inputs x unsigned nibbles) for all the rows at once
// instead of two `vpdpbusd` per row and octet, so the per-row work left is the float epilogue (Q8_0 keeps its
// AVX2 code).
// The integer sums are exact either way and the epilogue is the VNNI build's, operation for operation: the same
// bits as the other builds, and a row alone (which takes the VNNI path) gives what it gives in any batch.
//
// DFLASH_INT4_LIB names the operator's library (one per build, so all can be loaded in one process).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;   // inputs per scale and low
constexpr int64_t kTile = 16;    // outputs per register of 16 fp32
constexpr int64_t kOctets = kGroup / 8;
// rows per pass over the weight; more rows take more passes, from cache
constexpr int64_t kMaxRows = 8;
// How far ahead of its loads the weight stream asks for its next lines. A step streams each layer's weight from
// L3 or memory once; with 6-8 rows a pass computes long enough per line that the hardware prefetcher falls
// behind (30 layers' products at 8 rows, AVX-512 Xeon, 2 threads: 4.1-4.7 ms without, 3.7 ms with).
constexpr int64_t kAhead = 1024;
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p) + kAhead, _MM_HINT_T0); }

inline __m256 fp16x8_to_fp32(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// fp32 -> bf16, rounding to nearest even (both builds, and the AVX-512 code below, round alike)
inline __m128i fp32x8_to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  return _mm256_castsi256_si128(packed);
}

#if defined(__AVX512VNNI__)

inline __m512 fp16x16_to_fp32(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// fp32 -> bf16, rounding to nearest even (without AVX512-BF16, which VNNI CPUs such as Ice Lake lack)
inline __m256i fp32x16_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// One tile (16 outputs) for M rows, group by group and octet by octet. Per row m and group g: xscale, and
// xoff = xscale * sum(xq).
template <int M>
void tile_rows(const int8_t* xq, const float* xscale, const float* xoff, const uint8_t* q,
                const uint16_t* scales, int64_t K, int64_t N, int64_t tile, uint16_t* y) {
  const int64_t groups = K / kGroup, octets = K / 8;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const uint8_t* slab = q + tile * octets * 64;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[M];
    for (int m = 0; m < M; ++m) dot[m] = _mm512_setzero_si512();
    for (int64_t o = g * kOctets; o < (g + 1) * kOctets; ++o) {
      const __m512i w = _mm512_loadu_si512(slab + o * 64);
      prefetch(slab + o * 64);
      const __m512i lo = _mm512_and_si512(w, nibble);                         // inputs 8o..8o+3
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);  // inputs 8o+4..8o+7
      for (int m = 0; m < M; ++m) {
        const int32_t* x4 = reinterpret_cast<const int32_t*>(xq + m * K) + 2 * o;
        dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_set1_epi32(x4[0]));
        dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_set1_epi32(x4[1]));
      }
    }
    const uint16_t* sl = scales + (tile * groups + g) * 2 * kTile;
    const __m512 scale = fp16x16_to_fp32(sl), low = fp16x16_to_fp32(sl + kTile);
    for (int m = 0; m < M; ++m) {
      const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(xscale[m * groups + g]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), s, acc[m]);
      acc[m] = _mm512_fmadd_ps(low, _mm512_set1_ps(xoff[m * groups + g]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + tile * kTile), fp32x16_to_bf16(acc[m]));
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define DFLASH_AMX 1

// Linux hands a process AMX's tile registers only on request (once, for all its threads); where it refuses,
// every product takes the VNNI path, which gives the same bits.
bool amx_ready() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  }();
  return ready;
}

// AMX multiplies 32 inputs x 16 outputs for all the tile's rows in one `tdpbsud` of fixed cost (each group of 32
// has its own scales, so a product cannot span more inputs): below about 10 rows, the VNNI path's per-row work
// costs less than that. Measured at 2 threads on a Sapphire Rapids-class Xeon, 3072 x 576 weights: 8 rows 38.7 us
// (VNNI) / 41.5 (AMX), 10 rows 49.1 / 42.3, 16 rows 72.8 / 63.9, 32 rows 140.8 / 123.0.
constexpr int64_t kAmxMinRows = 10;
constexpr int64_t kAmxMaxRows = 16;  // a tile's rows

// Tiles 0-3: a group's sums (C, rows x 16 int32); 4-5: the rows' int8 inputs of a group (A, rows x 32 bytes);
// 6-7: a group's weights (B, 8 quads x 16 outputs x 4 bytes). The configuration is per thread and other
// libraries (oneDNN) load their own, so every call loads it and releases the tiles when done.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int64_t m) {
    for (int i : {0, 1, 2, 3}) { rows[i] = static_cast<uint8_t>(m); colsb[i] = kTile * 4; }
    for (int i : {4, 5}) { rows[i] = static_cast<uint8_t>(m); colsb[i] = kGroup; }
    for (int i : {6, 7}) { rows[i] = kGroup / 4; colsb[i] = kTile * 4; }
  }
};

// The VNNI epilogue of one group for M rows of one 16-output tile, from the group's int32 sums.
template <int M>
inline void int4_epilogue(const int32_t* dot, const uint16_t* sl, const float* xscale, const float* xoff,
                          int64_t groups, int64_t g, __m512* acc) {
  const __m512 scale = fp16x16_to_fp32(sl), low = fp16x16_to_fp32(sl + kTile);
  for (int m = 0; m < M; ++m) {
    const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(xscale[m * groups + g]));
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dot + m * kTile)), s, acc[m]);
    acc[m] = _mm512_fmadd_ps(low, _mm512_set1_ps(xoff[m * groups + g]), acc[m]);
  }
}

// A group's nibbles of one tile as B: quad 2j holds octet j's low nibbles, quad 2j + 1 its high ones.
inline void unpack_group(const uint8_t* slab, uint8_t* b) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < kOctets; ++j) {
    const __m512i w = _mm512_loadu_si512(slab + j * 64);
    _mm512_store_si512(b + 2 * j * 64, _mm512_and_si512(w, nibble));
    _mm512_store_si512(b + (2 * j + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble));
  }
}

constexpr int64_t kAmxChunk = 16;  // groups unpacked ahead of their products (8 KB)

// Tiles [begin, end) for M rows (kAmxMinRows..16). Per tile, up to kAmxChunk groups are unpacked first (their stores have
// landed by the time the tile loads read them), then multiplied four at a time into tiles 0-3, whose sums are
// stored together and go through the epilogue group by group.
template <int M>
void amx_rows(const int8_t* xq, const float* xscale, const float* xoff, const uint8_t* q, const uint16_t* scales,
              int64_t K, int64_t N, int64_t begin, int64_t end, uint16_t* y) {
  const int64_t groups = K / kGroup, octets = K / 8;
  constexpr int64_t kB = kOctets * 2 * 64;  // bytes of one group's B
  const TileConfig config(M);
  _tile_loadconfig(&config);
  alignas(64) uint8_t b[kAmxChunk * kB];
  alignas(64) int32_t dot[4][M * kTile];
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* slab = q + t * octets * 64;
    const uint16_t* sl = scales + t * groups * 2 * kTile;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += kAmxChunk) {
      const int64_t chunk = std::min(kAmxChunk, groups - g0);
      for (int64_t i = 0; i < chunk; ++i) unpack_group(slab + (g0 + i) * kOctets * 64, b + i * kB);
      int64_t i = 0;
      for (; i + 4 <= chunk; i += 4) {
        const int8_t* a = xq + (g0 + i) * kGroup;
        const uint8_t* bi = b + i * kB;
        _tile_zero(0);
        _tile_loadd(4, a, K);
        _tile_loadd(6, bi, 64);
        _tile_dpbsud(0, 4, 6);
        _tile_zero(1);
        _tile_loadd(5, a + kGroup, K);
        _tile_loadd(7, bi + kB, 64);
        _tile_dpbsud(1, 5, 7);
        _tile_zero(2);
        _tile_loadd(4, a + 2 * kGroup, K);
        _tile_loadd(6, bi + 2 * kB, 64);
        _tile_dpbsud(2, 4, 6);
        _tile_zero(3);
        _tile_loadd(5, a + 3 * kGroup, K);
        _tile_loadd(7, bi + 3 * kB, 64);
        _tile_dpbsud(3, 5, 7);
        _tile_stored(0, dot[0], 64);
        _tile_stored(1, dot[1], 64);
        _tile_stored(2, dot[2], 64);
        _tile_stored(3, dot[3], 64);
        for (int j = 0; j < 4; ++j) {
          const int64_t g = g0 + i + j;
          int4_epilogue<M>(dot[j], sl + g * 2 * kTile, xscale, xoff, groups, g, acc);
        }
      }
      for (; i < chunk; ++i) {
        const int64_t g = g0 + i;
        _tile_zero(0);
        _tile_loadd(4, xq + g * kGroup, K);
        _tile_loadd(6, b + i * kB, 64);
        _tile_dpbsud(0, 4, 6);
        _tile_stored(0, dot[0], 64);
        int4_epilogue<M>(dot[0], sl + g * 2 * kTile, xscale, xoff, groups, g, acc);
      }
    }
    for (int m = 0; m < M; ++m)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + t * kTile), fp32x16_to_bf16(acc[m]));
  }
  _tile_release();
}

using AmxRowsFn = void (*)(const int8_t*, const float*, const float*, const uint8_t*, const uint16_t*, int64_t,
                          int64_t, int64_t, int64_t, uint16_t*);
static_assert(kAmxMinRows == 10, "kAmxRows lists the passes from kAmxMinRows rows on");
constexpr AmxRowsFn kAmxRows[kAmxMaxRows + 1] = {
    nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
    amx_rows<10>, amx_rows<11>, amx_rows<12>, amx_rows<13>, amx_rows<14>, amx_rows<15>, amx_rows<16>};

#endif  // AMX

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#if defined(__AVXVNNI__) || defined(DFLASH_EMULATE_AVX_VNNI)
#define DFLASH_AVX_VNNI 1
// acc plus, per int32 lane, the sum of its four u8 x s8 byte products (vpdpbusd: exact, no saturation)
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  // bytes widened to int16 (u zero-extended, s sign-extended), even and odd bytes apart; vpmaddwd adds each
  // lane's two even products and its two odd ones exactly, and the sum of both is the lane's four
  const __m256i u_even = _mm256_and_si256(u, _mm256_set1_epi16(0x00FF)), u_odd = _mm256_srli_epi16(u, 8);
  const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
#endif
}
#endif

// A group's 32 inputs x 8 outputs without VNNI: `vpmaddubsw` makes u8 x s8 pairs into int16 (at most
// 2 x 15 x 127 = 3810), the group's eight of them (lo and hi nibbles of four octets) add up in int16 (at most
// 30480: no overflow, so in any order), and one `vpmaddwd` by ones makes each output's int32 sum. All exact: the
// same integers vpdpbusd gives, for about half the instructions of widening every pair.
//
// One tile (16 outputs, as two halves of 8: bytes 0-31 and 32-63 of each slab) for M rows, group by group and
// octet by octet: an octet's weights are unpacked once into four registers and multiplied into every row, each
// row's input bytes broadcast once for both halves, so the weight streams through memory once for up to
// kMaxRows rows. Per row m and group g: xscale, and xoff = xscale * sum(xq).
// Measured against unpacking a whole group and then taking the rows half a tile and 4 rows at a time (30 layers
// of SmolLM2-135M's products, AMD EPYC AVX2, 1 thread): 1 / 2 / 4 / 8 / 16 rows take 0.89 / 0.81 / 0.77 / 0.72 /
// 0.75 of the time. There the compiler scheduled all of a group's multiplies first and spilled their results; the
// empty asm below keeps each row's int16 sum in a register from one octet to the next.
template <int M>
void tile_rows(const int8_t* xq, const float* xscale, const float* xoff, const uint8_t* q, const uint16_t* scales,
               int64_t K, int64_t N, int64_t tile, uint16_t* y) {
  const int64_t groups = K / kGroup, octets = K / 8;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);  // not with vpdpbusd
  const uint8_t* slab = q + tile * octets * 64;
  const uint16_t* sl0 = scales + tile * groups * 2 * kTile;
  __m256 acc[M][2];
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) acc[m][h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i sum16[M][2];
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h) sum16[m][h] = _mm256_setzero_si256();
    for (int o = 0; o < kOctets; ++o) {
      const uint8_t* at = slab + (g * kOctets + o) * 64;
      prefetch(at);
      __m256i lo[2], hi[2];  // inputs 8o..8o+3 and 8o+4..8o+7 of octet o of the group, per half
      for (int h = 0; h < 2; ++h) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * h));
        lo[h] = _mm256_and_si256(packed, nibble);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
      }
      for (int m = 0; m < M; ++m) {
        const int32_t* x4 = reinterpret_cast<const int32_t*>(xq + m * K + g * kGroup) + 2 * o;
        const __m256i xlo = _mm256_set1_epi32(x4[0]), xhi = _mm256_set1_epi32(x4[1]);
        for (int h = 0; h < 2; ++h) {
#ifdef DFLASH_AVX_VNNI  // the int32 sums directly (sum16 holds them here)
          sum16[m][h] = dpbusd(dpbusd(sum16[m][h], lo[h], xlo), hi[h], xhi);
#else
          sum16[m][h] = _mm256_add_epi16(_mm256_add_epi16(sum16[m][h], _mm256_maddubs_epi16(lo[h], xlo)),
                                         _mm256_maddubs_epi16(hi[h], xhi));
#endif
          asm("" : "+x"(sum16[m][h]));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const uint16_t* sl = sl0 + g * 2 * kTile + h * 8;
      const __m256 scale = fp16x8_to_fp32(sl), low = fp16x8_to_fp32(sl + kTile);
      for (int m = 0; m < M; ++m) {
#ifdef DFLASH_AVX_VNNI
        const __m256i dot = sum16[m][h];
#else
        const __m256i dot = _mm256_madd_epi16(sum16[m][h], ones);
#endif
        const __m256 s = _mm256_mul_ps(scale, _mm256_set1_ps(xscale[m * groups + g]));
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(low, _mm256_set1_ps(xoff[m * groups + g]), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + m * N + tile * kTile + h * 8), fp32x8_to_bf16(acc[m][h]));
}

#else
#error "dflash's int4 kernel needs AVX-512 VNNI, or AVX2 with FMA and F16C"
#endif

// Tiles [begin, end) for M rows (tile_rows of the build), one tile after the other and all the rows in one pass.
// One tile at a time, the weight is one stream through memory: the VNNI code took 2-8 tiles side by side once
// (independent sums to hide vpdpbusd's latency), as many streams, which the hardware prefetcher follows worse (30
// layers of SmolLM2-135M's products, AMD EPYC (AVX-512), 2 threads: 2.42 / 2.64 / 2.73 ms for 1 / 2 / 4 rows one tile
// at a time against 2.96 / 3.07 / 3.35 with 8 / 4 / 2 tiles side by side, about 4.0 at 8 rows either way;
// benchmarks/linear_rows.py). All the rows in one pass: the sums of the rows beyond what the registers hold cost the
// AVX2 code less in spills than more passes over the slabs (passes of 2, 3 or 4 rows took 3-14% longer at 4-8 rows,
// AMD EPYC AVX2, 2 threads). Each row's arithmetic is the same whatever M and the grouping, so the same bits.
template <int M>
void rows_block(const int8_t* xq, const float* xscale, const float* xoff, const uint8_t* q, const uint16_t* scales,
                int64_t K, int64_t N, int64_t begin, int64_t end, uint16_t* y) {
  for (int64_t t = begin; t < end; ++t) tile_rows<M>(xq, xscale, xoff, q, scales, K, N, t, y);
}

// Each row's inputs to int8 per group of 32 (Q8_1's scheme): q = round(x * 127 / amax), scale = amax / 127, and
// off = scale * sum(q) (what a weight's offset multiplies). Row by row: a row's values do not depend on the others.
// Eight inputs per instruction, each as the scalar arithmetic would do it: bf16 widens exactly, the maximum is
// exact, x * inv is one rounding, and the conversion rounds to nearest even as std::nearbyint does.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale, off;

  QuantizedRows(const at::Tensor& x, int64_t groups) : q(x.numel()), scale(x.size(0) * groups), off(scale.size()) {
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t r = 0; r < static_cast<int64_t>(scale.size()); ++r) {
      __m256 v[kGroup / 8], amax8 = _mm256_setzero_ps();
      for (int i = 0; i < kGroup / 8; ++i) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xp + r * kGroup + 8 * i));
        v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        amax8 = _mm256_max_ps(_mm256_and_ps(v[i], no_sign), amax8);  // a NaN input is passed over, as std::max does
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, amax8);
      float amax = 0.0f;
      for (float a : lanes) amax = std::max(amax, a);
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m256i sum = _mm256_setzero_si256(), qi[kGroup / 8];
      for (int i = 0; i < kGroup / 8; ++i) {
        qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // |x * inv| <= 127: no overflow
        sum = _mm256_add_epi32(sum, qi[i]);
      }
      // int32 -> int8 (exact: all within +-127); packs work per 128-bit half, the permute puts the bytes in order
      const __m256i q16 = _mm256_packs_epi32(qi[0], qi[1]), q16b = _mm256_packs_epi32(qi[2], qi[3]);
      const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16, q16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + r * kGroup), q8);
      int32_t parts[8];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts), sum);
      int32_t total = 0;
      for (int32_t p : parts) total += p;
      scale[r] = amax / 127.0f;
      off[r] = scale[r] * static_cast<float>(total);
    }
  }
};

using RowsFn = void (*)(const int8_t*, const float*, const float*, const uint8_t*, const uint16_t*, int64_t,
                        int64_t, int64_t, int64_t, uint16_t*);
constexpr RowsFn kRows[9] = {nullptr,       rows_block<1>, rows_block<2>, rows_block<3>, rows_block<4>,
                                        rows_block<5>, rows_block<6>, rows_block<7>, rows_block<8>};

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "int4_linear: x must be a 2-D bf16 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 3 && qweight.size(2) == 64 &&
                  qweight.is_contiguous(),
              "int4_linear: qweight must be a contiguous uint8 [N/16, K/8, 64] tensor, got ", qweight.sizes());
  const int64_t M = x.size(0), K = x.size(1), tiles = qweight.size(0), N = tiles * kTile, groups = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && qweight.size(1) * 8 == K, "int4_linear: x has ", K, " inputs, the weight ",
              qweight.size(1) * 8, " (a multiple of 32 is needed)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.numel() == tiles * groups * 2 * kTile,
              "int4_linear: scales must be a contiguous fp16 [N/16, K/32, 2, 16] tensor, got ", scales.sizes());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;

  const QuantizedRows xr(xc, groups);

  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // threads split the outputs; each thread's later passes over rows find its part of the weight in cache
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    int64_t m0 = 0;
#ifdef DFLASH_AMX
    for (; M - m0 >= kAmxMinRows && amx_ready(); m0 += std::min(kAmxMaxRows, M - m0)) {
      const int64_t rows = std::min(kAmxMaxRows, M - m0);
      kAmxRows[rows](xr.q.data() + m0 * K, xr.scale.data() + m0 * groups, xr.off.data() + m0 * groups, qp, sp, K, N,
                     begin, end, yp + m0 * N);
    }
#endif
    for (; m0 < M; m0 += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, M - m0);
      kRows[rows](xr.q.data() + m0 * K, xr.scale.data() + m0 * groups, xr.off.data() + m0 * groups, qp, sp, K, N,
                  begin, end, yp + m0 * N);
    }
  });
  return y;
}

// ---- Q8_0 weights: q8_linear ----
// Layout (made by `dflash.kernels.Q8Weight`):
//   qweight [N/8, K/4, 32] int8: for tile t (outputs 8t..8t+7) and input quad o (inputs 4o..4o+3), byte 4c + i
//     holds input 4o + i of output 8t + c.
//   scales  [N/8, K/32, 8] fp16: per tile and group, the 8 outputs' scales.

constexpr int64_t kQ8Tile = 8;
constexpr int64_t kQuads = kGroup / 4;

// One tile (8 outputs) for M rows, group by group, quad by quad: each quad's weight register is loaded once and
// multiplied into every row in turn, so the weight streams through memory once for up to kMaxRows rows.
// s8 x s8 products of four inputs into each int32 lane: vpmaddubsw wants one u8 side, so the weight's magnitude
// (made once per quad, for all the rows) meets the input carrying the weight's sign: |w| x sign(x, w) = w x x,
// at most 2 x 127 x 127 per int16 (no saturation), and vpmaddwd adds the pairs exactly. (Taking the magnitude of
// the input instead costs each row two instructions per quad where this costs one: 8 rows 7-12% faster here.)
template <int M>
void q8_tile(const int8_t* xq, const float* xscale, const int8_t* q, const uint16_t* scales, int64_t K, int64_t N,
             int64_t tile, uint16_t* y) {
  const int64_t groups = K / kGroup, quads = K / 4;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);  // not with vpdpbusd
  const int8_t* slab = q + tile * quads * 32;
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dot[M];
    for (int m = 0; m < M; ++m) dot[m] = _mm256_setzero_si256();
    for (int o = 0; o < kQuads; ++o) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(slab + (g * kQuads + o) * 32));
      prefetch(slab + (g * kQuads + o) * 32);
      const __m256i magnitude = _mm256_abs_epi8(w);
      for (int m = 0; m < M; ++m) {
        const __m256i x = _mm256_set1_epi32(reinterpret_cast<const int32_t*>(xq + m * K + g * kGroup)[o]);
#ifdef DFLASH_AVX_VNNI
        dot[m] = dpbusd(dot[m], magnitude, _mm256_sign_epi8(x, w));
#else
        dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, w)),
                                                            ones));
#endif
      }
    }
    const __m256 scale = fp16x8_to_fp32(scales + (tile * groups + g) * kQ8Tile);
    for (int m = 0; m < M; ++m)
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_mul_ps(scale, _mm256_set1_ps(xscale[m * groups + g])),
                               acc[m]);
  }
  for (int m = 0; m < M; ++m)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + m * N + tile * kQ8Tile), fp32x8_to_bf16(acc[m]));
}

#if defined(__AVX512VNNI__)
// Two tiles (16 outputs, contiguous in y) for M rows with `vpdpbusd`: the same exact int32 sums as q8_tile's
// vpmaddubsw + vpmaddwd (|w| x sign(x, w), at most 4 x 127 x 127 per lane), the input's sign flipped where the
// weight is negative by one masked subtraction (AVX-512 has no vpsignb: sign(x, w) is x, -x or 0, and where w is 0
// the product is 0 either way), and the same float epilogue lane by lane: the AVX2 code's bits, for half the
// instructions per row and twice the outputs per instruction.
template <int M>
void q8_tile_pair(const int8_t* xq, const float* xscale, const int8_t* q, const uint16_t* scales, int64_t K,
                  int64_t N, int64_t tile, uint16_t* y) {
  const int64_t groups = K / kGroup, quads = K / 4;
  const int8_t* slab0 = q + tile * quads * 32;
  const int8_t* slab1 = slab0 + quads * 32;
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[M];
    for (int m = 0; m < M; ++m) dot[m] = _mm512_setzero_si512();
    for (int o = 0; o < kQuads; ++o) {
      const int64_t at = (g * kQuads + o) * 32;
      const __m512i w = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(slab0 + at))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(slab1 + at)), 1);
      prefetch(slab0 + at);
      prefetch(slab1 + at);
      const __m512i magnitude = _mm512_abs_epi8(w);
      const __mmask64 negative = _mm512_movepi8_mask(w);
      for (int m = 0; m < M; ++m) {
        const __m512i x = _mm512_set1_epi32(reinterpret_cast<const int32_t*>(xq + m * K + g * kGroup)[o]);
        dot[m] = _mm512_dpbusd_epi32(dot[m], magnitude, _mm512_mask_sub_epi8(x, negative, zero, x));
      }
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + (tile * groups + g) * kQ8Tile))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + ((tile + 1) * groups + g) * kQ8Tile)), 1));
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(scale, _mm512_set1_ps(xscale[m * groups + g])),
                               acc[m]);
  }
  for (int m = 0; m < M; ++m)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + tile * kQ8Tile), fp32x16_to_bf16(acc[m]));
}
#endif

template <int M>
void q8_rows(const int8_t* xq, const float* xscale, const int8_t* q, const uint16_t* scales, int64_t K, int64_t N,
             int64_t begin, int64_t end, uint16_t* y) {
  int64_t t = begin;
#if defined(__AVX512VNNI__)
  // two tiles side by side pay where the rows' products bound the time; with fewer rows the weight streams from
  // memory, and one stream is faster (SmolLM2-135M's 49152 x 576 head from memory, AMD EPYC (AVX-512), 2 threads,
  // both codes timed side by side once: 1 / 4 / 6 / 8 rows took 0.95 / 1.00 / 1.33 / 1.77 ms one tile at a time,
  // 1.32 / 1.30 / 1.34 / 1.59 two)
  if constexpr (M >= 6)
    for (; t + 2 <= end; t += 2) q8_tile_pair<M>(xq, xscale, q, scales, K, N, t, y);
#endif
  for (; t < end; ++t) q8_tile<M>(xq, xscale, q, scales, K, N, t, y);
}

using Q8RowsFn = void (*)(const int8_t*, const float*, const int8_t*, const uint16_t*, int64_t, int64_t, int64_t,
                          int64_t, uint16_t*);
constexpr Q8RowsFn kQ8Rows[kMaxRows + 1] = {nullptr,    q8_rows<1>, q8_rows<2>, q8_rows<3>, q8_rows<4>,
                                            q8_rows<5>, q8_rows<6>, q8_rows<7>, q8_rows<8>};

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "q8_linear: x must be a 2-D bf16 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 3 && qweight.size(2) == 32 &&
                  qweight.is_contiguous(),
              "q8_linear: qweight must be a contiguous int8 [N/8, K/4, 32] tensor, got ", qweight.sizes());
  const int64_t M = x.size(0), K = x.size(1), tiles = qweight.size(0), N = tiles * kQ8Tile, groups = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && qweight.size(1) * 4 == K, "q8_linear: x has ", K, " inputs, the weight ",
              qweight.size(1) * 4, " (a multiple of 32 is needed)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == tiles * groups * kQ8Tile,
              "q8_linear: scales must be a contiguous fp16 [N/8, K/32, 8] tensor, got ", scales.sizes());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantizedRows xr(xc, groups);
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, M - m0);
      kQ8Rows[rows](xr.q.data() + m0 * K, xr.scale.data() + m0 * groups, qp, sp, K, N, begin, end, yp + m0 * N);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(DFLASH_INT4_LIB, m) {
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(DFLASH_INT4_LIB, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("q8_linear", &q8_linear);
}
