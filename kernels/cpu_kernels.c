/* CPU kernels for the decode hot path, built once per machine by kernels/cpu.py and called through ctypes.
 *
 * Weights: W (N, K) in blocks of 32 along K, nb = K / 32 blocks per row, stored as planes:
 *   4-bit  qs uint8 (N, nb, 16)  byte j of a block holds q_j (low nibble) and q_{j+16} (high nibble)
 *          d  fp16  (N, nb)      scale
 *          m  fp16  (N, nb)      offset; NULL means symmetric, m = -8 d
 *          w = d * q + m
 *   8-bit  qs int8  (N, nb, 32), d fp16 (N, nb); w = d * q
 * GGML's Q4_1, Q4_0 and Q8_0 blocks are exactly these fields, interleaved; kernels/cpu.py splits them into
 * planes so eight blocks' scales load as one vector.
 *
 * Activations are quantized per block of 32 to int8 (scale ad, block sum as = ad * sum q), as llama.cpp's
 * Q8_1 does, so a block's dot product is an integer one:
 *   y = sum_b d_b ad_b sum_i q_bi qx_bi + m_b as_b
 * kernels/ref.py defines the same arithmetic in torch; tests/test_cpu_kernels.py holds the two together.
 *
 * Float tensors are fp32 and contiguous. Threads: OpenMP, the pool PyTorch has already loaded.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define USE_AVX2 1
#endif
#if defined(USE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define USE_VNNI 1  /* AVX-512 VNNI: vpdpbusd, 64 byte products summed into int32 lanes in one instruction */
#endif

typedef struct {
    int8_t *q;  /* M * ldq int8 values in the layout the kernel reads (below: QUADS and WIDE8 interleave a tile's rows) */
    float *d;   /* M * ldd block scales, likewise */
    float *s;   /* (M, nb): each block's scale times the sum of its values, in block order */
    int ldq, ldd;
} acts;

static float half_to_float(uint16_t h) {
#ifdef USE_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0 && mant == 0) {
        bits = sign;
    } else if (exp == 0) { /* subnormal: normalize */
        exp = 127 - 15 + 1;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp - 15 + 127) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* fp32 -> fp16, rounding to nearest even (as torch's .half()); past 65504 -> inf */
static uint16_t float_to_half(float f) {
#ifdef USE_AVX2
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax > 0x7f800000) return (uint16_t)(sign | 0x7e00);  /* nan */
    if (ax >= 0x47800000) return (uint16_t)(sign | 0x7c00);  /* >= 2^16 (and inf): inf */
    if (ax >= 0x38800000) {  /* a normal half (65520 and above round up to inf): rebias, drop 13 bits */
        uint32_t h = ax - ((uint32_t)(127 - 15) << 23);
        return (uint16_t)(sign | ((h + 0xfff + ((h >> 13) & 1)) >> 13));
    }
    if (ax <= 0x33000000) return (uint16_t)sign;  /* <= 2^-25: rounds to zero */
    /* a subnormal half: the value in units of 2^-24 is m >> shift */
    uint32_t m = (ax & 0x7fffff) | 0x800000, shift = 126 - (ax >> 23), h = m >> shift;
    uint32_t rest = m & ((1u << shift) - 1), tie = 1u << (shift - 1);
    return (uint16_t)(sign | (h + (rest > tie || (rest == tie && (h & 1)))));
#endif
}

/* Where quantize_row puts each block's 32 values (in two runs: values 0-15, values 16-31) and its scale, for the
 * kernel that reads them:
 * NATURAL  block order: K bytes and nb scales a row.
 * PAIRS    AVX2, 4-bit weights: blocks pair up (b, b+1) as [lo16(b) lo16(b+1) hi16(b) hi16(b+1)], matching 32 bytes
 *          of packed nibbles, and within each group of eight blocks the scales sit in the order the kernel's
 *          reduction produces its sums, [0 2 4 6 1 3 5 7].
 * QUADS    AVX-512 VNNI, 4-bit weights: chunks of four blocks, 128 bytes [lo16(b) .. lo16(b+3) hi16(b) .. hi16(b+3)]
 *          matching 64 bytes of packed nibbles, and 16 scales, each block's repeated over the 4 int32 lanes its
 *          products land in.
 * WIDE8    AVX-512 VNNI, 8-bit weights: chunks of two blocks, 64 bytes in block order, and 16 scales (8 a block).
 * QUADS and WIDE8 interleave the rows of a tile chunk by chunk (chunk c of every row, then chunk c + 1), so that
 * the kernel finds each row of a pass at a constant offset; a row's last chunk is padded with zeros. */
enum { NATURAL, PAIRS, QUADS, WIDE8 };

/* Block xb (32 floats) -> int8 codes, values 0-15 at lo and 16-31 at hi, rounded as torch.round does (ties to
 * even); returns the block's scale amax / 127 and sets *sum to the codes' sum. */
static inline float quantize_block(const float *xb, int8_t *lo, int8_t *hi, int *sum) {
#ifdef USE_AVX2
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(xb + 8 * k);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[k]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float scale = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    __m128i c[8];  /* the codes as int32, four at a time */
    __m256i total = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
        __m256i ck = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], _mm256_set1_ps(inv)),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        total = _mm256_add_epi32(total, ck);
        c[2 * k] = _mm256_castsi256_si128(ck), c[2 * k + 1] = _mm256_extracti128_si256(ck, 1);
    }
    _mm_storeu_si128((__m128i *)lo, _mm_packs_epi16(_mm_packs_epi32(c[0], c[1]), _mm_packs_epi32(c[2], c[3])));
    _mm_storeu_si128((__m128i *)hi, _mm_packs_epi16(_mm_packs_epi32(c[4], c[5]), _mm_packs_epi32(c[6], c[7])));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
    *sum = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1)));
    return scale;
#else
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
    float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    *sum = 0;
    for (int i = 0; i < 32; i++) {
        int v = (int)nearbyintf(xb[i] * inv);
        (i < 16 ? lo : hi - 16)[i] = (int8_t)v;
        *sum += v;
    }
    return scale;
#endif
}

/* One activation row x (nb blocks) into q, d (the layout's) and s (each block's scale times its codes' sum, in block
 * order); QUADS and WIDE8: a row's chunk c + 1 lies q_step bytes and d_step floats after its chunk c. */
static void quantize_row(const float *x, int nb, int layout, int8_t *q, float *d, size_t q_step, size_t d_step,
                         float *s) {
    if (layout == QUADS || layout == WIDE8) {  /* what lies past the last block reads as zeros */
        int per = layout == QUADS ? 4 : 2, last = (nb - 1) / per;
        memset(q + last * q_step, 0, layout == QUADS ? 128 : 64);
        memset(d + last * d_step, 0, 16 * sizeof(float));
    }
    for (int b = 0; b < nb; b++) {
        size_t lo, hi, at;  /* where values 0-15 and 16-31 go, and the scale */
        int lanes = 1;
        if (layout == QUADS) {
            lo = b / 4 * q_step + 16 * (b % 4), hi = lo + 64, at = b / 4 * d_step + 4 * (b % 4), lanes = 4;
        } else if (layout == WIDE8) {
            lo = b / 2 * q_step + 32 * (b % 2), hi = lo + 16, at = b / 2 * d_step + 8 * (b % 2), lanes = 8;
        } else if (layout == PAIRS && (b ^ 1) < nb) {
            int k = b % 8;
            lo = 32 * (b & ~1) + 16 * (b & 1), hi = lo + 32, at = b < nb / 8 * 8 ? b - k + (k % 2 ? 4 + k / 2 : k / 2) : b;
        } else {
            lo = 32 * b, hi = lo + 16, at = b;
        }
        int sum;
        float scale = quantize_block(x + 32 * b, q + lo, q + hi, &sum);
        for (int l = 0; l < lanes; l++) d[at + l] = scale;
        s[b] = scale * (float)sum;
    }
}

#ifdef USE_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 bytes of nibbles -> 32 bytes 0..15, in weight order */
static inline __m256i unpack_nibbles(const uint8_t *p) {
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
}

