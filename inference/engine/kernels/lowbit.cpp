// Decode-step linears over the model's own low-bit weights, for a few token rows at a time, and
// decode attention read in place from the paged KV cache (decode_attention, at the end).
//
// A decode step multiplies a handful of rows by every weight once, so it is bound by reading the
// weights; torch's CPU int4 kernel streamed them at ~7 GB/s on an Intel Xeon (bf16 activations,
// its own tile layout), a third of what the memory gives. These loops read each output row's
// weights once, contiguously, and do every input row's arithmetic on them while they are in
// registers. The activations are quantized to int8 per 32 values (scale: the group's largest |x|
// at 127) so that AVX-512 VNNI multiplies 64 weights by 64 activations per instruction, as
// llama.cpp does for Q4_1 × Q8_1:
//
//   ceiling::q4_linear(x[M,K] f32, codes[N,K/2] u8, scales_and_mins[N,⌈K/128⌉,8] f16) -> [M,N] f32
//       Q4_1 as in the GGUF: per 32 weights one scale d and one minimum m, w = d·q + m, q in 0..15;
//       byte j of a group holds q[j] in its low nibble and q[j+16] in its high nibble; per 4
//       groups the scales row holds their 4 d, then their 4 m.
//       Σ w·x = Σ_groups d·s·Σ q·q_x + m·Σ x  (s, q_x: the activations' int8 scale and codes).
//   ceiling::q8_linear(x[M,K] f32, codes[N,K] u8, scales[N] f32) -> [M,N] f32
//       int8 weights stored + 128, one scale per output row (the lm_head's int8 copy).
//
// Built once per machine with -march=native (inference/engine/kernels/__init__.py). Without
// AVX-512 VNNI the same int8 arithmetic runs 32 bytes at a time with AVX2 (maddubs, as llama.cpp's
// AVX2 build does), and without AVX2 as plain loops the compiler vectorises.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#else
inline int omp_get_thread_num() { return 0; }
inline int omp_get_num_threads() { return 1; }
#endif

#ifdef __F16C__  // the fp16 cache's conversions (store_kv)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#define CEILING_AVX512 1
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define CEILING_VNNI 1
#endif
#endif
// AVX2 machines (AMD EPYC of the Zen 2 generation, older Xeons) multiply the same int8 partners 32
// bytes at a time with maddubs: on the plain loops a lone q4 request took 37.9 ms a token on a
// 2-core EPYC, 7.1 ms with them.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CEILING_AVX2 1
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kChunk = 4;         // groups per step of the 4-bit loop: 64 bytes of codes
constexpr int kRowTile = 4;           // input rows sharing one output row's decoded weights

// The input rows quantized as the weights' partner, per 32-value group: int8 codes q and a scale s
// (x ≈ s·q, the group's largest |x| at 127), laid out as the 4-bit loop reads them. Per chunk of 4
// groups: 64 bytes of each group's values 0-15, then 64 bytes of its values 16-31, the order the
// low and high nibbles of the chunk's 64 code bytes come in. Scales are repeated 4 times, one per
// int32 lane of the dot product that group lands in. Σx per group stays exact (fp32): it meets
// the minimum m, Σ w·x = Σ_g d_g·s_g·Σ q_w·q_x + m_g·Σ x.
struct QuantizedRows {
  int64_t chunks;
  std::vector<int8_t> codes;  // [rows, chunks, 128]
  std::vector<float> scales;  // [rows, chunks, 16]
  std::vector<float> sums;    // [rows, chunks, 16]: a quarter of the group's Σx in each of its lanes

  QuantizedRows() : chunks(0) {}
  QuantizedRows(const float* x, int64_t rows, int64_t k) { assign(x, rows, k); }

  // Quantizes x[rows, k] into these buffers, reusing their memory (the stack quantizes four
  // inputs a layer into one per thread). The padding past a row's last group is zero: the 4-bit
  // loop multiplies it by masked (zero) weights, and garbage there could be a NaN.
  void assign(const float* x, int64_t rows, int64_t k) {
    chunks = (k / kGroup + kChunk - 1) / kChunk;
    codes.assign(rows * chunks * 128, 0);
    scales.assign(rows * chunks * 16, 0.f);
    sums.assign(rows * chunks * 16, 0.f);
    const int64_t groups = k / kGroup;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* part = x + r * k + g * kGroup;
        float largest = 0.f, total = 0.f;
        for (int64_t j = 0; j < kGroup; ++j) {
          largest = std::max(largest, std::abs(part[j]));
          total += part[j];
        }
        const float scale = largest / 127.f, inverse = largest > 0.f ? 127.f / largest : 0.f;
        const int64_t chunk = r * chunks + g / kChunk, lane = g % kChunk;
        int8_t* low = codes.data() + chunk * 128 + lane * 16;
        for (int64_t j = 0; j < 16; ++j) {
          low[j] = static_cast<int8_t>(std::nearbyint(part[j] * inverse));
          low[64 + j] = static_cast<int8_t>(std::nearbyint(part[16 + j] * inverse));
        }
        std::fill_n(scales.data() + chunk * 16 + lane * 4, 4, scale);
        std::fill_n(sums.data() + chunk * 16 + lane * 4, 4, total / 4);
      }
    }
  }
};

#ifdef CEILING_VNNI
// The sums of 4 vectors' lanes, as one 4-lane vector (cheaper than 4 separate reductions).
inline __m128 reduce_4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  // Per 128-bit lane: a0, a1, a2, a3's partial sums.
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
#endif

#ifdef CEILING_AVX2
// The sums of 4 vectors' 8 lanes, as one 4-lane vector.
inline __m128 reduce_4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  // Per 128-bit lane, after two rounds of pairwise sums: a0, a1, a2, a3's partial sums.
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// The sums of 8 vectors' lanes as one vector: lane j = Σ of v[j]'s 8 lanes (6 hadds, one swap of halves).
inline __m256 sums_of_8(const __m256 (&v)[8]) {
  // Per 128-bit lane after two rounds: v0…v3's partial sums (then v4…v7's) over that lane's half.
  const __m256 low4 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 high4 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low4, high4, 0x20), _mm256_permute2f128_ps(low4, high4, 0x31));
}

