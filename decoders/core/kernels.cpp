// model.fast_path=kernel: y = x W^T (+ bias) for inputs of a few rows (a decode step, a tree's
// verification), CPU, AVX-512 or else AVX2 with FMA (float32 only: built with -mavx2 -mfma, where the
// vector layer below is 8 lanes wide, panels 16 columns and register blocks 6 rows). Built by
// decoders/core/kernels.py (torch.utils.cpp_extension.load) and called through ctypes: a plain C
// interface on raw pointers, no torch headers, so that it builds in seconds; kernels.py allocates and
// checks every tensor.
//
// Weights are repacked once into column panels of PANEL = 32 output columns (AVX2: 16): float32
// (P, K, 32), bfloat16 (P, ceil(K / 2), 32, 2) (pairs of k, as vdpbf16ps reads them), N zero-padded to a multiple
// of 32. Each panel is streamed from memory once per call whatever the number of rows: a register
// block of up to ROWS = 12 rows x 32 columns (two zmm accumulators a row, x broadcast, FMA) walks the
// panel, and the further row blocks reuse it from cache (a panel is 72-196 KB for SmolLM2's shapes; the
// AVX2 build walks it in chunks of K so that they find it in L1, see linear).
// OpenMP threads (the libgomp torch has loaded: torch.set_num_threads holds) split the panels.
//
// Every output element is accumulated over k = 0, 1, ..., K - 1 in that order, from zero, then the
// bias added: a row's result is bitwise the same whether computed alone or among other rows.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <utility>