/* 8 int32 partial sums of unsigned bytes u times signed bytes s */
static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* signed . signed: maddubs needs an unsigned operand, so |w| . (x with w's sign) */
static inline __m256i dot_s8_s8(__m256i w, __m256i x) {
    return dot_u8_s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

/* e^x for 8 floats: 2^n * e^r with |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error ~1e-7) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);  /* ln 2 split in two for precision */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    static const float c[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 7; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c[i]));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* p[j] holds 8 partial sums of block j; returns lane j = block j's total */
static inline __m256i block_totals(const __m256i p[8]) {
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}
#endif

enum { TILE = 32 };  /* activation rows per pass over a weight row: its unpacked blocks are reused TILE times */

#ifdef USE_AVX2
enum { PREFETCH = 4096 };  /* bytes of weight codes ahead of the ones being read */

/* Ask for the weight codes PREFETCH bytes past the `bytes` at qs (whole cache lines), and for the scales d and
 * offsets m (NULL: none) as far ahead in the row's blocks. The hardware prefetcher alone left a one-token step
 * (Qwen2.5-Coder-1.5B on 2 cores of an AMD EPYC) a fifth short of its speed with these hints. Always inlined: GCC
 * judged a call that only prefetches free of effects and dropped it. */
static inline __attribute__((always_inline)) void prefetch_weights(int bits, const uint8_t *qs, int bytes,
                                                                  const uint16_t *d, const uint16_t *m) {
    for (int i = 0; i < bytes; i += 64) _mm_prefetch((const char *)qs + PREFETCH + i, _MM_HINT_T0);
    int ahead = PREFETCH / (bits == 4 ? 8 : 16);  /* 2 bytes of scale per block of 16 or 32 code bytes */
    _mm_prefetch((const char *)d + ahead, _MM_HINT_T0);
    if (m) _mm_prefetch((const char *)m + ahead, _MM_HINT_T0);
}
#endif

/* out[i] = W row . activation row i, for the T <= TILE activation rows in `a` starting at row i0.
 * Every row's arithmetic is the same whatever T is, so a token's result does not depend on how many tokens
 * share the call (greedy speculative decoding relies on this). */
static inline __attribute__((always_inline)) void dot_rows(int bits, const uint8_t *qs, const uint16_t *d, const uint16_t *m, int nb, const acts *a,
                     int i0, int T, float *out) {
#ifdef USE_AVX2
    __m256 acc[TILE], acc_m[TILE];
    float tail[TILE];
    __m256i w[8];
    for (int t = 0; t < T; t++) acc[t] = acc_m[t] = _mm256_setzero_ps(), tail[t] = 0.0f;
    int b = 0;
    if (bits == 4) {
        const __m256i low = _mm256_set1_epi8(0x0f);
        const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        for (; b + 8 <= nb; b += 8) {  /* eight blocks, as four pairs sharing one 32-byte load each */
            __m256i lo[4], hi[4];
            prefetch_weights(4, qs + 16 * b, 128, d + b, m ? m + b : NULL);
            for (int j = 0; j < 4; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 16 * (b + 2 * j)));
                lo[j] = _mm256_and_si256(v, low);
                hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            /* scales in the order the reduction below leaves the sums: blocks 0 2 4 6 1 3 5 7 */
            __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b)));
            __m256 dw = _mm256_permutevar8x32_ps(d8, order);
            __m256 mw = m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + b))) : _mm256_mul_ps(d8, _mm256_set1_ps(-8.0f));
            for (int t = 0; t < T; t++) {
                const int8_t *aq = a->q + (size_t)(i0 + t) * a->ldq + 32 * b;
                __m256i p[4];
                for (int j = 0; j < 4; j++) {  /* int16 sums stay below 2 * 2 * 15 * 127 */
                    __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], _mm256_loadu_si256((const __m256i *)(aq + 64 * j))),
                                                   _mm256_maddubs_epi16(hi[j], _mm256_loadu_si256((const __m256i *)(aq + 64 * j + 32))));
                    p[j] = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));  /* [block 2j x4 | block 2j+1 x4] */
                }
                __m256i totals = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
                const float *ad = a->d + (size_t)(i0 + t) * a->ldd + b, *as = a->s + (size_t)(i0 + t) * nb + b;
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(ad)), _mm256_cvtepi32_ps(totals), acc[t]);
                acc_m[t] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(as), acc_m[t]);
            }
        }
        for (; b + 2 <= nb; b += 2) {  /* the remaining pairs */
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 16 * b));
            __m256i l = _mm256_and_si256(v, low), h = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            float d0 = half_to_float(d[b]), d1 = half_to_float(d[b + 1]);
            float m0 = m ? half_to_float(m[b]) : -8.0f * d0, m1 = m ? half_to_float(m[b + 1]) : -8.0f * d1;
            for (int t = 0; t < T; t++) {
                size_t row = (size_t)(i0 + t);
                const int8_t *aq = a->q + row * a->ldq + 32 * b;
                __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(l, _mm256_loadu_si256((const __m256i *)aq)),
                                               _mm256_maddubs_epi16(h, _mm256_loadu_si256((const __m256i *)(aq + 32))));
                __m256i p = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
                __m256 sc = _mm256_set_m128(_mm_set1_ps(d1 * a->d[row * a->ldd + b + 1]), _mm_set1_ps(d0 * a->d[row * a->ldd + b]));
                acc[t] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(p), acc[t]);
                tail[t] += m0 * a->s[row * nb + b] + m1 * a->s[row * nb + b + 1];
            }
        }
    } else {
        for (; b + 8 <= nb; b += 8) {  /* eight blocks at a time: their scales are one vector */
            prefetch_weights(8, qs + 32 * b, 256, d + b, NULL);
            for (int j = 0; j < 8; j++) w[j] = _mm256_loadu_si256((const __m256i *)(qs + 32 * (b + j)));
            __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b)));
            for (int t = 0; t < T; t++) {
                const int8_t *aq = a->q + (size_t)(i0 + t) * a->ldq + 32 * b;
                __m256i p[8];
                for (int j = 0; j < 8; j++) p[j] = dot_s8_s8(w[j], _mm256_loadu_si256((const __m256i *)(aq + 32 * j)));
                const float *ad = a->d + (size_t)(i0 + t) * a->ldd + b;
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(ad)), _mm256_cvtepi32_ps(block_totals(p)), acc[t]);
            }
        }
    }
    for (; b < nb; b++) {  /* a last single block, natural order */
        __m256i wb = bits == 4 ? unpack_nibbles(qs + 16 * b) : _mm256_loadu_si256((const __m256i *)(qs + 32 * b));
        float db = half_to_float(d[b]), mb = m ? half_to_float(m[b]) : -8.0f * db;
        for (int t = 0; t < T; t++) {
            size_t row = (size_t)(i0 + t);
            __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + row * a->ldq + 32 * b));
            __m256i p = bits == 4 ? dot_u8_s8(wb, x) : dot_s8_s8(wb, x);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(db * a->d[row * a->ldd + b]), _mm256_cvtepi32_ps(p), acc[t]);
            if (bits == 4) tail[t] += mb * a->s[row * nb + b];
        }
    }
    for (int t = 0; t < T; t++) out[t] = tail[t] + hsum(_mm256_add_ps(acc[t], acc_m[t]));
#else
    for (int t = 0; t < T; t++) {
        size_t row = (size_t)(i0 + t);
        const int8_t *x = a->q + row * a->ldq;
        float total = 0.0f;
        for (int b = 0; b < nb; b++) {
            int sum = 0;
            if (bits == 4) {
                const uint8_t *q = qs + 16 * b;
                for (int i = 0; i < 16; i++) sum += (q[i] & 0x0f) * x[32 * b + i] + (q[i] >> 4) * x[32 * b + i + 16];
            } else {
                const int8_t *q = (const int8_t *)qs + 32 * b;
                for (int i = 0; i < 32; i++) sum += q[i] * x[32 * b + i];
            }
            float db = half_to_float(d[b]);
            total += db * a->d[row * a->ldd + b] * (float)sum;
            if (bits == 4) total += (m ? half_to_float(m[b]) : -8.0f * db) * a->s[row * nb + b];
        }
        out[t] = total;
    }
#endif
}

#ifdef USE_VNNI
enum { VNNI_ROWS = 8, WEIGHT_ROWS = 2 };  /* at most, activation and weight rows a pass of dot_rows_vnni: their
                                          * 16 accumulators stay in registers */

static const int32_t LANE_BLOCK4[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
static const int32_t LANE_BLOCK8[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};

/* dot_rows with AVX-512 VNNI, for R <= 2 weight rows (row r's planes at qs + r qs_row, d + r nb, m + r nb) and
 * T <= VNNI_ROWS activation rows, whose chunk c starts at aq + c q_step (values) and ad + c d_step (scales), row t
 * abytes and 16 floats after row 0, and whose block sums are rows of as, nb apart; out[r * TILE + t].
 * vpdpbusd multiplies unsigned weight bytes by signed activation bytes and adds each four products into an int32
 * lane: the weights go in as 4-bit codes, or as 8-bit codes plus 128 (w ^ 0x80), and lane l of 16 belongs to
 * block l / 4 of a quad (4-bit) or l / 8 of a pair (8-bit). Each lane is scaled by its block's d * ad and
 * accumulated in fp32, so nothing is summed across lanes until the end. The blocks' offsets (m; -8 d for
 * symmetric 4-bit; -128 d, which takes the 8-bit codes' 128 back) multiply the block sums in a second loop, 16
 * blocks at a time. Two weight rows share each activation load; a row's arithmetic is the same whatever R and T
 * are. */
static inline __attribute__((always_inline)) void dot_rows_vnni(int bits, int R, const uint8_t *qs, size_t qs_row,
                                                               const uint16_t *d, const uint16_t *m, int nb,
                                                               const int8_t *aq, size_t q_step, const float *ad,
                                                               size_t d_step, const float *as, int T,
                                                               float *out) {
    const int per = bits == 4 ? 4 : 2, abytes = bits == 4 ? 128 : 64;  /* blocks in 64 weight bytes; a row's bytes */
    const __m512i lane_block = _mm512_loadu_si512(bits == 4 ? LANE_BLOCK4 : LANE_BLOCK8);
    __m512 acc[2][VNNI_ROWS];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b += per, qs += 64, aq += q_step, ad += d_step) {
        int n = nb - b < per ? nb - b : per;
        __m512i lo[2], hi[2];
        __m512 dw[2];
        for (int r = 0; r < R; r++) {
            const uint8_t *wr = qs + r * qs_row;
            const uint16_t *dr = d + (size_t)r * nb + b;
            prefetch_weights(bits, wr, 64, dr, bits == 4 && m ? m + (size_t)r * nb + b : NULL);
            __m512i w;
            __m256i d16;
            if (n == per) {  /* (a masked load here stalls on every weight line that comes from memory) */
                w = _mm512_loadu_si512(wr);
                d16 = bits == 4 ? _mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)dr))
                                : _mm256_castsi128_si256(_mm_loadu_si32(dr));
            } else {
                w = _mm512_maskz_loadu_epi8((1ULL << (n * 64 / per)) - 1, wr);
                d16 = _mm256_maskz_loadu_epi16((__mmask16)((1 << n) - 1), dr);
            }
            dw[r] = _mm512_permutexvar_ps(lane_block, _mm512_cvtph_ps(d16));  /* each lane's weight scale */
            if (bits == 4) {
                lo[r] = _mm512_and_si512(w, _mm512_set1_epi8(0x0f));
                hi[r] = _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0f));
            } else
                lo[r] = hi[r] = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
        }
        for (int t = 0; t < T; t++) {
            __m512i x_lo = _mm512_loadu_si512(aq + abytes * t), x_hi = bits == 4 ? _mm512_loadu_si512(aq + abytes * t + 64) : x_lo;
            __m512 sa = _mm512_loadu_ps(ad + 16 * t);
            for (int r = 0; r < R; r++) {
                __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], x_lo);
                if (bits == 4) p = _mm512_dpbusd_epi32(p, hi[r], x_hi);
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw[r], sa), acc[r][t]);
            }
        }
    }
    for (int b = 0; b < nb; b += 16) {
        __mmask16 k = nb - b >= 16 ? 0xffff : (__mmask16)((1 << (nb - b)) - 1);
        __m512 mw[2];
        for (int r = 0; r < R; r++) {
            mw[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (bits == 4 && m ? m : d) + (size_t)r * nb + b));
            if (bits == 8 || !m) mw[r] = _mm512_mul_ps(mw[r], _mm512_set1_ps(bits == 4 ? -8.0f : -128.0f));
        }
        for (int t = 0; t < T; t++) {
            const float *at = as + (size_t)nb * t + b;
            __m512 st = k == 0xffff ? _mm512_loadu_ps(at) : _mm512_maskz_loadu_ps(k, at);
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(mw[r], st, acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) out[r * TILE + t] = _mm512_reduce_add_ps(acc[r][t]);
}

/* out[r * TILE + i] = W row r . activation row i0 + i for R <= 2 weight rows and the T <= TILE rows of the tile at
 * i0: VNNI_ROWS rows a pass (the weight rows stay in L1), each count compiled as a constant */
