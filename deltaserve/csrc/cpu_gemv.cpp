// Matrix-vector products for decode on x86 CPUs with AVX2 or AVX-512: y[M, N] = x[M, K] @ W[N, K]^T for a few rows
// (M <= 8) against weights stored as fp32, bf16 or MXFP4 (packed E2M1 codes, low nibble = even element, one E8M0
// scale per 32). Decode is memory-bound: each weight is read once for all M rows, widened to fp32 in registers
// (bf16: a shift; MXFP4: a table lookup by permute) and accumulated in fp32. Each row of y is computed by one thread
// in a fixed order, so a row's result does not depend on M, on the other rows or on the thread count (except bf16 x
// bf16 products of 4+ rows on CPUs with AMX, which use tiles: see amx_rows).
#include <torch/all.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int kMaxRows = 8;

// 16 floats as one AVX-512 register, or as two AVX2 halves (lo = lanes 0-7). Every kernel is written once against
// these; the AVX2 forms give the AVX-512 ones' results bit for bit (same lane-wise FMA chains, the same reduction
// tree as _mm512_reduce_add_ps, the same roundings), so a result does not depend on the CPU either.
#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
struct V16 { __m512 v; };
inline V16 zero() { return {_mm512_setzero_ps()}; }
inline V16 set1(float a) { return {_mm512_set1_ps(a)}; }
inline V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 load(const uint16_t* p) {        // bf16: a shift into the high half of each fp32
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16))};
}
inline V16 load_i8(const int8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))}; }
inline void store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }
inline V16 load_n(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(lanes(n), p)}; }  // lanes past n: 0
inline void store_n(float* p, int64_t n, V16 a) { _mm512_mask_storeu_ps(p, lanes(n), a.v); }
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }       // a * b + c
inline V16 fnma(V16 a, V16 b, V16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }     // c - a * b
inline V16 operator+(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 operator-(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 operator*(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 operator/(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }        // b where either is NaN
inline V16 vmin(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline float hsum(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline void in_register(V16& a) { __asm__("" : "+v"(a.v)); }     // see dense_block
inline float hmax(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline uint32_t nan_bits(V16 a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }    // bit i: lane i is NaN
inline uint32_t eq_bits(V16 a, V16 b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
inline V16 round_nearest(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V16 scale2(V16 a, V16 n) { return {_mm512_scalef_ps(a.v, n.v)}; }    // a * 2^n, n integral
inline V16 select_gt(V16 a, V16 b, V16 x, V16 y) {   // a > b ? x : y, lane by lane (y where either is NaN)
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ), y.v, x.v)};
}
// x = m 2^e, m in [1, 2), for normal x > 0
inline void frexp16(V16 x, V16& m, V16& e) {
  m = {_mm512_getmant_ps(x.v, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_zero)};
  e = {_mm512_getexp_ps(x.v)};
}
// v rounded to bf16 and back (to nearest even, NaN to the quiet NaN, as c10::BFloat16 does)
inline V16 round_bf16(V16 a) {
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)),
                               _mm512_set1_epi32(int(0xFFFF0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return {_mm512_castsi512_ps(r)};
}
// the E2M1 values of 16 packed bytes: low nibbles (even elements) and high nibbles (odd ones)
inline void e2m1_pairs(const uint8_t* p, V16& even, V16& odd) {
  static const float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                  -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  const __m512 table = _mm512_loadu_ps(kE2M1);
  const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  even = {_mm512_permutexvar_ps(_mm512_and_si512(codes, _mm512_set1_epi32(15)), table)};
  odd = {_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table)};
}
#else
constexpr bool kAvx512 = false;
struct V16 { __m256 lo, hi; };
template <typename F> inline V16 each(V16 a, V16 b, F f) { return {f(a.lo, b.lo), f(a.hi, b.hi)}; }
inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline V16 load(const uint16_t* p) {
  return {widen_bf16(_mm_loadu_si128((const __m128i*)p)), widen_bf16(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
inline V16 load_i8(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
}
inline void store(float* p, V16 a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline __m256i lanes8(int64_t n) {     // lane i set where i < n
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(std::max<int64_t>(n, 0), 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V16 load_n(const float* p, int64_t n) {
  return {_mm256_maskload_ps(p, lanes8(n)), _mm256_maskload_ps(p + 8, lanes8(n - 8))};
}
inline void store_n(float* p, int64_t n, V16 a) {
  _mm256_maskstore_ps(p, lanes8(n), a.lo), _mm256_maskstore_ps(p + 8, lanes8(n - 8), a.hi);
}
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 fnma(V16 a, V16 b, V16 c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 operator+(V16 a, V16 b) { return each(a, b, _mm256_add_ps); }
inline V16 operator-(V16 a, V16 b) { return each(a, b, _mm256_sub_ps); }
inline V16 operator*(V16 a, V16 b) { return each(a, b, _mm256_mul_ps); }
inline V16 operator/(V16 a, V16 b) { return each(a, b, _mm256_div_ps); }
inline V16 vmax(V16 a, V16 b) { return each(a, b, _mm256_max_ps); }
inline V16 vmin(V16 a, V16 b) { return each(a, b, _mm256_min_ps); }
// _mm512_reduce_add_ps's tree: high half + low half, then 4 + 4, then lanes {0,1} + {2,3}, then lane 0 + lane 1
template <typename Op8, typename Op4>
inline float reduce(V16 a, Op8 op8, Op4 op4) {
  const __m256 t = op8(a.hi, a.lo);
  const __m128 u = op4(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
  const __m128 w = op4(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(op4(w, _mm_shuffle_ps(w, w, _MM_SHUFFLE(1, 1, 1, 1))));
}
inline float hsum(V16 a) { return reduce(a, _mm256_add_ps, _mm_add_ps); }
inline void in_register(V16& a) { __asm__("" : "+x"(a.lo), "+x"(a.hi)); }
inline float hmax(V16 a) { return reduce(a, _mm256_max_ps, _mm_max_ps); }
inline uint32_t bits(__m256 lo, __m256 hi) {
  return uint32_t(_mm256_movemask_ps(lo)) | uint32_t(_mm256_movemask_ps(hi)) << 8;
}
inline uint32_t nan_bits(V16 a) { return bits(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)); }
inline uint32_t eq_bits(V16 a, V16 b) { return bits(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ)); }
inline V16 round_nearest(V16 a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// a * 2^n for integral n in -150..127, as scalef rounds it: a * 2^(n/2) is exact (a normal), times 2^(n - n/2)
// rounds once
inline __m256 scale2(__m256 a, __m256 n) {
  const __m256i k = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(k, 1);
  auto pow2 = [](__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); };
  return _mm256_mul_ps(_mm256_mul_ps(a, pow2(half)), pow2(_mm256_sub_epi32(k, half)));
}
inline V16 scale2(V16 a, V16 n) { return {scale2(a.lo, n.lo), scale2(a.hi, n.hi)}; }
inline __m256 select_gt(__m256 a, __m256 b, __m256 x, __m256 y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
inline V16 select_gt(V16 a, V16 b, V16 x, V16 y) { return {select_gt(a.lo, b.lo, x.lo, y.lo), select_gt(a.hi, b.hi, x.hi, y.hi)}; }
// x = m 2^e, m in [1, 2), for normal x > 0: the exponent field and the mantissa with a zero exponent
inline void frexp8(__m256 x, __m256& m, __m256& e) {
  const __m256i bits = _mm256_castps_si256(x);
  e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
  m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)),
                                          _mm256_set1_epi32(0x3F800000)));
}
inline void frexp16(V16 x, V16& m, V16& e) { frexp8(x.lo, m.lo, e.lo), frexp8(x.hi, m.hi, e.hi); }
inline __m256 round_bf16(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)),
                                     _mm256_set1_epi32(int(0xFFFF0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                          _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
inline V16 round_bf16(V16 a) { return {round_bf16(a.lo), round_bf16(a.hi)}; }
// E2M1: the magnitude by the code's low 3 bits, the sign from bit 3
inline __m256 e2m1(__m256i codes) {
  const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f), codes);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
  return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
}
inline void e2m1_pairs(const uint8_t* p, V16& even, V16& odd) {
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
  const __m256i nibble = _mm256_set1_epi32(15);
  even = {e2m1(_mm256_and_si256(lo, nibble)), e2m1(_mm256_and_si256(hi, nibble))};
  odd = {e2m1(_mm256_srli_epi32(lo, 4)), e2m1(_mm256_srli_epi32(hi, 4))};
}
#endif

// Elementwise math, 16 lanes at a time, the same on both widths.
// e^x for 16 floats within 1-2 ulp: x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts), e^r by its degree-6
// Taylor polynomial (remainder < 2e-7 relative), times 2^n. NaN stays NaN; below -104 the result is 0.
inline V16 exp16(V16 x) {
  x = vmin(set1(88.f), vmax(set1(-104.f), x));
  const V16 n = round_nearest(x * set1(1.44269504f));
  const V16 r = fnma(n, set1(1.428606765330187e-06f), fnma(n, set1(0.693145751953125f), x));
  V16 e = set1(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, .5f, 1.f, 1.f}) e = fma(e, r, set1(c));
  return scale2(e, n);
}

// v rounded to T and back, 16 at a time
template <typename T> inline V16 round_vec(V16 v) { return v; }
template <> inline V16 round_vec<at::BFloat16>(V16 v) { return round_bf16(v); }

// ln x for normal x > 0 within a few ulp: x = m 2^e with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(t) for
// t = (m - 1) / (m + 1), |t| < 0.172, by its odd series to t^13 (remainder < 1e-11), and e ln 2 in two parts.
inline V16 log16(V16 x) {
  V16 m, e;
  frexp16(x, m, e);
  const V16 high = set1(1.41421356f);
  e = select_gt(m, high, e + set1(1.f), e);
  m = select_gt(m, high, m * set1(.5f), m);
  const V16 t = (m - set1(1.f)) / (m + set1(1.f)), s = t * t;
  V16 p = set1(2.f / 13);
  for (const float c : {2.f / 11, 2.f / 9, 2.f / 7, 2.f / 5, 2.f / 3, 2.f}) p = fma(p, s, set1(c));
  return fma(e, set1(0.693145751953125f), fma(e, set1(1.428606765330187e-06f), p * t));
}
inline V16 sigmoid16(V16 x) { return set1(1.f) / (set1(1.f) + exp16(set1(0.f) - x)); }
// ln(1 + e^x) (x itself above 20, torch's softplus threshold): ln(1 + u) as ln(w) u / (w - 1) for w = 1 + u rounded,
// which cancels w's rounding error (Goldberg), and u where w rounds to 1
inline V16 softplus16(V16 x) {
  const V16 u = exp16(x), w = set1(1.f) + u, wm1 = w - set1(1.f);
  const V16 small = select_gt(wm1, zero(), log16(w) * (u / wm1), u);
  return select_gt(x, set1(20.f), x, small);
}

inline float bf16_to_float(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline const uint16_t* raw(const at::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); }
inline const float* raw(const float* p) { return p; }
// n values of T (16 at most read; lanes past n: 0) as fp32, and n raw values copied (16 at most)
template <typename T> inline V16 load_values(const T* p, int64_t n) {
  T part[16];
  if (n < 16) std::fill(part, part + 16, T(0.f)), std::memcpy(part, p, n * sizeof(T)), p = part;
  return load(raw(p));
}
template <typename T> inline void copy_values(T* to, const T* from, int64_t n) {
  std::memcpy(to, from, (n < 16 ? n : 16) * sizeof(T));
}
inline float widen(float w) { return w; }
inline float widen(uint16_t w) { return bf16_to_float(w); }

// Decode streams each weight from memory once, and at 2 threads the hardware prefetchers alone kept it at 15-20 GB/s
// of the ~30 a plain sum reads: every read also asks for the line kPrefetchBytes further on into L2 (measured on a
// decode step's mix of shapes, 2 threads: fp32 20 -> 28 GB/s, bf16 16 -> 31; 8-16 KB ahead did best, the L1 hint
// and shorter distances did worse). A prefetch past the end of a tensor does not fault.
constexpr int64_t kPrefetchBytes = 16384;
inline void prefetch_ahead(const void* p) { _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T1); }
// A stream's start, which prefetch_ahead never asks for: its first kPrefetchBytes at once (n bytes at most), so a
// product (or an expert's rows) does not begin with a run of demand misses, one latency after another.
inline void prefetch_start(const void* p, int64_t n) {
  for (int64_t i = 0; i < std::min(n, kPrefetchBytes); i += 64) _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_T1);
}

template <typename T> inline void store(T* y, float v) { *y = T(v); }       // bf16: rounded to nearest even
// A result rounded to T and kept as fp32, as `.to(T).float()` gives it, written once: a separate conversion pass would
// first read back what other threads just wrote (cache lines held by other cores: [8, 32000] logits 20 -> 140 us).
template <typename T> struct FloatOut { float v; };
static_assert(sizeof(FloatOut<at::BFloat16>) == sizeof(float), "stored in place of a float");
template <typename T> inline void store(FloatOut<T>* y, float v) { y->v = float(T(v)); }

// How many sums a pass over the weights keeps in registers (32 on AVX-512, 16 on AVX2, each V16 taking two): with
// few input rows, one accumulator per (row, input row) is a single FMA chain whose latency, not memory, would bound
// the speed, so R output rows share a pass; inputs beyond kPassInputs are summed in a second pass over the same R rows
// (from cache). Each row's sum is the same sequence of FMAs whatever R and M are, so results do not depend on the
// batch. AVX-512 dense weights, with the L2 prefetch on: 3 rows a pass up to 2 input rows, 2 above (decode step mix,
// 2 threads, fp32 at 1/2/4/8 input rows: 27.1/27.6/27.0/23.3 GB/s).
constexpr int kPassInputs = kAvx512 ? 8 : 4;
constexpr int rows_per_pass(int M) { return kAvx512 ? (M == 1 ? 4 : M == 2 ? 2 : 1) : (M == 1 ? 2 : 1); }
constexpr int dense_rows_per_pass(int M) { return kAvx512 ? (M <= 2 ? 3 : 2) : (M == 1 ? 3 : M == 2 ? 2 : 1); }

template <typename WT, typename OT, int M, int R>
void dense_block(const float* x, int64_t K, const WT* W, int64_t n, OT* y, int64_t N) {
  if constexpr (M > kPassInputs) {
    dense_block<WT, OT, kPassInputs, R>(x, K, W, n, y, N);
    dense_block<WT, OT, M - kPassInputs, R>(x + kPassInputs * K, K, W, n, y + kPassInputs * N, N);
  } else {
    V16 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = zero();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      V16 xv[M];
      // held in registers for all R rows: GCC otherwise folds each load into every FMA that reads it (R loads of
      // each input a step), which at 8 rows made the pass bound by loads (hot in L2, 1 thread: 17 -> 26-34 GFMA/s)
      for (int m = 0; m < M; ++m) xv[m] = load(x + m * K + k), in_register(xv[m]);
      for (int r = 0; r < R; ++r) {
        const WT* w = W + (n + r) * K + k;
        prefetch_ahead(w);
        const V16 wv = load(w);
        for (int m = 0; m < M; ++m) acc[r][m] = fma(wv, xv[m], acc[r][m]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const WT* w = W + (n + r) * K;
      for (int m = 0; m < M; ++m) {
        float s = hsum(acc[r][m]);
        for (int64_t j = k; j < K; ++j) s += widen(w[j]) * x[m * K + j];
        store(y + m * N + n + r, s);
      }
    }
  }
}

template <typename WT, typename OT, int M>
void dense_rows(const float* x, int64_t K, const WT* W, int64_t n0, int64_t n1, OT* y, int64_t N) {
  constexpr int R = dense_rows_per_pass(M);
  prefetch_start(W + n0 * K, (n1 - n0) * K * int64_t(sizeof(WT)));
  int64_t n = n0;
  for (; n + R <= n1; n += R) dense_block<WT, OT, M, R>(x, K, W, n, y, N);
  for (; n < n1; ++n) dense_block<WT, OT, M, 1>(x, K, W, n, y, N);
}

constexpr int kAmxRows = 4;            // bf16 products of this many rows or more use AMX tiles (amx_rows)

#if defined(__AVX512F__)
// bf16 weights times bf16 inputs on CPUs with AVX512-BF16: one vdpbf16ps multiplies 32 pairs (exactly: a product of
// two bf16 values fits in fp32) and adds them to 16 fp32 sums, two to a lane in a fixed order. Twice the products of
// an FMA and no widening: at 8 rows the FMA form is bound by arithmetic (bf16 8-row GEMV 11.5 -> 22.9 GB/s).
// K a multiple of 32 (other widths take the FMA form): masked loads for a tail cost 8-row products 40% of their speed.
const bool kBf16Dot = __builtin_cpu_supports("avx512bf16");
constexpr int bf16_rows_per_pass(int M) { return M <= 2 ? 3 : 2; }  // step mix: 32/31/30/28 GB/s at 1/2/4/8 rows

template <typename OT, int M, int R>
__attribute__((target("avx512bf16"))) void bf16_block(const uint16_t* x, int64_t K, const uint16_t* W, int64_t n,
                                                      OT* y, int64_t N) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const uint16_t* w = W + (n + r) * K + k;
      prefetch_ahead(w);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) store(y + m * N + n + r, _mm512_reduce_add_ps(acc[r][m]));
}

// AMX (Intel's tile unit, Sapphire Rapids on): at kAmxRows input rows or more, the vdpbf16ps form is bound by its
// arithmetic (~16 multiply-adds a cycle a core here), and one tdpbf16ps multiplies 16 weight rows by 32 inputs of
// each of M rows at once. Only from kAmxRows: with fewer rows the products are memory-bound either way, and a tile
// load of 16 strided weight rows streams worse than vdpbf16ps's 2-3 rows a pass (bench-s batch 1 10-20% slower with
// tiles for every M). So a row's result depends on whether its batch has kAmxRows rows (tiles sum in their own
// order); within either form it does not depend on the other rows or on the thread count (--batch-invariant decodes
// one row at a time for bitwise batch independence). Off with DELTASERVE_AMX=0, and where the CPU or the kernel
// (Linux asks a process to request the tile state) does not allow it.
bool amx_permitted() {
  if (const char* env = std::getenv("DELTASERVE_AMX"); env && std::string(env) == "0") return false;
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;          // arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}
const bool kAmx = kBf16Dot && amx_permitted();

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-2: the fp32 sums of three blocks of `rows` weight rows by M inputs; 3-5: those blocks' weights (`rows` rows
// of 32 bf16); 6: the inputs' next 32 values, as 16 pairs a row for each of the M inputs.
template <int M>
__attribute__((target("amx-tile,amx-bf16"))) void amx_configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = uint8_t(rows), cfg.colsb[t] = M * 4;
  for (int t = 3; t < 6; ++t) cfg.rows[t] = uint8_t(rows), cfg.colsb[t] = 64;
  cfg.rows[6] = 16, cfg.colsb[6] = M * 4;
  _tile_loadconfig(&cfg);
}

// pairs: the M input rows as pairs of bf16, pair p of row m at pairs[p * stride + m] (the input tiles' layout, made
// once per product by Inputs).
template <typename OT, int M>
__attribute__((target("amx-tile,amx-bf16"))) void amx_rows(const uint32_t* pairs, int64_t stride, int64_t K,
                                                           const uint16_t* W, int64_t n0, int64_t n1, OT* y, int64_t N) {
  alignas(64) float c[3][16][M];
  auto write = [&](int tiles, int64_t n, int rows) {       // the sums stored from tiles 0..tiles-1 into c
    for (int t = 0; t < tiles; ++t)
      for (int i = 0; i < rows; ++i)
        for (int m = 0; m < M; ++m) store(y + m * N + n + 16 * t + i, c[t][i][m]);
  };
  // the blocks stream column by column: each k step asks for the lines its block's rows reach ~kPrefetchBytes of the
  // stream later, in the next block from the end of a row on
  constexpr int64_t ahead = kPrefetchBytes / 2 / 48 / 32 * 32;
  auto prefetch_tiles = [&](int64_t n, int64_t k, int block) {
    const int64_t at = k + ahead;
    const uint16_t* p = at < K ? W + n * K + at : W + (n + block) * K + std::min(at - K, K - 32);
    for (int i = 0; i < block; ++i) _mm_prefetch((const char*)(p + i * K), _MM_HINT_T1);
  };
  for (int64_t i = n0; i < std::min(n1, n0 + 48); ++i) prefetch_start(W + i * K, std::min(ahead, K) * 2);
  int64_t n = n0;
  amx_configure<M>(16);
  for (; n + 48 <= n1; n += 48) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t k = 0; k < K; k += 32) {
      prefetch_tiles(n, k, 48);
      _tile_loadd(6, pairs + k / 2 * stride, stride * 4);
      _tile_loadd(3, W + n * K + k, K * 2);
      _tile_dpbf16ps(0, 3, 6);
      _tile_loadd(4, W + (n + 16) * K + k, K * 2);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, W + (n + 32) * K + k, K * 2);
      _tile_dpbf16ps(2, 5, 6);
    }
    _tile_stored(0, c[0], M * 4);
    _tile_stored(1, c[1], M * 4);
    _tile_stored(2, c[2], M * 4);
    write(3, n, 16);
  }
  for (; n < n1; n += 16) {               // the rest a block at a time, the last one shorter
    const int rows = int(std::min<int64_t>(16, n1 - n));
    if (rows < 16) amx_configure<M>(rows);
    _tile_zero(0);
    for (int64_t k = 0; k < K; k += 32) {
      prefetch_tiles(n, k, 16);
      _tile_loadd(6, pairs + k / 2 * stride, stride * 4);
      _tile_loadd(3, W + n * K + k, K * 2);
      _tile_dpbf16ps(0, 3, 6);
    }
    _tile_stored(0, c[0], M * 4);
    write(1, n, rows);
  }
  _tile_release();
}