inline float reduce_add(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Σ u·s over 32 unsigned × signed bytes, as 8 int32 lanes of 4 products each. maddubs adds pairs
// into int16 lanes: callers keep each pair's sum below 2^15 (4-bit codes, or |w| ≤ 128 by the sign trick).
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif

// O output rows (codes and scales `row_bytes` / `row_scales` apart) for R input rows. `scales`
// holds, per chunk of 4 groups, their 4 scales d then their 4 minima m (fp16, zero past the last
// group): one 16-byte load per chunk. Several output rows at once keep several independent
// accumulators in flight and share the activations' loads and the final reduction: a row of
// SmolLM2's 576 inputs is only 4.5 chunks, and one row at a time spent as long on its setup and
// reduction as on its arithmetic.
template <int R, int O>
void q4_block(const QuantizedRows& xq, int64_t first, int64_t groups, const uint8_t* codes, int64_t row_bytes,
              const at::Half* scales, int64_t row_scales, float* out, int64_t ldo) {
  const int64_t chunks = xq.chunks;
#ifdef CEILING_VNNI
  // Per chunk: the 64 code bytes' low nibbles are the 4 groups' weights 0-15, the high nibbles
  // 16-31; two VNNI dot products (u8 × s8 → int32, 4 products per lane) give lanes 4i..4i+3 the
  // partial sums of group i, scaled per lane by d·s and accumulated in fp32 with m·Σx.
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i spread_d = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i spread_m = _mm512_add_epi32(spread_d, _mm512_set1_epi32(4));
  __m512 acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = _mm512_setzero_ps();
  auto step = [&](int64_t c, __mmask64 live) {
    __m512i low[O], high[O];
    __m512 d[O], m[O];
    for (int o = 0; o < O; ++o) {
      const __m512i packed = _mm512_maskz_loadu_epi8(live, codes + o * row_bytes + c * 64);
      low[o] = _mm512_and_si512(packed, nibble);
      high[o] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      const __m512 both = _mm512_castps256_ps512(
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + o * row_scales + c * 8))));
      d[o] = _mm512_permutexvar_ps(spread_d, both);
      m[o] = _mm512_permutexvar_ps(spread_m, both);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (first + r) * chunks + c;
      const int8_t* x = xq.codes.data() + at * 128;
      const __m512i x_low = _mm512_loadu_si512(x), x_high = _mm512_loadu_si512(x + 64);
      const __m512 x_scale = _mm512_loadu_ps(xq.scales.data() + at * 16);
      const __m512 x_sum = _mm512_loadu_ps(xq.sums.data() + at * 16);  // a quarter of Σx per lane
      for (int o = 0; o < O; ++o) {
        __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low[o], x_low);
        sum = _mm512_dpbusd_epi32(sum, high[o], x_high);
        acc[r][o] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d[o], x_scale), acc[r][o]);
        acc[r][o] = _mm512_fmadd_ps(m[o], x_sum, acc[r][o]);
      }
    }
  };
  const int64_t full = groups / kChunk;
  for (int64_t c = 0; c < full; ++c) step(c, ~__mmask64(0));
  if (full < chunks) step(full, (__mmask64(1) << ((groups - full * kChunk) * 16)) - 1);  // past the end: zero codes
  for (int r = 0; r < R; ++r) {
    if constexpr (O == 4) {
      _mm_storeu_ps(out + r * ldo, reduce_4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    } else {
      for (int o = 0; o < O; ++o) out[r * ldo + o] = _mm512_reduce_add_ps(acc[r][o]);
    }
  }
#elif defined(CEILING_AVX2)
  // Half a chunk at a time: 32 code bytes are 2 groups; their low nibbles meet the activations'
  // values 0-15 of those groups, the high nibbles values 16-31, and lanes 0-3 / 4-7 of the int32
  // dot product hold the first / second group's partial sums. The weights of an output row are
  // loaded once per half and used for every input row; the activations come from L1.
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = _mm256_setzero_ps();
  auto half = [&](int64_t c, int h, bool both_groups) {
    const __m256i spread_d = _mm256_setr_epi32(2 * h, 2 * h, 2 * h, 2 * h, 2 * h + 1, 2 * h + 1, 2 * h + 1, 2 * h + 1);
    const __m256i spread_m = _mm256_add_epi32(spread_d, _mm256_set1_epi32(4));
    for (int o = 0; o < O; ++o) {
      const uint8_t* at_codes = codes + o * row_bytes + c * 64 + h * 32;
      // A row's last group alone: 16 bytes, not a read past the row (past the tensor, for the last row).
      const __m256i packed = both_groups ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at_codes))
                                         : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at_codes)));
      const __m256i low = _mm256_and_si256(packed, nibble);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
      const __m256 both = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + o * row_scales + c * 8)));
      const __m256 d = _mm256_permutevar8x32_ps(both, spread_d), m = _mm256_permutevar8x32_ps(both, spread_m);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (first + r) * chunks + c;
        const int8_t* x = xq.codes.data() + at * 128 + h * 32;
        const __m256i x_low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        const __m256i x_high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64));
        // 15·127·2 per int16 lane at most, twice: no saturation.
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, x_low), _mm256_maddubs_epi16(high, x_high));
        const __m256i sum = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        const __m256 x_scale = _mm256_loadu_ps(xq.scales.data() + at * 16 + h * 8);
        const __m256 x_sum = _mm256_loadu_ps(xq.sums.data() + at * 16 + h * 8);  // a quarter of Σx per lane
        acc[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, x_scale), acc[r][o]);
        acc[r][o] = _mm256_fmadd_ps(m, x_sum, acc[r][o]);
      }
    }
  };
  const int64_t full = groups / kChunk, left = groups - full * kChunk;
  for (int64_t c = 0; c < full; ++c) {
    half(c, 0, true);
    half(c, 1, true);
  }
  if (left >= 1) half(full, 0, left >= 2);
  if (left == 3) half(full, 1, false);
  for (int r = 0; r < R; ++r) {
    if constexpr (O == 4) {
      _mm_storeu_ps(out + r * ldo, reduce_4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    } else {
      for (int o = 0; o < O; ++o) out[r * ldo + o] = reduce_add(acc[r][o]);
    }
  }
#else
  for (int o = 0; o < O; ++o) {
    const uint8_t* row_codes = codes + o * row_bytes;
    const at::Half* row = scales + o * row_scales;
    for (int r = 0; r < R; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t c = g / kChunk, lane = g % kChunk, at = (first + r) * chunks + c;
        const int8_t* x = xq.codes.data() + at * 128 + lane * 16;
        const uint8_t* block = row_codes + g * 16;
        int32_t sum = 0;
        for (int j = 0; j < 16; ++j) sum += int32_t(block[j] & 0x0F) * x[j] + int32_t(block[j] >> 4) * x[64 + j];
        const float d = static_cast<float>(row[c * 8 + lane]), m = static_cast<float>(row[c * 8 + 4 + lane]);
        total += d * xq.scales[at * 16 + lane * 4] * float(sum) + m * 4 * xq.sums[at * 16 + lane * 4];
      }
      out[r * ldo + o] = total;
    }
  }
#endif
}

// The input rows quantized for the int8 product: per 32 values int8 codes q and a scale s, in
// chunks of 2 groups (64 bytes), each scale repeated over the 8 int32 lanes its group lands in.
// The weights are stored as w + 128 (unsigned, as VNNI's first operand must be), so every dot
// product carries 128·Σq too: `offset` is that share of the row's result, 128·Σ_g s_g·Σq_g.
struct Q8Rows {
  int64_t chunks;
  std::vector<int8_t> codes;  // [rows, chunks, 64]
  std::vector<float> scales;  // [rows, chunks, 16]
  std::vector<float> offset;  // [rows]

  Q8Rows(const float* x, int64_t rows, int64_t k)
      : chunks((k / kGroup + 1) / 2), codes(rows * chunks * 64, 0), scales(rows * chunks * 16, 0.f), offset(rows, 0.f) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < k / kGroup; ++g) {
        const float* part = x + r * k + g * kGroup;
        float largest = 0.f;
        for (int64_t j = 0; j < kGroup; ++j) largest = std::max(largest, std::abs(part[j]));
        const float scale = largest / 127.f, inverse = largest > 0.f ? 127.f / largest : 0.f;
        int8_t* group = codes.data() + (r * chunks + g / 2) * 64 + (g % 2) * 32;
        int32_t total = 0;
        for (int64_t j = 0; j < kGroup; ++j) {
          group[j] = static_cast<int8_t>(std::nearbyint(part[j] * inverse));
          total += group[j];
        }
        std::fill_n(scales.data() + (r * chunks + g / 2) * 16 + (g % 2) * 8, 8, scale);
        offset[r] += 128.f * scale * float(total);
      }
    }
  }
};

// O output rows (`k` bytes apart) of the int8 product for R input rows: per 64 weights one VNNI
// dot product per pair, scaled per lane by its group's s; several output rows at once for the
// reasons q4_block gives.
template <int R, int O>
void q8_block(const Q8Rows& xq, int64_t first, int64_t k, const uint8_t* codes, const float* scales, float* out,
              int64_t ldo) {
  const int64_t chunks = xq.chunks;
#ifdef CEILING_VNNI
  __m512 acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = _mm512_setzero_ps();
  auto step = [&](int64_t c, __mmask64 live) {
    __m512i w[O];
    for (int o = 0; o < O; ++o) w[o] = _mm512_maskz_loadu_epi8(live, codes + o * k + c * 64);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (first + r) * chunks + c;
      const __m512i x = _mm512_loadu_si512(xq.codes.data() + at * 64);
      const __m512 x_scale = _mm512_loadu_ps(xq.scales.data() + at * 16);
      for (int o = 0; o < O; ++o)
        acc[r][o] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w[o], x)), x_scale,
                                    acc[r][o]);
    }
  };
  const int64_t full = k / 64;
  for (int64_t c = 0; c < full; ++c) step(c, ~__mmask64(0));
  if (full < chunks) step(full, (__mmask64(1) << (k - full * 64)) - 1);  // the last 32 weights of an odd group count
  for (int r = 0; r < R; ++r) {
    if constexpr (O == 4) {
      const __m128 sums = reduce_4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      _mm_storeu_ps(out + r * ldo, _mm_mul_ps(_mm_loadu_ps(scales), _mm_sub_ps(sums, _mm_set1_ps(xq.offset[first + r]))));
    } else {
      for (int o = 0; o < O; ++o) out[r * ldo + o] = scales[o] * (_mm512_reduce_add_ps(acc[r][o]) - xq.offset[first + r]);
    }
  }
#elif defined(CEILING_AVX2)
  // One group (32 weights) at a time. maddubs would saturate on w + 128 (up to 255·127·2), so the
  // weights go back to signed w and the sign trick makes the unsigned operand |w| ≤ 128: Σ |w|·(x·sgn w).
  // No 128·Σq to take off, then: `offset` is not used.
  const __m256i unbias = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < O; ++o) acc[r][o] = _mm256_setzero_ps();
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const int64_t c = g / 2, h = g % 2;
    for (int o = 0; o < O; ++o) {
      const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + o * k + g * kGroup)), unbias);
      const __m256i magnitude = _mm256_sign_epi8(w, w);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (first + r) * chunks + c;
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.codes.data() + at * 64 + h * 32));
        const __m256 x_scale = _mm256_loadu_ps(xq.scales.data() + at * 16 + h * 8);
        acc[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_s8(magnitude, _mm256_sign_epi8(x, w))), x_scale, acc[r][o]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (O == 4) {
      _mm_storeu_ps(out + r * ldo, _mm_mul_ps(_mm_loadu_ps(scales), reduce_4(acc[r][0], acc[r][1], acc[r][2], acc[r][3])));
    } else {
      for (int o = 0; o < O; ++o) out[r * ldo + o] = scales[o] * reduce_add(acc[r][o]);
    }
  }