static void dot_tile(int bits, int R, const uint8_t *qs, const uint16_t *d, const uint16_t *m, int nb, const acts *a,
                     int i0, int T, float *out) {
    int abytes = bits == 4 ? 128 : 64;
    size_t qs_row = (size_t)nb * (bits == 4 ? 16 : 32);
    for (int g = 0; g < T; g += VNNI_ROWS) {
        const int8_t *aq = a->q + (size_t)i0 * a->ldq + (size_t)abytes * g;
        const float *ad = a->d + (size_t)i0 * a->ldd + 16 * g, *as = a->s + (size_t)(i0 + g) * nb;
        size_t q_step = (size_t)abytes * T, d_step = 16 * (size_t)T;
        switch ((T - g < VNNI_ROWS ? T - g : VNNI_ROWS) * 16 + (R - 1) * 8 + bits / 4) {
#define CASE(k, r, bits) \
        case k * 16 + (r - 1) * 8 + bits / 4: \
            dot_rows_vnni(bits, r, qs, qs_row, d, m, nb, aq, q_step, ad, d_step, as, k, out + g); break;
#define ROWS(k) CASE(k, 1, 4) CASE(k, 1, 8) CASE(k, 2, 4) CASE(k, 2, 8)
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
#undef CASE
        }
    }
}
#else
enum { WEIGHT_ROWS = 1 };

static void dot_tile(int bits, int R, const uint8_t *qs, const uint16_t *d, const uint16_t *m, int nb, const acts *a,
                     int i0, int T, float *out) {
    (void)R;  /* one weight row at a time */
    /* constant arguments let the compiler specialize the common cases (one token; 4 or 8 bits) */
    if (T == 1 && bits == 4) dot_rows(4, qs, d, m, nb, a, i0, 1, out);
    else if (T == 1) dot_rows(8, qs, d, m, nb, a, i0, 1, out);
    else if (bits == 4) dot_rows(4, qs, d, m, nb, a, i0, T, out);
    else dot_rows(8, qs, d, m, nb, a, i0, T, out);
}
#endif

/* y (M, N) = x (M, K) @ W^T for W in 4-bit (bits 4) or 8-bit (bits 8) planes; with `accumulate`, y +=.
 * Returns 0, -1 for bad arguments, -2 when out of memory. */
int quant_matmul(int bits, const void *qs, const uint16_t *d, const uint16_t *m, int N, int K, const float *x, int M,
                 float *y, int accumulate) {
    if ((bits != 4 && bits != 8) || K % 32 || N < 0 || M < 0) return -1;
    int nb = K / 32;
    int layout = NATURAL;
    acts a = {.ldq = K, .ldd = nb};
#if defined(USE_VNNI)
    int chunks = bits == 4 ? (nb + 3) / 4 : (nb + 1) / 2;
    layout = bits == 4 ? QUADS : WIDE8, a.ldq = chunks * (bits == 4 ? 128 : 64), a.ldd = 16 * chunks;
#elif defined(USE_AVX2)
    if (bits == 4) layout = PAIRS;
#endif
    a.q = malloc((size_t)M * a.ldq + 32);
    a.d = malloc((size_t)M * a.ldd * sizeof(float));
    a.s = malloc((size_t)M * nb * sizeof(float));
    if (!a.q || !a.d || !a.s) {
        free(a.q), free(a.d), free(a.s);
        return -2;
    }
    size_t row = (size_t)nb * (bits == 4 ? 16 : 32);
    /* Weight rows a pass. Two share each activation load once a tile's activations outgrow L1 (long rows, many
     * tokens); otherwise one, so that the weights stream from memory in one sequential run. */
    int R = (size_t)(M < TILE ? M : TILE) * ((size_t)a.ldq + a.ldd * sizeof(float)) > 48 * 1024 ? WEIGHT_ROWS : 1;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int i = 0; i < M; i++) {
            int i0 = i / TILE * TILE, r = i - i0, rows = M - i0 < TILE ? M - i0 : TILE;
            float *s = a.s + (size_t)i * nb;
            if (layout == QUADS || layout == WIDE8) {  /* rows of a tile interleaved chunk by chunk */
                int abytes = layout == QUADS ? 128 : 64;
                quantize_row(x + (size_t)i * K, nb, layout, a.q + (size_t)i0 * a.ldq + (size_t)abytes * r,
                             a.d + (size_t)i0 * a.ldd + 16 * r, (size_t)abytes * rows, 16 * (size_t)rows, s);
            } else
                quantize_row(x + (size_t)i * K, nb, layout, a.q + (size_t)i * a.ldq, a.d + (size_t)i * a.ldd, 0, 0, s);
        }
        /* each thread streams its share of W's rows once, unpacking each block once per TILE tokens */
#pragma omp for schedule(static) collapse(2)
        for (int i0 = 0; i0 < (M + TILE - 1) / TILE * TILE; i0 += TILE) {
            for (int n = 0; n < N; n += R) {
                int T = M - i0 < TILE ? M - i0 : TILE, rows = N - n < R ? N - n : R;
                float v[WEIGHT_ROWS * TILE];
                const uint8_t *qr = (const uint8_t *)qs + n * row;
                const uint16_t *dr = d + (size_t)n * nb, *mr = m ? m + (size_t)n * nb : NULL;
                dot_tile(bits, rows, qr, dr, mr, nb, &a, i0, T, v);
                for (int r = 0; r < rows; r++)
                    for (int t = 0; t < T; t++) {
                        float *out = y + (size_t)(i0 + t) * N + n + r;
                        *out = accumulate ? *out + v[r * TILE + t] : v[r * TILE + t];
                    }
            }
        }
    }
    free(a.q), free(a.d), free(a.s);
    return 0;
}

/* Rows `rows` (n of them; NULL: rows 0..n-1) of W expanded to fp32 (n, K): the prefill path multiplies
 * dequantized weights with sgemm, and the embedding lookup reads a few rows. */
int quant_dequantize(int bits, const void *qs, const uint16_t *d, const uint16_t *m, int K, const int64_t *rows, int n,
                     float *out) {
    if ((bits != 4 && bits != 8) || K % 32 || n < 0) return -1;
    int nb = K / 32;
#pragma omp parallel for schedule(static) if (n > 16)
    for (int i = 0; i < n; i++) {
        size_t r = rows ? (size_t)rows[i] : (size_t)i;
        float *o = out + (size_t)i * K;
        for (int b = 0; b < nb; b++) {
            float db = half_to_float(d[r * nb + b]);
            if (bits == 8) {
                const int8_t *q = (const int8_t *)qs + (r * nb + b) * 32;
                for (int j = 0; j < 32; j++) o[32 * b + j] = db * (float)q[j];
            } else {
                const uint8_t *q = (const uint8_t *)qs + (r * nb + b) * 16;
                float mb = m ? half_to_float(m[r * nb + b]) : -8.0f * db;
                for (int j = 0; j < 16; j++) {
                    o[32 * b + j] = db * (float)(q[j] & 0x0f) + mb;
                    o[32 * b + j + 16] = db * (float)(q[j] >> 4) + mb;
                }
            }
        }
    }
    return 0;
}

/* ---- fp32 ops around the matmuls: each row's arithmetic is independent of how many rows share a call ---- */

/* out (M, K) = x * rsqrt(mean(x^2) + eps) * w */
void rms_norm(const float *x, const float *w, float eps, int M, int K, float *out) {
#pragma omp parallel for schedule(static) if (M > 4)
    for (int i = 0; i < M; i++) {
        const float *xr = x + (size_t)i * K;
        float *o = out + (size_t)i * K;
        double ss = 0.0;  /* double: K up to ~16k squares, summed in a fixed order */
        for (int j = 0; j < K; j++) ss += (double)xr[j] * xr[j];
        float r = 1.0f / sqrtf((float)(ss / K) + eps);
        for (int j = 0; j < K; j++) o[j] = xr[j] * r * w[j];
    }
}

/* In place on x (T, H, D) whose token rows are ld floats apart, row t at the angles cos/sin (T, D):
 * pairs (i, i + D/2) rotate ("rotate half"). */