// pairs (with its stride): x as amx_rows takes it, or null where the tiles are not used
template <typename OT, int M>
void bf16_rows(const uint16_t* x, const uint32_t* pairs, int64_t stride, int64_t K, const uint16_t* W, int64_t n0,
               int64_t n1, OT* y, int64_t N) {
  if (M >= kAmxRows && pairs) return amx_rows<OT, M>(pairs, stride, K, W, n0, n1, y, N);
  constexpr int R = bf16_rows_per_pass(M);
  int64_t n = n0;
  for (; n + R <= n1; n += R) bf16_block<OT, M, R>(x, K, W, n, y, N);
  for (; n < n1; ++n) bf16_block<OT, M, 1>(x, K, W, n, y, N);
}
#else
constexpr bool kBf16Dot = false, kAmx = false;       // vdpbf16ps and the tiles are AVX-512 only
#endif

// 2^(s - 127): the float whose exponent field is s (s = 0, below the normal range, is 2^-127 = bit 22 alone)
inline float e8m0(uint8_t s) {
  const uint32_t bits = s ? uint32_t(s) << 23 : 0x00400000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// x is given de-interleaved per 32-block: xe holds the even elements, xo the odd ones ([M, K/2] each).
template <typename OT, int M, int R>
void mxfp4_block(const float* xe, const float* xo, int64_t K, const uint8_t* P, const uint8_t* S, int64_t n, OT* y,
                 int64_t N) {
  const int64_t blocks = K / 32, half = K / 2;
  if constexpr (M > kPassInputs) {
    mxfp4_block<OT, kPassInputs, R>(xe, xo, K, P, S, n, y, N);
    mxfp4_block<OT, M - kPassInputs, R>(xe + kPassInputs * half, xo + kPassInputs * half, K, P, S, n,
                                        y + kPassInputs * N, N);
  } else {
    V16 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = zero();
    for (int64_t b = 0; b < blocks; ++b) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* packed = P + (n + r) * half + b * 16;
        prefetch_ahead(packed);
        V16 even, odd;
        e2m1_pairs(packed, even, odd);
        const V16 scale = set1(e8m0(S[(n + r) * blocks + b]));
        for (int m = 0; m < M; ++m) {
          const int64_t at = m * half + b * 16;
          acc[r][m] = fma(fma(even, load(xe + at), odd * load(xo + at)), scale, acc[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) store(y + m * N + n + r, hsum(acc[r][m]));
  }
}

// x is given de-interleaved per 32-block: xe holds the even elements, xo the odd ones ([M, K/2] each).
template <typename OT, int M>
void mxfp4_rows(const float* xe, const float* xo, int64_t K, const uint8_t* P, const uint8_t* S, int64_t n0,
                int64_t n1, OT* y, int64_t N) {
  constexpr int R = rows_per_pass(M);
  prefetch_start(P + n0 * K / 2, (n1 - n0) * K / 2);
  int64_t n = n0;
  for (; n + R <= n1; n += R) mxfp4_block<OT, M, R>(xe, xo, K, P, S, n, y, N);
  for (; n < n1; ++n) mxfp4_block<OT, M, 1>(xe, xo, K, P, S, n, y, N);
}

template <typename OT, int M, int R>
void q8_block(const float* x, int64_t K, const int8_t* Q, const float* S, int64_t n, OT* y, int64_t N) {
  if constexpr (M > kPassInputs) {
    q8_block<OT, kPassInputs, R>(x, K, Q, S, n, y, N);
    q8_block<OT, M - kPassInputs, R>(x + kPassInputs * K, K, Q, S, n, y + kPassInputs * N, N);
  } else {
    const int64_t blocks = K / 32;
    V16 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = zero();
    for (int64_t b = 0; b < blocks; ++b) {
      for (int r = 0; r < R; ++r) {
        const int8_t* q = Q + (n + r) * K + b * 32;
        prefetch_ahead(q);
        const V16 lo = load_i8(q), hi = load_i8(q + 16), scale = set1(S[(n + r) * blocks + b]);
        for (int m = 0; m < M; ++m) {
          const float* xb = x + m * K + b * 32;
          acc[r][m] = fma(fma(lo, load(xb), hi * load(xb + 16)), scale, acc[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) store(y + m * N + n + r, hsum(acc[r][m]));
  }
}

// Int8 weights with one fp32 scale per 32 consecutive inputs (llama.cpp's Q8_0 layout, fp32 scales).
template <typename OT, int M>
void q8_rows(const float* x, int64_t K, const int8_t* Q, const float* S, int64_t n0, int64_t n1, OT* y, int64_t N) {
  constexpr int R = rows_per_pass(M);
  prefetch_start(Q + n0 * K, (n1 - n0) * K);
  int64_t n = n0;
  for (; n + R <= n1; n += R) q8_block<OT, M, R>(x, K, Q, S, n, y, N);
  for (; n < n1; ++n) q8_block<OT, M, 1>(x, K, Q, S, n, y, N);
}

// f(std::integral_constant<int, m>{}) for a count m in 1..kMaxRows known only at run time (rows; also the state
// vectors of delta_rule_columns).
template <typename F>
void with_rows(int64_t m, F&& f) {
  switch (m) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// f(c0, c1) over [0, N) on torch's threads, in chunks of about an eighth of a thread's share (`grain` rows at least):
// each thread takes the chunks of its own share in order, then any a slower thread (a descheduled vCPU, a late start)
// has not begun, so none waits out another's share. Which thread computes a chunk never changes its result.
template <typename F>
void balanced_for(int64_t N, int64_t grain, F&& f) {
  grain = std::max<int64_t>({grain, 1, N / (8 * at::get_num_threads())});
  const int64_t chunks = (N + grain - 1) / grain;
  const int threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1) {
    at::parallel_for(0, N, grain, f);
    return;
  }
  std::unique_ptr<std::atomic<bool>[]> taken(new std::atomic<bool>[chunks]);
  for (int64_t c = 0; c < chunks; ++c) taken[c].store(false, std::memory_order_relaxed);
  auto run = [&](int64_t c) {
    // a plain read first: scanning chunks already taken then writes no flag line that their owners also write
    if (!taken[c].load(std::memory_order_relaxed) && !taken[c].exchange(true, std::memory_order_relaxed))
      f(c * grain, std::min(N, (c + 1) * grain));
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t own0 = chunks * t / threads, own1 = chunks * (t + 1) / threads;
      for (int64_t c = own0; c < own1; ++c) run(c);
      for (int64_t c = chunks - 1; c >= 0; --c) run(c);        // what others left: from the far end
    }
  });
}

template <template <int> class Rows, typename... Args>
void by_rows(int64_t M, int64_t N, int64_t grain, Args... args) {
  balanced_for(N, grain, [&](int64_t n0, int64_t n1) {
    with_rows(M, [&](auto m) { Rows<decltype(m)::value>::run(args..., n0, n1); });
  });
}

template <int M>
struct Mxfp4Rows {
  template <typename OT>
  static void run(const float* xe, const float* xo, int64_t K, const uint8_t* P, const uint8_t* S, OT* y, int64_t N,
                  int64_t n0, int64_t n1) {
    mxfp4_rows<OT, M>(xe, xo, K, P, S, n0, n1, y, N);
  }
};

template <int M>
struct Q8Rows {
  template <typename OT>
  static void run(const float* x, int64_t K, const int8_t* Q, const float* S, OT* y, int64_t N, int64_t n0,
                  int64_t n1) {
    q8_rows<OT, M>(x, K, Q, S, n0, n1, y, N);
  }
};

// M rows of K bf16 as amx_rows's input layout: out[p * M + m] = pair p (elements 2p, 2p + 1) of row m
inline void pack_pairs(const uint16_t* rows, int64_t M, int64_t K, uint32_t* out) {
  for (int64_t p = 0; p < K / 2; ++p)
    for (int64_t m = 0; m < M; ++m) std::memcpy(&out[p * M + m], rows + m * K + 2 * p, 4);
}

// Rows of inputs ([..., K] -> M rows of K) in the forms the kernels read for weights W: bf16 as they are for bf16
// weights on a CPU with AVX512-BF16, else fp32, and for MXFP4 (uint8 W) their even and odd elements apart. Rows
// already in that form are read in place (x must outlive this object); others are converted once, into buffers this
// object owns (a decode step makes ~50 of these: no tensors, no ATen calls for the common layouts).
struct Inputs {
  int64_t M, K;
  const uint16_t* b = nullptr;
  const float *f = nullptr, *even = nullptr, *odd = nullptr;

  // widest: the most rows one product reads from these (all of them by default; a group's, for experts)
  Inputs(const torch::Tensor& x, const torch::Tensor& W, int64_t widest = -1)
      : M(0), K(W.size(-1) * (W.scalar_type() == torch::kByte ? 2 : 1)) {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "x must be [..., ", K, "]");
    M = x.numel() / K;
    const bool dense = x.is_contiguous();
    if (kBf16Dot && x.scalar_type() == torch::kBFloat16 && W.scalar_type() == torch::kBFloat16 && K % 32 == 0) {
      b = static_cast<const uint16_t*>((dense ? x : hold_ = x.contiguous()).data_ptr());
      if (kAmx && (widest < 0 ? M : widest) >= kAmxRows) {   // the tiles' layout, once for every chunk of rows
        pairs_.resize(K / 2 * M);
        pack_pairs(b, M, K, pairs_.data());
      }
      return;
    }
    if (dense && x.scalar_type() == torch::kFloat) {
      f = x.data_ptr<float>();
    } else if (dense && x.scalar_type() == torch::kBFloat16) {
      const auto* src = static_cast<const uint16_t*>(x.data_ptr());
      own_.resize(M * K);
      int64_t i = 0;
      for (; i + 16 <= M * K; i += 16) store(own_.data() + i, load(src + i));
      for (; i < M * K; ++i) own_[i] = bf16_to_float(src[i]);
      f = own_.data();
    } else {                                             // strided rows, other dtypes
      hold_ = x.to(torch::kFloat).contiguous();
      f = hold_.data_ptr<float>();
    }
    if (W.scalar_type() == torch::kByte) {
      split_.resize(M * K);
      for (int64_t i = 0; i < M * K / 2; ++i) split_[i] = f[2 * i], split_[M * K / 2 + i] = f[2 * i + 1];
      even = split_.data(), odd = split_.data() + M * K / 2;
    }
  }
  int64_t rows() const { return M; }
  // the M of a product these rows feed alone (gemv): the kernels' row counts
  int64_t product_rows() const {
    TORCH_CHECK(M >= 1 && M <= kMaxRows, "x must have 1..", kMaxRows, " rows");
    return M;
  }
  const float* row_f(int64_t i) const { return f + i * K; }
  const float* row_even(int64_t i) const { return even + i * K / 2; }
  const float* row_odd(int64_t i) const { return odd + i * K / 2; }
  const uint16_t* row_b(int64_t i) const { return b + i * K; }
  // row i on in amx_rows's layout (pair p of row i + m at [p * M + m]), or null where the tiles are not used
  const uint32_t* pairs(int64_t i) const { return pairs_.empty() ? nullptr : pairs_.data() + i; }

 private:
  torch::Tensor hold_;
  std::vector<float> own_, split_;
  std::vector<uint32_t> pairs_;
};

// The result of a product of x's rows ([..., N]): each value rounded to x's dtype, and given back in it or, with
// `float_out`, in fp32 (`.float()` of it). The kernels write fp32, bf16 and such bf16 values directly (`into` hands the
// output as the type they store); for another dtype they write fp32 and `finish` rounds.
class Result {
 public:
  Result(const torch::Tensor& x, int64_t N, bool float_out) : dtype_(x.scalar_type()), float_out_(float_out) {
    auto shape = x.sizes().vec();
    shape.back() = N;
    y_ = torch::empty(shape, x.options().dtype(dtype_ == torch::kBFloat16 && !float_out ? dtype_ : torch::kFloat));
  }
  template <typename F>
  void into(F&& f) {
    if (dtype_ != torch::kBFloat16) f(y_.data_ptr<float>());
    else if (float_out_) f(reinterpret_cast<FloatOut<at::BFloat16>*>(y_.data_ptr<float>()));
    else f(static_cast<at::BFloat16*>(y_.data_ptr()));
  }
  torch::Tensor finish() const {
    if (dtype_ == torch::kFloat || dtype_ == torch::kBFloat16) return y_;
    return float_out_ ? y_.to(dtype_).to(torch::kFloat) : y_.to(dtype_);
  }

 private:
  torch::Tensor y_;
  c10::ScalarType dtype_;
  bool float_out_;
};

// y[m] = W x[m] for rows [n0, n1) of a dense W (fp32 or bf16), each result rounded once to OT.
template <typename OT, int M>
void dense_product(const Inputs& x, int64_t row0, const torch::Tensor& W, const char* base, int64_t n0, int64_t n1,
                   OT* y, int64_t N) {
  const int64_t K = W.size(-1);
#if defined(__AVX512F__)
  if (x.b)
    return bf16_rows<OT, M>(x.row_b(row0), x.pairs(row0), x.M, K, reinterpret_cast<const uint16_t*>(base), n0, n1, y,
                            N);
#endif
  if (W.scalar_type() == torch::kBFloat16)
    dense_rows<uint16_t, OT, M>(x.row_f(row0), K, reinterpret_cast<const uint16_t*>(base), n0, n1, y, N);
  else
    dense_rows<float, OT, M>(x.row_f(row0), K, reinterpret_cast<const float*>(base), n0, n1, y, N);
}

template <int M>
struct DenseRows {
  template <typename OT>
  static void run(const Inputs* x, const torch::Tensor* W, OT* y, int64_t N, int64_t n0, int64_t n1) {
    dense_product<OT, M>(*x, 0, *W, static_cast<const char*>(W->data_ptr()), n0, n1, y, N);
  }
};

}  // namespace

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& W, bool float_out) {
  TORCH_CHECK(W.dim() == 2 && W.is_contiguous(), "W must be a contiguous [N, K] matrix");
  TORCH_CHECK(W.scalar_type() == torch::kFloat || W.scalar_type() == torch::kBFloat16, "W must be float32 or bfloat16");
  const int64_t N = W.size(0);
  const Inputs xs(x, W);
  Result y(x, N, float_out);
  y.into([&](auto* out) { by_rows<DenseRows>(xs.product_rows(), N, 64, &xs, &W, out, N); });
  return y.finish();
}

torch::Tensor gemv_mxfp4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                         bool float_out) {
  TORCH_CHECK(packed.dim() == 2 && scales.dim() == 2 && packed.is_contiguous() && scales.is_contiguous() &&
              packed.scalar_type() == torch::kByte && scales.scalar_type() == torch::kByte,
              "packed [N, K/2] and scales [N, K/32] must be contiguous uint8");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(K % 32 == 0 && scales.size(0) == N && scales.size(1) == K / 32, "scales must be [N, K/32]");
  const Inputs xs(x, packed);
  Result y(x, N, float_out);
  y.into([&](auto* out) {
    by_rows<Mxfp4Rows>(xs.product_rows(), N, 16, xs.even, xs.odd, K, packed.data_ptr<uint8_t>(),
                       scales.data_ptr<uint8_t>(), out, N);
  });
  return y.finish();
}

torch::Tensor gemv_q8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales, bool float_out) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == torch::kChar, "q must be contiguous int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(K % 32 == 0 && scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / 32 &&
              scales.scalar_type() == torch::kFloat && scales.is_contiguous(), "scales must be float32 [N, K/32]");
  const Inputs xs(x, q);
  Result y(x, N, float_out);
  y.into([&](auto* out) {
    by_rows<Q8Rows>(xs.product_rows(), N, 32, xs.f, K, q.data_ptr<int8_t>(), scales.data_ptr<float>(), out, N);
  });
  return y.finish();
}

