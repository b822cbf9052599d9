// thc_cpu_isa_words.h -- the payload words of the THC CPU block kernels: digit packing and unpacking
// with exactness checks, and the payload checksum. Part of thc_cpu_isa.h, which includes it once per
// x86-64 level inside that level's namespace (LHC_THC_ISA), with LHC_TGT / LHC_TGT_INLINE defined; no
// include guard, for the same reason.

// ---- digit packing -------------------------------------------------------------------------------
// Round to the nearest integer for |x| < 2^51 with two additions (2^52 + x has no fraction bits),
// which vectorise on every x86 level. The digit loops only need an estimate within one of the true
// quotient; they correct it.
LHC_TGT_INLINE double round_small(double x) {
  constexpr double kShift = 4503599627370496.0;  // 2^52
  return (x + kShift) - kShift;
}

// Full words with a compile-time digit count, Horner in doubles (exact below 2^53).
template <int PW>
LHC_TGT void pack_full_words_f64(const uint32_t* __restrict q, uint64_t nwords, double base, double* __restrict out) {
  for (uint64_t w = 0; w < nwords; ++w) {
    double a = 0.0;
    for (int j = PW - 1; j >= 0; --j) a = a * base + (double)(int32_t)q[w * PW + j];
    out[w] = a;
  }
}

// Digits of full words, 16 words at a time: the arithmetic runs across the 16 words of a tile
// (contiguous, vectorised), then the tile's digits are written out in coordinate order.
template <int PW>
LHC_TGT void digits_full_words_f64(double* __restrict s, uint64_t nwords, double base_d, double a, double b,
                                   float* __restrict y) {
  constexpr int kTile = 16;
  const double inv_base = 1.0 / base_d;
  uint64_t w0 = 0;
  for (; w0 + kTile <= nwords; w0 += kTile) {
    double v[kTile];
    float out[PW][kTile];
    for (int l = 0; l < kTile; ++l) v[l] = s[w0 + l];
    for (int j = 0; j < PW; ++j) {
      for (int l = 0; l < kTile; ++l) {
        double quot = round_small(v[l] * inv_base);
        const double rem = v[l] - quot * base_d;   // exact; off by one base at most
        quot += (rem >= base_d ? 1.0 : 0.0) - (rem < 0.0 ? 1.0 : 0.0);
        out[j][l] = thc_digit_value(v[l] - quot * base_d, a, b);
        v[l] = quot;
      }
    }
    float* __restrict yt = y + w0 * PW;
    for (int l = 0; l < kTile; ++l)
      for (int j = 0; j < PW; ++j) yt[l * PW + j] = out[j][l];
  }
  for (; w0 < nwords; ++w0) {
    double v = s[w0];
    for (int j = 0; j < PW; ++j) {
      double quot = round_small(v * inv_base);
      const double rem = v - quot * base_d;
      quot += (rem >= base_d ? 1.0 : 0.0) - (rem < 0.0 ? 1.0 : 0.0);
      y[w0 * PW + j] = thc_digit_value(v - quot * base_d, a, b);
      v = quot;
    }
  }
}

#if LHC_THC_PERMUTE
// 1/d rounded up (the double just above 1/d unless 1/d is one), d >= 1: for an integer
// 0 <= v < 2^51, floor(v * inv_up(d)) = floor(v / d), with no correction. Proof: v/d = k + f/d with
// integers k and 0 <= f < d; the product is at least v/d >= k (k representable), and below
// (v/d)(1 + 2^-52)(1 + 2^-53) < v/d + 1/d <= k + 1.
LHC_TGT_INLINE double inv_up(double d) {
  const double inv = 1.0 / d;
  return __builtin_fma(inv, d, -1.0) < 0.0 ? __builtin_nextafter(inv, 2.0) : inv;
}

// The most digits per word digits_by_coordinate_f64 takes (its tables have a row per digit). A small
// base n g + 1 packs more (49 at n = g = 1); unpack_full_words_f64 reads those word by word.
constexpr uint64_t kCoordinateMaxDigits = 12;