void rope(float *x, long ld, const float *cos_t, const float *sin_t, int T, int H, int D) {
    int half = D / 2;
    for (int t = 0; t < T; t++) {
        const float *c = cos_t + (size_t)t * D, *s = sin_t + (size_t)t * D;
        for (int h = 0; h < H; h++) {
            float *v = x + (size_t)t * ld + (size_t)h * D;
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out (M, F) = silu(gate) * up, gate and up (M, F) with row strides ld (so both may be halves of one tensor) */
void silu_mul(const float *gate, const float *up, int M, int F, int ld, float *out) {
    for (int i = 0; i < M; i++) {
        int j = 0;
#ifdef USE_AVX2
        for (; j + 8 <= F; j += 8) {
            __m256 g = _mm256_loadu_ps(gate + (size_t)i * ld + j), u = _mm256_loadu_ps(up + (size_t)i * ld + j);
            __m256 sig = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
            _mm256_storeu_ps(out + (size_t)i * F + j, _mm256_mul_ps(_mm256_mul_ps(g, sig), u));
        }
#endif
        for (; j < F; j++) {
            float g = gate[(size_t)i * ld + j];
            out[(size_t)i * F + j] = g / (1.0f + expf(-g)) * up[(size_t)i * ld + j];
        }
    }
}

/* ---- causal attention over a KV cache: fp32 rows, or codes read as they are stored ---- */

/* How one kv head's keys or values are stored (kernels/ref.py defines each format):
 *   KV_F32      fp32 rows: row s at f + s * D
 *   KV_INT8     int8 codes q (rows of D) times fp16 scales sc (rows of D >> gshift): per token and group of channels
 *   KV_INT4     INT4 values: rows below nq are packed int4 codes q (rows of D / 2 bytes) times scales sc plus
 *               minimums mn, per token and group of channels; rows from nq on are exact, row s at f + (s % ring) * D
 *   KV_INT4_CH  INT4 keys: rows below nq are packed codes with a scale and a minimum per channel for each group of
 *               KEY_GROUP rows (sc, mn: a row of D per group); rows from nq on are exact, row s at f + (s % ring) * D
 * Head h's data start h * f_stride floats, h * q_stride code bytes and h * s_stride scales after head 0's. fs, fm: scratch where
 * attend_row puts the scales and minimums it reads, as fp32, at the same offsets. */
enum { KV_F32, KV_INT8, KV_INT4, KV_INT4_CH };
enum { KEY_GROUP = 32, MAX_INT4_D = 256 };  /* MAX_INT4_D: head_dim an INT4 cache takes */

typedef struct {
    const float *f;
    const void *q;
    const uint16_t *sc, *mn;
    long f_stride, q_stride, s_stride;
    float *fs, *fm;
    int nq, ring;
} kv_rows;

static inline __attribute__((always_inline)) float nibble(const void *q, int D, int s, int i) {
    uint8_t b = ((const uint8_t *)q)[(size_t)s * (D / 2) + i / 2];
    return (float)(i & 1 ? b >> 4 : b & 15);
}

/* Channel i of row s in fp32: a code times its scale (plus its minimum), as kernels/ref.py dequantizes. The
 * vector loops below mostly leave the codes as they are (key_dots, values64); this serves the remainders. */
static inline __attribute__((always_inline)) float kv_at(int fmt, int gshift, kv_rows r, int D, int s, int i) {
    size_t g;
    switch (fmt) {
    case KV_F32:
        return r.f[(size_t)s * D + i];
    case KV_INT8:
        return (float)((const int8_t *)r.q)[(size_t)s * D + i] * r.fs[(size_t)s * (D >> gshift) + (i >> gshift)];
    case KV_INT4:
        if (s >= r.nq) return r.f[(size_t)(s % r.ring) * D + i];
        g = (size_t)s * (D >> gshift) + (i >> gshift);
        return nibble(r.q, D, s, i) * r.fs[g] + r.fm[g];
    default:
        if (s >= r.nq) return r.f[(size_t)(s % r.ring) * D + i];
        g = (size_t)(s / KEY_GROUP) * D + i;
        return nibble(r.q, D, s, i) * r.fs[g] + r.fm[g];
    }
}

#ifdef USE_AVX2
/* The 8 codes of 4 packed bytes at p (channel 2j in the low nibble of byte j), as floats */
static inline __m256 nibbles8(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    __m256i x = _mm256_srlv_epi32(_mm256_set1_epi32((int)w), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    return _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15)));
}

/* Channels i .. i+7 of row s (i a multiple of 8: within one scale group, as groups are 16 or 32 channels) */
static inline __attribute__((always_inline)) __m256 kv_at8(int fmt, int gshift, kv_rows r, int D, int s, int i) {
    size_t g;
    switch (fmt) {
    case KV_F32:
        return _mm256_loadu_ps(r.f + (size_t)s * D + i);
    case KV_INT8: {
        __m128i c = _mm_loadl_epi64((const __m128i *)((const int8_t *)r.q + (size_t)s * D + i));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)),
                             _mm256_broadcast_ss(r.fs + (size_t)s * (D >> gshift) + (i >> gshift)));
    }
    case KV_INT4:
        if (s >= r.nq) return _mm256_loadu_ps(r.f + (size_t)(s % r.ring) * D + i);
        g = (size_t)s * (D >> gshift) + (i >> gshift);
        return _mm256_add_ps(_mm256_mul_ps(nibbles8((const uint8_t *)r.q + (size_t)s * (D / 2) + i / 2),
                                           _mm256_broadcast_ss(r.fs + g)), _mm256_broadcast_ss(r.fm + g));
    default:
        if (s >= r.nq) return _mm256_loadu_ps(r.f + (size_t)(s % r.ring) * D + i);
        g = (size_t)(s / KEY_GROUP) * D + i;
        return _mm256_add_ps(_mm256_mul_ps(nibbles8((const uint8_t *)r.q + (size_t)s * (D / 2) + i / 2),
                                           _mm256_loadu_ps(r.fs + g)), _mm256_loadu_ps(r.fm + g));
    }
}
#endif

static void halves_to_float(const uint16_t *h, size_t n, float *out) {
    size_t i = 0;
#ifdef USE_AVX2
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) out[i] = half_to_float(h[i]);
}

/* Converts the scales (and minimums) of rows first..last to fp32, into r.fs (r.fm) */
static void load_scales(int fmt, int gshift, kv_rows r, int D, int first, int last) {
    if (fmt == KV_INT8 || fmt == KV_INT4) {
        size_t ng = (size_t)D >> gshift, n = (size_t)(last + 1 - first) * ng;
        halves_to_float(r.sc + first * ng, n, r.fs + first * ng);
        if (fmt == KV_INT4) halves_to_float(r.mn + first * ng, n, r.fm + first * ng);
    } else if (fmt == KV_INT4_CH && first < r.nq) {
        int end = last + 1 < r.nq ? last + 1 : r.nq;
        size_t g0 = (size_t)first / KEY_GROUP * D, n = ((size_t)(end - 1) / KEY_GROUP + 1) * D - g0;
        halves_to_float(r.sc + g0, n, r.fs + g0);
        halves_to_float(r.mn + g0, n, r.fm + g0);
    }
}

/* Scratch floats one head's scales and minimums take in load_scales, for S rows */
static size_t scale_scratch(int fmt, int gshift, int D, int S) {
    switch (fmt) {
    case KV_INT8: return (size_t)S * (D >> gshift);
    case KV_INT4: return 2 * ((size_t)S * (D >> gshift) + 8);  /* value_offsets reads up to 7 floats past the end */
    case KV_INT4_CH: return 2 * (size_t)((S + KEY_GROUP - 1) / KEY_GROUP) * D;
    default: return 0;
    }
}

#ifdef USE_AVX2
/* 8 int8 codes at p as floats */
static inline __m256 codes8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Channels i .. i+7 of row s's codes as floats (INT8, or INT4 keys or values), or from cf: that row's codes
 * already unpacked (unpack_codes) by the caller for several query rows to share */
static inline __attribute__((always_inline)) __m256 code8(int fmt, kv_rows r, int D, int s, int i, const float *cf) {
    if (cf) return _mm256_loadu_ps(cf + i);
    if (fmt == KV_INT8) return codes8((const int8_t *)r.q + (size_t)s * D + i);
    return nibbles8((const uint8_t *)r.q + (size_t)s * (D / 2) + i / 2);
}

/* Rows s0 .. s0+n-1's codes as floats into out (n, D): exact small integers, so reading them back gives the bits
 * code8 computes from the codes */
static void unpack_codes(int fmt, kv_rows r, int D, int s0, int n, float *out) {
    for (int s = s0; s < s0 + n; s++)
        for (int i = 0; i < D; i += 8) _mm256_storeu_ps(out + (size_t)(s - s0) * D + i, code8(fmt, r, D, s, i, NULL));
}

/* Whether INT4 keys s .. s+7 are all codes of one key group: then q . (code * scale + minimum) is taken as
 * (q * scale) . code + q . minimum, with q * scale and q . minimum (scaled_query) shared by the group's keys */
static inline int int4_block(int kfmt, kv_rows k, int s) {
    return kfmt == KV_INT4_CH && s + 8 <= k.nq && s / KEY_GROUP == (s + 7) / KEY_GROUP;
}

/* q * the channel scales of key group g -> qsc (D); returns q . the group's minimums */
static float scaled_query(const float *qr, kv_rows k, int D, int g, float *qsc) {
    const float *sc = k.fs + (size_t)g * D, *mn = k.fm + (size_t)g * D;
    __m256 m8 = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) {
        __m256 q8 = _mm256_loadu_ps(qr + i);
        _mm256_storeu_ps(qsc + i, _mm256_mul_ps(q8, _mm256_loadu_ps(sc + i)));
        m8 = _mm256_fmadd_ps(q8, _mm256_loadu_ps(mn + i), m8);
    }
    return hsum(m8);
}

/* Eight partial sums of q . key row s + j into acc[j], j < 8, each in a fixed order; the keys advance together
 * through the channels, so their eight sums are independent chains. Quantized keys are not dequantized element by
 * element: INT8 sums codes times q within a group of channels, then scales the group's sum; an INT4 block (qsc
 * given) multiplies codes by q * scale. cf: NULL, or the eight keys' codes as floats (8, D). */
static inline __attribute__((always_inline)) void key_dots(int kfmt, int gshift, const float *qr, const float *qsc,
                                                           kv_rows k, int D, int s, const float *cf, __m256 *acc) {
#define CODES(j, i) code8(kfmt, k, D, s + (j), i, cf ? cf + (size_t)(j) * D : NULL)
    if (kfmt == KV_INT8) {
        for (int g0 = 0; g0 < D; g0 += 1 << gshift) {
            __m256 part[8], q8 = _mm256_loadu_ps(qr + g0);
            for (int j = 0; j < 8; j++) part[j] = _mm256_mul_ps(q8, CODES(j, g0));
            for (int i = g0 + 8; i < g0 + (1 << gshift); i += 8) {
                q8 = _mm256_loadu_ps(qr + i);
                for (int j = 0; j < 8; j++) part[j] = _mm256_fmadd_ps(q8, CODES(j, i), part[j]);
            }
            for (int j = 0; j < 8; j++) {
                __m256 scale = _mm256_broadcast_ss(k.fs + (size_t)(s + j) * (D >> gshift) + (g0 >> gshift));
                acc[j] = g0 ? _mm256_fmadd_ps(part[j], scale, acc[j]) : _mm256_mul_ps(part[j], scale);
            }
        }
    } else if (qsc) {
        __m256 q8 = _mm256_loadu_ps(qsc);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_mul_ps(q8, CODES(j, 0));
        for (int i = 8; i < D; i += 8) {
            q8 = _mm256_loadu_ps(qsc + i);
            for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(q8, CODES(j, i), acc[j]);
        }
    } else {
        __m256 q8 = _mm256_loadu_ps(qr);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_mul_ps(q8, kv_at8(kfmt, gshift, k, D, s + j, 0));
        for (int i = 8; i < D; i += 8) {
            q8 = _mm256_loadu_ps(qr + i);
            for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(q8, kv_at8(kfmt, gshift, k, D, s + j, i), acc[j]);
        }
    }
#undef CODES
}

/* The scaled dot products of query row qr (D) with keys s .. s+7: eight accumulators, reduced together.
 * qsc, qoff: for an int4_block, scaled_query's results for its group (else NULL); cf: NULL, or the eight keys'
 * codes as floats (8, D). */
static inline __attribute__((always_inline)) __m256 dots8(int kfmt, int gshift, const float *qr, const float *qsc,
                                                          float qoff, kv_rows k, int D, int s, float scale,
                                                          const float *cf) {
    __m256 acc[8] = {0};  /* all set by key_dots (D >= 8); the compiler cannot see it */
    key_dots(kfmt, gshift, qr, qsc, k, D, s, cf, acc);
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    __m256 dots = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    return _mm256_mul_ps(qsc ? _mm256_add_ps(dots, _mm256_set1_ps(qoff)) : dots, _mm256_set1_ps(scale));
}