#else
  for (int o = 0; o < O; ++o) {
    const uint8_t* row_codes = codes + o * k;
    for (int r = 0; r < R; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < k / kGroup; ++g) {
        const int64_t at = (first + r) * chunks + g / 2;
        const int8_t* x = xq.codes.data() + at * 64 + (g % 2) * 32;
        int32_t sum = 0;
        for (int64_t j = 0; j < kGroup; ++j) sum += int32_t(row_codes[g * kGroup + j]) * x[j];
        total += xq.scales[at * 16 + (g % 2) * 8] * float(sum);
      }
      out[r * ldo + o] = scales[o] * (total - xq.offset[first + r]);
    }
  }
#endif
}

// Calls row<R>(first input row, R) over the input rows in tiles of kRowTile, the last tile narrower.
template <typename Row>
void over_row_tiles(int64_t rows, Row&& row) {
  int64_t first = 0;
  for (; first + kRowTile <= rows; first += kRowTile) row(first, std::integral_constant<int, kRowTile>{});
  switch (rows - first) {
    case 3: row(first, std::integral_constant<int, 3>{}); break;
    case 2: row(first, std::integral_constant<int, 2>{}); break;
    case 1: row(first, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

void check_input(const at::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous [rows, in] float32 tensor");
  TORCH_CHECK(x.size(1) == k, op, ": x has ", x.size(1), " columns, the weights ", k);
}

// Asks for the cache lines of the output row kPrefetchRows ahead while this one is computed: each
// row is a few hundred bytes, and without it a lone row's step stalled on memory as long as it
// computed (4-bit pass over SmolLM2's layers, one thread: 12.5 ms without, 9.9 at 4 rows ahead,
// 8.8 at 12, 7.0 at 32; torch's kernel 11.3-8.7 ms in the same runs, a noisy machine).
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 16
#endif
constexpr int64_t kPrefetchRows = PREFETCH_ROWS;
inline void prefetch_row(const void* codes, int64_t code_bytes, const void* scales, int64_t scale_bytes) {
  for (int64_t at = 0; at < code_bytes; at += 64) __builtin_prefetch(static_cast<const char*>(codes) + at);
  for (int64_t at = 0; at < scale_bytes; at += 64) __builtin_prefetch(static_cast<const char*>(scales) + at);
}

// Output rows per task: enough work to pay for handing it to a thread, small enough to split evenly.
constexpr int64_t kGrain = 16;

// Calls block(first input row, its tile R, first output row o, O) over output rows [begin, end) in
// blocks of O (4 for a lone input row, 2 for two, else 1; singles where a range ends), kGrain
// output rows at a time through every tile of input rows while their weights are in cache.
template <typename Block>
void over_output_range(int64_t begin, int64_t end, int64_t rows, Block&& block) {
  for (int64_t from = begin; from < end; from += kGrain) {
    const int64_t to = std::min(end, from + kGrain);
    over_row_tiles(rows, [&](int64_t first, auto tile) {
      constexpr int R = decltype(tile)::value, O = R == 1 ? 4 : (R == 2 ? 2 : 1);
      int64_t o = from;
      for (; o + O <= to; o += O) block(first, tile, o, std::integral_constant<int, O>{});
      for (; o < to; ++o) block(first, tile, o, std::integral_constant<int, 1>{});
    });
  }
}

// over_output_range over every output row, the tasks of `task_grain` output rows spread over torch's threads.
template <typename Block>
void over_output_blocks(int64_t n, int64_t rows, int64_t task_grain, Block&& block) {
  at::parallel_for(0, n, task_grain, [&](int64_t begin, int64_t end) { over_output_range(begin, end, rows, block); });
}

// A 4-bit weight's raw layout (q4_linear's codes and scales_and_mins), read without touching a tensor.
struct Q4Weights {
  const uint8_t* codes;
  const at::Half* scales;
  int64_t n, k;

  int64_t groups() const { return k / kGroup; }
  int64_t row_bytes() const { return k / 2; }
  int64_t row_scales() const { return (groups() + kChunk - 1) / kChunk * 8; }
};

// Output rows [begin, end) of x·Wᵀ for the quantized input rows xq, into out[rows, w.n].
void q4_rows(const QuantizedRows& xq, int64_t rows, const Q4Weights& w, int64_t begin, int64_t end, float* out) {
  const int64_t row_bytes = w.row_bytes(), row_scales = w.row_scales(), groups = w.groups();
  over_output_range(begin, end, rows, [&](int64_t first, auto tile, int64_t o, auto block) {
    constexpr int R = decltype(tile)::value, O = decltype(block)::value;
    if (first == 0)  // later input rows find these weights in cache
      prefetch_row(w.codes + (o + kPrefetchRows) * row_bytes, O * row_bytes,
                   w.scales + (o + kPrefetchRows) * row_scales, O * row_scales * 2);
    q4_block<R, O>(xq, first, groups, w.codes + o * row_bytes, row_bytes, w.scales + o * row_scales, row_scales,
                   out + first * w.n + o, w.n);
  });
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_and_mins) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "q4_linear: codes must be a contiguous [out, in/2] uint8 tensor");
  const int64_t n = codes.size(0), k = codes.size(1) * 2, groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0, "q4_linear: in must be a multiple of 32");
  const int64_t chunks = (groups + kChunk - 1) / kChunk;
  TORCH_CHECK(scales_and_mins.scalar_type() == at::kHalf && scales_and_mins.is_contiguous() &&
                  scales_and_mins.numel() == n * chunks * 8,
              "q4_linear: scales_and_mins must be a contiguous [out, ceil(in/128), 8] float16 tensor");
  check_input(x, k, "q4_linear");
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  const QuantizedRows xq(x.data_ptr<float>(), rows, k);
  const Q4Weights weights{codes.data_ptr<uint8_t>(), scales_and_mins.data_ptr<at::Half>(), n, k};
  float* result = out.data_ptr<float>();
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { q4_rows(xq, rows, weights, begin, end, result); });
  return out;
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "q8_linear: codes must be a contiguous [out, in] uint8 tensor (the int8 weights + 128)");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(k % kGroup == 0, "q8_linear: in must be a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n,
              "q8_linear: scales must be a contiguous [out] float32 tensor");
  check_input(x, k, "q8_linear");
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  const Q8Rows xq(x.data_ptr<float>(), rows, k);
  const uint8_t* all_codes = codes.data_ptr<uint8_t>();
  const float* all_scales = scales.data_ptr<float>();
  float* result = out.data_ptr<float>();
  over_output_blocks(n, rows, kGrain * 16, [&](int64_t first, auto tile, int64_t o, auto block) {
    constexpr int R = decltype(tile)::value, O = decltype(block)::value;
    if (first == 0) prefetch_row(all_codes + (o + kPrefetchRows) * k, O * k, nullptr, 0);
    q8_block<R, O>(xq, first, k, all_codes + o * k, all_scales + o, result + first * n + o, n);
  });
  return out;
}



// e^x (x ≤ 0 here: scores minus their maximum) as x = n·ln2 + f, e^f by its Taylor polynomial to
// f^7 (|f| ≤ ln2/2: relative error < 2e-7, about an fp32 ulp), times 2^n. The AVX-512 and AVX2
// exp_ps below share these numbers; only the vector width and how 2^n is applied differ.
constexpr float kExpFloor = -87.f;  // e^-87 is already below fp32's normal range (and 2^n stays normal)
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693145751953125f, kLn2Low = 1.428606765330187e-06f;  // ln2 split in two for exactness
constexpr float kExpTaylor[] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};  // f^7 … f^0

// The KV cache holds fp32, fp16 (at::Half) or int8 values: attention reads each, always computing
// in fp32. fp16 halves the bytes a step reads per cached position (a lone SmolLM2 row at 2,000
// positions reads as much fp32 cache as 4-bit weights); its 10-bit mantissa rounds each key and
// value once, when it is written. int8 halves them again: each (slot, KV head) row is dim codes
// q = round(x / s) in -127…127 and then its scale s = max|x| / 127 as 4 bytes of fp32, so a head's
// row is dim + 4 bytes (kInt8ScaleBytes) and a slot kv_heads of them; x ≈ s·q, off by at most s/2
// (inference/engine/owned/kv.py writes the same codes from Python: the same rounding, the same scale).
constexpr int64_t kInt8ScaleBytes = 4;
inline float as_float(float x) { return x; }
inline float as_float(at::Half x) { return static_cast<float>(x); }
inline float as_float(int8_t x) { return static_cast<float>(x); }

// Elements from one (slot, KV head) row of the cache to the next head's: dim, and for int8 its scale too.
template <typename T>
constexpr int64_t head_stride(int64_t dim) { return std::is_same_v<T, int8_t> ? dim + kInt8ScaleBytes : dim; }

// What a row's values are multiplied by: its stored scale for int8, 1 for fp32 and fp16 (folded away).
inline float row_scale(const float*, int64_t) { return 1.f; }
inline float row_scale(const at::Half*, int64_t) { return 1.f; }
inline float row_scale(const int8_t* row, int64_t dim) {
  float scale;
  std::memcpy(&scale, row + dim, sizeof scale);  // 4 bytes after the codes, not aligned
  return scale;
}