// The digits of validated words s[0, nwords) (integers below 2^51) as digit * a + b, computed per
// coordinate rather than per word, so that 8 consecutive coordinates are one vector store (the
// per-word order needs a scalar store per digit): coordinate c = w * PW + j reads its word by a
// permute and takes digit j = floor(v / base^j) - base * floor(v / base^(j+1)) (inv_up: exact).
// The same digits, hence the same floats, as digits_full_words_f64. per_word <= kCoordinateMaxDigits.
LHC_TGT void digits_by_coordinate_f64(const double* __restrict s, uint64_t nwords, uint64_t per_word, double base_d,
                                      double a, double b, float* __restrict y) {
  typedef double vd8 __attribute__((vector_size(64)));
  typedef int64_t vl8 __attribute__((vector_size(64)));
  typedef float vf8 __attribute__((vector_size(32)));
  const uint64_t PW = per_word;
  double inv_pow[kCoordinateMaxDigits + 1];   // inv_up(base^j), j <= PW (base^PW <= 2^53: exact powers)
  double pw = 1.0;
  for (uint64_t j = 0; j <= PW; ++j, pw *= base_d) inv_pow[j] = inv_up(pw);
  // For each phase r = c0 mod PW of a run of 8 coordinates: each lane's word (relative to c0 / PW)
  // and the reciprocals of its digit's two powers.
  alignas(64) int64_t rel[kCoordinateMaxDigits][8];
  alignas(64) double lo[kCoordinateMaxDigits][8], hi[kCoordinateMaxDigits][8];
  for (uint64_t r = 0; r < PW; ++r)
    for (uint64_t l = 0; l < 8; ++l) {
      rel[r][l] = (int64_t)((r + l) / PW);
      lo[r][l] = inv_pow[(r + l) % PW];
      hi[r][l] = inv_pow[(r + l) % PW + 1];
    }
  const vd8 zero = vd8{}, one = 1.0 - zero, shift = 4503599627370496.0 - zero, base = base_d - zero;
  const uint64_t coords = nwords * PW;
  uint64_t c0 = 0, w = 0, r = 0;
  for (; c0 + 8 <= coords && w + 8 <= nwords; c0 += 8) {
    vd8 words, il, ih;
    vl8 ix;
    __builtin_memcpy(&words, s + w, sizeof words);
    __builtin_memcpy(&ix, rel[r], sizeof ix);
    __builtin_memcpy(&il, lo[r], sizeof il);
    __builtin_memcpy(&ih, hi[r], sizeof ih);
    const vd8 v = __builtin_shuffle(words, ix);
    const vd8 pl = v * il, ph = v * ih;
    vd8 ql = (pl + shift) - shift, qh = (ph + shift) - shift;   // round_small, then down to the floor
    ql -= ql > pl ? one : zero;
    qh -= qh > ph ? one : zero;
    const vd8 digit = ql - qh * base;   // exact integers
    vd8 val;
    for (int l = 0; l < 8; ++l) val[l] = __builtin_fma(digit[l], a, b);   // thc_digit_value
    const vf8 f = __builtin_convertvector(val, vf8);
    __builtin_memcpy(y + c0, &f, sizeof f);
    r += 8;
    while (r >= PW) {
      r -= PW;
      ++w;
    }
  }
  for (; c0 < coords; ++c0) {
    const double v = s[c0 / PW];
    const uint64_t j = c0 % PW;
    const double ql = __builtin_floor(v * inv_pow[j]), qh = __builtin_floor(v * inv_pow[j + 1]);
    y[c0] = thc_digit_value(ql - qh * base_d, a, b);
  }
}
#endif

// Digits q[0, count) (count <= words * per_word; missing digits are 0) into `words` words.
// Horner in doubles while base^per_word <= 2^53 (exact, vectorisable across words), else uint64.
LHC_TGT void pack_block(const uint32_t* q, uint64_t count, uint64_t per_word, uint64_t base, bool fits_double,
                        int32_t word_kind, uint64_t nwords, void* words) {
  uint64_t w = 0;
  if (fits_double && word_kind == kThcWordFloat64) {
    const uint64_t full = count / per_word;
    double* out = static_cast<double*>(words);
    const double bd = (double)base;
    w = full;
    switch (per_word) {
#define LHC_PACK_CASE(P) case P: pack_full_words_f64<P>(q, full, bd, out); break;
      LHC_PACK_CASE(1) LHC_PACK_CASE(2) LHC_PACK_CASE(3) LHC_PACK_CASE(4) LHC_PACK_CASE(5) LHC_PACK_CASE(6)
      LHC_PACK_CASE(7) LHC_PACK_CASE(8) LHC_PACK_CASE(9) LHC_PACK_CASE(10) LHC_PACK_CASE(11) LHC_PACK_CASE(12)
#undef LHC_PACK_CASE
      default: w = 0;
    }
  }
  for (; w < nwords; ++w) {
    const uint64_t first = w * per_word;
    const uint64_t have = first >= count ? 0 : std::min<uint64_t>(per_word, count - first);
    uint64_t acc = 0;
    if (fits_double) {
      double a = 0.0;
      for (uint64_t j = have; j-- > 0;) a = a * (double)base + (double)q[first + j];
      acc = (uint64_t)a;
    } else {
      for (uint64_t j = have; j-- > 0;) acc = acc * base + q[first + j];
    }
    if (word_kind == kThcWordFloat64)
      static_cast<double*>(words)[w] = (double)acc;  // exact: acc < 2^53 by the layout rule
    else
      static_cast<int64_t*>(words)[w] = (int64_t)acc;
  }
}