/* acc[0..7] + a * value row s, channels i0 .. i0+63. A quantized value is not dequantized: a times its group's
 * scale multiplies the code; INT4's minimums are summed once per group (value_offsets) and start the accumulator.
 * An exact INT4 value (s >= v.nq) is read from the ring. cf: NULL, or the row's codes as floats. */
static inline __attribute__((always_inline)) void values64(int vfmt, int gshift, kv_rows v, int D, int s, int i0,
                                                           float a, __m256 *acc, const float *cf) {
    if (vfmt == KV_INT8 || (vfmt == KV_INT4 && s < v.nq)) {
        const float *sc = v.fs + (size_t)s * (D >> gshift) + (i0 >> gshift);
        __m256 ag[4];  /* 64 channels span 2 or 4 groups */
        for (int g = 0; g < 64 >> gshift; g++) ag[g] = _mm256_set1_ps(a * sc[g]);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(ag[(8 * j) >> gshift], code8(vfmt, v, D, s, i0 + 8 * j, cf), acc[j]);
    } else {
        __m256 a8 = _mm256_set1_ps(a);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(a8, kv_at8(vfmt, gshift, v, D, s, i0 + 8 * j), acc[j]);
    }
}

/* INT4 values: per group of channels g, sum over the coded rows first..last (all below v.nq) of
 * p[s] * inv * minimum(s, g) -> off[g]. Eight
 * groups a vector, one multiply-add per key (lanes past the last group sum the next key's minimums, unused). */
static inline __attribute__((always_inline)) void value_offsets(int gshift, kv_rows v, int D, int first, int last,
                                                                const float *p, float inv, float *off) {
    int ng = D >> gshift;  /* at most MAX_INT4_D / 16 = 16: two vectors, named so that they stay in registers */
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int s = first; s <= last; s++) {
        __m256 a = _mm256_set1_ps(p[s] * inv);
        lo = _mm256_fmadd_ps(a, _mm256_loadu_ps(v.fm + (size_t)s * ng), lo);
        if (ng > 8) hi = _mm256_fmadd_ps(a, _mm256_loadu_ps(v.fm + (size_t)s * ng + 8), hi);
    }
    float all[16];
    _mm256_storeu_ps(all, lo);
    _mm256_storeu_ps(all + 8, hi);
    for (int g = 0; g < ng; g++) off[g] = all[g];
}
#endif

/* One query row qr (D) against the key/value rows first..last of one kv head -> o (D); with w, each key's
 * softmax weight is added to w[s]. p: scratch, S floats. kfmt, vfmt and gshift are constants at each call (the
 * row_* functions below), so every format compiles to its own loops. */
static inline __attribute__((always_inline)) void attend_row(int kfmt, int vfmt, int gshift, const float *qr, kv_rows k,
                                                             kv_rows v, int D, int first, int last, float scale,
                                                             float *p, float *o, float *w) {
    load_scales(kfmt, gshift, k, D, first, last);
    load_scales(vfmt, gshift, v, D, first, last);
    float mx = -INFINITY;
    int s = first;
#ifdef USE_AVX2
    if (D % 8 == 0) {  /* eight keys at a time: their dot products reduce together */
        __m256 mx8 = _mm256_set1_ps(-INFINITY);
        float qsc[MAX_INT4_D], qoff = 0.0f;
        int qsc_group = -1;
        for (; s + 8 <= last + 1; s += 8) {
            int scaled = int4_block(kfmt, k, s);
            if (scaled && s / KEY_GROUP != qsc_group) qsc_group = s / KEY_GROUP, qoff = scaled_query(qr, k, D, qsc_group, qsc);
            __m256 dots = dots8(kfmt, gshift, qr, scaled ? qsc : NULL, qoff, k, D, s, scale, NULL);
            _mm256_storeu_ps(p + s, dots);
            mx8 = _mm256_max_ps(mx8, dots);
        }
        float m[8];  /* a maximum is exact: the order it is taken in does not matter */
        _mm256_storeu_ps(m, mx8);
        for (int j = 0; j < 8; j++) mx = m[j] > mx ? m[j] : mx;
    }
#endif
    for (; s <= last; s++) {
        float dot = 0.0f;
        for (int i = 0; i < D; i++) dot += qr[i] * kv_at(kfmt, gshift, k, D, s, i);
        p[s] = dot * scale;
        mx = fmaxf(mx, p[s]);
    }
    float sum = 0.0f;
    s = first;
#ifdef USE_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; s + 8 <= last + 1; s += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + s), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(p + s, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum(acc);
#endif
    for (; s <= last; s++) sum += (p[s] = expf(p[s] - mx));
    float inv = 1.0f / sum;
    if (w)
        for (s = first; s <= last; s++) w[s] += p[s] * inv;
    int i0 = 0;
#ifdef USE_AVX2
    float off[MAX_INT4_D / 16];
    if (vfmt == KV_INT4 && D >= 64) value_offsets(gshift, v, D, first, last < v.nq ? last : v.nq - 1, p, inv, off);
    for (; i0 + 64 <= D; i0 += 64) {  /* 64 output values stay in registers over all keys */
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = vfmt == KV_INT4 ? _mm256_set1_ps(off[(i0 + 8 * j) >> gshift]) : _mm256_setzero_ps();
        for (int s = first; s <= last; s++) {
            float a = p[s] * inv;
            values64(vfmt, gshift, v, D, s, i0, a, acc, NULL);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + i0 + 8 * j, acc[j]);
    }
#endif
    for (int i = i0; i < D; i++) o[i] = 0.0f;
    for (int s = first; s <= last; s++) {
        float a = p[s] * inv;
        for (int i = i0; i < D; i++) o[i] += a * kv_at(vfmt, gshift, v, D, s, i);
    }
}

#ifdef USE_AVX2
enum { PV_TILE = 32 };  /* keys whose value rows stay in L1 while every row of a kv head reads them */

/* `attend_row` for the n query rows r0 .. r0+n-1 of one kv head (row r: token r / group, query head of the group
 * r % group; qrow(r), orow(r) its q and output, last(r) its last key), with every key and value row read once for
 * all of them rather than once each (grouped-query heads and the tokens of a verification block share them); with
 * two rows or more, quantized codes are unpacked to floats once for all (exact small integers: the same bits).
 * Each row's arithmetic is attend_row's, operation for operation (the same 8-key dot products, maximum, exp
 * and sum, and value sums in key order, kept in o between tiles of keys), so a row's result does not depend on
 * which rows share the pass. Rows see keys from 0 (no window); keys must not depend on the row (INT4 keys: every
 * row reads codes up to the same k.nq); D % 8 == 0. p: scratch, n * S floats; mx: 8 * n floats; work:
 * (8 + PV_TILE) * D + n * (D + 1) floats. */
static inline __attribute__((always_inline)) void attend_rows(int kfmt, int vfmt, int gshift, const float *q, long q_ld,
                                                              kv_rows k, kv_rows v, int T, int S, int Hq, int group,
                                                              int D, int h, int r0, int n, float scale, float *p,
                                                              float *mx, float *work, float *out, float *w) {
    load_scales(kfmt, gshift, k, D, 0, S - 1);
    load_scales(vfmt, gshift, v, D, 0, S - 1);
#define QROW(r) (q + (size_t)((r) / group) * q_ld + (size_t)(h * group + (r) % group) * D)
#define OROW(r) (out + ((size_t)((r) / group) * Hq + h * group + (r) % group) * D)
#define LAST(r) (S - T + (r) / group)
    /* quantized codes are unpacked to floats once for all n rows: kf holds eight keys', vf a tile of values' */
    float *kf = work, *vf = kf + 8 * D, *qsc = vf + PV_TILE * D, *qoff = qsc + (size_t)n * D;
    int share = n > 1, qsc_group = -1;
    for (int j = 0; j < n; j++) _mm256_storeu_ps(mx + 8 * j, _mm256_set1_ps(-INFINITY));
    for (int s = 0; s + 8 <= S; s += 8) {  /* eight keys at a time, as attend_row takes them, for every row */
        int scaled = int4_block(kfmt, k, s);
        if (scaled && s / KEY_GROUP != qsc_group) {
            qsc_group = s / KEY_GROUP;
            for (int j = 0; j < n; j++) qoff[j] = scaled_query(QROW(r0 + j), k, D, qsc_group, qsc + (size_t)j * D);
        }
        const float *cf = share && (kfmt == KV_INT8 || scaled) ? kf : NULL;
        if (cf) unpack_codes(kfmt, k, D, s, 8, kf);
        for (int j = 0; j < n; j++) {
            int r = r0 + j;
            if (s + 8 > LAST(r) + 1) continue;
            const float *qs = scaled ? qsc + (size_t)j * D : NULL;
            float qo = scaled ? qoff[j] : 0.0f;
            __m256 dots = cf ? dots8(kfmt, gshift, QROW(r), qs, qo, k, D, s, scale, cf)  /* each compiled apart */
                             : dots8(kfmt, gshift, QROW(r), qs, qo, k, D, s, scale, NULL);
            _mm256_storeu_ps(p + (size_t)j * S + s, dots);
            _mm256_storeu_ps(mx + 8 * j, _mm256_max_ps(_mm256_loadu_ps(mx + 8 * j), dots));
        }
    }
    float *inv = mx;  /* row j's 1 / sum replaces its maxima once they are used */
    for (int j = 0; j < n; j++) {
        int r = r0 + j, last = LAST(r);
        const float *qr = QROW(r);
        float *pr = p + (size_t)j * S, m = -INFINITY;
        for (int jj = 0; jj < 8; jj++) m = mx[8 * j + jj] > m ? mx[8 * j + jj] : m;
        int s = (last + 1) / 8 * 8;
        for (; s <= last; s++) {
            float dot = 0.0f;
            for (int i = 0; i < D; i++) dot += qr[i] * kv_at(kfmt, gshift, k, D, s, i);
            pr[s] = dot * scale;
            m = fmaxf(m, pr[s]);
        }
        __m256 acc = _mm256_setzero_ps();
        for (s = 0; s + 8 <= last + 1; s += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pr + s), _mm256_set1_ps(m)));
            _mm256_storeu_ps(pr + s, e);
            acc = _mm256_add_ps(acc, e);
        }
        float sum = hsum(acc);
        for (; s <= last; s++) sum += (pr[s] = expf(pr[s] - m));
        inv[j] = 1.0f / sum;
        if (w)
            for (s = 0; s <= last; s++) w[s] += pr[s] * inv[j];
    }
    int d64 = D / 64 * 64;
    for (int s0 = 0; s0 < S; s0 += PV_TILE) {  /* 64 output values of a row in registers over a tile of keys */
        const float *cf = share && d64 && (vfmt == KV_INT8 || vfmt == KV_INT4) ? vf : NULL;
        if (cf) unpack_codes(vfmt, v, D, s0, S - s0 < PV_TILE ? S - s0 : PV_TILE, vf);
        for (int j = 0; j < n; j++) {
            int r = r0 + j, end = LAST(r) + 1 < s0 + PV_TILE ? LAST(r) + 1 : s0 + PV_TILE;
            if (end <= s0) continue;
            const float *pr = p + (size_t)j * S;
            float *o = OROW(r);
            float off[MAX_INT4_D / 16];
            if (vfmt == KV_INT4 && !s0 && d64)
                value_offsets(gshift, v, D, 0, LAST(r) < v.nq ? LAST(r) : v.nq - 1, pr, inv[j], off);
            for (int i0 = 0; i0 < d64; i0 += 64) {
                __m256 acc[8];
                for (int jj = 0; jj < 8; jj++)
                    acc[jj] = s0 ? _mm256_loadu_ps(o + i0 + 8 * jj)
                                 : vfmt == KV_INT4 ? _mm256_set1_ps(off[(i0 + 8 * jj) >> gshift]) : _mm256_setzero_ps();
                for (int s = s0; s < end; s++) {
                    float a = pr[s] * inv[j];
                    const float *vs = cf && !(vfmt == KV_INT4 && s >= v.nq) ? cf + (size_t)(s - s0) * D : NULL;
                    if (vs) values64(vfmt, gshift, v, D, s, i0, a, acc, vs);  /* each compiled apart */
                    else values64(vfmt, gshift, v, D, s, i0, a, acc, NULL);
                }
                for (int jj = 0; jj < 8; jj++) _mm256_storeu_ps(o + i0 + 8 * jj, acc[jj]);
            }
        }
    }
    for (int j = 0; j < n; j++) {  /* the channels past the last 64, as attend_row does them */
        int r = r0 + j, last = LAST(r);
        const float *pr = p + (size_t)j * S;
        float *o = OROW(r);
        for (int i = d64; i < D; i++) o[i] = 0.0f;
        for (int s = 0; s <= last; s++) {
            float a = pr[s] * inv[j];
            for (int i = d64; i < D; i++) o[i] += a * kv_at(vfmt, gshift, v, D, s, i);
        }
    }