// Products of stacked weights (routed experts) and of a weight given in parts (dense, or int8 with scales), for
// kernels that fuse them with other work: each row computed exactly as gemv computes it.
namespace {
// The rows [begin, end) of the inputs and of the outputs that one expert takes: of the routed stack (set 0) or the
// shared expert (set 1, expert 0).
struct Group {
  int64_t expert, begin, end, set;
};

// Rows [n0, n1) of y[m] = W_e x[begin + m] for the M inputs of a group (each row as gemv computes it and rounds it
// to OT). w: a stack of experts ([E, N, K] dense, or int8 / MXFP4 codes and scales), or one matrix ([N, K], e = 0).
template <int M, typename OT>
void group_rows(at::TensorList w, const Group& g, const Inputs& x, int64_t n0, int64_t n1, OT* y) {
  const int64_t N = w[0].size(-2), e = g.expert;
  auto expert_base = [&](int i) {
    return static_cast<const char*>(w[i].data_ptr()) + e * w[i].stride(0) * w[i].element_size();
  };
  if (w.size() == 1) {
    dense_product<OT, M>(x, g.begin, w[0], expert_base(0), n0, n1, y, N);
  } else if (w[0].scalar_type() == torch::kByte) {
    mxfp4_rows<OT, M>(x.row_even(g.begin), x.row_odd(g.begin), w[0].size(-1) * 2,
                         (const uint8_t*)expert_base(0), (const uint8_t*)expert_base(1), n0, n1, y, N);
  } else {
    q8_rows<OT, M>(x.row_f(g.begin), w[0].size(-1), (const int8_t*)expert_base(0), (const float*)expert_base(1),
                      n0, n1, y, N);
  }
}


}  // namespace