// The float64 words whose digits all lie inside the group (the common case), vectorised across
// words: validity first, then the digits. s is scratch (nwords). round_small is round-to-nearest for
// |t| < 2^51; anything larger fails the range check.
LHC_TGT uint64_t unpack_full_words_f64(const double* __restrict words, uint64_t nwords, uint64_t per_word,
                                       double base_d, double max_word, double multiplier, double tolerance, double a,
                                       double b, float* __restrict y, double* __restrict s) {
  uint64_t bad = 0;
  for (uint64_t w = 0; w < nwords; ++w) {
    const double t = words[w] * multiplier;
    const double r = round_small(t);
    // Non-short-circuit & keeps the loop free of branches; every comparison is false for NaN.
    const bool ok = (std::fabs(t - r) <= tolerance) & (r >= 0.0) & (r <= max_word);
    bad += (uint64_t)!ok;
    s[w] = ok ? r : 0.0;
  }
#if LHC_THC_PERMUTE
  if (max_word < 2251799813685248.0 && per_word <= kCoordinateMaxDigits) {   // 2^51: see inv_up
    digits_by_coordinate_f64(s, nwords, per_word, base_d, a, b, y);
    return bad;
  }
#endif
  switch (per_word) {
#define LHC_DIGITS_CASE(P) case P: digits_full_words_f64<P>(s, nwords, base_d, a, b, y); return bad;
    LHC_DIGITS_CASE(1) LHC_DIGITS_CASE(2) LHC_DIGITS_CASE(3) LHC_DIGITS_CASE(4) LHC_DIGITS_CASE(5)
    LHC_DIGITS_CASE(6) LHC_DIGITS_CASE(7) LHC_DIGITS_CASE(8) LHC_DIGITS_CASE(9) LHC_DIGITS_CASE(10)
    LHC_DIGITS_CASE(11) LHC_DIGITS_CASE(12)
#undef LHC_DIGITS_CASE
    default: break;
  }
  const double inv_base = 1.0 / base_d;
  for (uint64_t j = 0; j < per_word; ++j) {
    for (uint64_t w = 0; w < nwords; ++w) {
      const double v = s[w];
      double quot = round_small(v * inv_base);
      const double rem = v - quot * base_d;   // exact; off by one base at most
      quot += (rem >= base_d ? 1.0 : 0.0) - (rem < 0.0 ? 1.0 : 0.0);
      s[w] = quot;
      y[w * per_word + j] = thc_digit_value(v - quot * base_d, a, b);
    }
  }
  return bad;
}

