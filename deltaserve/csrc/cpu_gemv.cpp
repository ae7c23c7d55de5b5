// Matrix-vector products for decode on x86 CPUs with AVX-512: y[M, N] = x[M, K] @ W[N, K]^T for a few rows (M <= 8)
// against weights stored as fp32, bf16 or MXFP4 (packed E2M1 codes, low nibble = even element, one E8M0 scale per
// 32). Decode is memory-bound: each weight is read once for all M rows, widened to fp32 in registers (bf16: a
// shift; MXFP4: a 16-entry table lookup by permute) and accumulated in fp32. Each row of y is computed by one
// thread in a fixed order, so a row's result does not depend on M, on the other rows or on the thread count.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>

namespace {

constexpr int kMaxRows = 8;

inline float bf16_to_float(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline __m512 load_widened(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load_widened(const uint16_t* w) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)w)), 16));
}
inline float widen(float w) { return w; }
inline float widen(uint16_t w) { return bf16_to_float(w); }

template <typename WT, int M>
void dense_rows(const float* x, int64_t K, const WT* W, int64_t n0, int64_t n1, float* y, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const WT* w = W + n * K;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m512 wv = load_widened(w + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(acc[m]);
      for (int64_t j = k; j < K; ++j) s += widen(w[j]) * x[m * K + j];
      y[m * N + n] = s;
    }
  }
}

// x is given de-interleaved per 32-block: xe holds the even elements, xo the odd ones ([M, K/2] each).
template <int M>
void mxfp4_rows(const float* xe, const float* xo, int64_t K, const uint8_t* P, const uint8_t* S, int64_t n0,
                int64_t n1, float* y, int64_t N) {
  static const float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                  -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  const __m512 table = _mm512_loadu_ps(kE2M1);
  const __m512i low_nibble = _mm512_set1_epi32(15);
  const int64_t blocks = K / 32, half = K / 2;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* p = P + n * half;
    const uint8_t* s = S + n * blocks;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + b * 16)));
      const __m512 even = _mm512_permutexvar_ps(_mm512_and_si512(codes, low_nibble), table);
      const __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
      const __m512 scale = _mm512_set1_ps(std::ldexp(1.0f, int(s[b]) - 127));
      for (int m = 0; m < M; ++m) {
        const int64_t at = m * half + b * 16;
        const __m512 dot = _mm512_fmadd_ps(even, _mm512_loadu_ps(xe + at), _mm512_mul_ps(odd, _mm512_loadu_ps(xo + at)));
        acc[m] = _mm512_fmadd_ps(dot, scale, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(acc[m]);
  }
}

template <template <int> class Rows, typename... Args>
void by_rows(int64_t M, int64_t N, int64_t grain, Args... args) {
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: Rows<1>::run(args..., n0, n1); break;
      case 2: Rows<2>::run(args..., n0, n1); break;
      case 3: Rows<3>::run(args..., n0, n1); break;
      case 4: Rows<4>::run(args..., n0, n1); break;
      case 5: Rows<5>::run(args..., n0, n1); break;
      case 6: Rows<6>::run(args..., n0, n1); break;
      case 7: Rows<7>::run(args..., n0, n1); break;
      default: Rows<8>::run(args..., n0, n1); break;
    }
  });
}

template <typename WT>
struct Dense {
  template <int M>
  struct Rows {
    static void run(const float* x, int64_t K, const WT* W, float* y, int64_t N, int64_t n0, int64_t n1) {
      dense_rows<WT, M>(x, K, W, n0, n1, y, N);
    }
  };
};

template <int M>
struct Mxfp4Rows {
  static void run(const float* xe, const float* xo, int64_t K, const uint8_t* P, const uint8_t* S, float* y,
                  int64_t N, int64_t n0, int64_t n1) {
    mxfp4_rows<M>(xe, xo, K, P, S, n0, n1, y, N);
  }
};

torch::Tensor rows_input(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "x must have 1..", kMaxRows, " rows");
  return x.to(torch::kFloat).contiguous();
}

}  // namespace

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& W) {
  TORCH_CHECK(W.dim() == 2 && W.is_contiguous(), "W must be a contiguous [N, K] matrix");
  const int64_t N = W.size(0), K = W.size(1);
  const auto xf = rows_input(x, K);
  const int64_t M = xf.size(0);
  auto y = torch::empty({M, N}, xf.options());
  if (W.scalar_type() == torch::kBFloat16) {
    by_rows<Dense<uint16_t>::Rows>(M, N, 64, xf.data_ptr<float>(), K, (const uint16_t*)W.data_ptr(),
                                   y.data_ptr<float>(), N);
  } else {
    TORCH_CHECK(W.scalar_type() == torch::kFloat, "W must be float32 or bfloat16");
    by_rows<Dense<float>::Rows>(M, N, 64, xf.data_ptr<float>(), K, W.data_ptr<float>(), y.data_ptr<float>(), N);
  }
  return y;
}

torch::Tensor gemv_mxfp4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales) {
  TORCH_CHECK(packed.dim() == 2 && scales.dim() == 2 && packed.is_contiguous() && scales.is_contiguous() &&
              packed.scalar_type() == torch::kByte && scales.scalar_type() == torch::kByte,
              "packed [N, K/2] and scales [N, K/32] must be contiguous uint8");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(K % 32 == 0 && scales.size(0) == N && scales.size(1) == K / 32, "scales must be [N, K/32]");
  const auto xf = rows_input(x, K);
  const int64_t M = xf.size(0);
  const auto pairs = xf.view({M, K / 2, 2});
  const auto even = pairs.select(2, 0).contiguous(), odd = pairs.select(2, 1).contiguous();
  auto y = torch::empty({M, N}, xf.options());
  by_rows<Mxfp4Rows>(M, N, 16, even.data_ptr<float>(), odd.data_ptr<float>(), K, packed.data_ptr<uint8_t>(),
                     scales.data_ptr<uint8_t>(), y.data_ptr<float>(), N);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y = x @ W^T for 1..8 rows, W float32 or bfloat16, fp32 result");
  m.def("gemv_mxfp4", &gemv_mxfp4, "y = x @ dequant(packed, scales)^T for 1..8 rows, fp32 result");
}