// One KDA decode step (T = 1) for a batch: causal conv of the new q|k|v inputs over the carried window, SiLU,
// L2 norms, forget gate and beta, the gated delta rule on the fp32 state, and the gated RMSNorm of the output, in
// place on the conv window and the state, with the gates' low-rank up projections (f_b, and g_b unless the gate is
// full-rank) computed as gemv computes them. Mirrors KimiDeltaAttention.forward op for op (including where values
// are rounded to the activation dtype) for one (row, head) per task.
namespace {

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return float(v); }
template <typename T> inline float round_to(float v) { return to_float(T(v)); }

// Rows updating the same slot in place would race (and the op-by-op path would keep only one of them).
inline void check_distinct(const int64_t* slots, int64_t B) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < b; ++c) TORCH_CHECK(slots[b] != slots[c], "slot ", slots[b], " appears twice in a batch");
}
inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
// KDA's log-decay from the forget-gate input f (+ dt_bias) and the rate a = exp(A_log): -a softplus(f), or with a
// lower bound L, L sigmoid(a f) (layers/kda.py forget_gate)
inline V16 log_decay16(V16 f, V16 rate, float lower_bound) {
  return lower_bound != 0.f ? set1(lower_bound) * sigmoid16(rate * f) : (set1(0.f) - rate) * softplus16(f);
}

struct KdaArgs {
  int64_t B, H, K, W;
  int64_t proj_stride, beta_stride;                           // row strides of the projection slices
  int64_t conv_stride, state_stride;                          // slot strides of the conv window and the state
  const int64_t* slots;                                       // row b's slot in the pools
  float lower_bound, eps, scale;
  bool per_channel, silu_gate;
};

// x = f(x) for n floats, 16 at a time
template <typename F>
inline void each16(float* x, int64_t n, F f) {
  for (int64_t i = 0; i < n; i += 16) store_n(x + i, n - i, f(load_n(x + i, n - i)));
}

// The delta rule on columns [c0, c0 + 16 NV) of one head's state s [K keys][K values], those columns' sums held in
// registers across all K rows (two passes over the rows, each row read and written once a pass): decay each row,
// pred = S^T k, delta = (v - pred) beta, S += k delta^T, o = S^T q. The same multiplies and adds, in the same order, as
// the scalar loops they replace (no FMA: -ffp-contract=off keeps every product rounded, as the op-by-op path does).
constexpr int64_t kStateVectors = kAvx512 ? 8 : 2;     // AVX2: 16 registers
template <int NV>
void delta_rule_columns(float* s, int64_t K, int64_t c0, const float* d, const float* k, const float* v, float beta,
                        const float* q, float* o) {
  auto width = [&](int i) { return K - c0 - 16 * i; };            // lanes of vector i that are in the state
  V16 acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = zero();
  for (int64_t r = 0; r < K; ++r) {
    float* row = s + r * K + c0;
    const V16 dr = set1(d[r]), kr = set1(k[r]);
    for (int i = 0; i < NV; ++i) {
      prefetch_ahead(row + 16 * i);
      const V16 x = load_n(row + 16 * i, width(i)) * dr;
      store_n(row + 16 * i, width(i), x);
      acc[i] = acc[i] + kr * x;
    }
  }
  V16 delta[NV];
  for (int i = 0; i < NV; ++i) {
    delta[i] = (load_n(v + c0 + 16 * i, width(i)) - acc[i]) * set1(beta);
    acc[i] = zero();
  }
  for (int64_t r = 0; r < K; ++r) {
    float* row = s + r * K + c0;
    const V16 kr = set1(k[r]), qr = set1(q[r]);
    for (int i = 0; i < NV; ++i) {
      const V16 x = load_n(row + 16 * i, width(i)) + kr * delta[i];
      store_n(row + 16 * i, width(i), x);
      acc[i] = acc[i] + qr * x;
    }
  }
  for (int i = 0; i < NV; ++i) store_n(o + c0 + 16 * i, width(i), acc[i]);
}

// f and z: the head's forget-gate input and output gate (K values each, as rounded to T). The transcendental steps
// (SiLU, the forget gate, the output gate: ~900 a head, ~3/4 of a head's time as scalar libm calls) run 16 lanes at
// a time, within a few ulp of libm.
template <typename T>
void kda_head(const KdaArgs& a, int64_t b, int64_t h, const T* proj, T* conv, const float* taps, const float* f,
              const float* dt_bias, const float* decay, const T* beta_logit, const float* z, const float* o_norm,
              float* S, T* out) {
  const int64_t K = a.K, P = a.H * K, W = a.W;
  std::vector<float> qkv(3 * K);
  T* const windows = conv + a.slots[b] * a.conv_stride;                   // W-1 rows of 3P channels
  for (int part = 0; part < 3; ++part) {                                  // 16 channels at a time
    for (int64_t i = 0; i < K; i += 16) {
      const int64_t c = part * P + h * K + i, n = K - i;
      T* window = windows + c;
      const T* fresh = proj + b * a.proj_stride + c;
      V16 acc = zero();
      for (int64_t j = 0; j < W - 1; ++j)
        acc = acc + load_values(window + j * 3 * P, n) * load_n(taps + j * 3 * P + c, n);
      acc = acc + load_values(fresh, n) * load_n(taps + (W - 1) * 3 * P + c, n);
      for (int64_t j = 0; j + 1 < W - 1; ++j) copy_values(window + j * 3 * P, window + (j + 1) * 3 * P, n);
      copy_values(window + (W - 2) * 3 * P, fresh, n);
      store_n(qkv.data() + part * K + i, n, acc);
    }
  }
  each16(qkv.data(), 3 * K, [](V16 x) { return round_vec<T>(x * sigmoid16(x)); });       // SiLU, rounded to T
  float* q = qkv.data(); float* k = q + K; float* v = k + K;
  for (float* x : {q, k}) {
    float ss = 0.f;
    for (int64_t i = 0; i < K; ++i) ss += x[i] * x[i];
    const float inv = 1.f / std::sqrt(ss + 1e-6f);
    for (int64_t i = 0; i < K; ++i) x[i] *= inv;
  }
  for (int64_t i = 0; i < K; ++i) q[i] *= a.scale;
  const float beta = sigmoid(to_float(beta_logit[b * a.beta_stride + h]));
  // each key row's decay: e^(-a softplus(f + dt_bias)), or e^(L sigmoid(a (f + dt_bias))) with a lower bound L
  std::vector<float> d(K);
  for (int64_t r = 0; r < K; r += 16) {
    const int64_t n = K - r;
    const V16 fr = load_n(f + r, n) + load_n(dt_bias + h * K + r, n);
    const V16 rate = a.per_channel ? load_n(decay + r, n) : set1(decay[h]);
    store_n(d.data() + r, n, exp16(log_decay16(fr, rate, a.lower_bound)));
  }
  float* s = S + a.slots[b] * a.state_stride + h * K * K;                // [K keys][K values]
  // the state streams from memory (a batch's states outgrow the caches): its first kPrefetchBytes asked for at
  // once, then every line that far ahead, as the GEMVs read their weights
  for (int64_t i = 0; i < std::min<int64_t>(K * K, kPrefetchBytes / 4); i += 16)
    _mm_prefetch(reinterpret_cast<const char*>(s + i), _MM_HINT_T1);
  std::vector<float> o(K);
  for (int64_t c0 = 0; c0 < K; c0 += 16 * kStateVectors)
    with_rows((std::min(K - c0, 16 * kStateVectors) + 15) / 16, [&](auto nv) {
      delta_rule_columns<decltype(nv)::value>(s, K, c0, d.data(), k, v, beta, q, o.data());
    });
  float ss = 0.f;
  for (int64_t c = 0; c < K; ++c) ss += o[c] * o[c];
  const float inv = 1.f / std::sqrt(ss / K + a.eps);
  for (int64_t c = 0; c < K; c += 16) {                                    // gated RMSNorm
    const int64_t n = K - c;
    const V16 g = load_n(z + c, n);
    const V16 act = a.silu_gate ? g * sigmoid16(g) : sigmoid16(g);
    store_n(o.data() + c, n, load_n(o.data() + c, n) * set1(inv) * load_n(o_norm + c, n) * act);
  }
  for (int64_t c = 0; c < K; ++c) out[b * P + h * K + c] = T(o[c]);
}

// Rows [h K, (h + 1) K) of W x[b] (the low-rank up projections of the gates), rounded to T as gemv rounds them.
template <typename T>
void head_rows(at::TensorList w, const Inputs& x, int64_t b, int64_t h, int64_t K, std::vector<float>& y, float* out) {
  group_rows<1>(w, {0, b, b + 1, 0}, x, h * K, (h + 1) * K, y.data());
  for (int64_t i = 0; i < K; ++i) out[i] = round_to<T>(y[h * K + i]);
}

template <typename T>
torch::Tensor kda_step_typed(const KdaArgs& a, const torch::Tensor& proj, torch::Tensor& conv, const torch::Tensor& taps,
                             const torch::Tensor& f_a, at::TensorList f_b, const torch::Tensor& dt_bias,
                             const torch::Tensor& decay, const torch::Tensor& beta_logit, const torch::Tensor& g,
                             at::TensorList g_b, const torch::Tensor& o_norm, torch::Tensor& S) {
  auto out = torch::empty({a.B, a.H * a.K}, proj.options());
  const T* P = proj.data_ptr<T>(); T* C = conv.data_ptr<T>(); const T* G = g.data_ptr<T>();
  const T* Bl = beta_logit.data_ptr<T>(); T* O = out.data_ptr<T>();
  const float* taps_p = taps.data_ptr<float>(); const float* dt = dt_bias.data_ptr<float>();
  const float* dec = decay.data_ptr<float>(); const float* w = o_norm.data_ptr<float>(); float* St = S.data_ptr<float>();
  const Inputs fx(f_a, f_b[0], 1);                       // read a row at a time (head_rows)
  const std::optional<Inputs> gx = g_b.empty() ? std::nullopt : std::optional<Inputs>(std::in_place, g, g_b[0], 1);
  const int64_t K = a.K, HK = a.H * K, g_stride = g.stride(0);
  at::parallel_for(0, a.B * a.H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> rows(HK), f(K), z(K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / a.H, h = t % a.H;
      head_rows<T>(f_b, fx, b, h, K, rows, f.data());
      if (gx) head_rows<T>(g_b, *gx, b, h, K, rows, z.data());
      else for (int64_t i = 0; i < K; ++i) z[i] = to_float(G[b * g_stride + h * K + i]);      // a full-rank gate
      kda_head<T>(a, b, h, P, C, taps_p, f.data(), dt, dec, Bl, z.data(), w, St, O);
    }
  });
  return out;
}

}  // namespace

torch::Tensor kda_decode_step(const torch::Tensor& proj, torch::Tensor conv, const torch::Tensor& taps,
                              const torch::Tensor& f_a, at::TensorList f_b, const torch::Tensor& dt_bias,
                              const torch::Tensor& decay, double lower_bound, const torch::Tensor& beta_logit,
                              const torch::Tensor& g, at::TensorList g_b, const torch::Tensor& o_norm, double eps,
                              bool silu_gate, bool per_channel, torch::Tensor S, const torch::Tensor& slots) {
  const int64_t B = proj.size(0), H = S.size(1), K = S.size(2), W = taps.size(0);
  for (const auto* t : {&proj, &f_a, &beta_logit, &g})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == B && t->stride(1) == 1 && t->scalar_type() == proj.scalar_type(),
                "projections must be [B, n] row slices of one dtype");
  for (const auto* w : {&f_b, &g_b}) {
    if (w->empty()) continue;
    TORCH_CHECK((*w)[0].dim() == 2 && (*w)[0].size(0) == H * K && (*w)[0].is_contiguous() &&
                (w->size() == 1 || (*w)[1].is_contiguous()), "gate up projections must be contiguous [H K, rank]");
  }
  TORCH_CHECK(!f_b.empty() && f_b[0].size(1) == f_a.size(1), "f_b must map f_a's width to H K");
  TORCH_CHECK(g_b.empty() ? g.size(1) == H * K : g_b[0].size(1) == g.size(1),
              "the output gate is [B, H K], or g_b maps g's width to H K");
  TORCH_CHECK(conv.dim() == 3 && conv.size(1) == W - 1 && conv.stride(2) == 1 && conv.stride(1) == 3 * H * K &&
              conv.scalar_type() == proj.scalar_type(), "conv windows must be [slots, W-1, 3P] in the activation dtype");
  TORCH_CHECK(S.dim() == 4 && S.size(3) == K && S.scalar_type() == torch::kFloat && S.stride(3) == 1 &&
              S.stride(2) == K && S.stride(1) == K * K, "states must be [slots, H, K, K] float32, each contiguous");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == B && slots.scalar_type() == torch::kLong && slots.is_contiguous(),
              "slots must be int64 [B]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < std::min(conv.size(0), S.size(0)), "slot ", slot[b], " out of range");
  check_distinct(slot, B);
  TORCH_CHECK(taps.dim() == 2 && taps.scalar_type() == torch::kFloat && taps.is_contiguous() &&
              taps.size(1) == 3 * H * K, "taps must be [W, 3P] float32");
  TORCH_CHECK(decay.numel() == (per_channel ? K : H), "decay rates: one per ", per_channel ? "key channel" : "head");
  KdaArgs a{B, H, K, W, proj.stride(0), beta_logit.stride(0), conv.stride(0), S.stride(0),
            slot, float(lower_bound), float(eps), 1.f / std::sqrt(float(K)), per_channel, silu_gate};
  auto tc = [](const torch::Tensor& t) { return t.to(torch::kFloat).contiguous(); };
  const auto dt = tc(dt_bias), dec = tc(decay), w = tc(o_norm);
  if (proj.scalar_type() == torch::kBFloat16)
    return kda_step_typed<at::BFloat16>(a, proj, conv, taps, f_a, f_b, dt, dec, beta_logit, g, g_b, w, S);
  TORCH_CHECK(proj.scalar_type() == torch::kFloat, "activations must be float32 or bfloat16");
  return kda_step_typed<float>(a, proj, conv, taps, f_a, f_b, dt, dec, beta_logit, g, g_b, w, S);
}