#undef QROW
#undef OROW
#undef LAST
}
#endif

/* attend_row and attend_rows for each (key format, value format, group shift) the entry points use, each compiled
 * with them as constants: called from an OpenMP region, whose body the compiler outlines before inlining, the
 * formats would otherwise be run-time values tested for every element read. */
#define FORMATS(X) X(KV_F32, KV_F32, 0) X(KV_INT8, KV_INT8, 5) X(KV_INT8, KV_INT8, 4) X(KV_INT4_CH, KV_INT4, 5) \
    X(KV_INT4_CH, KV_INT4, 4)
#define ROW_FN(K, V, G) \
    static __attribute__((noinline)) void row_##K##_##V##_##G(const float *qr, kv_rows k, kv_rows v, int D, int first, \
                                                               int last, float scale, float *p, float *o, float *w) { \
        attend_row(K, V, G, qr, k, v, D, first, last, scale, p, o, w); \
    }
FORMATS(ROW_FN)

static void attend_row_any(int kfmt, int vfmt, int gshift, const float *qr, kv_rows k, kv_rows v, int D, int first,
                           int last, float scale, float *p, float *o, float *w) {
#define ROW_CASE(K, V, G) if (kfmt == K && vfmt == V && gshift == G) return row_##K##_##V##_##G(qr, k, v, D, first, last, scale, p, o, w);
    FORMATS(ROW_CASE)
    attend_row(kfmt, vfmt, gshift, qr, k, v, D, first, last, scale, p, o, w);
}

#ifdef USE_AVX2
#define ROWS_FN(K, V, G) \
    static __attribute__((noinline)) void rows_##K##_##V##_##G(const float *q, long q_ld, kv_rows k, kv_rows v, int T, \
                                                                int S, int Hq, int group, int D, int h, int r0, int n, \
                                                                float scale, float *p, float *mx, float *work, \
                                                                float *out, float *w) { \
        attend_rows(K, V, G, q, q_ld, k, v, T, S, Hq, group, D, h, r0, n, scale, p, mx, work, out, w); \
    }
FORMATS(ROWS_FN)

static void attend_rows_any(int kfmt, int vfmt, int gshift, const float *q, long q_ld, kv_rows k, kv_rows v, int T,
                            int S, int Hq, int group, int D, int h, int r0, int n, float scale, float *p, float *mx,
                            float *work, float *out, float *w) {
#define ROWS_CASE(K, V, G) if (kfmt == K && vfmt == V && gshift == G) \
        return rows_##K##_##V##_##G(q, q_ld, k, v, T, S, Hq, group, D, h, r0, n, scale, p, mx, work, out, w);
    FORMATS(ROWS_CASE)
    attend_rows(kfmt, vfmt, gshift, q, q_ld, k, v, T, S, Hq, group, D, h, r0, n, scale, p, mx, work, out, w);
}
#endif

/* kv head h's rows, with n_scales floats of scratch at fs for its scales (INT4: scales, then as many minimums) */
static kv_rows head_rows(kv_rows r, int h, float *fs, size_t n_scales) {
    if (r.f) r.f += h * r.f_stride;
    if (r.q) r.q = (const uint8_t *)r.q + h * r.q_stride;  /* codes: int8, or two int4 a byte */
    if (r.sc) r.sc += h * r.s_stride;
    if (r.mn) r.mn += h * r.s_stride;
    r.fs = fs;
    r.fm = fs + n_scales / 2;
    return r;
}

/* The keys a query row at key index p reads as INT4 codes (ref.QuantizedKV.row_quantized): the groups full once p
 * was written, within [first_exact, n_quantized] */
static int row_quantized(int p, int first_exact, int n_quantized) {
    int nq = (p + 1) / KEY_GROUP * KEY_GROUP;
    nq = nq > first_exact ? nq : first_exact;
    return nq < n_quantized ? nq : n_quantized;
}

/* Causal attention of T new queries against S keys, grouped-query heads, keys and values in formats kfmt, vfmt.
 * q (T, Hq, D), token rows q_ld floats apart. Query t sits at key index S - T + t and sees keys
 * (S - T + t - window, S - T + t] (all earlier ones when window <= 0). INT4 keys: query t reads codes below
 * row_quantized(S - T + t, first_exact, n_quantized). out (T, Hq, D).
 * mass: NULL, or (Hkv, S) rows mass_stride floats apart, to which each key's softmax weight is added, summed over
 * the queries and the query heads of its kv head (H2O's attention mass), in an order fixed by the thread count. */
static inline __attribute__((always_inline)) int attend(int kfmt, int vfmt, int gshift, const float *q, long q_ld,
                                                        kv_rows k, kv_rows v, int T, int S, int Hq, int Hkv, int D,
                                                        int window, int first_exact, int n_quantized, float *mass,
                                                        long mass_stride, float *out) {
    if (T > S || Hq % Hkv) return -1;
    int group = Hq / Hkv, failed = 0;
    size_t ks = scale_scratch(kfmt, gshift, D, S), vs = scale_scratch(vfmt, gshift, D, S);
    float scale = 1.0f / sqrtf((float)D);
#ifdef _OPENMP
    int n_threads = omp_get_max_threads();
#else
    int n_threads = 1;
#endif
    float *weights = mass ? calloc((size_t)n_threads * Hkv * S, sizeof(float)) : NULL;  /* per thread (Hkv, S) */
    if (mass && !weights) return -2;
    /* Without a window, and with keys every row reads alike (INT4 keys: when every row reads codes up to the same
     * key, as a single token's rows do), the rows of a kv head (its query heads times the T tokens) share one
     * pass over its keys and values, in runs spread over at least twice the threads. */
    int rows = group * T, nq_shared = row_quantized(S - 1, first_exact, n_quantized);
    int shared = window <= 0 && D % 8 == 0
                 && (kfmt != KV_INT4_CH || row_quantized(S - T, first_exact, n_quantized) == nq_shared);
    int pieces = (2 * n_threads + Hkv - 1) / Hkv;
    pieces = pieces > rows ? rows : pieces;
    pieces = pieces < 1 ? 1 : pieces;
    int chunk = rows > pieces ? (rows + pieces - 1) / pieces : 1;
    (void)shared, (void)chunk, (void)nq_shared;
#pragma omp parallel num_threads(n_threads)
    {
#ifdef _OPENMP
        int thread = omp_get_thread_num();
#else
        int thread = 0;
#endif
#ifdef USE_AVX2
        if (shared) {  /* each kv head's rows in `pieces` runs of `chunk`, every key read once per run */
            size_t work = (size_t)(8 + PV_TILE) * D + (size_t)chunk * (D + 1);  /* attend_rows' unpacked codes */
            float *p = malloc(((size_t)chunk * (S + 8) + ks + vs + work) * sizeof(float));
            if (!p) failed = 1;
#pragma omp for schedule(static)
            for (int u = 0; u < Hkv * pieces; u++) {
                int h = u / pieces, r0 = u % pieces * chunk, n = rows - r0 < chunk ? rows - r0 : chunk;
                if (!p || n <= 0) continue;
                float *scales = p + (size_t)chunk * (S + 8);
                kv_rows kh = head_rows(k, h, scales, ks), vh = head_rows(v, h, scales + ks, vs);
                kh.nq = vh.nq = nq_shared;
                float *w = weights ? weights + ((size_t)thread * Hkv + h) * S : NULL;
                attend_rows_any(kfmt, vfmt, gshift, q, q_ld, kh, vh, T, S, Hq, group, D, h, r0, n, scale, p,
                                p + (size_t)chunk * S, scales + ks + vs, out, w);
            }
            free(p);
        } else
#endif
        {
            float *p = malloc(((size_t)S + ks + vs) * sizeof(float));
            if (!p) failed = 1;
#pragma omp for schedule(static) collapse(2)
            for (int t = 0; t < T; t++)
                for (int h = 0; h < Hq; h++) {
                    if (!p) continue;
                    const float *qr = q + (size_t)t * q_ld + (size_t)h * D;
                    float *o = out + ((size_t)t * Hq + h) * D;
                    int last = S - T + t, first = window > 0 && last - window + 1 > 0 ? last - window + 1 : 0;
                    kv_rows kh = head_rows(k, h / group, p + S, ks), vh = head_rows(v, h / group, p + S + ks, vs);
                    kh.nq = vh.nq = row_quantized(last, first_exact, n_quantized);
                    float *w = weights ? weights + ((size_t)thread * Hkv + h / group) * S : NULL;
                    attend_row_any(kfmt, vfmt, gshift, qr, kh, vh, D, first, last, scale, p, o, w);
                }
            free(p);
        }
    }
    if (weights && !failed) {
#pragma omp parallel for schedule(static) collapse(2)
        for (int h = 0; h < Hkv; h++)
            for (int s = 0; s < S; s++) {
                float total = 0.0f;
                for (int i = 0; i < n_threads; i++) total += weights[((size_t)i * Hkv + h) * S + s];
                mass[h * mass_stride + s] += total;
            }
    }
    free(weights);
    return failed ? -2 : 0;
}