// dim values from fp32 into one (slot, KV head) row of the cache's type (round to nearest even for
// fp16 and for int8's codes).
inline void store_kv(float* target, const float* source, int64_t dim) { std::copy_n(source, dim, target); }
inline void store_kv(at::Half* target, const float* source, int64_t dim) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= dim; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(target + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(source + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < dim; ++i) target[i] = at::Half(source[i]);
}
inline void store_kv(int8_t* target, const float* source, int64_t dim) {
  float largest = 0.f;
  for (int64_t i = 0; i < dim; ++i) largest = std::max(largest, std::abs(source[i]));
  const float scale = largest / 127.f, inverse = largest > 0.f ? 127.f / largest : 0.f;
  for (int64_t i = 0; i < dim; ++i)
    target[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(source[i] * inverse))));
  std::memcpy(target + dim, &scale, sizeof scale);
}

// How far ahead (in positions) attention asks for the keys and values it will read. The cache's
// slots come in pages scattered over memory and a KV head is a third of each slot (SmolLM2), a
// pattern the hardware's own prefetch follows poorly: a lone row's attention over 2,000 positions
// of 30 layers read ~9 GB/s a thread where a plain sum reads 25 (2-core AMD EPYC, Zen 4); asking
// 16 positions ahead took 9-12% off that step (the figures at attend_in_parts).
#ifndef ATTENTION_PREFETCH
#define ATTENTION_PREFETCH 16
#endif
constexpr int64_t kAttentionPrefetch = ATTENTION_PREFETCH;

// Asks for one head row of 64 values (and an int8 row's scale) into the cache, its lines known at
// compile time: a loop over a length passed at run time took ~30 instructions a (position, KV head)
// of the AVX2 attention on int8 rows, 15% of all (callgrind).
template <typename T>
inline void prefetch_row_64(const T* p) {
  constexpr int64_t bytes = 64 * sizeof(T) + (std::is_same_v<T, int8_t> ? kInt8ScaleBytes : 0);
  const char* at = reinterpret_cast<const char*>(p);
  for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(at + byte);
  if constexpr (bytes % 64 != 0) __builtin_prefetch(at + bytes - 1);  // a row that ends past its last whole line
}

#ifdef CEILING_AVX512
// e^x for 16 floats; 2^n by vscalefps.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), f);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_scalef_ps(p, n);
}
#endif

#ifdef CEILING_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The horizontal sums of 16 vectors as one: lane j = Σ of v[j]'s lanes. A transpose folded into
// the additions, 45 instructions where 16 separate horizontal sums take ~130 (a score is one
// horizontal sum after its 4 products): decode_attention over 2,000 cached positions with its cache
// in L2 went from 59 to 55 µs a layer (fp32; 63 → 61 on fp16, which its conversions bound).
inline __m512 sums_of_16(const __m512 (&v)[16]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i]'s two halves summed in lanes 0 and 2, v[2i+1]'s in 1 and 3
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the sums of v[4i] … v[4i+3] over that lane
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // then over the 4 lanes: 128-bit lane k of the result holds v[4k] … v[4k+3]'s totals
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}

// attend_one_kv_head for heads of 64 and G query heads per KV head, everything in registers.
template <int G, typename T>
void attend_64(const float* q, const T* keys, const T* values, int64_t stride, const int64_t* slots,
               int64_t seen, float scale, float* scores, int64_t ld_scores, float* out, float* stats,
               int64_t prefetch) {
  __m512 qv[G][4];
  for (int64_t h = 0; h < G; ++h)
    for (int i = 0; i < 4; ++i) qv[h][i] = _mm512_mul_ps(_mm512_loadu_ps(q + h * 64 + i * 16), _mm512_set1_ps(scale));
  int64_t tiled = 0;
  for (; tiled + 16 <= seen; tiled += 16) {  // 16 positions at a time, each head's scores summed together
    const T* tile[16];
    for (int j = 0; j < 16; ++j) tile[j] = keys + slots[tiled + j] * stride;
    float key_scales[16];  // int8 rows' scales (unused for fp32 and fp16)
    if constexpr (std::is_same_v<T, int8_t>)
      for (int j = 0; j < 16; ++j) key_scales[j] = row_scale(tile[j], 64);
    for (int64_t j = tiled + kAttentionPrefetch; j < std::min(seen, tiled + kAttentionPrefetch + 16); ++j)
      if (prefetch) prefetch_row_64(keys + slots[j] * stride);
    for (int64_t h = 0; h < G; ++h) {
      __m512 dots[16];
      for (int j = 0; j < 16; ++j) {
        __m512 a = _mm512_mul_ps(qv[h][0], load16(tile[j]));
        a = _mm512_fmadd_ps(qv[h][1], load16(tile[j] + 16), a);
        a = _mm512_fmadd_ps(qv[h][2], load16(tile[j] + 32), a);
        dots[j] = _mm512_fmadd_ps(qv[h][3], load16(tile[j] + 48), a);
      }
      __m512 tile_scores = sums_of_16(dots);
      if constexpr (std::is_same_v<T, int8_t>) tile_scores = _mm512_mul_ps(tile_scores, _mm512_loadu_ps(key_scales));
      _mm512_storeu_ps(scores + h * ld_scores + tiled, tile_scores);
    }
  }
  for (int64_t t = tiled; t < seen; ++t) {
    const T* key = keys + slots[t] * stride;
    const __m512 k0 = load16(key), k1 = load16(key + 16);
    const __m512 k2 = load16(key + 32), k3 = load16(key + 48);
    for (int64_t h = 0; h < G; ++h) {
      __m512 a = _mm512_mul_ps(qv[h][0], k0);
      a = _mm512_fmadd_ps(qv[h][1], k1, a);
      a = _mm512_fmadd_ps(qv[h][2], k2, a);
      a = _mm512_fmadd_ps(qv[h][3], k3, a);
      scores[h * ld_scores + t] = _mm512_reduce_add_ps(a) * row_scale(key, 64);
    }
  }
  __m512 total[G][4];
  for (int64_t h = 0; h < G; ++h) {
    float* score = scores + h * ld_scores;
    __m512 top = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= seen; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(score + t));
    float largest = _mm512_reduce_max_ps(top);
    for (; t < seen; ++t) largest = std::max(largest, score[t]);
    const __m512 shift = _mm512_set1_ps(largest);
    __m512 sums = _mm512_setzero_ps();
    for (t = 0; t < seen; t += 16) {
      const __mmask16 live = seen - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (seen - t)) - 1);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, score + t), shift));
      _mm512_mask_storeu_ps(score + t, live, e);
      sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(live, e));
    }
    const float sum = _mm512_reduce_add_ps(sums), inverse = 1.f / sum;
    if (stats != nullptr) stats[h * 2] = largest, stats[h * 2 + 1] = sum;
    for (t = 0; t < seen; ++t) score[t] *= inverse;
    for (int i = 0; i < 4; ++i) total[h][i] = _mm512_setzero_ps();
  }
  for (int64_t t = 0; t < seen; ++t) {
    const T* value = values + slots[t] * stride;
    if (prefetch && t + kAttentionPrefetch < seen) prefetch_row_64(values + slots[t + kAttentionPrefetch] * stride);
    const __m512 v0 = load16(value), v1 = load16(value + 16);
    const __m512 v2 = load16(value + 32), v3 = load16(value + 48);
    const float value_scale = row_scale(value, 64);
    for (int64_t h = 0; h < G; ++h) {
      const __m512 w = _mm512_set1_ps(scores[h * ld_scores + t] * value_scale);
      total[h][0] = _mm512_fmadd_ps(w, v0, total[h][0]);
      total[h][1] = _mm512_fmadd_ps(w, v1, total[h][1]);
      total[h][2] = _mm512_fmadd_ps(w, v2, total[h][2]);
      total[h][3] = _mm512_fmadd_ps(w, v3, total[h][3]);
    }
  }
  for (int64_t h = 0; h < G; ++h)
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + h * 64 + i * 16, total[h][i]);
}
#endif