// The routed experts of a few tokens (decode: 1..8 rows): out[n] += (w[n, j] * expert_e(h[n])).to(h's dtype) for
// each assignment (n, j) of token n to expert e = ids[n, j], experts in ascending order and each expert's tokens in
// slot order, with the same ops, shapes and roundings as the op-by-op loop in layers/moe.py (gate/up and down
// results in h's dtype; SwiGLU as silu(g) * u in h's dtype; SiTU in fp32, rounded once). A stacked weight is (W)
// dense [E, N, K], (packed, scales) MXFP4 or (q, scales) int8. The shared expert, when given ([N, K] dense or int8,
// the widths of a routed one), runs on all tokens in the same passes and comes back apart, as GatedMLP computes it.
// All gate/up products run as one parallel pass, then all down products as another (two thread fork-joins per
// layer), each expert's weights read once for all its tokens, each row computed exactly as gemv computes it.
namespace {
using WeightSets = std::array<at::TensorList, 2>;

// y[a] = W_{expert of a} x[a] for every input row a: each expert's weights read once for all its rows, every group
// in one parallel pass over their output rows; y [rows, N] in `dtype` (fp32 or bf16), each value rounded once.
torch::Tensor experts_product(const WeightSets& w, const std::vector<Group>& groups, const Inputs& x,
                              c10::ScalarType dtype) {
  const int64_t N = w[0][0].size(-2);
  for (const auto& set : w) {
    if (set.empty()) continue;
    TORCH_CHECK(set[0].dim() >= 2 && set[0].dim() <= 3 && set[0].is_contiguous() &&
                (set.size() == 1 || set[1].is_contiguous()) && set[0].size(-2) == N,
                "expert weights must be contiguous, stacked [E, N, ...] or one [N, ...], N alike");
  }
  for (const auto& g : groups)
    TORCH_CHECK(g.expert >= 0 && g.expert < (w[g.set][0].dim() == 3 ? w[g.set][0].size(0) : 1),
                "expert id out of range");
  auto y = torch::empty({x.rows(), N}, torch::TensorOptions().dtype(dtype));
  const int64_t G = groups.size();
  auto run = [&](auto* out) {
    balanced_for(G * N, 16, [&](int64_t t0, int64_t t1) {
      while (t0 < t1) {                       // split the range at group boundaries
        const Group& g = groups[t0 / N];
        const int64_t n0 = t0 % N, n1 = std::min(N, n0 + (t1 - t0));
        auto* yg = out + g.begin * N;
        with_rows(g.end - g.begin, [&](auto m) { group_rows<decltype(m)::value>(w[g.set], g, x, n0, n1, yg); });
        t0 += n1 - n0;
      }
    });
  };
  if (dtype == torch::kBFloat16) run(y.data_ptr<at::BFloat16>());
  else run(y.data_ptr<float>());
  return y;
}
}  // namespace

namespace {
// The experts' activation of [gate | up] rows in their dtype, as layers/mlp.py computes it: SwiGLU silu(g) * u, or SiTU
// in fp32, rounded once. Elementwise, row by row (rows stay I long: the same vector/tail split); but ATen splits an op
// of over GRAIN_SIZE elements among threads at any element, where an element's last bit can change (scalar vs vector
// code), so callers give it the rows the loop gives each call, or run it sequentially where each of the loop's calls
// is under that size.
torch::Tensor gated_act(const torch::Tensor& gate_up, bool situ, double beta, double linear_beta) {
  const int64_t I = gate_up.size(1) / 2;
  const auto gate = gate_up.narrow(1, 0, I), up = gate_up.narrow(1, I, I);
  if (!situ) return torch::silu(gate) * up;
  const auto gf = gate.to(torch::kFloat), uf = up.to(torch::kFloat);
  return (beta * torch::tanh(gf / beta) * torch::sigmoid(gf) * (linear_beta * torch::tanh(uf / linear_beta)))
      .to(gate_up.scalar_type());
}

// Token-to-expert assignments a = n k + j (ids [N, k]) grouped by expert: slot[r] is the assignment at row r, experts
// in ascending order and each expert's assignments in slot order, expert e's rows [begin[e], begin[e + 1]); at[n k + i]
// is the row of token n's i-th smallest expert; k assignments a token.
struct ByExpert {
  int64_t k;
  std::vector<int64_t> slot, begin, at;
  ByExpert(const torch::Tensor& ids, int64_t E)
      : k(ids.size(1)), slot(ids.numel()), begin(E + 1, 0), at(ids.numel()) {
    const auto id = ids.contiguous();
    const int64_t* e_of = id.data_ptr<int64_t>();
    const int64_t A = ids.numel();
    for (int64_t a = 0; a < A; ++a) {
      TORCH_CHECK(e_of[a] >= 0 && e_of[a] < E, "expert id out of range");
      ++begin[e_of[a] + 1];
    }
    for (int64_t e = 0; e < E; ++e) begin[e + 1] += begin[e];
    std::vector<int64_t> next(begin.begin(), begin.end() - 1), filled(ids.size(0), 0);
    for (int64_t a = 0; a < A; ++a) slot[next[e_of[a]]++] = a;
    for (int64_t r = 0; r < A; ++r) at[slot[r] / k * k + filled[slot[r] / k]++] = r;
  }
  // h's rows in this order, each row's token, then tokens 0..then_each-1 (a plain copy: an index_select of a decode
  // step's few rows costs more in ATen's dispatch than in copying)
  torch::Tensor rows_of(const torch::Tensor& h, int64_t then_each = 0) const {
    const auto src = h.contiguous();
    const int64_t A = slot.size(), bytes = h.size(1) * h.element_size();
    auto x = torch::empty({A + then_each, h.size(1)}, h.options());
    const char* from = static_cast<const char*>(src.data_ptr());
    char* to = static_cast<char*>(x.data_ptr());
    for (int64_t r = 0; r < A; ++r) std::memcpy(to + r * bytes, from + slot[r] / k * bytes, bytes);
    std::memcpy(to + A * bytes, from, then_each * bytes);
    return x;
  }
};

// out[n] = token n's expert results down[r], each times its routing weight in fp32 and rounded, added in T in
// ascending expert order: what the loop's index_add_ per expert rounds (summing a token's experts in fp32 and rounding
// once would differ). down [A, R] and out [N, R] in h's dtype T; parallel over tokens.
template <typename T>
void weighted_sums(const ByExpert& by, const T* down, const float* weights, int64_t N, int64_t R, T* out) {
  const int64_t k = by.k;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      T* sum = out + n * R;
      std::fill(sum, sum + R, T(0.f));
      for (int64_t i = 0; i < k; ++i) {
        const int64_t r = by.at[n * k + i];
        const T* dr = down + r * R;
        const float weight = weights[by.slot[r]];
        for (int64_t c = 0; c < R; ++c) sum[c] = T(to_float(sum[c]) + round_to<T>(to_float(dr[c]) * weight));
      }
    }
  });
}

torch::Tensor weighted_sums(const ByExpert& by, const torch::Tensor& down, const torch::Tensor& weights,
                            const torch::Tensor& h) {
  TORCH_CHECK(down.scalar_type() == h.scalar_type(), "expert results must be in h's dtype");
  const int64_t N = h.size(0), R = h.size(1);
  auto out = torch::empty({N, R}, h.options());
  const auto w = weights.contiguous();
  if (h.scalar_type() == torch::kFloat)
    weighted_sums<float>(by, down.data_ptr<float>(), w.data_ptr<float>(), N, R, out.data_ptr<float>());
  else
    weighted_sums<at::BFloat16>(by, down.data_ptr<at::BFloat16>(), w.data_ptr<float>(), N, R,
                                out.data_ptr<at::BFloat16>());
  return out;
}
}  // namespace

std::tuple<torch::Tensor, torch::Tensor> routed_experts(
    const torch::Tensor& h, const torch::Tensor& ids, const torch::Tensor& weights, at::TensorList w13,
    at::TensorList w2, bool situ, double beta, double linear_beta, at::TensorList shared_gate_up,
    at::TensorList shared_down) {
  TORCH_CHECK(h.dim() == 2 && h.size(0) >= 1 && h.size(0) <= kMaxRows, "h must be [1..", kMaxRows, ", R]");
  TORCH_CHECK(h.scalar_type() == torch::kFloat || h.scalar_type() == torch::kBFloat16, "h must be float32 or bfloat16");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == h.size(0) && ids.scalar_type() == torch::kLong,
              "ids must be int64 [N, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == torch::kFloat, "weights must be fp32 [N, k]");
  TORCH_CHECK(shared_gate_up.empty() == shared_down.empty(), "the shared expert needs both its gate/up and down");
  const auto dtype = h.scalar_type();
  const int64_t A = ids.numel(), B = h.size(0), R = h.size(1);
  const bool shared = !shared_gate_up.empty();
  const ByExpert by(ids, w13[0].size(0));
  std::vector<Group> groups;                             // a token's experts are distinct: at most 8 rows a group
  for (int64_t e = 0; e + 1 < int64_t(by.begin.size()); ++e)
    if (by.begin[e + 1] > by.begin[e]) groups.push_back({e, by.begin[e], by.begin[e + 1], 0});
  if (shared) groups.push_back({0, A, A + B, 1});
  // input rows: each assignment's token, then every token once for the shared expert
  int64_t widest = 0;
  for (const auto& g : groups) widest = std::max(widest, g.end - g.begin);
  const auto gate_up = experts_product({w13, shared_gate_up}, groups,
                                       Inputs(by.rows_of(h, shared ? B : 0), w13[0], widest), dtype);
  const auto act = [&] {             // the loop's per-expert calls (at most 8 rows each) run on one thread
    c10::ParallelGuard sequential(true);
    return gated_act(gate_up, situ, beta, linear_beta);
  }();
  const auto down = experts_product({w2, shared_down}, groups, Inputs(act, w2[0], widest), dtype);   // [A (+ B), R]
  TORCH_CHECK(down.size(1) == R, "w2 experts must map back to h's width ", R);
  const auto out = weighted_sums(by, down, weights, h);
  return {out, shared ? down.narrow(0, A, B) : torch::empty({0, R}, h.options())};     // the shared expert's rows
}

// The routed experts of a prefill chunk (any number of tokens), dense weights [E, 2I, R] and [E, R, I] in h's dtype:
// MoE.experts's loop without its per-expert Python. Each expert's rows through the product layers/linear.py's `linear`
// picks for them (gemv up to kMaxRows rows; else ATen's, in fp32 from widen_from_rows rows on if given) and the
// activation, each result times its routing weight in fp32, rounded, and added to its token's running sum in h's dtype
// in ascending expert order: bit for bit the loop's results.
torch::Tensor routed_experts_prefill(const torch::Tensor& h, const torch::Tensor& ids, const torch::Tensor& weights,
                                     const torch::Tensor& w13, const torch::Tensor& w2, bool situ, double beta,
                                     double linear_beta, std::optional<int64_t> widen_from_rows) {
  TORCH_CHECK(h.dim() == 2 && (h.scalar_type() == torch::kFloat || h.scalar_type() == torch::kBFloat16),
              "h must be [N, R] float32 or bfloat16");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == h.size(0) && ids.scalar_type() == torch::kLong,
              "ids must be int64 [N, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == torch::kFloat, "weights must be fp32 [N, k]");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous() &&
              w13.scalar_type() == h.scalar_type() && w2.scalar_type() == h.scalar_type() &&
              w13.size(2) == h.size(1) && w2.size(1) == h.size(1) && w13.size(1) == 2 * w2.size(2) &&
              w2.size(0) == w13.size(0), "experts must be contiguous [E, 2I, R] and [E, R, I] in h's dtype");
  const int64_t A = ids.numel(), E = w13.size(0), R = h.size(1);
  const ByExpert by(ids, E);
  const auto rows = by.rows_of(h);
  auto product = [&](const torch::Tensor& x, const torch::Tensor& W) {
    if (x.size(0) <= kMaxRows) return gemv(x, W, false);
    if (widen_from_rows && x.scalar_type() == torch::kBFloat16 && x.size(0) >= *widen_from_rows)
      return at::linear(x.to(torch::kFloat), W.to(torch::kFloat)).to(x.scalar_type());
    return at::linear(x, W);
  };
  auto down = torch::empty({A, R}, h.options());
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = by.begin[e], n = by.begin[e + 1] - begin;
    if (n)
      down.narrow(0, begin, n)
          .copy_(product(gated_act(product(rows.narrow(0, begin, n), w13[e]), situ, beta, linear_beta), w2[e]));
  }
  return weighted_sums(by, down, weights, h);
}