// Aggregated words -> digit * a + b into y[0, count). Returns the number of invalid words: not an
// integer (within `tolerance` after multiplying), negative, or above the largest aggregate of the
// digits the word holds (base^have - 1; the padding digits of a block's last word must be 0).
LHC_TGT uint64_t unpack_block(const void* words, int32_t word_kind, uint64_t nwords, uint64_t count, uint64_t per_word,
                              uint64_t base, double multiplier, double tolerance, double a, double b,
                              float* __restrict y, double* scratch) {
  uint64_t bad = 0;
  const double base_d = (double)base, inv_base = 1.0 / base_d;
  uint64_t w = 0;
  if (word_kind == kThcWordFloat64) {
    const uint64_t full = count / per_word;
    double max_word = 1.0;
    for (uint64_t j = 0; j < per_word; ++j) max_word *= base_d;
    bad += unpack_full_words_f64(static_cast<const double*>(words), full, per_word, base_d, max_word - 1.0,
                                 multiplier, tolerance, a, b, y, scratch);
    w = full;
  }
  for (; w < nwords; ++w) {
    const uint64_t first = w * per_word;
    const uint64_t have = std::min<uint64_t>(per_word, count - first);
    uint64_t limit = 1;
    for (uint64_t j = 0; j < have; ++j) limit *= base;
    if (word_kind == kThcWordFloat64) {
      const double t = static_cast<const double*>(words)[w] * multiplier;
      double s = std::nearbyint(t);
      if (!(std::fabs(t - s) <= tolerance) || !(s >= 0.0) || !(s <= (double)(limit - 1))) {
        ++bad;
        s = 0.0;
      }
      // s < 2^53: digit extraction in doubles is exact (quot * base <= s + base < 2^53), one correction.
      for (uint64_t j = 0; j < have; ++j) {
        double quot = std::floor(s * inv_base);
        double digit = s - quot * base_d;
        quot = digit < 0 ? quot - 1 : (digit >= base_d ? quot + 1 : quot);
        digit = s - quot * base_d;
        s = quot;
        y[first + j] = thc_digit_value(digit, a, b);
      }
    } else {
      const int64_t v = static_cast<const int64_t*>(words)[w];
      uint64_t s = (uint64_t)v;
      if (v < 0 || s > limit - 1) {
        ++bad;
        s = 0;
      }
      for (uint64_t j = 0; j < have; ++j) {
        y[first + j] = thc_digit_value((double)(s % base), a, b);
        s /= base;
      }
    }
  }
  return bad;
}

// ---- the payload checksum (thc_math.h: thc_check_term) -------------------------------------------
// sum_i thc_check_term(C, w0 + i, s[i]) mod P over integer-valued doubles s[0, n) (each < 2^53),
// eight lanes at a time in exact double arithmetic (the same integers as thc_check_term), the
// coefficients stepped per lane: c - 1 = (c0 + w k) mod (P - 1).
LHC_TGT uint64_t check_words_f64(const double* __restrict s, uint64_t n, uint64_t w0, const ThcCheck& C) {
  constexpr int V = 8;
  uint64_t i = 0, total = 0;
#if LHC_THC_PERMUTE && defined(__x86_64__)
  // AVX-512: in 64-bit integer lanes, without a division. With S = hi 2^26 + lo (lo < 2^26,
  // hi < 2^27) and c' = c 2^26 mod P, c S = c lo + c' hi (mod P): two 32 x 32-bit products, each
  // below 2^52, so a lane's sum stays below 2^64 for 2048 words and is reduced mod P that often.
  // c - 1 steps by `step` mod (P - 1) as below; c' steps by step 2^26 mod P, or by
  // (step - (P - 1)) 2^26 mod P when c - 1 wraps.
  if (n >= V) {
    const uint64_t P = C.prime, Pm = P - 1, step = ((uint64_t)V % Pm) * C.k % Pm;
    const uint64_t up = (step << 26) % P, wrap_up = (up + P - (Pm << 26) % P) % P;
    alignas(64) uint64_t d0[V], cp0[V], lanes[V];
    for (int l = 0; l < V; ++l) {
      d0[l] = thc_check_coeff(C, w0 + l) - 1;
      cp0[l] = ((d0[l] + 1) << 26) % P;
    }
    typedef uint64_t vu8 __attribute__((vector_size(64)));
    typedef double vd8 __attribute__((vector_size(64)));
    typedef int64_t vi8 __attribute__((vector_size(64)));
    vu8 d, cp, acc = vu8{};
    __builtin_memcpy(&d, d0, sizeof d);
    __builtin_memcpy(&cp, cp0, sizeof cp);
    const vu8 zero = vu8{}, vP = P + zero, vPm = Pm + zero, low26 = ((1u << 26) - 1) + zero;
    uint64_t since_reduce = 0;
    for (; i + V <= n; i += V) {
      vd8 sd;
      __builtin_memcpy(&sd, s + i, sizeof sd);
      const vu8 S = __builtin_convertvector(sd, vu8);   // exact: integers below 2^53
      // Operands below 2^32: 32 x 32 -> 64-bit multiplies (vpmuludq; the generic 64-bit product would
      // be vpmullq, three times the work). maskz with a full mask: the plain intrinsic's undefined
      // pass-through operand trips GCC 12's -Wmaybe-uninitialized.
      acc += (vu8)_mm512_maskz_mul_epu32(0xff, (__m512i)(d + 1), (__m512i)(S & low26)) +
             (vu8)_mm512_maskz_mul_epu32(0xff, (__m512i)cp, (__m512i)(S >> 26));
      const vu8 dn = d + step;
      const vi8 wrap = dn >= vPm;   // all ones where c - 1 wraps
      d = dn - (vPm & (vu8)wrap);
      const vu8 cn = cp + (wrap ? wrap_up + zero : up + zero);
      cp = cn - (vP & (vu8)(cn >= vP));
      if (++since_reduce == 2048) {
        for (int l = 0; l < V; ++l) acc[l] %= P;
        since_reduce = 0;
      }
    }
    __builtin_memcpy(lanes, &acc, sizeof acc);
    for (int l = 0; l < V; ++l) total += lanes[l] % P;
  }
#else
  if (n >= V) {
    // In exact double arithmetic, four lanes to a vector (one 8-lane generic vector for all V lanes
    // measured slower with AVX2). mod_p(x) = x mod P for integer-valued 0 <= x < 2^53 (P < 2^25):
    // the quotient estimate q is within one of floor(x / P) (relative error 2^-52), fma(-q, P, x) is
    // an integer below 2^26 in magnitude and therefore exact, and one correction brings it into [0, P).
    // The corrections are masks: written as scalar selects they compile to branches, mispredicted on
    // random words, and the loop is not vectorised.
    typedef double vd4 __attribute__((vector_size(32)));
    typedef int64_t vi4 __attribute__((vector_size(32)));
    const double P = (double)C.prime, inv_P = 1.0 / P, Pm = (double)(C.prime - 1);
    const double step = (double)(((uint64_t)V % (C.prime - 1)) * C.k % (C.prime - 1));
    const vd4 zero = vd4{}, vP = P + zero, vinv = inv_P + zero, vPm = Pm + zero, vstep = step + zero;
    const vd4 one = 1.0 + zero, shift = 4503599627370496.0 + zero;  // round_small's 2^52
    // v where mask, else +0. Vectors go by reference, as everywhere in these kernels (by value,
    // their ABI depends on the ISA).
    const auto where = [](const vi4& mask, const vd4& v) { return (vd4)(mask & (vi4)v); };
    const auto mod_p = [&](const vd4& x) {
      const vd4 q = (x * vinv + shift) - shift;
      vd4 r;
      for (int l = 0; l < 4; ++l) r[l] = __builtin_fma(-q[l], P, x[l]);
      return r + where(r < zero, vP) - where(r >= vP, vP);  // at most one applies
    };
    vd4 d[2], acc[2] = {zero, zero};
    for (int l = 0; l < V; ++l) d[l / 4][l % 4] = (double)(thc_check_coeff(C, w0 + l) - 1);
    // acc lanes < (n / V) P < 2^53 for any group (n < 2^28 words).
    for (; i + V <= n; i += V)
      for (int h = 0; h < 2; ++h) {
        vd4 x;
        __builtin_memcpy(&x, s + i + 4 * h, sizeof x);
        acc[h] += mod_p(mod_p(x) * (d[h] + one));   // r (c - 1 + 1) < 2^50: exact
        const vd4 dn = d[h] + vstep;
        d[h] = dn - where(dn >= vPm, vPm);
      }
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 4; ++l) total += (uint64_t)acc[h][l];
  }