#if defined(CEILING_AVX2) && !defined(CEILING_AVX512)
// e^x for 8 floats; 2^n built in the exponent bits (n ≥ -126 after the floor: a normal float).
inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpFloor));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), f);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i two_to_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_to_n));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// attend_one_kv_head for heads of 64 and G query heads per KV head, 8 lanes at a time: a head is
// 8 vectors, too many to keep G of them in 16 registers, so the (scaled) queries are read from L1.
template <int G, typename T>
void attend_64(const float* q, const T* keys, const T* values, int64_t stride, const int64_t* slots,
               int64_t seen, float scale, float* scores, int64_t ld_scores, float* out, float* stats,
               int64_t prefetch) {
  alignas(32) float scaled[G * 64];
  for (int64_t i = 0; i < G * 64; ++i) scaled[i] = q[i] * scale;
  float inverse[G];  // 1 / each head's Σ e^(score - largest)
  // Keys 8 positions at a time: widened to fp32 once into L1 (fp32 rows are read where they are),
  // then each head's 8 dot products summed together (sums_of_8), where one horizontal sum per
  // (position, head) had cost more than its 8 products.
  alignas(32) float widened[8 * 64];
  int64_t t = 0;
  for (; t + 8 <= seen; t += 8) {
    const float* rows[8];
    alignas(32) float key_scales[8];
    for (int j = 0; j < 8; ++j) {
      const T* key = keys + slots[t + j] * stride;
      key_scales[j] = row_scale(key, 64);
      if constexpr (std::is_same_v<T, float>) {
        rows[j] = key;
      } else {
        for (int i = 0; i < 8; ++i) _mm256_store_ps(widened + j * 64 + i * 8, load8(key + i * 8));
        rows[j] = widened + j * 64;
      }
    }
    for (int64_t ahead = t + kAttentionPrefetch; ahead < std::min(seen, t + kAttentionPrefetch + 8); ++ahead)
      if (prefetch) prefetch_row_64(keys + slots[ahead] * stride);
    for (int64_t h = 0; h < G; ++h) {
      const float* head = scaled + h * 64;
      __m256 dots[8];
      const __m256 first = _mm256_load_ps(head);
      for (int j = 0; j < 8; ++j) dots[j] = _mm256_mul_ps(first, _mm256_loadu_ps(rows[j]));
      for (int i = 1; i < 8; ++i) {
        const __m256 part = _mm256_load_ps(head + i * 8);
        for (int j = 0; j < 8; ++j) dots[j] = _mm256_fmadd_ps(part, _mm256_loadu_ps(rows[j] + i * 8), dots[j]);
      }
      __m256 tile = sums_of_8(dots);
      if constexpr (std::is_same_v<T, int8_t>) tile = _mm256_mul_ps(tile, _mm256_load_ps(key_scales));
      _mm256_storeu_ps(scores + h * ld_scores + t, tile);
    }
  }
  for (; t < seen; ++t) {  // the last positions, one at a time
    const T* key = keys + slots[t] * stride;
    __m256 k[8];
    for (int i = 0; i < 8; ++i) k[i] = load8(key + i * 8);
    for (int64_t h = 0; h < G; ++h) {
      const float* head = scaled + h * 64;
      __m256 a = _mm256_mul_ps(_mm256_load_ps(head), k[0]), b = _mm256_mul_ps(_mm256_load_ps(head + 8), k[1]);
      for (int i = 2; i < 8; i += 2) {
        a = _mm256_fmadd_ps(_mm256_load_ps(head + i * 8), k[i], a);
        b = _mm256_fmadd_ps(_mm256_load_ps(head + i * 8 + 8), k[i + 1], b);
      }
      scores[h * ld_scores + t] = reduce_add(_mm256_add_ps(a, b)) * row_scale(key, 64);
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    float* score = scores + h * ld_scores;
    __m256 top = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= seen; t += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(score + t));
    float largest = -INFINITY;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    for (float lane : lanes) largest = std::max(largest, lane);
    for (; t < seen; ++t) largest = std::max(largest, score[t]);
    const __m256 shift = _mm256_set1_ps(largest);
    __m256 sums = _mm256_setzero_ps();
    for (t = 0; t + 8 <= seen; t += 8) {
      const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(score + t), shift));
      _mm256_storeu_ps(score + t, e);
      sums = _mm256_add_ps(sums, e);
    }
    float total = reduce_add(sums);
    for (; t < seen; ++t) total += (score[t] = std::exp(score[t] - largest));
    inverse[h] = 1.f / total;
    if (stats != nullptr) stats[h * 2] = largest, stats[h * 2 + 1] = total;
  }
  // The values, each read and widened once for all G heads: a head's 8 accumulators times G do not
  // fit 16 registers beside the value, so a slice of the head's dims at a time (4 vectors for up to
  // 3 heads: 12 accumulators, 3 weights, 1 value), the positions read again per slice from L1/L2.
  constexpr int kSlice = G == 1 ? 8 : (G <= 3 ? 4 : 2);
  for (int slice = 0; slice < 8 / kSlice; ++slice) {
    __m256 acc[G][kSlice];
    for (int h = 0; h < G; ++h)
      for (int i = 0; i < kSlice; ++i) acc[h][i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < seen; ++t) {
      const T* value = values + slots[t] * stride;
      if (prefetch && slice == 0 && t + kAttentionPrefetch < seen)  // the next slices find them in the cache
        prefetch_row_64(values + slots[t + kAttentionPrefetch] * stride);
      const float value_scale = row_scale(value, 64);
      __m256 w[G];
      for (int h = 0; h < G; ++h) w[h] = _mm256_set1_ps(scores[h * ld_scores + t] * value_scale);
      for (int i = 0; i < kSlice; ++i) {
        const __m256 v = load8(value + (slice * kSlice + i) * 8);
        for (int h = 0; h < G; ++h) acc[h][i] = _mm256_fmadd_ps(w[h], v, acc[h][i]);
      }
    }
    for (int h = 0; h < G; ++h)
      for (int i = 0; i < kSlice; ++i)
        _mm256_storeu_ps(out + h * 64 + (slice * kSlice + i) * 8, _mm256_mul_ps(acc[h][i], _mm256_set1_ps(inverse[h])));
  }
}
#endif

// The `group` query heads that share one KV head, over one row's `seen` positions (seen ≥ 1):
// scores (scaled dot products), their softmax, and the weighted sum of the values into
// out[group, dim]. `keys` and `values` point at this KV head's first dimension of slot 0; a slot's
// row is `stride` elements (kv_heads head rows of head_stride). With `stats`, each head's largest
// score and Σ e^(score - largest) go to stats[head, 2], so that attention over a part of the
// positions can be combined with the rest (combine_parts). `prefetch`: non-zero (callers pass the
// head row's stride) to ask for each position's head row kAttentionPrefetch positions ahead of
// reading it, on the 64-wide paths; 0 for none.
template <typename T>
void attend_one_kv_head(const float* q, const T* keys, const T* values, int64_t stride, const int64_t* slots,
                        int64_t seen, int64_t group, int64_t dim, float scale, float* scores, int64_t ld_scores,
                        float* out, float* stats = nullptr, int64_t prefetch = 0) {
#if defined(CEILING_AVX512) || defined(CEILING_AVX2)
  if (dim == 64 && group <= 4) {  // SmolLM2's and most small models' heads
    switch (group) {
      case 1: return attend_64<1, T>(q, keys, values, stride, slots, seen, scale, scores, ld_scores, out, stats, prefetch);
      case 2: return attend_64<2, T>(q, keys, values, stride, slots, seen, scale, scores, ld_scores, out, stats, prefetch);
      case 3: return attend_64<3, T>(q, keys, values, stride, slots, seen, scale, scores, ld_scores, out, stats, prefetch);
      default: return attend_64<4, T>(q, keys, values, stride, slots, seen, scale, scores, ld_scores, out, stats, prefetch);
    }
  }
#endif
  for (int64_t t = 0; t < seen; ++t) {
    const T* key = keys + slots[t] * stride;
    for (int64_t h = 0; h < group; ++h) {
      const float* q_head = q + h * dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += q_head[d] * as_float(key[d]);
      scores[h * ld_scores + t] = dot * scale * row_scale(key, dim);
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* score = scores + h * ld_scores;
    const float largest = *std::max_element(score, score + seen);
    float sum = 0.f;
    for (int64_t t = 0; t < seen; ++t) sum += (score[t] = std::exp(score[t] - largest));
    const float inverse = 1.f / sum;
    if (stats != nullptr) stats[h * 2] = largest, stats[h * 2 + 1] = sum;
    float* total = out + h * dim;
    std::fill_n(total, dim, 0.f);
    for (int64_t t = 0; t < seen; ++t) {
      const T* value = values + slots[t] * stride;
      const float weight = score[t] * inverse * row_scale(value, dim);
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) total[d] += weight * as_float(value[d]);
    }
  }
}

// Attention over a row's positions cut into `parts` (as flash-decoding does): each part's output
// outs[part, group, dim], normalized over its own positions, and its stats[part, group, 2] (largest
// score, Σ e^(score - largest); a part with no positions has Σ 0) → the whole's into result[group,
// dim]. A part weighs its Σ rescaled to the largest score of all parts.
inline void combine_parts(const float* outs, const float* stats, int64_t parts, int64_t group, int64_t dim,
                          float* result) {
  for (int64_t h = 0; h < group; ++h) {
    float largest = -INFINITY;
    for (int64_t p = 0; p < parts; ++p)
      if (stats[(p * group + h) * 2 + 1] > 0.f) largest = std::max(largest, stats[(p * group + h) * 2]);
    float* total = result + h * dim;
    std::fill_n(total, dim, 0.f);
    float weights = 0.f;
    for (int64_t p = 0; p < parts; ++p) {
      const float sum = stats[(p * group + h) * 2 + 1];
      if (sum == 0.f) continue;
      const float weight = sum * std::exp(stats[(p * group + h) * 2] - largest);
      weights += weight;
      const float* part = outs + (p * group + h) * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) total[d] += weight * part[d];
    }
    const float inverse = 1.f / weights;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) total[d] *= inverse;
  }
}