// One decode step of latent attention (MLA, absorbed form; layers/mla.py) for a batch whose rows live in cache slots:
// folds W_UK into each head's query, writes row b's new latent at position positions[b] of slot slots[b], attends
// over positions 0..positions[b] of that slot, and applies W_UV to each head's context. As the op-by-op form rounds:
// the absorbed query to q's dtype; scores to it, then scaled in it; softmax in fp32, the probabilities rounded to
// q's dtype; the context summed in fp32 and rounded once; the output rounded once. Reading the cache in
// place, per row's own length, is what lets a compiled decode step keep static shapes.
namespace {

// Query heads a score tile holds and cache rows it reads at once (each row load serves G heads, each query load J
// rows), and context accumulators a task keeps in registers (AVX2: 16 ymm, AVX-512: 32 zmm).
constexpr int kScoreHeads = kAvx512 ? 8 : 4, kScoreRows = kAvx512 ? 3 : 1, kContextVecs = kAvx512 ? 16 : 4;

// out[g * stride + j] = q[g] . rows[j] for G query rows (heads, C apart) and J cache rows. Each sum is 16 lane-wise
// FMA chains over the columns, reduced, then the scalar tail: the same for every G and J.
template <typename CT, int G, int J>
void score_tile(const float* q, int64_t C, const CT* const* rows, float* out, int64_t stride) {
  V16 acc[G][J];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < J; ++j) acc[g][j] = zero();
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    V16 r[J];
    for (int j = 0; j < J; ++j) {
      prefetch_ahead(rows[j] + c);
      r[j] = load(raw(rows[j] + c));
    }
    for (int g = 0; g < G; ++g) {
      V16 qv = load(q + g * C + c);
      in_register(qv);                    // loaded once for the J rows, not folded into each FMA (see dense_block)
      for (int j = 0; j < J; ++j) acc[g][j] = fma(qv, r[j], acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < J; ++j) {
      float sum = hsum(acc[g][j]);
      for (int64_t k = c; k < C; ++k) sum += q[g * C + k] * to_float(rows[j][k]);
      out[g * stride + j] = sum;
    }
}

template <typename CT, int J>
void score_rows(const float* q, int64_t H, int64_t C, const CT* const* rows, float* out, int64_t stride) {
  int64_t h = 0;
  for (; h + kScoreHeads <= H; h += kScoreHeads)
    score_tile<CT, kScoreHeads, J>(q + h * C, C, rows, out + h * stride, stride);
  if constexpr (kScoreHeads > 4)
    for (; h + 4 <= H; h += 4) score_tile<CT, 4, J>(q + h * C, C, rows, out + h * stride, stride);
  for (; h < H; ++h) score_tile<CT, 1, J>(q + h * C, C, rows, out + h * stride, stride);
}

// out[g][c0 + k] = sum_j p[g * Lp + j] row_j[c0 + k] for G heads and n <= 16 NC columns, summed over j in order. A
// task reads 16 NC consecutive floats of each row (rows are C apart), so the cache streams in runs, not single lines.
template <typename QT, typename CT, int G, int NC>
void context_heads(const float* p, int64_t Lp, int64_t L, const CT* rows, int64_t C, int64_t c0, int64_t n, QT* out,
                   int64_t rank) {
  V16 acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NC; ++i) acc[g][i] = zero();
  alignas(64) float part[16 * NC] = {}, sums[16];
  constexpr int64_t kLine = 64 / sizeof(CT);
  for (int64_t j = 0; j < L; ++j) {
    const CT* row = rows + j * C + c0;
    for (int64_t k = 0; k < 16 * NC; k += kLine)      // rows are C apart: ahead of the hardware's guess
      _mm_prefetch((const char*)(row + 16 * C + k), _MM_HINT_T0);
    V16 v[NC];
    if (n == 16 * NC) {
      for (int i = 0; i < NC; ++i) v[i] = load(raw(row + 16 * i));
    } else {                                       // a last partial block: lanes past n stay zero
      for (int64_t k = 0; k < n; ++k) part[k] = to_float(row[k]);
      for (int i = 0; i < NC; ++i) v[i] = load(part + 16 * i);
    }
    for (int g = 0; g < G; ++g) {
      const V16 pg = set1(p[g * Lp + j]);
      for (int i = 0; i < NC; ++i) acc[g][i] = fma(pg, v[i], acc[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NC && 16 * i < n; ++i) {
      store(sums, acc[g][i]);
      for (int64_t k = 0; k < std::min<int64_t>(16, n - 16 * i); ++k) out[g * rank + c0 + 16 * i + k] = QT(sums[k]);
    }
}

template <typename QT, typename CT>
void mla_rows(const QT* query, CT* cache, const QT* latent, const int64_t* slots, const int64_t* positions, int64_t B,
              int64_t H, int64_t C, int64_t slot_stride, float scale, int64_t rank, QT* out) {
  int64_t Lmax = 0;
  for (int64_t b = 0; b < B; ++b) {
    CT* at = cache + slots[b] * slot_stride + positions[b] * C;
    for (int64_t c = 0; c < C; ++c) at[c] = CT(to_float(latent[b * C + c]));
    Lmax = std::max(Lmax, positions[b] + 1);
  }
  auto row_of = [&](int64_t b, int64_t j) -> const CT* { return cache + slots[b] * slot_stride + j * C; };
  const int64_t Lp = (Lmax + 15) / 16 * 16;
  std::unique_ptr<float[]> p(new float[B * H * Lp]);      // scores, then probabilities [B, H, Lp]
  // scores: a task is 16 positions of one row, every head; kScoreRows cache rows at a time share each query load
  constexpr int64_t kBlock = 16;
  const int64_t blocks = (Lmax + kBlock - 1) / kBlock;
  const V16 scale_v = set1(scale);
  // A bf16 query and cache on a CPU with AMX: a block's scores for 8 heads at a time as one tile product (the cache
  // rows as the weight tiles, the heads as the inputs, in amx_rows's pair layout); the FMA form is bound by its
  // arithmetic once the cache is in L2 (long contexts, many heads).
  std::vector<uint32_t> head_pairs;
  [[maybe_unused]] auto tile_scores = [&](int64_t b, int64_t j0, int64_t j1) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<QT, at::BFloat16> && std::is_same_v<CT, at::BFloat16>) {
      for (int64_t h = 0; h < H; h += 8)
        with_rows(std::min<int64_t>(8, H - h), [&](auto m) {
          amx_rows<float, decltype(m)::value>(&head_pairs[b * C / 2 * H + h], H, C, raw(row_of(b, 0)), j0, j1,
                                              &p[(b * H + h) * Lp], Lp);
        });
    }
#endif
  };
  const bool tiles = kAmx && std::is_same_v<QT, at::BFloat16> && std::is_same_v<CT, at::BFloat16> && C % 32 == 0;
  std::vector<float> q;                                  // else the queries in fp32
  if (tiles) {                                           // [B][C/2 pairs][H]
    head_pairs.resize(B * C / 2 * H);
    const auto* qb = reinterpret_cast<const uint16_t*>(query);
    for (int64_t b = 0; b < B; ++b) pack_pairs(qb + b * H * C, H, C, &head_pairs[b * C / 2 * H]);
  } else {
    q.resize(B * H * C);
    for (int64_t i = 0; i < B * H * C; ++i) q[i] = to_float(query[i]);
  }
  at::parallel_for(0, B * blocks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / blocks, j0 = t % blocks * kBlock, j1 = std::min(j0 + kBlock, positions[b] + 1);
      if (j1 <= j0) continue;                                // past this row's length
      if (t == t0 || j0 == 0) prefetch_start(row_of(b, j0), (positions[b] + 1 - j0) * C * int64_t(sizeof(CT)));
      int64_t j = j0;
      if (tiles) {
        tile_scores(b, j0, j1);
        j = j1;
      }
      for (; j + kScoreRows <= j1; j += kScoreRows) {
        const CT* rows[kScoreRows];
        for (int i = 0; i < kScoreRows; ++i) rows[i] = row_of(b, j + i);
        score_rows<CT, kScoreRows>(&q[b * H * C], H, C, rows, &p[b * H * Lp + j], Lp);
      }
      for (; j < j1; ++j) {
        const CT* rows[1] = {row_of(b, j)};
        score_rows<CT, 1>(&q[b * H * C], H, C, rows, &p[b * H * Lp + j], Lp);
      }
      for (int64_t h = 0; h < H; ++h) {                     // rounded to the query's dtype, scaled in it
        float* s = &p[(b * H + h) * Lp + j0];
        store_n(s, j1 - j0, round_vec<QT>(round_vec<QT>(load_n(s, j1 - j0)) * scale_v));
      }
    }
  });
  // softmax over each row's positions for each head as torch computes it, exp(x - max) * (1 / sum); a head's scores
  // are contiguous, 16 positions to a vector
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t L = positions[t / H] + 1, full = L / 16 * 16, n = L - full;
      float* s = &p[t * Lp];
      V16 top = set1(-INFINITY), sum = zero();
      for (int64_t j = 0; j < full; j += 16) top = vmax(top, load(s + j));
      float best = hmax(top);
      for (int64_t j = full; j < L; ++j) best = std::max(best, s[j]);
      top = set1(best);
      for (int64_t j = 0; j < full; j += 16) {
        const V16 e = exp16(load(s + j) - top);
        store(s + j, e);
        sum = sum + e;
      }
      if (n) {                                       // the last partial vector: lanes past n add nothing
        store_n(s + full, n, exp16(load_n(s + full, n) - top));
        sum = sum + load_n(s + full, n);
      }
      const V16 inv = set1(1.f / hsum(sum));
      for (int64_t j = 0; j < L; j += 16) store_n(s + j, L - j, round_vec<QT>(load_n(s + j, L - j) * inv));
    }
  });
  // context: a task is G heads (the most of 16, 8, 4, 2, 1 that H allows, within the register budget) by 16 NC latent
  // columns of one row, NC the vectors of accumulators the budget leaves each head, or 1 where that would leave a
  // thread fewer than two tasks
  auto context = [&](auto group, auto vecs) {
    constexpr int G = decltype(group)::value, NC = decltype(vecs)::value;
    const int64_t width = 16 * NC, col_blocks = (rank + width - 1) / width, head_groups = (H + G - 1) / G;
    at::parallel_for(0, B * col_blocks * head_groups, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / (col_blocks * head_groups), c0 = t / head_groups % col_blocks * width;
        const int64_t n = std::min(width, rank - c0), L = positions[b] + 1;
        int64_t h = t % head_groups * G;
        const int64_t h1 = std::min<int64_t>(h + G, H);
        const float* pb = &p[b * H * Lp];
        const CT* rows = row_of(b, 0);
        QT* ob = out + b * H * rank;
        for (; h + G <= h1; h += G) context_heads<QT, CT, G, NC>(pb + h * Lp, Lp, L, rows, C, c0, n, ob + h * rank, rank);
        for (; h < h1; ++h) context_heads<QT, CT, 1, NC>(pb + h * Lp, Lp, L, rows, C, c0, n, ob + h * rank, rank);
      }
    });
  };
  auto widest = [&](auto group) {
    constexpr int G = decltype(group)::value, NC = kContextVecs / G;
    const int64_t tasks = B * ((rank + 16 * NC - 1) / (16 * NC)) * ((H + G - 1) / G);
    if (NC > 1 && tasks < 2 * at::get_num_threads()) context(group, std::integral_constant<int, 1>{});
    else context(group, std::integral_constant<int, NC>{});
  };
  if (kAvx512 && H >= 16) widest(std::integral_constant<int, kAvx512 ? 16 : 1>{});
  else if (kAvx512 && H >= 8) widest(std::integral_constant<int, kAvx512 ? 8 : 1>{});
  else if (H >= 4) widest(std::integral_constant<int, 4>{});
  else if (H >= 2) widest(std::integral_constant<int, 2>{});
  else widest(std::integral_constant<int, 1>{});
}
}  // namespace