#endif
  for (; i < n; ++i) total += thc_check_term(C, w0 + i, (uint64_t)s[i]);
  return total % C.prime;
}

// The checksum of `nwords` payload words of either kind (word index w0 first): float64 words through
// check_words_f64 (scratch: nwords doubles), int64 words one by one. Aggregated words (multiplier,
// tolerance: see unpack_block) that are not valid integers count as 0, as the decoder reads them.
LHC_TGT uint64_t check_words(const void* words, int32_t word_kind, uint64_t nwords, uint64_t w0, double multiplier,
                             double tolerance, const ThcCheck& C, double* __restrict scratch) {
  if (word_kind == kThcWordFloat64) {
    const double* wd = static_cast<const double*>(words);
    for (uint64_t w = 0; w < nwords; ++w) {
      const double t = wd[w] * multiplier;
      const double r = round_small(t);
      const bool ok = (std::fabs(t - r) <= tolerance) & (r >= 0.0) & (r < 9007199254740992.0);
      scratch[w] = ok ? r : 0.0;
    }
    return check_words_f64(scratch, nwords, w0, C);
  }
  const int64_t* wi = static_cast<const int64_t*>(words);
  uint64_t total = 0;
  for (uint64_t w = 0; w < nwords; ++w) total += thc_check_term(C, w0 + w, wi[w] < 0 ? 0 : (uint64_t)wi[w]);
  return total % C.prime;
}