// Parts of each row's positions in a decode step's attention: 128 to 255 positions each (a part's
// keys and values, ~100-400 KB, stay in a core's L2 while its KV heads are read one after another),
// once rows are few. A lone row had one task per KV head (3 for SmolLM2), which 2 threads share 2:1,
// and at a long context attention is most of its step. Steps of many rows have tasks enough, and
// the per-thread combine of the parts (combine_parts) would grow with their rows: not cut.
constexpr int64_t kMinPart = 128;
constexpr int64_t kTasksPerThread = 8;
inline int64_t attention_parts(int64_t rows, int64_t kv_heads, int64_t longest, int threads) {
  if (rows * kv_heads >= kTasksPerThread * std::max(threads, 1)) return 1;
  return std::max<int64_t>(1, longest / kMinPart);
}

#ifndef ATTENTION_GRAIN
#define ATTENTION_GRAIN 1024
#endif
// (row, KV head) positions per task. At 4096, four rows of 160 positions (12 tasks) ran on one thread:
// 57 µs, against 34 at 1024 (2-core AMD EPYC, AVX2); a lone row of 150 stays on one (~15 µs).
constexpr int64_t kAttentionGrain = ATTENTION_GRAIN;

// Every row's attention, one task per (row, KV head), over slots checked by the caller. A row's
// query heads start `q_row_stride` floats after the previous row's (the stack reads them in place
// in its fused q|k|v output); `slots` holds `positions` per row, of which row r reads length[r].
template <typename T>
void attend_rows(const float* query, int64_t q_row_stride, const T* keys, const T* values, int64_t kv_heads,
                 int64_t heads, int64_t dim, const int64_t* slot, int64_t positions, const int64_t* length,
                 int64_t rows, float* result) {
  const int64_t group = heads / kv_heads, stride = head_stride<T>(dim);
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  // Threads only for enough positions to pay for waking them: a lone row's few hundred take ~10 µs.
  const int64_t grain = std::max<int64_t>(1, kAttentionGrain / std::max<int64_t>(1, positions));
  at::parallel_for(0, rows * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * positions);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, g = task % kv_heads;
      attend_one_kv_head(query + r * q_row_stride + g * group * dim, keys + g * stride, values + g * stride,
                         kv_heads * stride, slot + r * positions, length[r], group, dim, scale, scores.data(), positions,
                         result + r * heads * dim + g * group * dim, nullptr, stride);
    }
  });
}

// One decode row's attention over its cached positions, read in place from the paged cache: the
// slots of positions 0…length-1 come from the row's block table, so no keys or values are gathered
// into a tensor first (a gather of every layer's K and V per step, then scaled_dot_product_attention
// at ~70 µs a call, was a fifth of a lone compiled step). One task per (row, KV head): its query
// heads (grouped-query attention) share each key and value as it is read. Two passes over the
// scores (max, then exp and sum), as the softmax is defined; fp32 arithmetic over an fp32 or fp16 cache.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lengths) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "decode_attention: q must be a contiguous [rows, heads, head_dim] float32 tensor");
  const auto cache_type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 3 && (cache_type == at::kFloat || cache_type == at::kHalf || cache_type == at::kChar) &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == cache_type &&
                  v_cache.is_contiguous(),
              "decode_attention: the caches must be contiguous [slots, kv_heads, head_dim] float32 or float16 tensors, "
              "or [slots, kv_heads, head_dim + 4] int8 ones");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  const int64_t row_width = cache_type == at::kChar ? head_stride<int8_t>(dim) : dim;
  TORCH_CHECK(k_cache.size(2) == row_width && heads % kv_heads == 0,
              "decode_attention: head_dim differs or heads are not a multiple of kv_heads");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == rows && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  lengths.dim() == 1 && lengths.size(0) == rows && lengths.scalar_type() == at::kLong &&
                  lengths.is_contiguous(),
              "decode_attention: slots must be a contiguous [rows, positions] int64 tensor, lengths [rows] int64");
  const int64_t positions = slots.size(1), cache_slots = k_cache.size(0);
  at::Tensor out = at::empty({rows, heads * dim}, q.options());
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(length[r] >= 1 && length[r] <= positions, "decode_attention: row ", r, " sees ", length[r],
                " positions, its slots hold ", positions);
    for (int64_t t = 0; t < length[r]; ++t)
      TORCH_CHECK(slot[r * positions + t] >= 0 && slot[r * positions + t] < cache_slots,
                  "decode_attention: a slot past the cache's ", cache_slots);
  }
  if (cache_type == at::kHalf)
    attend_rows(q.data_ptr<float>(), heads * dim, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(),
                kv_heads, heads, dim, slot, positions, length, rows, out.data_ptr<float>());
  else if (cache_type == at::kChar)
    attend_rows(q.data_ptr<float>(), heads * dim, k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
                kv_heads, heads, dim, slot, positions, length, rows, out.data_ptr<float>());
  else
    attend_rows(q.data_ptr<float>(), heads * dim, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), kv_heads,
                heads, dim, slot, positions, length, rows, out.data_ptr<float>());
  return out;
}

// --- A whole decode step in one call ---------------------------------------------------------------
//
// A lone decode step through SmolLM2's 30 layers is ~150 kernel calls. Run as a compiled graph
// (inductor) the arithmetic took ~5 ms of a ~7.4 ms step on a 2-core EPYC and the rest went to
// calling: dynamo's entry, Python between the custom ops, and inductor's own small loops, each an
// OpenMP fork and join. DecodeStack holds every layer's weights and caches once and runs the
// whole step in C++, in one parallel region whose threads meet at a barrier after each product,
// as llama.cpp's graph does: the norms, rotary, cache writes and activation are loops over a few
// thousand floats that every thread repeats for itself. It serves the decode steps of engines
// whose block linears are all 4-bit on these kernels with an fp32 cache
// (inference/engine/owned/stack.py); the lm_head stays in Python, where its own routing lives.

// out = x · rsqrt(mean(x²) + eps) · weight, per row of `width` floats (transformers' LlamaRMSNorm).
void rms_norm_rows(const float* x, const float* weight, int64_t rows, int64_t width, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * width;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < width; ++i) squares += row[i] * row[i];
    const float inverse = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
    float* normed = out + r * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) normed[i] = row[i] * inverse * weight[i];
  }
}

// Rotary embedding in place on `count` heads of `dim` (transformers' layout: the halves of each
// head rotate together): x·cos + rotate_half(x)·sin, rotate_half(x) = (-x₂, x₁).
void rotate_heads(float* heads, int64_t count, int64_t dim, const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < count; ++h) {
    float* x = heads + h * dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float first = x[i], second = x[i + half];
      x[i] = first * cos[i] - second * sin[i];
      x[i + half] = second * cos[i + half] + first * sin[i + half];
    }
  }
}

// out[i] = silu(gate[i]) · up[i], silu(g) = g · σ(g). σ from e^-|g| (an argument ≤ 0, the range
// exp_ps serves): σ(g) = 1 / (1 + e^-g) for g ≥ 0, else e^g / (1 + e^g).
void silu_times(const float* gate, const float* up, int64_t count, float* out) {
  int64_t i = 0;
#if defined(CEILING_AVX512)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= count; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sigma = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sigma), _mm512_loadu_ps(up + i)));
  }
#elif defined(CEILING_AVX2)
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (; i + 8 <= count; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_ps(_mm256_or_ps(g, sign));  // -|g|
    const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 sigma = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigma), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < count; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// A 4-bit linear of the stack: its weights' raw layout and an optional bias (null when the layer
// has none), read without touching a tensor inside the step's parallel region. The tensors are
// kept so the memory stays alive.
struct StackLinear {
  at::Tensor codes, scales, bias;
  Q4Weights weights;
  const float* bias_values;

  StackLinear(at::Tensor codes_, at::Tensor scales_, at::Tensor bias_)
      : codes(codes_), scales(scales_), bias(bias_),
        weights{codes_.data_ptr<uint8_t>(), scales_.data_ptr<at::Half>(), codes_.size(0), codes_.size(1) * 2},
        bias_values(bias_.numel() ? bias_.data_ptr<float>() : nullptr) {
    // What q4_linear checks on every call, once: the step reads these without a check.
    TORCH_CHECK(codes_.dim() == 2 && codes_.is_contiguous() && scales_.is_contiguous() &&
                    weights.k % kGroup == 0 && scales_.numel() == weights.n * (weights.row_scales() / 8) * 8,
                "DecodeStack: a linear's codes must be a contiguous [out, in/2] uint8 tensor (in a multiple of 32), "
                "its scales_and_mins a contiguous [out, ceil(in/128), 8] float16 tensor");
  }

  // This thread's share of out[rows, n] = x·Wᵀ (+ bias): an even split of the output rows, as
  // at::parallel_for would hand them out, so that each thread reads its own part of the weights.
  void share(const QuantizedRows& xq, int64_t rows, float* out, int thread, int threads) const {
    const int64_t n = weights.n, parts = std::min<int64_t>(threads, (n + kGrain - 1) / kGrain);
    const int64_t each = (n + parts - 1) / parts, begin = thread * each, end = std::min(n, begin + each);
    if (begin >= end) return;
    q4_rows(xq, rows, weights, begin, end, out);
    if (bias_values == nullptr) return;
    for (int64_t r = 0; r < rows; ++r)
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) out[r * n + i] += bias_values[i];
  }
};

void add_into(float* target, const float* source, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) target[i] += source[i];
}