namespace {

// ---- the vector layer: AVX-512 (16 float lanes, 32 registers) or AVX2 + FMA (8 lanes, 16 registers) ----
#if defined(__AVX512F__)
constexpr int LANES = 16, REGISTERS = 32;
using vfloat = __m512;
using lanes = __mmask16;  // which lanes a tail load or store touches

inline __mmask16 tail_mask(int64_t valid) {  // the first `valid` of 16 lanes (valid may be <= 0 or >= 16)
  return valid >= 16 ? static_cast<__mmask16>(0xFFFF)
                     : valid <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << valid) - 1);
}
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset1(float v) { return _mm512_set1_ps(v); }
inline vfloat vload(const float* p) { return _mm512_load_ps(p); }  // aligned
inline vfloat vload_tail(lanes m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline void vstore(float* p, vfloat v) { _mm512_store_ps(p, v); }  // aligned
inline void vstore_tail(float* p, lanes m, vfloat v) { _mm512_mask_storeu_ps(p, m, v); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
// Rounded on their own, never fused into an FMA (the explicit-rounding forms the compiler cannot fuse).
constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
inline vfloat vadd_rounded(vfloat a, vfloat b) { return _mm512_add_round_ps(a, b, NEAREST); }
inline vfloat vmul_rounded(vfloat a, vfloat b) { return _mm512_mul_round_ps(a, b, NEAREST); }
inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
inline vfloat negate(vfloat v) {  // the sign bit flipped, as torch's neg (-0 for +0, unlike 0 - v)
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
}
// Bit i set where lane i of p[0..LANES) is above `bound` or a NaN (not <=, unordered).
inline uint32_t above_or_nan(const float* p, vfloat bound) {
  return _mm512_cmp_ps_mask(_mm512_loadu_ps(p), bound, _CMP_NLE_UQ);
}
#else
constexpr int LANES = 8, REGISTERS = 16;
using vfloat = __m256;
using lanes = __m256i;

inline __m256i tail_mask(int64_t valid) {  // all ones in the first `valid` of 8 lanes
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(valid, 0, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vset1(float v) { return _mm256_set1_ps(v); }
inline vfloat vload(const float* p) { return _mm256_load_ps(p); }  // aligned
inline vfloat vload_tail(lanes m, const float* p) { return _mm256_maskload_ps(p, m); }  // masked lanes read 0
inline void vstore(float* p, vfloat v) { _mm256_store_ps(p, v); }  // aligned
inline void vstore_tail(float* p, lanes m, vfloat v) { _mm256_maskstore_ps(p, m, v); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
// Not fused: this build has -ffp-contract=off (kernels.py), so a product and a sum stay two roundings.
inline vfloat vadd_rounded(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vmul_rounded(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline float vsum(vfloat v) {  // the lanes in a fixed order
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}
inline vfloat negate(vfloat v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }  // the sign bit flipped
inline uint32_t above_or_nan(const float* p, vfloat bound) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), bound, _CMP_NLE_UQ)));
}
#endif

// The tuning knobs (macros so that scripts/bench_linear_kernels.py --variants can build others beside).
#ifndef DB_PANEL
#define DB_PANEL (2 * LANES)
#endif
#ifndef DB_ROWS
#define DB_ROWS (LANES == 16 ? 12 : 6)
#endif
#ifndef DB_PREFETCH
#define DB_PREFETCH 0
#endif
#ifndef DB_KCHUNK
#define DB_KCHUNK (LANES == 16 ? 0 : 32)
#endif
// Chosen on a Zen 4 EPYC, one thread (results/reference/kernels/README.md): 12 rows beat 8 and 6 by a
// few percent at 16-32 rows, a 64-column panel was no better, and software prefetch (4-16 k steps
// ahead) no better than the hardware's on a sequential panel. AVX2's 6 rows x 16 columns fill 12 of its 16
// registers with accumulators, the most that leave room for the panel's two vectors and a broadcast.
// AVX2's chunks of 32 k steps for 7-24 rows, each block prefetching the next chunk, were chosen on a Zen 3,
// 2 threads (results/reference/kernels/avx2_zen3/chunks/). The AVX-512 build keeps K in one pass: on a Zen 4
// (2 threads) chunks of 32 or 64 made 16-24 rows 1-7% slower, the rows being compute-bound there
// (results/reference/kernels/avx512_zen4/chunks/).
constexpr int64_t PANEL = DB_PANEL;  // output columns per panel: PANEL / LANES vectors of accumulators a row
constexpr int VECS = DB_PANEL / LANES;
constexpr int ROWS = DB_ROWS;  // rows per register block: ROWS * VECS accumulators of the REGISTERS
constexpr int64_t PREFETCH = DB_PREFETCH;  // k steps ahead the weight stream is prefetched (0: none)
constexpr int64_t K_CHUNK = DB_KCHUNK;  // float32, more rows than a block: k steps a chunk (0: K in one pass)
constexpr int64_t CARRY_ROWS = 24;  // the most rows walked in chunks; more: K in one pass (32-48 lost 5-10%)
constexpr int64_t GRAIN_BYTES = 1 << 17;  // the least weight bytes worth a thread of their own (a wake-up)
static_assert(DB_PANEL % LANES == 0 && ROWS >= 1 && ROWS <= 12 && ROWS * VECS + VECS + 1 <= REGISTERS,
              "registers");

inline int64_t panels(int64_t n) { return (n + PANEL - 1) / PANEL; }

// Panels [0, p) split over the threads in contiguous chunks of at least `grain`, as at::parallel_for
// does (a team of the calling thread's omp_get_max_threads(), which torch.set_num_threads sets).
template <typename F>
void for_panels(int64_t p, int64_t grain, const F& body) {
  const int64_t threads = omp_get_max_threads();
  const int64_t chunks = std::min<int64_t>(threads, (p + grain - 1) / grain);
  if (chunks <= 1 || omp_in_parallel()) {
    body(0, p);
    return;
  }
#pragma omp parallel
  {
    const int64_t team = std::min<int64_t>(omp_get_num_threads(), chunks);
    const int64_t tid = omp_get_thread_num();
    const int64_t size = (p + team - 1) / team, begin = tid * size;
    if (tid < team && begin < p) body(begin, std::min(p, begin + size));
  }
}

// ---- float32 -------------------------------------------------------------------------------
template <int R>
inline void finish_f32(vfloat (&acc)[R][VECS], const float* bias, float* y, int64_t ldy, int64_t valid) {
#pragma GCC unroll 4
  for (int c = 0; c < VECS; ++c) {
    const lanes mask = tail_mask(valid - LANES * c);
    const vfloat b = bias != nullptr ? vload_tail(mask, bias + LANES * c) : vzero();
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      vstore_tail(y + r * ldy + LANES * c, mask, bias != nullptr ? vadd(acc[r][c], b) : acc[r][c]);
    }
  }
}

// Rows [0, R) over k steps [0, k) of a panel: all of K, or one chunk of it (see linear). The accumulators
// start at zero (first) or from `carry` (R x PANEL: the previous chunk's, stored and reloaded exactly), and
// end in y (last) or in carry. `ahead` > 0: the panel's line that many k steps on is prefetched at each step
// (in the last chunk, past the panel's end: the next panel's start, or nothing; a prefetch never faults).
template <int R>
inline void block_f32(const float* x, int64_t ldx, const float* wp, int64_t k, const float* bias,
                      float* y, int64_t ldy, int64_t valid, float* carry, bool first, bool last, int64_t ahead) {
  vfloat acc[R][VECS];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < VECS; ++c) acc[r][c] = first ? vzero() : vload(carry + r * PANEL + LANES * c);
  const int64_t distance = PREFETCH > 0 ? PREFETCH : ahead;
  for (int64_t i = 0; i < k; ++i) {
    const float* w = wp + i * PANEL;
    if (distance > 0) {
#pragma GCC unroll 4
      for (int c = 0; c < VECS; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(w + distance * PANEL + LANES * c), _MM_HINT_T0);
    }
    vfloat wv[VECS];
#pragma GCC unroll 4
    for (int c = 0; c < VECS; ++c) wv[c] = vload(w + LANES * c);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vfloat xb = vset1(x[r * ldx + i]);
#pragma GCC unroll 4
      for (int c = 0; c < VECS; ++c) acc[r][c] = vfma(xb, wv[c], acc[r][c]);
    }
  }
  if (last) {
    finish_f32<R>(acc, bias, y, ldy, valid);
    return;
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < VECS; ++c) vstore(carry + r * PANEL + LANES * c, acc[r][c]);
}