/* `attend` over fp32 keys and values k, v; kv head h's rows start h * head_stride floats after head 0's */
int attention(const float *q, long q_ld, const float *k, const float *v, long head_stride, int T, int S, int Hq, int Hkv, int D,
              int window, float *mass, long mass_stride, float *out) {
    kv_rows kr = {.f = k, .f_stride = head_stride}, vr = {.f = v, .f_stride = head_stride};
    return attend(KV_F32, KV_F32, 0, q, q_ld, kr, vr, T, S, Hq, Hkv, D, window, 0, 0, mass, mass_stride, out);
}

static int group_shift(int group, int D) {  /* log2(group) for a group of 16 or 32 channels dividing D; else -1 */
    int shift = group == 16 ? 4 : group == 32 ? 5 : -1;
    return shift > 0 && D % group == 0 ? shift : -1;
}

/* `attend` over an int8 cache: codes k, v (rows of D) with fp16 scales k_scale, v_scale (rows of D / group),
 * per token and group of channels (ref.quantize_int8), dequantized in registers as they are read. */
int attention_int8(const float *q, long q_ld, const int8_t *k, const int8_t *v, const uint16_t *k_scale,
                   const uint16_t *v_scale, long head_stride, long scale_stride, int T, int S, int Hq, int Hkv, int D,
                   int group, int window, float *mass, long mass_stride, float *out) {
    int gshift = group_shift(group, D);
    kv_rows kr = {.q = k, .sc = k_scale, .q_stride = head_stride, .s_stride = scale_stride};
    kv_rows vr = {.q = v, .sc = v_scale, .q_stride = head_stride, .s_stride = scale_stride};
    if (gshift == 5)
        return attend(KV_INT8, KV_INT8, 5, q, q_ld, kr, vr, T, S, Hq, Hkv, D, window, 0, 0, mass, mass_stride, out);
    if (gshift == 4)
        return attend(KV_INT8, KV_INT8, 4, q, q_ld, kr, vr, T, S, Hq, Hkv, D, window, 0, 0, mass, mass_stride, out);
    return -1;
}

/* One layer's INT4 cache (ref.QuantizedKV with bits 4, llmrun/kv_cache.py's store), per kv head: packed key and value
 * codes (rows of D / 2 bytes, code_stride bytes per head); key scales and minimums (a row of D per group of KEY_GROUP
 * positions, k_scale_stride per head); value scales and minimums (rows of D / group, v_scale_stride per head); the
 * rings of exact recent keys and values (ring rows of D, fp32, recent_stride per head). */
typedef struct {
    uint8_t *k, *v;
    uint16_t *k_scale, *k_min, *v_scale, *v_min;
    float *recent, *v_recent;
    long code_stride, k_scale_stride, v_scale_stride, recent_stride;
    int group, ring;  /* ring: the rings' rows; position s at row s % ring */
    int window;  /* the last `window` positions are read exact (kernels/ref.py's ring_window: ring less its spare
                    rows for a rollback) */
} int4_cache;

/* `attend` over an INT4 cache of S positions: keys below n_quantized are codes, first_exact <= n_quantized the
 * lowest from which the rings hold keys and values exactly (each query row reads codes up to its row_quantized,
 * keys and values alike). */
int attention_int4(const float *q, long q_ld, const int4_cache *c, int T, int S, int Hq, int Hkv, int D,
                   int n_quantized, int first_exact, int window, float *mass, long mass_stride, float *out) {
    int gshift = group_shift(c->group, D);
    if (first_exact > n_quantized || n_quantized % KEY_GROUP || first_exact % KEY_GROUP || c->ring < 1 || S - first_exact > c->ring
        || D > MAX_INT4_D)
        return -1;
    kv_rows kr = {.f = c->recent, .q = c->k, .sc = c->k_scale, .mn = c->k_min, .f_stride = c->recent_stride,
                  .q_stride = c->code_stride, .s_stride = c->k_scale_stride, .ring = c->ring};
    kv_rows vr = {.f = c->v_recent, .q = c->v, .sc = c->v_scale, .mn = c->v_min, .f_stride = c->recent_stride,
                  .q_stride = c->code_stride, .s_stride = c->v_scale_stride, .ring = c->ring};
    if (gshift == 5)
        return attend(KV_INT4_CH, KV_INT4, 5, q, q_ld, kr, vr, T, S, Hq, Hkv, D, window, first_exact, n_quantized,
                      mass, mass_stride, out);
    if (gshift == 4)
        return attend(KV_INT4_CH, KV_INT4, 4, q, q_ld, kr, vr, T, S, Hq, Hkv, D, window, first_exact, n_quantized,
                      mass, mass_stride, out);
    return -1;
}

/* x (M, D) -> codes (M, D), fp16 scales (M, D / group) as ref.quantize_int8 computes them, bit for bit: per group,
 * scale = fp16(max|x| / 127) and code = round(x * (1 / scale)), ties to even, clamped to +-127. */
int quantize_int8(const float *x, int M, int D, int group, int8_t *codes, uint16_t *scales) {
    if (group_shift(group, D) < 0) return -1;
    for (int r = 0; r < M; r++)
        for (int g = 0; g < D / group; g++) {
            const float *xg = x + (size_t)r * D + g * group;
            int8_t *q = codes + (size_t)r * D + g * group;
            float amax = 0.0f;
            for (int i = 0; i < group; i++) amax = fabsf(xg[i]) > amax ? fabsf(xg[i]) : amax;
            uint16_t h = float_to_half(amax / 127.0f);
            float scale = half_to_float(h), inv = scale > 0.0f ? 1.0f / scale : 0.0f;
            for (int i = 0; i < group; i++) {
                float c = nearbyintf(xg[i] * inv);
                q[i] = (int8_t)(c < -127.0f ? -127.0f : c > 127.0f ? 127.0f : c);
            }
            scales[(size_t)r * (D / group) + g] = h;
        }
    return 0;
}

/* Asymmetric 4-bit rounding of n values x[0], x[stride], ... (ref._int4_round, bit for bit): fp16 minimum lo and
 * scale = fp16((max - lo) / 15); code = round((x - lo) * (1 / scale)), ties to even, clamped to 0..15. */
static void int4_round(const float *x, long stride, int n, uint8_t *codes, uint16_t *scale, uint16_t *lo) {
    float mn = x[0], mx = x[0];
    for (int i = 1; i < n; i++) {
        float e = x[i * stride];
        mn = e < mn ? e : mn;
        mx = e > mx ? e : mx;
    }
    *lo = float_to_half(mn);
    float lo_f = half_to_float(*lo);
    *scale = float_to_half((mx - lo_f) / 15.0f);
    float s = half_to_float(*scale), inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (int i = 0; i < n; i++) {
        float c = nearbyintf((x[i * stride] - lo_f) * inv);
        codes[i] = (uint8_t)(c > 15.0f ? 15.0f : c > 0.0f ? c : 0.0f);
    }
}

static void pack_row(const uint8_t *codes, int D, uint8_t *packed) {  /* channel 2i low nibble of byte i */
    for (int i = 0; i < D / 2; i++) packed[i] = (uint8_t)(codes[2 * i] | codes[2 * i + 1] << 4);
}

/* Writes T new keys and values of every kv head (token rows ld floats apart, head j's D at + j * D) into slots
 * slot .. slot + T - 1 of an INT4 cache, as llmrun/kv_cache.py's store writes them, bit for bit: values per token;
 * keys and values into the exact rings, and each key group that fills quantized per channel. state: the layer's
 * {quantized, exact_from, end} (keys [0, quantized) are codes, keys and values [exact_from, end) exact in the
 * rings), updated. */
int int4_write(const int4_cache *c, int *state, int Hkv, int D, int slot, int T, const float *k, const float *v, long ld) {
    int gshift = group_shift(c->group, D), G = KEY_GROUP, R = c->ring;
    if (gshift < 0 || D > MAX_INT4_D || slot < 0 || T < 0 || R < 1) return -1;
    int g0 = slot / G * G, end = slot + T, full = end / G * G, exact_from = state[1];
    int lossy = slot < exact_from || slot > state[2];
    int start = lossy ? g0 : slot;
    start = start > end - R ? start : end - R;
    /* the keys [g0, end) of a head, then its values */
    float *seg = malloc(2 * sizeof(float) * (size_t)(end - g0) * D), *vseg = seg + (size_t)(end - g0) * D;
    if (!seg) return -2;
    for (int j = 0; j < Hkv; j++) {
        uint8_t *kq = c->k + j * c->code_stride, *vq = c->v + j * c->code_stride;
        uint16_t *ks = c->k_scale + j * c->k_scale_stride, *km = c->k_min + j * c->k_scale_stride;
        uint16_t *vs = c->v_scale + j * c->v_scale_stride, *vm = c->v_min + j * c->v_scale_stride;
        float *ring = c->recent + j * c->recent_stride, *vring = c->v_recent + j * c->recent_stride;
        int ng = D >> gshift, gs = 1 << gshift;
        for (int s = g0; s < slot; s++)  /* the partial group so far: exact, or from the codes below the rings */
            for (int i = 0; i < D; i++) {
                size_t g = (size_t)(s / G) * D + i, gv = (size_t)s * ng + (i >> gshift);
                seg[(size_t)(s - g0) * D + i] = s >= exact_from ? ring[(size_t)(s % R) * D + i]
                    : nibble(kq, D, s, i) * half_to_float(ks[g]) + half_to_float(km[g]);
                vseg[(size_t)(s - g0) * D + i] = s >= exact_from ? vring[(size_t)(s % R) * D + i]
                    : nibble(vq, D, s, i) * half_to_float(vs[gv]) + half_to_float(vm[gv]);
            }
        for (int t = 0; t < T; t++) {
            memcpy(seg + (size_t)(slot - g0 + t) * D, k + t * ld + j * D, sizeof(float) * D);
            memcpy(vseg + (size_t)(slot - g0 + t) * D, v + t * ld + j * D, sizeof(float) * D);
        }
        for (int g = g0; g < full; g += G) {  /* each filled group, per channel over its G positions */
            uint8_t block[KEY_GROUP][256], codes[KEY_GROUP];
            for (int i = 0; i < D; i++) {
                int4_round(seg + (size_t)(g - g0) * D + i, D, G, codes, ks + (size_t)(g / G) * D + i, km + (size_t)(g / G) * D + i);
                for (int s = 0; s < G; s++) block[s][i] = codes[s];
            }
            for (int s = 0; s < G; s++) pack_row(block[s], D, kq + (size_t)(g + s) * (D / 2));
        }
        for (int s = start; s < end; s++) {
            memcpy(ring + (size_t)(s % R) * D, seg + (size_t)(s - g0) * D, sizeof(float) * D);
            memcpy(vring + (size_t)(s % R) * D, vseg + (size_t)(s - g0) * D, sizeof(float) * D);
        }
        for (int t = 0; t < T; t++) {  /* values: per token, per group of channels */
            uint8_t row[256];
            for (int g = 0; g < ng; g++)
                int4_round(v + t * ld + j * D + g * gs, 1, gs, row + g * gs, vs + (size_t)(slot + t) * ng + g,
                           vm + (size_t)(slot + t) * ng + g);
            pack_row(row, D, vq + (size_t)(slot + t) * (D / 2));
        }
    }
    free(seg);
    int kept = lossy ? start : exact_from;
    state[0] = full;
    state[1] = kept > end - R ? kept : end - R;
    state[2] = end;
    return 0;
}