namespace {
// y[b * y_row + h * y_head + n] = W_h x[b, h] for n in [0, N) of every head h, rounded to T: the absorbed products
// of latent attention (W_h: [N, K] rows, heads W.stride(0) apart; x[b, h, k] at b * xs[0] + h * xs[1] + k * xs[2]),
// one task per head, each row as gemv computes it.
template <typename T>
void per_head_products(const torch::Tensor& W, int64_t B, int64_t H, const T* x, std::array<int64_t, 3> xs, int64_t K,
                       T* y, int64_t y_row, int64_t y_head) {
  const int64_t N = W.size(1);
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> rows(B * K);
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t b = 0; b < B; ++b)
        for (int64_t k = 0; k < K; ++k) rows[b * K + k] = to_float(x[b * xs[0] + h * xs[1] + k * xs[2]]);
      const char* base = static_cast<const char*>(W.data_ptr()) + h * W.stride(0) * W.element_size();
      with_rows(B, [&](auto m) {
        constexpr int M = decltype(m)::value;
        if (W.scalar_type() == torch::kBFloat16)
          dense_rows<uint16_t, T, M>(rows.data(), K, reinterpret_cast<const uint16_t*>(base), 0, N, y + h * y_head,
                                     y_row);
        else
          dense_rows<float, T, M>(rows.data(), K, reinterpret_cast<const float*>(base), 0, N, y + h * y_head, y_row);
      });
    }
  });
}
}  // namespace

torch::Tensor mla_decode(const torch::Tensor& q, const torch::Tensor& w_uk, const torch::Tensor& w_uv,
                         torch::Tensor cache, const torch::Tensor& latent, const torch::Tensor& slots,
                         const torch::Tensor& positions, double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [B, H, nope + rope]");
  const int64_t B = q.size(0), H = q.size(1), C = cache.size(2);
  TORCH_CHECK(B >= 1 && B <= kMaxRows, "q must have 1..", kMaxRows, " rows");
  TORCH_CHECK(w_uk.dim() == 3 && w_uk.size(0) == H && w_uk.is_contiguous() && w_uv.dim() == 3 && w_uv.size(0) == H &&
              w_uv.stride(2) == 1 && w_uv.stride(1) == w_uv.size(2) && w_uk.scalar_type() == w_uv.scalar_type() &&
              (w_uk.scalar_type() == torch::kFloat || w_uk.scalar_type() == torch::kBFloat16),
              "w_uk must be contiguous [H, rank, nope] and w_uv [H, v, rank] (each head's rows contiguous), "
              "float32 or bfloat16");
  const int64_t rank = w_uk.size(1), nope = w_uk.size(2), rope = q.size(2) - nope, V = w_uv.size(1);
  TORCH_CHECK(w_uv.size(2) == rank && rope >= 0 && C == rank + rope, "widths: the cache holds rank + rope columns");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous(), "cache must be contiguous [slots, L, C]");
  TORCH_CHECK(latent.dim() == 2 && latent.size(0) == B && latent.size(1) == C && latent.is_contiguous() &&
              latent.scalar_type() == q.scalar_type(), "latent must be contiguous [B, C] in q's dtype");
  for (const auto* t : {&slots, &positions})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == B && t->scalar_type() == torch::kLong && t->is_contiguous(),
                "slots and positions must be int64 [B]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < cache.size(0) && pos[b] >= 0 && pos[b] < cache.size(1),
                "slot ", slot[b], " / position ", pos[b], " outside the cache");
  check_distinct(slot, B);
  const auto qt = q.scalar_type(), ct = cache.scalar_type();
  TORCH_CHECK((qt == torch::kFloat || qt == torch::kBFloat16) && (ct == torch::kFloat || ct == torch::kBFloat16),
              "q and cache must be float32 or bfloat16");
  TORCH_CHECK(!(qt == torch::kFloat && ct == torch::kBFloat16), "an fp32 query needs an fp32 cache");
  auto out = torch::empty({B, H * V}, q.options());
  auto run = [&](auto q_type, auto c_type) {
    using QT = decltype(q_type);
    using CT = decltype(c_type);
    const QT* qp = q.data_ptr<QT>();
    const int64_t sb = q.stride(0), sh = q.stride(1), sc = q.stride(2);
    // the query: W_UK folded into its no-position part (rounded to q's dtype, as the op-by-op product), then k_pe's
    std::vector<QT> query(B * H * C), ctx(B * H * rank);
    per_head_products<QT>(w_uk, B, H, qp, {sb, sh, sc}, nope, query.data(), H * C, C);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t k = 0; k < rope; ++k) query[(b * H + h) * C + rank + k] = qp[b * sb + h * sh + (nope + k) * sc];
    mla_rows<QT, CT>(query.data(), cache.data_ptr<CT>(), latent.data_ptr<QT>(), slot, pos, B, H, C, cache.stride(0),
                     float(scale), rank, ctx.data());
    // W_UV applied to each head's context
    per_head_products<QT>(w_uv, B, H, ctx.data(), {H * rank, rank, 1}, rank, out.data_ptr<QT>(), H * V, V);
  };
  if (qt == torch::kFloat) run(float{}, float{});
  else if (ct == torch::kFloat) run(at::BFloat16{}, float{});
  else run(at::BFloat16{}, at::BFloat16{});
  return out;
}

// The inputs of chunked KDA for a prefill, from its projections, in the layout chunk_prepare takes ([B, H, n, C, *],
// rows past T zero), one chunk of one head a task, as layers/kda.py computes them op by op: the causal depthwise
// conv over the window [carried W-1 inputs | T new ones] (fp32, taps [W, 3P]), SiLU rounded to the activations'
// dtype, q and k L2-normalised (then q scaled), v; the log-decay from the forget-gate input f + dt_bias; beta =
// sigmoid of its logit. Replaces a conv, a dozen elementwise ops and the copies into chunks (bench-s: ~5 of a KDA
// layer's 10 ms a 512-token chunk).
namespace {
template <typename T>
void chunk_inputs_typed(const torch::Tensor& window, const torch::Tensor& taps, const torch::Tensor& f,
                        const float* dt_bias, const float* decay, float lower_bound, bool per_channel,
                        const torch::Tensor& beta_logit, float scale, int64_t C, std::vector<torch::Tensor>& out) {
  const int64_t B = f.size(0), T_ = f.size(1), H = beta_logit.size(2), P = f.size(2), K = P / H, W = taps.size(0);
  const int64_t n = (T_ + C - 1) / C;
  const T* win = window.data_ptr<T>();
  const T* fp = f.data_ptr<T>();
  const T* bp = beta_logit.data_ptr<T>();
  const float* tp = taps.data_ptr<float>();
  float *q = out[0].data_ptr<float>(), *k = out[1].data_ptr<float>(), *v = out[2].data_ptr<float>();
  float *g = out[3].data_ptr<float>(), *beta = out[4].data_ptr<float>();
  const int64_t ws0 = window.stride(0), ws1 = window.stride(1), fs0 = f.stride(0), fs1 = f.stride(1);
  const int64_t bs0 = beta_logit.stride(0), bs1 = beta_logit.stride(1);
  at::parallel_for(0, B * H * n, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> x(3 * K);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / (H * n), h = task / n % H, c = task % n;
      for (int64_t r = 0; r < C; ++r) {
        const int64_t t = c * C + r, row = task * C + r, at = row * K;
        if (t >= T_) {
          std::fill(q + at, q + at + K, 0.f), std::fill(k + at, k + at + K, 0.f), std::fill(v + at, v + at + K, 0.f);
          std::fill(g + at, g + at + K, 0.f), beta[row] = 0.f;
          continue;
        }
        for (int part = 0; part < 3; ++part)
          for (int64_t i = 0; i < K; i += 16) {
            const int64_t ch = part * P + h * K + i;
            V16 acc = zero();
            for (int64_t j = 0; j < W; ++j)
              acc = fma(load(raw(win + b * ws0 + (t + j) * ws1 + ch)), load(tp + j * 3 * P + ch), acc);
            store(&x[part * K + i], round_vec<T>(acc * sigmoid16(acc)));
          }
        for (int part = 0; part < 2; ++part) {             // L2 norms of q and k
          float* y = &x[part * K];
          V16 ss = zero();
          for (int64_t i = 0; i < K; i += 16) ss = fma(load(y + i), load(y + i), ss);
          const V16 inv = set1(1.f / std::sqrt(hsum(ss) + 1e-6f));
          for (int64_t i = 0; i < K; i += 16) store(y + i, load(y + i) * inv);
        }
        for (int64_t i = 0; i < K; i += 16) {
          store(q + at + i, load(&x[i]) * set1(scale));
          store(k + at + i, load(&x[K + i]));
          store(v + at + i, load(&x[2 * K + i]));
          const V16 fr = load(raw(fp + b * fs0 + t * fs1 + h * K + i)) + load(dt_bias + h * K + i);
          const V16 rate = per_channel ? load(decay + i) : set1(decay[h]);
          store(g + at + i, log_decay16(fr, rate, lower_bound));
        }
        beta[row] = sigmoid(to_float(bp[b * bs0 + t * bs1 + h]));
      }
    }
  });
}
}  // namespace

std::vector<torch::Tensor> kda_chunk_inputs(const torch::Tensor& window, const torch::Tensor& taps,
                                            const torch::Tensor& f, const torch::Tensor& dt_bias,
                                            const torch::Tensor& decay, double lower_bound, bool per_channel,
                                            const torch::Tensor& beta_logit, double scale, int64_t chunk) {
  TORCH_CHECK(f.dim() == 3 && beta_logit.dim() == 3 && window.dim() == 3 && taps.dim() == 2,
              "f [B, T, P], beta_logit [B, T, H], window [B, T + W - 1, 3P], taps [W, 3P]");
  const int64_t B = f.size(0), T = f.size(1), P = f.size(2), H = beta_logit.size(2), W = taps.size(0);
  TORCH_CHECK(H > 0 && P % H == 0 && (P / H) % 16 == 0, "head width must be a multiple of 16");
  TORCH_CHECK(beta_logit.size(0) == B && beta_logit.size(1) == T && window.size(0) == B &&
              window.size(1) == T + W - 1 && window.size(2) == 3 * P && taps.size(1) == 3 * P, "shapes disagree");
  TORCH_CHECK(f.stride(2) == 1 && beta_logit.stride(2) == 1 && window.stride(2) == 1 && taps.is_contiguous() &&
              taps.scalar_type() == torch::kFloat, "rows must be contiguous; taps contiguous float32");
  TORCH_CHECK(f.scalar_type() == window.scalar_type() && beta_logit.scalar_type() == window.scalar_type() &&
              (f.scalar_type() == torch::kFloat || f.scalar_type() == torch::kBFloat16),
              "f, beta_logit and window in one dtype, float32 or bfloat16");
  TORCH_CHECK(chunk > 0 && T > 0, "chunk and T must be positive");
  const int64_t K = P / H;
  TORCH_CHECK(decay.numel() == (per_channel ? K : H), "decay rates: one per ", per_channel ? "key channel" : "head");
  const int64_t n = (T + chunk - 1) / chunk;
  const auto opts = f.options().dtype(torch::kFloat);
  std::vector<torch::Tensor> out;
  for (int i = 0; i < 4; ++i) out.push_back(torch::empty({B, H, n, chunk, K}, opts));
  out.push_back(torch::empty({B, H, n, chunk}, opts));
  const auto dt = dt_bias.to(torch::kFloat).contiguous(), dec = decay.to(torch::kFloat).contiguous();
  if (f.scalar_type() == torch::kBFloat16)
    chunk_inputs_typed<at::BFloat16>(window, taps, f, dt.data_ptr<float>(), dec.data_ptr<float>(), float(lower_bound),
                                     per_channel, beta_logit, float(scale), chunk, out);
  else
    chunk_inputs_typed<float>(window, taps, f, dt.data_ptr<float>(), dec.data_ptr<float>(), float(lower_bound),
                              per_channel, beta_logit, float(scale), chunk, out);
  return out;
}

