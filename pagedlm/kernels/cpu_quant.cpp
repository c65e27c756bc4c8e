// Quantized products on the CPU with integer dot products (kernels/cpu_quant.py);
// at the end, the compiled one-row decode step's attention (decode_attention).
//
// y[m, n] = sum_k x[m, k] * w[n, k] for int4 weights (groups of 32:
// w = (q - 8) * s + z, q in 0..15, s and z bfloat16, as torch's int4 kernel
// reads them) and int8 weights (w = q * scale[n]). The activations are
// quantized first, llama.cpp's Q8 way: per group of 32, d = max|x| / 127,
// a = round(x / d) in -127..127. A group's product is then an integer dot
// product of 32 codes with 32 bytes, scaled once:
//   int4: d * (s * sum(q a) + (z - 8 s) * sum(a))
//   int8: d * scale * sum(q a)
//
// Weight layout (built at load, pack_int4 / pack_int8 in cpu_quant.py):
// tiles of 16 output rows; per tile and group, the lane of row r holds 4
// bytes of its row, so that one 512-bit dot product (vpdpbusd) advances 16
// rows by 4 inputs each against 4 activation bytes broadcast to all lanes.
//   int4: per (tile, group) 4 chunks of [16 rows][4 bytes]; chunk c, byte b
//         holds input 4c + b in its low nibble and 16 + 4c + b in its high
//         one; then [16 s][16 z] bfloat16 per (tile, group).
//   int8: per (tile, group) 8 steps of [16 rows][4 bytes], step t holding
//         inputs 4t..4t+3 as q + 128 (unsigned: vpdpbusd multiplies unsigned
//         by signed bytes; the 128 * sum(a) it adds is taken off per group).
// The AVX2 path (no VNNI) reads the same layout in two 8-row halves.
#include <ATen/Parallel.h>  // at::get_num_threads
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

enum { G = 32, MB = 4 };  // group size; activation rows per pass over a tile