using BlockF32 = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t, float*,
                          bool, bool, int64_t);
template <int... I>
constexpr std::array<BlockF32, ROWS + 1> f32_blocks(std::integer_sequence<int, I...>) {
  return {nullptr, block_f32<I + 1>...};
}
constexpr auto BLOCKS_F32 = f32_blocks(std::make_integer_sequence<int, ROWS>{});  // by rows in the block

// ---- bfloat16 (avx512_bf16: vdpbf16ps; fp32 accumulation; the AVX-512 build only) -----------------
#if defined(__AVX512F__)
__attribute__((target("avx512f,avx512bw"))) inline __m512 bf16_to_f32(__mmask16 mask, const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
inline void block_bf16(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t k, const uint16_t* bias,
                       uint16_t* y, int64_t ldy, int64_t valid, float*, bool, bool, int64_t) {
  // Always all of K (linear is given no chunk for bfloat16): the chunk's arguments are unused.
  __m512 acc[R][VECS];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < VECS; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t pairs = (k + 1) / 2;
  for (int64_t i = 0; i < pairs; ++i) {
    const uint16_t* w = wp + i * PANEL * 2;
    if (PREFETCH > 0) {
#pragma GCC unroll 4
      for (int c = 0; c < VECS; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH * PANEL * 2 + 32 * c), _MM_HINT_T0);
    }
    __m512bh wv[VECS];
#pragma GCC unroll 4
    for (int c = 0; c < VECS; ++c) wv[c] = (__m512bh)_mm512_load_si512(w + 32 * c);
    const bool last_odd = 2 * i + 1 == k;  // an odd K: the last pair is (x[K - 1], 0), the weight's pad is 0 too
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      if (last_odd) {
        pair = x[r * ldx + 2 * i];
      } else {
        std::memcpy(&pair, x + r * ldx + 2 * i, sizeof(pair));
      }
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
#pragma GCC unroll 4
      for (int c = 0; c < VECS; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, wv[c]);
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < VECS; ++c) {
    const __mmask16 mask = tail_mask(valid - 16 * c);
    const __m512 b = bias != nullptr ? bf16_to_f32(mask, bias + 16 * c) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {  // rounded to bfloat16 to nearest even, once, as torch rounds
      const __m512 v = bias != nullptr ? _mm512_add_ps(acc[r][c], b) : acc[r][c];
      _mm256_mask_storeu_epi16(y + r * ldy + 16 * c, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

using BlockBF16 = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const uint16_t*, uint16_t*, int64_t,
                           int64_t, float*, bool, bool, int64_t);
template <int... I>
constexpr std::array<BlockBF16, ROWS + 1> bf16_blocks(std::integer_sequence<int, I...>) {
  return {nullptr, block_bf16<I + 1>...};
}
constexpr auto BLOCKS_BF16 = bf16_blocks(std::make_integer_sequence<int, ROWS>{});
#endif

// Each row's largest output in a panel as numpy's argmax finds it (the first largest; a NaN above everything,
// the first NaN): `best` its value in float32, `where` its column in the panel. Read while the panel's outputs
// are still in L1, so that a row's argmax later reads 1 / PANEL of the row (the first panel holding its
// maximum, then that column): a 262,144-token row is 1 MB, read back from memory after the readout.
inline float as_float(float v) { return v; }
inline float as_float(uint16_t v) {  // bfloat16's bits: the high half of a float32's
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline void panel_best(const T* y, int64_t valid, float* best, int32_t* where) {
  float b = as_float(y[0]);
  int32_t w = 0;
  for (int32_t j = 1; j < valid && b == b; ++j) {  // b == b: not yet a NaN, which nothing replaces
    const float v = as_float(y[j]);
    if (v > b || v != v) {
      b = v;
      w = j;
    }
  }
  *best = b;
  *where = w;
}

// Panels split over the threads; in each panel, the rows in register blocks of ROWS. With more than one
// block and a `chunk` (k steps; 0: none), K is walked a chunk at a time, every block taking the chunk before
// the next: the later blocks find it in L1, and each block prefetches the next chunk as it goes, so the
// memory stream runs under the arithmetic instead of waiting for the next panel. Between chunks a block's
// accumulators wait in `carry`, so every output is still summed over k = 0..K-1 in order.
template <typename T, typename Blocks>
void linear(const T* x, int64_t m, int64_t k, const T* packed, int64_t panel_elems, const T* bias, int64_t n,
            T* y, const Blocks& blocks, int64_t chunk, float* best = nullptr, int32_t* where = nullptr) {
  const int64_t p = panels(n);
  const int64_t grain = std::max<int64_t>(1, GRAIN_BYTES / (panel_elems * static_cast<int64_t>(sizeof(T))));
  const bool chunked = chunk > 0 && chunk < k && m > ROWS && m <= CARRY_ROWS;
  const int64_t step = chunked ? chunk : k, ahead = chunked ? chunk : 0;
  for_panels(p, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float carry[CARRY_ROWS * PANEL];
    for (int64_t q = begin; q < end; ++q) {
      const int64_t col = q * PANEL, valid = std::min<int64_t>(PANEL, n - col);
      int64_t i = 0;
      do {  // at least once: K = 0 still writes the bias
        const int64_t kc = std::min(step, k - i);
        for (int64_t r = 0; r < m; r += ROWS) {
          const int64_t rows = std::min<int64_t>(ROWS, m - r);
          blocks[rows](x + r * k + i, k, packed + q * panel_elems + i * PANEL, kc, bias ? bias + col : nullptr,
                       y + r * n + col, n, valid, carry + r * PANEL, i == 0, i + kc >= k, ahead);
        }
        i += kc;
      } while (i < k);
      if (best != nullptr) {
        for (int64_t r = 0; r < m; ++r) panel_best(y + r * n + col, valid, best + r * p + q, where + r * p + q);
      }
    }
  });
}

// ---- RMSNorm (Llama's): y = w * (x * rsqrt(mean(x^2) + eps)), each row on its own -----------------
// The squares are summed in 16 lanes over the row, then the lanes in a fixed order: a row's result does not
// depend on the other rows. transformers' 7 operations per norm cost about 15 us a call on a 2-core Zen 4,
// 61 norms a SmolLM2 step (results/reference/kernels/split_zen4/).
inline float mean_square(const float* x, int64_t dim) {
  vfloat acc = vzero();
  for (int64_t i = 0; i < dim; i += LANES) {
    const vfloat v = vload_tail(tail_mask(dim - i), x + i);
    acc = vadd(acc, vmul(v, v));
  }
  return vsum(acc) / static_cast<float>(dim);
}

#if defined(__AVX512F__)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
inline __m512 round_bf16(__m512 v) {  // to bfloat16, nearest even (as torch rounds), and back
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

__attribute__((target("avx512f,avx512bw")))
inline float mean_square_bf16(const uint16_t* x, int64_t dim) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 v = bf16_to_f32(tail_mask(dim - i), x + i);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  return _mm512_reduce_add_ps(acc) / static_cast<float>(dim);
}

__attribute__((target("avx512f,avx512bw")))
inline __m512 weight_f32(__mmask16 mask, const uint16_t* w) { return bf16_to_f32(mask, w); }
__attribute__((target("avx512f")))
inline __m512 weight_f32(__mmask16 mask, const float* w) { return _mm512_maskz_loadu_ps(mask, w); }

// The bfloat16 norms: x read as float32, times its scale, rounded to bfloat16 there where `round_norm`
// (Llama's formula), times the weight w (bfloat16 or float32 elements), rounded to bfloat16.
template <bool round_norm, typename W>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
inline void rmsnorm_bf16(const uint16_t* x, int64_t rows, int64_t dim, const W* w, float eps, uint16_t* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * dim;
    const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(mean_square_bf16(xr, dim) + eps));
    for (int64_t i = 0; i < dim; i += 16) {
      const __mmask16 mask = tail_mask(dim - i);
      const __m512 norm = _mm512_mul_ps(bf16_to_f32(mask, xr + i), scale);
      const __m512 h = round_norm ? round_bf16(norm) : norm;
      _mm256_mask_storeu_epi16(y + r * dim + i, mask,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(weight_f32(mask, w + i), h)));
    }
  }
}
#endif