struct StackLayer {
  at::Tensor input_norm, post_norm;
  StackLinear qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;  // [slots, kv_heads, head_dim] fp32 or fp16, shared with the runner
  // The same memory as raw pointers, for the step's parallel region (which touches no tensor).
  const float* input_norm_values;
  const float* post_norm_values;
  void* k_values;
  void* v_values;
};

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(at::Tensor embed, at::Tensor cos, at::Tensor sin, at::Tensor final_norm, int64_t heads,
              int64_t kv_heads, int64_t page_size, double eps)
      : embed_(embed), cos_(cos), sin_(sin), final_norm_(final_norm), heads_(heads), kv_heads_(kv_heads),
        page_(page_size), eps_(static_cast<float>(eps)) {
    TORCH_CHECK(embed.dim() == 2 && embed.scalar_type() == at::kFloat && embed.is_contiguous(),
                "DecodeStack: the embeddings must be a contiguous [vocab, hidden] float32 tensor");
    TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.scalar_type() == at::kFloat &&
                    sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
                "DecodeStack: cos and sin must be contiguous [positions, head_dim] float32 tables");
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && page_size > 0,
                "DecodeStack: heads must be a multiple of kv_heads, the page size positive");
    hidden_ = embed.size(1);
    dim_ = cos.size(1);
    TORCH_CHECK(dim_ % 2 == 0, "DecodeStack: head_dim must be even");
    check_vector(final_norm, hidden_, "final_norm");
    final_norm_values_ = final_norm.data_ptr<float>();
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor qkv_codes, at::Tensor qkv_scales,
                 at::Tensor qkv_bias, at::Tensor o_codes, at::Tensor o_scales, at::Tensor gate_up_codes,
                 at::Tensor gate_up_scales, at::Tensor down_codes, at::Tensor down_scales, at::Tensor k_cache,
                 at::Tensor v_cache) {
    const int64_t width = (heads_ + 2 * kv_heads_) * dim_;
    check_vector(input_norm, hidden_, "input_norm");
    check_vector(post_norm, hidden_, "post_norm");
    TORCH_CHECK(qkv_codes.size(0) == width && qkv_codes.size(1) * 2 == hidden_,
                "DecodeStack: q|k|v must map hidden to (heads + 2·kv_heads)·head_dim");
    TORCH_CHECK(qkv_bias.numel() == 0 || (qkv_bias.numel() == width && qkv_bias.scalar_type() == at::kFloat &&
                                          qkv_bias.is_contiguous()),
                "DecodeStack: the q|k|v bias must be empty or [out] float32");
    TORCH_CHECK(o_codes.size(0) == hidden_ && o_codes.size(1) * 2 == heads_ * dim_,
                "DecodeStack: o must map heads·head_dim to hidden");
    TORCH_CHECK(gate_up_codes.size(0) % 2 == 0 && gate_up_codes.size(1) * 2 == hidden_ &&
                    down_codes.size(1) * 2 == gate_up_codes.size(0) / 2 && down_codes.size(0) == hidden_,
                "DecodeStack: gate|up must map hidden to 2·intermediate, down intermediate to hidden");
    const auto cache_type = k_cache.scalar_type();
    const int64_t row_width = cache_type == at::kChar ? head_stride<int8_t>(dim_) : dim_;
    TORCH_CHECK(k_cache.dim() == 3 && (cache_type == at::kFloat || cache_type == at::kHalf || cache_type == at::kChar) &&
                    k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                    v_cache.scalar_type() == cache_type && v_cache.is_contiguous() && k_cache.size(1) == kv_heads_ &&
                    k_cache.size(2) == row_width,
                "DecodeStack: the caches must be contiguous [slots, kv_heads, head_dim] float32 or float16 tensors, "
                "or [slots, kv_heads, head_dim + 4] int8 ones");
    TORCH_CHECK(layers_.empty() || (k_cache.size(0) == layers_.front().k_cache.size(0) &&
                                    cache_type == layers_.front().k_cache.scalar_type()),
                "DecodeStack: every layer's cache must hold the same slots, of the same type");
    cache_type_ = cache_type;
    TORCH_CHECK(layers_.empty() || down_codes.size(1) == layers_.front().down.codes.size(1),
                "DecodeStack: every layer must have the same intermediate size");
    const at::Tensor no_bias = at::empty({0}, embed_.options());  // only q|k|v carries one (Qwen2's)
    layers_.push_back({input_norm, post_norm, {qkv_codes, qkv_scales, qkv_bias}, {o_codes, o_scales, no_bias},
                       {gate_up_codes, gate_up_scales, no_bias}, {down_codes, down_scales, no_bias}, k_cache, v_cache,
                       input_norm.data_ptr<float>(), post_norm.data_ptr<float>(), k_cache.data_ptr(),
                       v_cache.data_ptr()});
  }

  // The decode step of rows r = 0…B-1: token tokens[r] at position lengths[r] - 1, its K and V
  // written to that position's slot, attending over positions 0…lengths[r]-1 of its block table
  // (block_tables[r], page_size slots per block). Returns the final-normed hidden states [B, hidden]
  // (the lm_head's input).
  //
  // The whole step is one parallel region: torch's threads are woken once, not for each of the
  // ~150 products and attentions (each an OpenMP fork and join), and meet at a barrier after each
  // product. Every thread keeps its own copy of the residual stream and computes the norms, the
  // activation and the input's int8 quantization itself: a few thousand floats, cheaper to repeat
  // than to hand over through another barrier. The products split their output rows evenly, the
  // attention hands out one (row, KV head) at a time, each rotating its own heads and writing its
  // own K and V first.
  at::Tensor step(at::Tensor tokens, at::Tensor lengths, at::Tensor block_tables) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack: no layers added");
    const int64_t rows = tokens.size(0);
    TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.is_contiguous() && rows > 0 &&
                    lengths.dim() == 1 && lengths.size(0) == rows && lengths.scalar_type() == at::kLong &&
                    lengths.is_contiguous() && block_tables.dim() == 2 && block_tables.size(0) == rows &&
                    block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
                "DecodeStack.step: tokens and lengths must be [rows] int64, block_tables [rows, blocks] int64");
    const int64_t* length = lengths.data_ptr<int64_t>();
    const int64_t* token = tokens.data_ptr<int64_t>();
    const int64_t vocab = embed_.size(0);
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(token[r] >= 0 && token[r] < vocab, "DecodeStack.step: token ", token[r], " is not in the vocabulary");
    const int64_t longest = *std::max_element(length, length + rows);
    const std::vector<int64_t> slots = read_slots(block_tables, length, rows, longest);

    const int64_t hidden = hidden_, dim = dim_, q_width = heads_ * dim, kv_width = kv_heads_ * dim;
    const int64_t qkv_width = q_width + 2 * kv_width, group = heads_ / kv_heads_;
    const int64_t intermediate = layers_.front().down.weights.k;
    const int64_t widest = std::max({hidden, intermediate, q_width});
    const int team = std::max(1, at::get_num_threads());
    const int64_t parts = attention_parts(rows, kv_heads_, longest, team);
    // Written by the products' shares, read by every thread after the barrier that follows them.
    std::vector<float> qkv(rows * qkv_width), attended(rows * q_width), o_out(rows * hidden),
        gate_up(rows * 2 * intermediate), down_out(rows * hidden);
    // Each thread's own: the residual stream, a product's input and its int8 codes, attention scores.
    std::vector<float> residual(team * rows * hidden), input(team * rows * widest), scores(team * group * longest);
    // Attention cut into parts: each part's output and stats (shared), each thread's rotated query.
    std::vector<float> part_out, part_stats, part_query;
    if (parts > 1) {
      part_out.resize(rows * kv_heads_ * parts * group * dim);
      part_stats.resize(rows * kv_heads_ * parts * group * 2);
      part_query.resize(team * q_width);
    }
    std::vector<QuantizedRows> quantized(team);
    at::Tensor normed = at::empty({rows, hidden}, embed_.options());
    float* result = normed.data_ptr<float>();
    const float* embed = embed_.data_ptr<float>();
    const float* cos = cos_.data_ptr<float>();
    const float* sin = sin_.data_ptr<float>();
    const float scale = 1.f / std::sqrt(static_cast<float>(dim));