// Q8 activations of rows [m, k]: codes a, per group d and sum(a).
static void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* a, float* d, int32_t* sum) {
    for (int64_t g = 0; g < m * k / G; g++) {
        const float* xg = x + g * G;
        float amax = 0.f;
        for (int j = 0; j < G; j++) amax = fmaxf(amax, fabsf(xg[j]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t s = 0;
        for (int j = 0; j < G; j++) {
            const int32_t q = (int32_t)nearbyintf(xg[j] * inv);
            a[g * G + j] = (int8_t)q;
            s += q;
        }
        d[g] = amax / 127.f;
        sum[g] = s;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
typedef __m512i ivec;
typedef __m512 fvec;
enum { LANES = 16, HALVES = 1 };
// acc += per lane the sum of 4 unsigned code bytes times 4 signed activation bytes
static inline ivec dot4_int4(ivec acc, ivec u8, int32_t s8x4) {
    return _mm512_dpbusd_epi32(acc, u8, _mm512_set1_epi32(s8x4));
}
static inline ivec dot4_int8(ivec acc, ivec biased, int32_t s8x4) { return dot4_int4(acc, biased, s8x4); }
static inline ivec load_i(const void* p) { return _mm512_loadu_si512(p); }
static inline ivec izero() { return _mm512_setzero_si512(); }
static inline ivec low4(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
static inline ivec high4(ivec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
static inline ivec isub(ivec a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
static inline fvec to_f(ivec v) { return _mm512_cvtepi32_ps(v); }
static inline fvec fset(float f) { return _mm512_set1_ps(f); }
static inline fvec fzero() { return _mm512_setzero_ps(); }
static inline fvec fma_(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
static inline fvec fmul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
static inline fvec fsub(fvec a, fvec b) { return _mm512_sub_ps(a, b); }
static inline fvec load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline fvec load_f(const float* p) { return _mm512_loadu_ps(p); }
static inline void store_f(float* p, fvec v) { _mm512_storeu_ps(p, v); }
#define INT8_BIAS 128  // q + 128 unsigned times a signed: sum(q a) + 128 sum(a)
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256i ivec;
typedef __m256 fvec;
enum { LANES = 8, HALVES = 2 };
// maddubs adds pairs of u8 * s8 into int16 with saturation: the int4 codes
// (<= 15) stay far below it, the biased int8 ones (q + 128) do not, so int8
// takes the sign route (|q| times a with q's sign), as llama.cpp does.
static inline ivec dot4_int4(ivec acc, ivec u8, int32_t s8x4) {
    const ivec p = _mm256_maddubs_epi16(u8, _mm256_set1_epi32(s8x4));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
static inline ivec load_i(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline ivec izero() { return _mm256_setzero_si256(); }
static inline ivec low4(ivec v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
static inline ivec high4(ivec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
static inline ivec isub(ivec a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
static inline fvec to_f(ivec v) { return _mm256_cvtepi32_ps(v); }
static inline fvec fset(float f) { return _mm256_set1_ps(f); }
static inline fvec fzero() { return _mm256_setzero_ps(); }
static inline fvec fma_(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
static inline fvec fmul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
static inline fvec fsub(fvec a, fvec b) { return _mm256_sub_ps(a, b); }
static inline fvec load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline fvec load_f(const float* p) { return _mm256_loadu_ps(p); }
static inline void store_f(float* p, fvec v) { _mm256_storeu_ps(p, v); }
#define INT8_BIAS 0  // the sign route below computes sum(q a) itself
static inline ivec dot4_int8(ivec acc, ivec biased, int32_t s8x4) {
    const ivec q = _mm256_xor_si256(biased, _mm256_set1_epi8((char)0x80));
    const ivec p = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(_mm256_set1_epi32(s8x4), q));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#else
#error "cpu_quant.cpp needs AVX2 and FMA (or AVX-512 VNNI)"
#endif

static inline int32_t word(const int8_t* p) { int32_t w; __builtin_memcpy(&w, p, 4); return w; }

// One tile (16 rows) of int4 weights times `mb` (<= MB) quantized activation rows.
static void int4_tile(const uint8_t* codes, const uint16_t* sz, int64_t groups, const int8_t* a,
                      const float* d, const int32_t* sum, int64_t k, int mb, float* y, int64_t n) {
    for (int h = 0; h < HALVES; h++) {
        fvec acc[MB];
        for (int i = 0; i < mb; i++) acc[i] = fzero();
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t* c = codes + g * 256 + h * LANES * 4;
            const uint16_t* p = sz + g * 32 + h * LANES;
            ivec q[8];
            for (int j = 0; j < 4; j++) {
                const ivec v = load_i(c + j * 64);
                q[j] = low4(v);
                q[j + 4] = high4(v);
            }
            const fvec s = load_bf16(p), z = load_bf16(p + 16);
            const fvec m = fsub(z, fmul(fset(8.f), s));
            for (int i = 0; i < mb; i++) {
                const int8_t* ag = a + i * k + g * G;
                ivec dot = izero();
                for (int t = 0; t < 8; t++) dot = dot4_int4(dot, q[t], word(ag + 4 * t));
                const float dg = d[i * groups + g];
                acc[i] = fma_(to_f(dot), fmul(s, fset(dg)), acc[i]);
                acc[i] = fma_(m, fset(dg * (float)sum[i * groups + g]), acc[i]);
            }
        }
        for (int i = 0; i < mb; i++) store_f(y + i * n + h * LANES, acc[i]);
    }
}

static void int8_tile(const uint8_t* codes, const float* scale, int64_t groups, const int8_t* a,
                      const float* d, const int32_t* sum, int64_t k, int mb, float* y, int64_t n) {
    for (int h = 0; h < HALVES; h++) {
        fvec acc[MB];
        for (int i = 0; i < mb; i++) acc[i] = fzero();
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t* c = codes + g * 512 + h * LANES * 4;
            ivec q[8];
            for (int t = 0; t < 8; t++) q[t] = load_i(c + t * 64);
            for (int i = 0; i < mb; i++) {
                const int8_t* ag = a + i * k + g * G;
                ivec dot = izero();
                for (int t = 0; t < 8; t++) dot = dot4_int8(dot, q[t], word(ag + 4 * t));
                dot = isub(dot, INT8_BIAS * sum[i * groups + g]);
                acc[i] = fma_(to_f(dot), fset(d[i * groups + g]), acc[i]);
            }
        }
        const fvec sc = load_f(scale + h * LANES);
        for (int i = 0; i < mb; i++) store_f(y + i * n + h * LANES, fmul(acc[i], sc));
    }
}

// y [m, n] = x [m, k] times the weight; rows of x in passes of MB, tiles of
// 16 output rows split over torch's intra-op threads (OpenMP: the libgomp
// torch loaded; at::parallel_for measured 2-18% slower on Gemma's head).
static at::Tensor cpu_quant_mm(const at::Tensor& input, const at::Tensor& tiles, const at::Tensor& scales) {
    const at::Tensor x = input.to(at::kFloat).contiguous();
    const bool int4 = scales.scalar_type() == at::kBFloat16;
    TORCH_CHECK(x.dim() == 2 && x.size(1) % G == 0 && tiles.is_contiguous() && scales.is_contiguous() &&
                    tiles.scalar_type() == at::kByte && tiles.size(1) == x.size(1) / G &&
                    (int4 || scales.scalar_type() == at::kFloat),
                "cpu_quant_mm: x [M, K] (K a multiple of 32) and tiles of cpu_quant.pack_int4 / pack_int8");
    const int64_t m = x.size(0), k = x.size(1), n = tiles.size(0) * 16, groups = k / G;
    TORCH_CHECK(tiles.numel() == n * k / (int4 ? 2 : 1) && scales.numel() == (int4 ? n * groups * 2 : n),
                "cpu_quant_mm: tiles or scales of another shape than x's inputs");
    at::Tensor y = at::empty({m, n}, x.options());
    std::vector<int8_t> a(m * k);
    std::vector<float> d(m * groups);
    std::vector<int32_t> sum(m * groups);
    quantize_rows(x.data_ptr<float>(), m, k, a.data(), d.data(), sum.data());
    const uint8_t* codes = tiles.data_ptr<uint8_t>();
    const void* sc = scales.data_ptr();
    float* out = y.data_ptr<float>();
    const int8_t* qa = a.data();
    const float* qd = d.data();
    const int32_t* qs = sum.data();
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(static)
    for (int64_t t = 0; t < n / 16; t++) {
        for (int64_t i = 0; i < m; i += MB) {
            const int mb = (int)(m - i < MB ? m - i : MB);
            if (int4)
                int4_tile(codes + t * groups * 256, (const uint16_t*)sc + t * groups * 32, groups, qa + i * k,
                          qd + i * groups, qs + i * groups, k, mb, out + i * n + t * 16, n);
            else
                int8_tile(codes + t * groups * 512, (const float*)sc + t * 16, groups, qa + i * k,
                          qd + i * groups, qs + i * groups, k, mb, out + i * n + t * 16, n);
        }
    }
    return y;
}

// The activations' Q8 codes, scales and sums, as the products compute them (for tests).
static std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_quant_q8(const at::Tensor& input) {
    const at::Tensor x = input.to(at::kFloat).contiguous();
    TORCH_CHECK(x.dim() == 2 && x.size(1) % G == 0, "cpu_quant_q8: x [M, K], K a multiple of 32");
    at::Tensor a = at::empty(x.sizes(), x.options().dtype(at::kChar));
    at::Tensor d = at::empty({x.size(0), x.size(1) / G}, x.options());
    at::Tensor sum = at::empty({x.size(0), x.size(1) / G}, x.options().dtype(at::kInt));
    quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), a.data_ptr<int8_t>(), d.data_ptr<float>(),
                  sum.data_ptr<int32_t>());
    return {a, d, sum};
}

// One query per head over every key: the attention of the compiled one-row
// CPU decode step (batch/compiled.py), where SDPA's CPU kernel spent ~115 us
// a layer on 512 keys of SmolLM2 (3 KV heads of 64: 393 KB read); this op,
// alone, 16 us with AVX-512 (attend_split), 26 us with AVX2, 57-60 us in
// plain loops (other head sizes). q [1, Hq, D]; k [S, Hkv, D], v [S, Hkv,
// Dv] (the store's views: any strides along
// keys and heads, the last dimension contiguous), float32; query head h reads
// KV head h / (Hq / Hkv). Split over (KV head, block of KB keys) on torch's
// threads; each split keeps its maximum, its sum of exp and its weighted
// values per query head, merged in a fixed order (the same bits on any
// thread count).
enum { KB = 64 };

// attend_split's vector operations, one struct per instruction set: W lanes,
// SLAB vectors of values per head in registers (AVX-512 has 32, AVX2 16).
#if defined(__AVX512F__)
#define ATTEND_VECTOR
struct Vec {
    typedef __m512 T;
    enum { W = 16, SLAB = 4 };
    static T zero() { return _mm512_setzero_ps(); }
    static T set1(float x) { return _mm512_set1_ps(x); }
    static T load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
    static T add(T a, T b) { return _mm512_add_ps(a, b); }
    static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
    static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
    static T max(T a, T b) { return _mm512_max_ps(a, b); }
    static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
    static T fnmadd(T a, T b, T c) { return _mm512_fnmadd_ps(a, b, c); }
    static T round(T x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static T scale2(T p, T n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
    // Lanes below cnt from x, the rest `other`.
    static T first(T x, int64_t cnt, float other) {
        return _mm512_mask_blend_ps((__mmask16)((1u << cnt) - 1), _mm512_set1_ps(other), x);
    }
    static float reduce_max(T x) { return _mm512_reduce_max_ps(x); }
    static float reduce_add(T x) { return _mm512_reduce_add_ps(x); }
    // y[i] = the sum of x[i]'s 16 lanes: four levels of adding shuffled pairs
    // (a horizontal sum per key would cost twice the key's products at D = 64),
    // which leave key 4m + b in lane 4b + m; one permutation puts it in lane 4m + b.
    static T sums(const T* x) {
        T t[8], u[4];
        for (int i = 0; i < 8; i++)  // 128-bit blocks: [a0 + a2, a1 + a3, b0 + b2, b1 + b3]
            t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x44),
                                 _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xEE));
        for (int i = 0; i < 4; i++)  // block b: 4 partial sums of key 4i + b
            u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
        const T v01 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
        const T v23 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
        const __m512d a = _mm512_castps_pd(v01), b = _mm512_castps_pd(v23);
        const T z = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
        return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), z);
    }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define ATTEND_VECTOR
struct Vec {
    typedef __m256 T;
    enum { W = 8, SLAB = 2 };
    static T zero() { return _mm256_setzero_ps(); }
    static T set1(float x) { return _mm256_set1_ps(x); }
    static T load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
    static T add(T a, T b) { return _mm256_add_ps(a, b); }
    static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
    static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
    static T max(T a, T b) { return _mm256_max_ps(a, b); }
    static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
    static T fnmadd(T a, T b, T c) { return _mm256_fnmadd_ps(a, b, c); }
    static T round(T x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static T scale2(T p, T n) {  // p * 2^n, 2^n built in the exponent bits (n >= -126)
        const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
    }
    static T first(T x, int64_t cnt, float other) {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cnt), lane);
        return _mm256_blendv_ps(_mm256_set1_ps(other), x, _mm256_castsi256_ps(below));
    }
    static float reduce(T x, bool max) {
        __m128 s = max ? _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1))
                       : _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
        s = max ? _mm_max_ps(s, _mm_movehl_ps(s, s)) : _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = max ? _mm_max_ss(s, _mm_movehdup_ps(s)) : _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    static float reduce_max(T x) { return reduce(x, true); }
    static float reduce_add(T x) { return reduce(x, false); }
    // y[i] = the sum of x[i]'s 8 lanes: two levels of hadd within 128-bit
    // halves, then the halves added in order.
    static T sums(const T* x) {
        const T u0 = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
        const T u1 = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
        return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    }
};
#endif

#ifdef ATTEND_VECTOR
typedef Vec::T V;
enum { W = Vec::W, SLAB = Vec::SLAB };

// exp(x) for x <= 0, W at a time (glibc's expf is scalar without -ffast-math):
// x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial (relative
// error < 1e-8 there), times 2^n; below -87 (e^-87 ~ 1.6e-38) it flushes to
// e^-87, which a sum that holds the maximum's 1 cannot see.
static inline V exp_nonpositive(V x) {
    x = Vec::max(x, Vec::set1(-87.f));
    const V n = Vec::round(Vec::mul(x, Vec::set1(1.44269504f)));
    V r = Vec::fnmadd(n, Vec::set1(0.693145752f), x);  // ln 2 in two parts
    r = Vec::fnmadd(n, Vec::set1(1.42860677e-6f), r);
    V p = Vec::set1(1.f / 5040);
    for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = Vec::fmadd(p, r, Vec::set1(c));
    return Vec::scale2(p, n);
}

// One split of decode_attention: query heads q [g][D] (g <= 16) over n <= KB
// keys k and values v (rows ks and vs apart) of their KV head; per head its
// maximum, its sum of exp and its weighted values into dst (rows of width).
// D and Dv multiples of W. Scores W keys at a time (Vec::sums); the values in
// slabs of SLAB vectors by 4 heads, their accumulators in registers; the
// split's values and the next W keys prefetched.
static void attend_split(const float* q, int64_t g, int64_t D, const float* k, int64_t ks, const float* v,
                         int64_t vs, int64_t Dv, int64_t n, float sc, float* dst, int64_t width) {
    float p[16][KB];
    for (int64_t s = 0; s < n; s++)  // the values arrive while the scores are computed
        for (int64_t d = 0; d < Dv; d += 16) _mm_prefetch((const char*)(v + s * vs + d), _MM_HINT_T0);
    for (int64_t c0 = 0; c0 < n; c0 += W) {
        const int64_t cnt = n - c0 < W ? n - c0 : W;
        for (int64_t m = W; m < 2 * W && c0 + m < n; m++)
            for (int64_t d = 0; d < D; d += 16) _mm_prefetch((const char*)(k + (c0 + m) * ks + d), _MM_HINT_T0);
        for (int64_t j = 0; j < g; j++) {
            const float* qj = q + j * D;
            V acc[W];
            for (int64_t m = 0; m < W; m++) {
                V a = Vec::zero();
                if (m < cnt) {
                    const float* kr = k + (c0 + m) * ks;
                    for (int64_t d = 0; d < D; d += W) a = Vec::fmadd(Vec::load(qj + d), Vec::load(kr + d), a);
                }
                acc[m] = a;
            }
            Vec::store(p[j] + c0, Vec::first(Vec::mul(Vec::sums(acc), Vec::set1(sc)), cnt, -INFINITY));
        }
    }
    for (int64_t j = 0; j < g; j++) {
        V big = Vec::set1(-INFINITY), total = Vec::zero();
        for (int64_t c0 = 0; c0 < n; c0 += W) big = Vec::max(big, Vec::load(p[j] + c0));
        const float m = Vec::reduce_max(big);
        for (int64_t c0 = 0; c0 < n; c0 += W) {
            const int64_t cnt = n - c0 < W ? n - c0 : W;
            const V e = Vec::first(exp_nonpositive(Vec::sub(Vec::load(p[j] + c0), Vec::set1(m))), cnt, 0.f);
            Vec::store(p[j] + c0, e);
            total = Vec::add(total, e);
        }
        dst[j * width] = m;
        dst[j * width + 1] = Vec::reduce_add(total);
    }
    for (int64_t d0 = 0; d0 < Dv; d0 += SLAB * W) {
        const int64_t nv = (Dv - d0) / W < SLAB ? (Dv - d0) / W : SLAB;
        for (int64_t j0 = 0; j0 < g; j0 += 4) {
            const int64_t nj = g - j0 < 4 ? g - j0 : 4;
            V acc[4][SLAB];
            for (int jj = 0; jj < 4; jj++)
                for (int c = 0; c < SLAB; c++) acc[jj][c] = Vec::zero();
            for (int64_t s = 0; s < n; s++) {
                const float* vr = v + s * vs + d0;
                V vv[SLAB];
                for (int c = 0; c < SLAB; c++) vv[c] = c < nv ? Vec::load(vr + W * c) : Vec::zero();
                for (int jj = 0; jj < 4; jj++) {
                    if (jj >= nj) break;
                    const V w = Vec::set1(p[j0 + jj][s]);
                    for (int c = 0; c < SLAB; c++) acc[jj][c] = Vec::fmadd(w, vv[c], acc[jj][c]);
                }
            }
            for (int jj = 0; jj < nj; jj++)
                for (int c = 0; c < nv; c++) Vec::store(dst + (j0 + jj) * width + 2 + d0 + W * c, acc[jj][c]);
        }
    }
}
#endif

static at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& k, const at::Tensor& v, double scale) {
    TORCH_CHECK(query.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                    query.dim() == 3 && query.size(0) == 1 && k.dim() == 3 && v.dim() == 3 &&
                    k.size(0) == v.size(0) && k.size(1) == v.size(1) && k.size(2) == query.size(2) &&
                    k.size(0) > 0 && k.stride(2) == 1 && v.stride(2) == 1 && query.size(1) % k.size(1) == 0,
                "decode_attention: float32 q [1, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv], S > 0, Hq a multiple of Hkv");
    const at::Tensor q = query.contiguous();
    const int64_t S = k.size(0), Hkv = k.size(1), D = k.size(2), Dv = v.size(2), Hq = q.size(1), g = Hq / Hkv;
    const int64_t nb = (S + KB - 1) / KB, width = Dv + 2;
    std::vector<float> part(Hkv * nb * g * width);
    const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
    const int64_t ks = k.stride(0), kh = k.stride(1), vs = v.stride(0), vh = v.stride(1);
    const float sc = (float)scale;
    float* parts = part.data();
#ifdef ATTEND_VECTOR
    const bool vector = D % W == 0 && Dv % W == 0 && g <= 16;
#endif
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(static)
    for (int64_t item = 0; item < Hkv * nb; item++) {
        const int64_t h = item / nb, s0 = (item % nb) * KB, s1 = s0 + KB < S ? s0 + KB : S;
#ifdef ATTEND_VECTOR
        if (vector) {
            attend_split(qp + h * g * D, g, D, kp + s0 * ks + h * kh, ks, vp + s0 * vs + h * vh, vs, Dv, s1 - s0, sc,
                         parts + item * g * width, width);
            continue;
        }
#endif
        float scores[KB];
        for (int64_t j = 0; j < g; j++) {
            const float* qh = qp + (h * g + j) * D;
            float* dst = parts + (item * g + j) * width;
            float m = -INFINITY;
            for (int64_t s = s0; s < s1; s++) {
                const float* kr = kp + s * ks + h * kh;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qh[d] * kr[d];
                scores[s - s0] = dot * sc;
                m = fmaxf(m, dot * sc);
            }
            float l = 0.f;
#pragma omp simd reduction(+ : l)  // vector expf (libmvec; -fno-math-errno)
            for (int64_t s = 0; s < s1 - s0; s++) {
                scores[s] = expf(scores[s] - m);
                l += scores[s];
            }
            float* acc = dst + 2;
            for (int64_t d = 0; d < Dv; d++) acc[d] = 0.f;
            for (int64_t s = s0; s < s1; s++) {
                const float p = scores[s - s0];
                const float* vr = vp + s * vs + h * vh;
#pragma omp simd
                for (int64_t d = 0; d < Dv; d++) acc[d] += p * vr[d];
            }
            dst[0] = m;
            dst[1] = l;
        }
    }
    at::Tensor out = at::empty({1, Hq, Dv}, q.options());
    float* o = out.data_ptr<float>();
    for (int64_t h = 0; h < Hkv; h++)
        for (int64_t j = 0; j < g; j++) {
            float big = -INFINITY, total = 0.f;
            for (int64_t b = 0; b < nb; b++) big = fmaxf(big, parts[((h * nb + b) * g + j) * width]);
            float* oh = o + (h * g + j) * Dv;
            for (int64_t d = 0; d < Dv; d++) oh[d] = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const float* src = parts + ((h * nb + b) * g + j) * width;
                const float w = expf(src[0] - big);
                total += src[1] * w;
                for (int64_t d = 0; d < Dv; d++) oh[d] += src[2 + d] * w;
            }
            for (int64_t d = 0; d < Dv; d++) oh[d] /= total;
        }
    return out;
}

#ifndef PAGEDLM_OPS
#define PAGEDLM_OPS pagedlm  // the namespace of the ops (tests build the AVX2 path under another)
#endif
#define REGISTER(ns) TORCH_LIBRARY_FRAGMENT(ns, lib)
REGISTER(PAGEDLM_OPS) {
    lib.def("cpu_quant_mm(Tensor x, Tensor tiles, Tensor scales) -> Tensor");
    lib.def("cpu_quant_q8(Tensor x) -> (Tensor, Tensor, Tensor)");
    lib.impl("cpu_quant_mm", c10::DispatchKey::CPU, TORCH_FN(cpu_quant_mm));
    lib.impl("cpu_quant_q8", c10::DispatchKey::CPU, TORCH_FN(cpu_quant_q8));
    lib.def("decode_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
    lib.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
}