// ---- rotary embeddings (Llama's): out = x * cos + rotate_half(x) * sin ------------------------------
// As transformers computes it, each product and the sum rounded on their own (the explicit-rounding
// intrinsics cannot be fused into an FMA by the compiler): the result is bitwise transformers'.

// One row of D = 2 * half values: out = x * cos + rotate_half(x) * sin, cos and sin the row's own.
void rotary_row_f32(const float* xr, const float* c, const float* s, int64_t half, float* yr) {
  for (int64_t i = 0; i < half; i += LANES) {
    const lanes m = tail_mask(half - i);
    const vfloat lo = vload_tail(m, xr + i), hi = vload_tail(m, xr + half + i);
    vstore_tail(yr + i, m, vadd_rounded(vmul_rounded(lo, vload_tail(m, c + i)),
                                        vmul_rounded(negate(hi), vload_tail(m, s + i))));
    vstore_tail(yr + half + i, m, vadd_rounded(vmul_rounded(hi, vload_tail(m, c + half + i)),
                                               vmul_rounded(lo, vload_tail(m, s + half + i))));
  }
}

#if defined(__AVX512F__)
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
inline void store_bf16(uint16_t* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// The same in bfloat16: each product rounded to bfloat16, then their sum (as torch's bfloat16 operations do).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void rotary_row_bf16(const uint16_t* xr, const uint16_t* c, const uint16_t* s, int64_t half, uint16_t* yr) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = tail_mask(half - i);
    const __m512 lo = bf16_to_f32(m, xr + i), hi = bf16_to_f32(m, xr + half + i);
    store_bf16(yr + i, m, _mm512_add_ps(round_bf16(_mm512_mul_ps(lo, bf16_to_f32(m, c + i))),
                                        round_bf16(_mm512_mul_ps(negate(hi), bf16_to_f32(m, s + i)))));
    store_bf16(yr + half + i, m, _mm512_add_ps(round_bf16(_mm512_mul_ps(hi, bf16_to_f32(m, c + half + i))),
                                               round_bf16(_mm512_mul_ps(lo, bf16_to_f32(m, s + half + i)))));
  }
}
#endif