// The part of chunked KDA that is parallel over chunks (ops/delta_rule.py chunk_prepare, same math), one chunk of one
// head a task, everything in fp32 and in registers or a task's scratch: q (already scaled), k, g [.., C, K], v
// [.., C, V], beta [.., C] -> w, u (the UT transform of beta exp(G) k and beta v), q exp(G), exp(G_last - G) k,
// exp(G_last) [.., K, 1] and A_qk [.., C, C] (lower triangle, diagonal included), G = cumsum(g) in the chunk. The
// intra-chunk scores go through the reference point at the end of the previous sub-chunk of 16 rows (as fla's
// kernels do), since exp(-G) alone overflows under strong decay; only the diagonal blocks are formed pairwise. A dot
// product of two rows is 16 lane-wise FMA chains, reduced; the triangular solve is forward substitution.
namespace {
inline float dot(const float* a, const float* b, int64_t K) {
  V16 acc = zero();
  for (int64_t d = 0; d < K; d += 16) acc = fma(load(a + d), load(b + d), acc);
  return hsum(acc);
}

struct ChunkOut { float *w, *u, *q_decayed, *k_to_end, *end_decay, *A_qk; };

void prepare_chunk(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t C,
                   int64_t K, int64_t V, int64_t sub, const ChunkOut& o, float* scratch) {
  float *G = scratch, *eG = G + C * K, *A_kk = eG + C * K, *rows = A_kk + C * C, *cols = rows + 2 * sub * K;
  for (int64_t d = 0; d < K; ++d) {          // inclusive cumulative log-decay, summed in double as torch.cumsum does
    double run = 0;
    for (int64_t r = 0; r < C; ++r) G[r * K + d] = float(run += g[r * K + d]);
  }
  for (int64_t i = 0; i < C * K; i += 16) store(eG + i, exp16(load(G + i)));
  std::fill(A_kk, A_kk + C * C, 0.f);
  std::fill(o.A_qk, o.A_qk + C * C, 0.f);
  for (int64_t r0 = 0; r0 < C; r0 += sub) {
    const float* ref = r0 ? G + (r0 - 1) * K : nullptr;    // block 0: the chunk's start, log-decay 0
    auto rel = [&](int64_t r, int64_t d) { return ref ? load(G + r * K + d) - load(ref + d) : load(G + r * K + d); };
    for (int64_t r = r0; r < r0 + sub; ++r)               // the block's k and q rows decayed from the reference
      for (int64_t d = 0; d < K; d += 16) {
        const V16 e = exp16(rel(r, d));
        store(rows + (r - r0) * K + d, load(k + r * K + d) * e);
        store(rows + (sub + r - r0) * K + d, load(q + r * K + d) * e);
      }
    for (int64_t j = 0; j < r0; ++j)                      // earlier columns decayed up to the reference
      for (int64_t d = 0; d < K; d += 16)
        store(cols + j * K + d, exp16(set1(0.f) - rel(j, d)) * load(k + j * K + d));
    for (int64_t r = r0; r < r0 + sub; ++r) {
      for (int64_t j = 0; j < r0; ++j) {
        A_kk[r * C + j] = dot(rows + (r - r0) * K, cols + j * K, K);
        o.A_qk[r * C + j] = dot(rows + (sub + r - r0) * K, cols + j * K, K);
      }
      for (int64_t j = r0; j <= r; ++j) {                 // the diagonal block, pair by pair: exp(G_r - G_j) <= 1
        V16 kk = zero(), qk = zero();
        for (int64_t d = 0; d < K; d += 16) {
          const V16 pair = exp16(load(G + r * K + d) - load(G + j * K + d)) * load(k + j * K + d);
          kk = fma(pair, load(k + r * K + d), kk);
          qk = fma(pair, load(q + r * K + d), qk);
        }
        A_kk[r * C + j] = hsum(kk), o.A_qk[r * C + j] = hsum(qk);
      }
    }
  }
  // (I + tril(beta_r A_kk, -1)) [w | u] = beta [exp(G) k | v], row by row
  for (int64_t r = 0; r < C; ++r) {
    const V16 b = set1(beta[r]);
    auto substitute = [&](float* x, int64_t width, auto rhs) {
      for (int64_t d = 0; d < width; d += 16) {
        V16 acc = b * rhs(d);
        for (int64_t j = 0; j < r; ++j) acc = fnma(set1(beta[r] * A_kk[r * C + j]), load(x + j * width + d), acc);
        store(x + r * width + d, acc);
      }
    };
    substitute(o.w, K, [&](int64_t d) { return load(eG + r * K + d) * load(k + r * K + d); });
    substitute(o.u, V, [&](int64_t d) { return load(v + r * V + d); });
  }
  const float* last = G + (C - 1) * K;
  for (int64_t r = 0; r < C; ++r)
    for (int64_t d = 0; d < K; d += 16) {
      store(o.q_decayed + r * K + d, load(q + r * K + d) * load(eG + r * K + d));
      store(o.k_to_end + r * K + d, exp16(load(last + d) - load(G + r * K + d)) * load(k + r * K + d));
    }
  for (int64_t d = 0; d < K; d += 16) store(o.end_decay + d, load(eG + (C - 1) * K + d));
}
}  // namespace

std::vector<torch::Tensor> kda_chunk_prepare(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                             const torch::Tensor& g, const torch::Tensor& beta) {
  TORCH_CHECK(k.dim() == 5, "k must be [B, H, n, C, K]");
  const int64_t C = k.size(3), K = k.size(4), V = v.size(4), tasks = k.numel() / (C * K);
  for (const auto* t : {&q, &k, &v, &g, &beta})
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous(), "inputs must be contiguous float32");
  TORCH_CHECK(q.sizes() == k.sizes() && g.sizes() == k.sizes() && v.sizes().slice(0, 4) == k.sizes().slice(0, 4) &&
              beta.sizes() == k.sizes().slice(0, 4),
              "q, g like k [B, H, n, C, K]; v [B, H, n, C, V]; beta [B, H, n, C]");
  TORCH_CHECK(K % 16 == 0 && V % 16 == 0 && K > 0 && V > 0, "head widths must be multiples of 16");
  const int64_t sub = C % 16 == 0 ? 16 : C;
  auto w = torch::empty_like(k), u = torch::empty_like(v), q_decayed = torch::empty_like(q);
  auto k_to_end = torch::empty_like(k), A_qk = torch::empty({k.size(0), k.size(1), k.size(2), C, C}, k.options());
  auto end_decay = torch::empty({k.size(0), k.size(1), k.size(2), K, 1}, k.options());
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(2 * C * K + C * C + 2 * sub * K + C * K);
    for (int64_t t = t0; t < t1; ++t) {
      const ChunkOut o{w.data_ptr<float>() + t * C * K, u.data_ptr<float>() + t * C * V,
                       q_decayed.data_ptr<float>() + t * C * K, k_to_end.data_ptr<float>() + t * C * K,
                       end_decay.data_ptr<float>() + t * K, A_qk.data_ptr<float>() + t * C * C};
      prepare_chunk(q.data_ptr<float>() + t * C * K, k.data_ptr<float>() + t * C * K, v.data_ptr<float>() + t * C * V,
                    g.data_ptr<float>() + t * C * K, beta.data_ptr<float>() + t * C, C, K, V, sub, o, scratch.data());
    }
  });
  return {w, u, q_decayed, k_to_end, end_decay, A_qk};
}

// RMSNorm of a few rows as the Kimi family computes it: statistics in fp32, normalised values rounded to the input
// dtype, then multiplied by the weight (in the input dtype, as `weight * x.to(dtype)` does).
namespace {
template <typename T>
void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t D, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * D;
    float ss = 0.f;
    for (int64_t i = 0; i < D; ++i) ss += to_float(xr[i]) * to_float(xr[i]);
    const float inv = 1.f / std::sqrt(ss / D + eps);
    for (int64_t i = 0; i < D; ++i) y[r * D + i] = T(to_float(w[i]) * round_to<T>(to_float(xr[i]) * inv));
  }
}
}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const auto xc = x.contiguous();
  const int64_t D = xc.size(-1), rows = xc.numel() / D;
  TORCH_CHECK(weight.numel() == D && weight.scalar_type() == xc.scalar_type() && weight.is_contiguous(),
              "weight must be [D] in x's dtype");
  auto y = torch::empty_like(xc);
  if (xc.scalar_type() == torch::kBFloat16)
    rms_rows<at::BFloat16>(xc.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(),
                           rows, D, float(eps));
  else {
    TORCH_CHECK(xc.scalar_type() == torch::kFloat, "x must be float32 or bfloat16");
    rms_rows<float>(xc.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), rows, D, float(eps));
  }
  return y;
}

// The index of the first largest value of each row, as torch.argmax gives it (a NaN counts as the largest; -0 and
// +0 are equal), at memory speed: torch's CPU argmax takes about 1 ns an element, 30-60 us a step for one row of a
// 32K vocabulary and several times that for Kimi's 164K.
namespace {
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  V16 top = set1(-INFINITY);
  uint32_t nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const V16 v = load(raw(x + i));
    nan |= nan_bits(v);
    top = vmax(top, v);
  }
  float best = hmax(top);
  for (int64_t j = i; j < n; ++j) {
    const float v = to_float(x[j]);
    if (v != v) nan = 1;
    best = std::max(best, v);
  }
  const V16 b = set1(best);     // the first NaN, else the first value equal to the maximum
  for (i = 0; i + 16 <= n; i += 16) {
    const V16 v = load(raw(x + i));
    const uint32_t hit = nan ? nan_bits(v) : eq_bits(v, b);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    if (nan ? v != v : v == best) return i;
  }
  return 0;
}
}  // namespace

torch::Tensor argmax(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x must be [..., n] with n > 0");
  const auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t R = rows.size(0), n = rows.size(1);
  auto out = torch::empty({R}, torch::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  if (rows.scalar_type() == torch::kBFloat16) {
    for (int64_t r = 0; r < R; ++r) o[r] = argmax_row(rows.data_ptr<at::BFloat16>() + r * n, n);
  } else {
    TORCH_CHECK(rows.scalar_type() == torch::kFloat, "x must be float32 or bfloat16");
    for (int64_t r = 0; r < R; ++r) o[r] = argmax_row(rows.data_ptr<float>() + r * n, n);
  }
  auto shape = x.sizes().vec();
  shape.pop_back();
  return out.view(shape);
}

// The indices of each row's k largest scores, largest first, the lower index first among equals: a stable
// descending sort's first k (a NaN counts as the largest; -0 and +0 are equal). A MoE router's choice of experts: the
// sort it replaces cost a decode step 2-3% in ATen's dispatch and scratch tensors.
torch::Tensor top_k(const torch::Tensor& scores, int64_t k) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == torch::kFloat && k >= 1 && k <= scores.size(1),
              "scores must be float32 [N, E] and k in 1..E");
  const auto x = scores.contiguous();
  const int64_t N = x.size(0), E = x.size(1);
  auto out = torch::empty({N, k}, torch::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<char> taken(E);
    for (int64_t n = n0; n < n1; ++n) {
      const float* row = x.data_ptr<float>() + n * E;
      std::fill(taken.begin(), taken.end(), 0);
      for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
          if (taken[e]) continue;
          if (best < 0 || (std::isnan(row[e]) ? !std::isnan(row[best]) : row[e] > row[best])) best = e;
        }
        taken[best] = 1;
        o[n * k + j] = best;
      }
    }
  });
  return out;
}

// Whether bf16 products of kAmxRows rows or more run on AMX tiles here.
bool uses_amx() { return kAmx; }

// Registered as operators (torch.ops.<this build's name>), so torch.compile sees them as single nodes; their
// shape functions are in ops/cpu_kernels.py.
TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  // float_out: results rounded to x's dtype, given back in fp32 (logits)
  m.def("gemv(Tensor x, Tensor W, bool float_out=False) -> Tensor");
  m.def("gemv_q8(Tensor x, Tensor q, Tensor scales, bool float_out=False) -> Tensor");
  m.def("gemv_mxfp4(Tensor x, Tensor packed, Tensor scales, bool float_out=False) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("top_k(Tensor scores, int k) -> Tensor");
  m.def("uses_amx() -> bool", &uses_amx);         // no tensors to dispatch on: one kernel for every key
  m.def("kda_decode_step(Tensor proj, Tensor(a!) conv, Tensor taps, Tensor f_a, Tensor[] f_b, Tensor dt_bias, "
        "Tensor decay, float lower_bound, Tensor beta_logit, Tensor g, Tensor[] g_b, Tensor o_norm, float eps, "
        "bool silu_gate, bool per_channel, Tensor(b!) state, Tensor slots) -> Tensor");
  m.def("mla_decode(Tensor q, Tensor w_uk, Tensor w_uv, Tensor(a!) cache, Tensor latent, Tensor slots, "
        "Tensor positions, float scale) -> Tensor");
  m.def("routed_experts(Tensor h, Tensor ids, Tensor weights, Tensor[] w13, Tensor[] w2, bool situ, float beta, "
        "float linear_beta, Tensor[] shared_gate_up, Tensor[] shared_down) -> (Tensor, Tensor)");
  m.def("routed_experts_prefill(Tensor h, Tensor ids, Tensor weights, Tensor w13, Tensor w2, bool situ, float beta, "
        "float linear_beta, int? widen_from_rows) -> Tensor");
  m.def("kda_chunk_inputs(Tensor window, Tensor taps, Tensor f, Tensor dt_bias, Tensor decay, float lower_bound, "
        "bool per_channel, Tensor beta_logit, float scale, int chunk) -> Tensor[]");
  m.def("kda_chunk_prepare(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("gemv_q8", &gemv_q8);
  m.impl("gemv_mxfp4", &gemv_mxfp4);
  m.impl("rms_norm", &rms_norm);
  m.impl("argmax", &argmax);
  m.impl("top_k", &top_k);
  m.impl("kda_decode_step", &kda_decode_step);
  m.impl("routed_experts", &routed_experts);
  m.impl("routed_experts_prefill", &routed_experts_prefill);
  m.impl("kda_chunk_inputs", &kda_chunk_inputs);
  m.impl("kda_chunk_prepare", &kda_chunk_prepare);
  m.impl("mla_decode", &mla_decode);
}