#pragma omp parallel num_threads(team)
    {
      const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
      float* h = residual.data() + thread * rows * hidden;
      float* x = input.data() + thread * rows * widest;
      float* own_scores = scores.data() + thread * group * longest;
      QuantizedRows& xq = quantized[thread];
      for (int64_t r = 0; r < rows; ++r) std::copy_n(embed + token[r] * hidden, hidden, h + r * hidden);
      for (size_t index = 0; index < layers_.size(); ++index) {
        const StackLayer& layer = layers_[index];
        if (index > 0) add_into(h, down_out.data(), rows * hidden);
        rms_norm_rows(h, layer.input_norm_values, rows, hidden, eps_, x);
        xq.assign(x, rows, hidden);
        layer.qkv.share(xq, rows, qkv.data(), thread, threads);
#pragma omp barrier
        if (parts > 1) {
          attend_in_parts(layer, qkv.data(), length, slots.data(), longest, rows, parts, cos, sin, scale,
                          own_scores, part_query.data() + thread * q_width, part_out.data(), part_stats.data());
          // the loop's own barrier: every part attended; each thread combines them for itself
          for (int64_t task = 0; task < rows * kv_heads_; ++task) {
            const int64_t r = task / kv_heads_, g = task % kv_heads_;
            combine_parts(part_out.data() + task * parts * group * dim, part_stats.data() + task * parts * group * 2,
                          parts, group, dim, x + r * q_width + g * group * dim);
          }
          xq.assign(x, rows, q_width);
        } else {
#pragma omp for schedule(dynamic, 1)
          for (int64_t task = 0; task < rows * kv_heads_; ++task) {
            const int64_t r = task / kv_heads_, g = task % kv_heads_;
            const int64_t position = length[r] - 1, slot = slots[r * longest + position];
            float* row = qkv.data() + r * qkv_width;
            float* key = row + q_width + g * dim;
            float* value = row + q_width + kv_width + g * dim;
            rotate_heads(row + g * group * dim, group, dim, cos + position * dim, sin + position * dim);
            rotate_heads(key, 1, dim, cos + position * dim, sin + position * dim);
            const auto write_and_attend = [&](auto* keys, auto* values) {
              const int64_t stride = head_stride<std::remove_pointer_t<decltype(keys)>>(dim);
              const int64_t slot_width = kv_heads_ * stride;
              store_kv(keys + slot * slot_width + g * stride, key, dim);
              store_kv(values + slot * slot_width + g * stride, value, dim);
              attend_one_kv_head(row + g * group * dim, keys + g * stride, values + g * stride, slot_width,
                                 slots.data() + r * longest, length[r], group, dim, scale, own_scores, longest,
                                 attended.data() + r * q_width + g * group * dim, nullptr, stride);
            };
            with_cache(layer, write_and_attend);
          }  // the loop's own barrier: every head attended
          xq.assign(attended.data(), rows, q_width);
        }
        layer.o.share(xq, rows, o_out.data(), thread, threads);
#pragma omp barrier
        add_into(h, o_out.data(), rows * hidden);
        rms_norm_rows(h, layer.post_norm_values, rows, hidden, eps_, x);
        xq.assign(x, rows, hidden);
        layer.gate_up.share(xq, rows, gate_up.data(), thread, threads);
#pragma omp barrier
        for (int64_t r = 0; r < rows; ++r) {
          const float* both = gate_up.data() + r * 2 * intermediate;
          silu_times(both, both + intermediate, intermediate, x + r * intermediate);
        }
        xq.assign(x, rows, intermediate);
        layer.down.share(xq, rows, down_out.data(), thread, threads);
#pragma omp barrier
      }
      if (thread == 0) {
        add_into(h, down_out.data(), rows * hidden);
        rms_norm_rows(h, final_norm_values_, rows, hidden, eps_, result);
      }
    }
    return normed;
  }

 private:
  // Calls attend(keys, values) with the layer's caches as the type they hold (fp32, fp16 or int8).
  template <typename Attend>
  void with_cache(const StackLayer& layer, Attend&& attend) const {
    if (cache_type_ == at::kHalf)
      attend(static_cast<at::Half*>(layer.k_values), static_cast<at::Half*>(layer.v_values));
    else if (cache_type_ == at::kChar)
      attend(static_cast<int8_t*>(layer.k_values), static_cast<int8_t*>(layer.v_values));
    else
      attend(static_cast<float*>(layer.k_values), static_cast<float*>(layer.v_values));
  }

  // One layer's attention with each row's positions cut into `parts`: one task per (row, part),
  // handed out one at a time (an omp for inside the step's parallel region, ending in its barrier).
  // A task reads every KV head of its positions, one head after another. A lone row's stacked step
  // at 2,000 positions (a SmolLM2-shaped model, 2-core AMD EPYC of the Zen 4 generation, variants
  // alternated in one process): 10.2 ms on an fp16 cache, 12.2 on fp32, with one task per KV head
  // over every position; 8.1 and 10.1 in parts with the prefetch (8.9 and 10.7 without it); 3.2 at
  // position 1. Every task rotates its own copy of the row's query heads;
  // the one that holds the row's new position rotates its keys and writes them and the values
  // first. Each (row, KV head, part)'s output and stats go to part_out and part_stats.
  void attend_in_parts(const StackLayer& layer, float* qkv, const int64_t* length, const int64_t* slots,
                       int64_t longest, int64_t rows, int64_t parts, const float* cos, const float* sin, float scale,
                       float* scores, float* query, float* part_out, float* part_stats) const {
    const int64_t dim = dim_, q_width = heads_ * dim, kv_width = kv_heads_ * dim, group = heads_ / kv_heads_;
    const int64_t qkv_width = q_width + 2 * kv_width;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < rows * parts; ++task) {
      const int64_t r = task / parts, part = task % parts;
      const int64_t position = length[r] - 1, span = (length[r] + parts - 1) / parts;
      const int64_t begin = part * span, end = std::min(length[r], begin + span);
      const auto output = [&](int64_t g) { return (r * kv_heads_ + g) * parts + part; };
      if (begin >= end) {  // a short row's last parts hold no positions
        for (int64_t g = 0; g < kv_heads_; ++g)
          for (int64_t h = 0; h < group; ++h)
            part_stats[(output(g) * group + h) * 2] = -INFINITY, part_stats[(output(g) * group + h) * 2 + 1] = 0.f;
        continue;
      }
      float* row = qkv + r * qkv_width;
      std::copy_n(row, q_width, query);
      rotate_heads(query, heads_, dim, cos + position * dim, sin + position * dim);
      const auto write_and_attend = [&](auto* keys, auto* values) {
        const int64_t stride = head_stride<std::remove_pointer_t<decltype(keys)>>(dim);
        const int64_t slot_width = kv_heads_ * stride;
        if (begin <= position && position < end) {
          const int64_t slot = slots[r * longest + position];
          rotate_heads(row + q_width, kv_heads_, dim, cos + position * dim, sin + position * dim);
          for (int64_t g = 0; g < kv_heads_; ++g) {
            store_kv(keys + slot * slot_width + g * stride, row + q_width + g * dim, dim);
            store_kv(values + slot * slot_width + g * stride, row + q_width + kv_width + g * dim, dim);
          }
        }
        for (int64_t g = 0; g < kv_heads_; ++g)
          attend_one_kv_head(query + g * group * dim, keys + g * stride, values + g * stride, slot_width,
                             slots + r * longest + begin, end - begin, group, dim, scale, scores, longest,
                             part_out + output(g) * group * dim, part_stats + output(g) * group * 2,
                             stride);
      };
      with_cache(layer, write_and_attend);
    }
  }

  static void check_vector(const at::Tensor& t, int64_t size, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == size && t.scalar_type() == at::kFloat && t.is_contiguous(),
                "DecodeStack: ", name, " must be a contiguous [", size, "] float32 tensor");
  }

  // Each row's cache slots of positions 0…longest-1 ([rows, longest]; past a row's length its
  // first slot, never read), every block it reads checked to lie in the cache.
  std::vector<int64_t> read_slots(const at::Tensor& block_tables, const int64_t* length, int64_t rows,
                                  int64_t longest) const {
    const int64_t width = block_tables.size(1), cache_slots = layers_.front().k_cache.size(0);
    const int64_t* table = block_tables.data_ptr<int64_t>();
    std::vector<int64_t> slots(rows * longest);
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(length[r] >= 1 && length[r] <= cos_.size(0), "DecodeStack.step: row ", r, " has length ",
                  length[r], "; the rotary table holds ", cos_.size(0), " positions");
      TORCH_CHECK((length[r] + page_ - 1) / page_ <= width, "DecodeStack.step: row ", r, "'s block table is ",
                  width, " blocks, its length needs ", (length[r] + page_ - 1) / page_);
      for (int64_t b = 0; b * page_ < length[r]; ++b) {
        const int64_t block = table[r * width + b];
        TORCH_CHECK(block >= 0 && (block + 1) * page_ <= cache_slots, "DecodeStack.step: block ", block,
                    " is past the cache's ", cache_slots / page_);
      }
      int64_t* row = slots.data() + r * longest;
      for (int64_t t = 0; t < longest; ++t) {
        const int64_t position = t < length[r] ? t : 0;
        row[t] = table[r * width + position / page_] * page_ + position % page_;
      }
    }
    return slots;
  }

  at::Tensor embed_, cos_, sin_, final_norm_;
  const float* final_norm_values_ = nullptr;
  int64_t heads_, kv_heads_, page_, hidden_ = 0, dim_ = 0;
  float eps_;
  at::ScalarType cache_type_ = at::kFloat;  // what the layers' caches hold: fp32, fp16 or int8
  std::vector<StackLayer> layers_;
};

}  // namespace

TORCH_LIBRARY(ceiling, m) {
  m.def("q4_linear(Tensor x, Tensor codes, Tensor scales_and_mins) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lengths) -> Tensor");
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("step", &DecodeStack::step);
}

TORCH_LIBRARY_IMPL(ceiling, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
  m.impl("decode_attention", &decode_attention);
}