// x, out: (B, H, T, D) at strides (sb, sh, st, 1); cos, sin: (B, T, D) contiguous; `row` rotates one row.
template <typename E>
void rotary(void (*row)(const E*, const E*, const E*, int64_t, E*), const E* x, int64_t B, int64_t H, int64_t T,
            int64_t D, const int64_t* xs, const E* cos, const E* sin, E* out, const int64_t* os) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        row(x + b * xs[0] + h * xs[1] + t * xs[2], cos + (b * T + t) * D, sin + (b * T + t) * D, D / 2,
            out + b * os[0] + h * os[1] + t * os[2]);
}

// ---- each row's k largest logits from its panel maxima (sampling.top_k_rows) -------------------------
// The k largest of a row lie in the k panels with the largest maxima: each of those holds a value at least
// the k-th largest maximum, which every one of the k largest values is at least (an equal value elsewhere
// gives the same values). `best` keeps the k largest seen so far, largest first; a value enters only above
// the k-th (ties keep the earlier: torch.topk's values either way, its ids among equal values may differ).
struct Best {
  float* value;
  int64_t* index;
  int64_t k, count = 0;
  void offer(float v, int64_t i) {  // v not a NaN
    if (count == k && !(v > value[k - 1])) return;
    int64_t at = count < k ? count++ : k - 1;
    for (; at > 0 && v > value[at - 1]; --at) {
      value[at] = value[at - 1];
      index[at] = index[at - 1];
    }
    value[at] = v;
    index[at] = i;
  }
};