/* ---- one decode step through every layer in one call: no Python between the ops ---- */

typedef struct {
    const void *qs;
    const uint16_t *d, *m;
    const float *bias; /* or NULL */
    int bits, N, K;
} qlinear;

enum { CACHE_FP32, CACHE_INT8, CACHE_INT4 };

typedef struct {
    const float *attn_norm, *mlp_norm;
    const float *q_norm, *k_norm; /* NULL, or (D) each: every q and k head RMS-normalized before RoPE (Qwen3) */
    qlinear qkv, o, gate_up, down;
    /* this layer's cache: CACHE_FP32: fp32 (Hkv, max_len, D) buffers k_cache, v_cache; CACHE_INT8: int8 codes
     * (Hkv, max_len, D) with fp16 scales (Hkv, max_len, D / kv_group); CACHE_INT4: int4 and its int4_state
     * {quantized, exact_from, end} (see int4_write) */
    void *k_cache, *v_cache;
    uint16_t *k_scale, *v_scale;
    int4_cache int4;
    int *int4_state;
    float *scores; /* NULL, or (Hkv, max_len): H2O's accumulated attention mass, which the step's attention adds to */
} layer_params;

typedef struct {
    int n_layers, dim, n_heads, n_kv_heads, head_dim, ffn_dim, max_len, window;
    int kv_format; /* CACHE_FP32, CACHE_INT8 or CACHE_INT4 */
    int kv_group;  /* channels per scale of an int8 cache */
    float eps;
    const layer_params *layers;
} stack_params;

static int linear(const qlinear *w, const float *x, int M, float *y, int accumulate) {
    if (accumulate && w->bias) {  /* y += (x W + bias): the layer loop adds the biased output to y, in that order */
        float *out = malloc(sizeof(float) * (size_t)M * w->N);
        int rc = out ? linear(w, x, M, out, 0) : -2;
        for (long i = 0; !rc && i < (long)M * w->N; i++) y[i] += out[i];
        free(out);
        return rc;
    }
    int rc = quant_matmul(w->bits, w->qs, w->d, w->m, w->N, w->K, x, M, y, accumulate);
    if (w->bias && !rc)
        for (int t = 0; t < M; t++)
            for (int j = 0; j < w->N; j++) y[(long)t * w->N + j] += w->bias[j];
    return rc;
}

/* The attention of a step's T queries (rows qkv_ld floats apart) over layer L's cache of S positions -> att */
static int layer_attention(const stack_params *p, const layer_params *L, const float *qkv, long qkv_ld, int T, int S,
                           float *att) {
    int Hq = p->n_heads, Hkv = p->n_kv_heads, D = p->head_dim, G = p->kv_group;
    long head_stride = (long)p->max_len * D;
    switch (p->kv_format) {
    case CACHE_FP32:
        return attention(qkv, qkv_ld, L->k_cache, L->v_cache, head_stride, T, S, Hq, Hkv, D, p->window, L->scores,
                         p->max_len, att);
    case CACHE_INT8:
        return attention_int8(qkv, qkv_ld, L->k_cache, L->v_cache, L->k_scale, L->v_scale, head_stride,
                              (long)p->max_len * (D / G), T, S, Hq, Hkv, D, G, p->window, L->scores, p->max_len, att);
    default: {  /* what llmrun/kv_cache.py's INT4 store hands attention (its `read`) */
        const int *st = L->int4_state;
        int nq = st[0] < S / KEY_GROUP * KEY_GROUP ? st[0] : S / KEY_GROUP * KEY_GROUP;
        int W = L->int4.window, exact = st[1] > S - W ? st[1] : S - W;
        exact = (exact + KEY_GROUP - 1) / KEY_GROUP * KEY_GROUP;
        return attention_int4(qkv, qkv_ld, &L->int4, T, S, Hq, Hkv, D, nq, exact < nq ? exact : nq, p->window,
                              L->scores, p->max_len, att);
    }
    }
}

/* x (T, dim): the hidden states of T consecutive tokens at positions pos .. pos+T-1 (one decode step, or a
 * speculative block to verify), updated in place through every layer; their K/V are written into the caches
 * (quantized as kernels/ref.py and llmrun/kv_cache.py do), and with H2O scores their slots' mass restarts at 0.
 * The same kernels, in the same order, as the model's layer-by-layer forward, so the results are bit-identical to
 * it. cos/sin (T, D): the angles of those positions. */
int decode_layers(const stack_params *p, float *x, int T, int pos, const float *cos_t, const float *sin_t) {
    int Hq = p->n_heads, Hkv = p->n_kv_heads, D = p->head_dim, F = p->ffn_dim, G = p->kv_group, rc = 0;
    if (pos < 0 || pos + T > p->max_len || (p->kv_format == CACHE_INT8 && group_shift(G, D) < 0)) return -1;
    long qkv_ld = (long)(Hq + 2 * Hkv) * D, head_stride = (long)p->max_len * D;
    long scale_stride = p->kv_format == CACHE_INT8 ? (long)p->max_len * (D / G) : 0;
    float *xn = malloc(sizeof(float) * T * p->dim), *qkv = malloc(sizeof(float) * T * qkv_ld),
          *att = malloc(sizeof(float) * T * Hq * D), *gu = malloc(sizeof(float) * T * 2 * F),
          *h = malloc(sizeof(float) * T * F);
    if (!xn || !qkv || !att || !gu || !h) rc = -2;
    for (int l = 0; l < p->n_layers && !rc; l++) {
        const layer_params *L = p->layers + l;
        rms_norm(x, L->attn_norm, p->eps, T, p->dim, xn);
        if ((rc = linear(&L->qkv, xn, T, qkv, 0))) break;
        if (L->q_norm)  /* in place: each value is read before it is written */
            for (int t = 0; t < T; t++) {
                rms_norm(qkv + t * qkv_ld, L->q_norm, p->eps, Hq, D, qkv + t * qkv_ld);
                rms_norm(qkv + t * qkv_ld + Hq * D, L->k_norm, p->eps, Hkv, D, qkv + t * qkv_ld + Hq * D);
            }
        rope(qkv, qkv_ld, cos_t, sin_t, T, Hq + Hkv, D);
        if (p->kv_format == CACHE_INT4) {
            if ((rc = int4_write(&L->int4, L->int4_state, Hkv, D, pos, T, qkv + Hq * D, qkv + (Hq + Hkv) * D, qkv_ld)))
                break;
        } else
            for (int t = 0; t < T; t++)
                for (int j = 0; j < Hkv; j++) {
                    const float *k = qkv + t * qkv_ld + (Hq + j) * D, *v = k + Hkv * D;
                    long at = j * head_stride + (long)(pos + t) * D;
                    if (p->kv_format == CACHE_INT8) {
                        long sat = j * scale_stride + (long)(pos + t) * (D / G);
                        quantize_int8(k, 1, D, G, (int8_t *)L->k_cache + at, L->k_scale + sat);
                        quantize_int8(v, 1, D, G, (int8_t *)L->v_cache + at, L->v_scale + sat);
                    } else {
                        memcpy((float *)L->k_cache + at, k, sizeof(float) * D);
                        memcpy((float *)L->v_cache + at, v, sizeof(float) * D);
                    }
                }
        if (L->scores)
            for (int j = 0; j < Hkv; j++) memset(L->scores + (long)j * p->max_len + pos, 0, sizeof(float) * T);
        if ((rc = layer_attention(p, L, qkv, qkv_ld, T, pos + T, att))) break;
        if ((rc = linear(&L->o, att, T, x, 1))) break;  /* x += o(attention) */
        rms_norm(x, L->mlp_norm, p->eps, T, p->dim, xn);
        if ((rc = linear(&L->gate_up, xn, T, gu, 0))) break;
        silu_mul(gu, gu + F, T, F, 2 * F, h);
        if ((rc = linear(&L->down, h, T, x, 1))) break;  /* x += down(silu(gate) * up) */
    }
    free(xn), free(qkv), free(att), free(gu), free(h);
    return rc;
}

/* AWQ's grid search (llmrun/awq.py: _grid_error): for each of R groups of g weights w (row r at w + r * g, its
 * channels' energies at e + (r % G) * g) on the grid (scale[r], zero[r]), the weighted rounding error
 * sum_i e_i * (scale * clamp(round(w_i / scale), -zero, top - zero) - w_i)^2, each operation rounded as torch rounds
 * it (rounding ties to even; no fma), summed in eight lanes i % 8 added pairwise. g a multiple of 8, else -1. */
int grid_error(const float *w, const float *e, const float *scale, const float *zero, long R, int G, int g, float top,
               float *out) {
    if (g <= 0 || g % 8 || G <= 0) return -1;
#pragma omp parallel for schedule(static) if (R > 512)
    for (long r = 0; r < R; r++) {
        const float *wr = w + r * g, *er = e + (r % G) * (long)g;
        const float s = scale[r], lo = -zero[r], hi = top - zero[r];
        float acc[8] = {0};
        for (int i = 0; i < g; i += 8)
            for (int j = 0; j < 8; j++) {
                float q = nearbyintf(wr[i + j] / s);
                q = q < lo ? lo : q > hi ? hi : q;
                float d = s * q - wr[i + j];
                acc[j] += d * d * er[i + j];
            }
        out[r] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
    return 0;
}