// Offers x[0..n) to `best` (false at a NaN): a vector compare against the k-th value first, so that a long
// row costs a compare per LANES values and only the few values above it are looked at one by one.
inline bool offer_all(const float* x, int64_t n, Best& best) {
  int64_t i = 0;
  for (; i < n && best.count < best.k; ++i) {
    if (x[i] != x[i]) return false;
    best.offer(x[i], i);
  }
  for (; i + LANES <= n; i += LANES) {
    for (uint32_t bits = above_or_nan(x + i, vset1(best.value[best.k - 1])); bits != 0; bits &= bits - 1) {
      const int64_t j = i + __builtin_ctz(bits);
      if (x[j] != x[j]) return false;
      best.offer(x[j], j);
    }
  }
  for (; i < n; ++i) {
    if (x[i] != x[i]) return false;
    best.offer(x[i], i);
  }
  return true;
}

template <typename T>
int64_t top_k(const float* maxima, int64_t rows, int64_t p, const T* logits, int64_t ld, int64_t n, int64_t panel,
              int64_t k, int64_t* top) {
  int64_t failed = 0;
#pragma omp parallel for schedule(static) reduction(+ : failed) if (rows * p >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    float value[64], panel_value[64], candidates[64 * 64];
    int64_t panel_index[64], column[64 * 64];
    Best panels_best{panel_value, panel_index, k};
    if (!offer_all(maxima + r * p, p, panels_best)) {
      ++failed;
      continue;
    }
    // the k best panels' columns, in panel order, then the k largest of them
    std::sort(panel_index, panel_index + k);
    const T* row = logits + r * ld;
    int64_t m = 0;
    for (int64_t j = 0; j < k; ++j)
      for (int64_t c = panel_index[j] * panel; c < std::min(n, (panel_index[j] + 1) * panel); ++c) {
        candidates[m] = as_float(row[c]);
        column[m++] = c;
      }
    int64_t* out = top + r * k;
    Best best{value, out, k};
    if (!offer_all(candidates, m, best)) {
      ++failed;
      continue;
    }
    for (int64_t j = 0; j < k; ++j) out[j] = column[out[j]];  // a candidate's place -> its column in the row
  }
  return failed;
}

}  // namespace

extern "C" {

// Each of `rows` logits rows' k largest values' columns, largest first, into top (rows, k): the rows' panel
// maxima (rows, p) as the readout wrote them (db_linear_best_*), the rows (rows, n) at row stride `ld`.
// 1 <= k <= 64, panel <= 64. Returns the number of rows holding a NaN (their top left unwritten: the caller
// asks torch.topk, whose order of NaNs decides).
int64_t db_top_k_f32(const float* maxima, int64_t rows, int64_t p, const float* logits, int64_t ld, int64_t n,
                     int64_t panel, int64_t k, int64_t* top) {
  return top_k(maxima, rows, p, logits, ld, n, panel, k, top);
}

int64_t db_top_k_bf16(const float* maxima, int64_t rows, int64_t p, const uint16_t* logits, int64_t ld, int64_t n,
                      int64_t panel, int64_t k, int64_t* top) {
  return top_k(maxima, rows, p, logits, ld, n, panel, k, top);
}

// Rotary embeddings for queries and keys in one call: q (B, H, T, D), k (B, KV, T, D) at the given
// strides (the last dimension contiguous), cos / sin (B, T, D) contiguous; outputs at their own strides.
void db_rotary_f32(const float* q, const float* k, int64_t B, int64_t H, int64_t KV, int64_t T, int64_t D,
                   const int64_t* strides, const float* cos, const float* sin, float* q_out, float* k_out) {
  rotary<float>(rotary_row_f32, q, B, H, T, D, strides, cos, sin, q_out, strides + 3);
  rotary<float>(rotary_row_f32, k, B, KV, T, D, strides + 6, cos, sin, k_out, strides + 9);
}

#if defined(__AVX512F__)
void db_rotary_bf16(const uint16_t* q, const uint16_t* k, int64_t B, int64_t H, int64_t KV, int64_t T, int64_t D,
                    const int64_t* strides, const uint16_t* cos, const uint16_t* sin, uint16_t* q_out,
                    uint16_t* k_out) {
  rotary<uint16_t>(rotary_row_bf16, q, B, H, T, D, strides, cos, sin, q_out, strides + 3);
  rotary<uint16_t>(rotary_row_bf16, k, B, KV, T, D, strides + 6, cos, sin, k_out, strides + 9);
}
#endif

// x, y (rows, dim) float32, w (dim): transformers' LlamaRMSNorm in float32.
void db_rmsnorm_f32(const float* x, int64_t rows, int64_t dim, const float* w, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    const vfloat scale = vset1(1.0f / std::sqrt(mean_square(xr, dim) + eps));
    for (int64_t i = 0; i < dim; i += LANES) {
      const lanes mask = tail_mask(dim - i);
      const vfloat h = vmul(vload_tail(mask, xr + i), scale);
      vstore_tail(y + r * dim + i, mask, vmul(vload_tail(mask, w + i), h));
    }
  }
}

#if defined(__AVX512F__)
// The same in bfloat16 (bits as uint16), as transformers computes it: the norm in float32, rounded to
// bfloat16, then times the bfloat16 weight, rounded again.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void db_rmsnorm_bf16(const uint16_t* x, int64_t rows, int64_t dim, const uint16_t* w, float eps, uint16_t* y) {
  rmsnorm_bf16<true>(x, rows, dim, w, eps, y);
}

// Gemma's formula in bfloat16, as transformers computes it: x read as float32, the norm and the float32
// weight w (1 + its stored weight) applied in float32, rounded to bfloat16 once.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void db_rmsnorm_f32w_bf16(const uint16_t* x, int64_t rows, int64_t dim, const float* w, float eps, uint16_t* y) {
  rmsnorm_bf16<false>(x, rows, dim, w, eps, y);
}
#endif

int64_t db_kernel_panel() { return PANEL; }
int64_t db_kernel_rows() { return ROWS; }

// weight (n, k) row-major -> out (ceil(n/PANEL), k, PANEL), zeroed by the caller.
void db_pack_f32(const float* w, int64_t n, int64_t k, float* out) {
  for_panels(panels(n), 1, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q)
      for (int64_t j = 0; j < PANEL && q * PANEL + j < n; ++j)
        for (int64_t i = 0; i < k; ++i) out[(q * k + i) * PANEL + j] = w[(q * PANEL + j) * k + i];
  });
}

#if defined(__AVX512F__)
// weight (n, k) bfloat16 bits -> out (ceil(n/32), ceil(k/2), 32, 2), zeroed by the caller.
void db_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* out) {
  const int64_t pairs = (k + 1) / 2;
  for_panels(panels(n), 1, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q)
      for (int64_t j = 0; j < PANEL && q * PANEL + j < n; ++j)
        for (int64_t i = 0; i < k; ++i) out[((q * pairs + i / 2) * PANEL + j) * 2 + i % 2] = w[(q * PANEL + j) * k + i];
  });
}
#endif

// y (m, n) = x (m, k) W^T + bias (n, or null); x and y row-major and contiguous, W packed by db_pack_f32.
void db_linear_f32(const float* x, int64_t m, int64_t k, const float* packed, const float* bias, int64_t n,
                   float* y) {
  linear(x, m, k, packed, k * PANEL, bias, n, y, BLOCKS_F32, K_CHUNK);
}

// db_linear_f32, and each row's largest output per panel (panel_best): best, where (m, ceil(n / PANEL)).
void db_linear_best_f32(const float* x, int64_t m, int64_t k, const float* packed, const float* bias, int64_t n,
                        float* y, float* best, int32_t* where) {
  linear(x, m, k, packed, k * PANEL, bias, n, y, BLOCKS_F32, K_CHUNK, best, where);
}

#if defined(__AVX512F__)
// The same in bfloat16 (bits as uint16), W packed by db_pack_bf16; accumulated in float32, rounded once.
void db_linear_bf16(const uint16_t* x, int64_t m, int64_t k, const uint16_t* packed, const uint16_t* bias,
                    int64_t n, uint16_t* y) {
  linear(x, m, k, packed, (k + 1) / 2 * 2 * PANEL, bias, n, y, BLOCKS_BF16, 0);
}

void db_linear_best_bf16(const uint16_t* x, int64_t m, int64_t k, const uint16_t* packed, const uint16_t* bias,
                         int64_t n, uint16_t* y, float* best, int32_t* where) {
  linear(x, m, k, packed, (k + 1) / 2 * 2 * PANEL, bias, n, y, BLOCKS_BF16, 0, best, where);
}
#endif

}  // extern "C"
