// Element-wise reduction kernels. Every loop is a plain indexed loop over restrict-qualified
// pointers with a branch-free body, so the compiler (g++ or clang) vectorizes it at -O3 without
// intrinsics or arch flags. The hot loops are compiled three times (x86-64's baseline, AVX2,
// AVX-512) and the CPU picks one when the library loads: the shared-memory allreduce runs from
// cache, where vector width shows. Reducing an Average of 11.6 MB in place took 0.75-1.0 ms of
// engine CPU instead of 1.2-1.85 ms.
//
// The copies are target attributes on the same templates in three namespaces (SHVD_VECTOR_LOOPS)
// with a switch on the CPU's level in front, not target_clones: clang (the wheel's compiler)
// does not clone templates, and one way for both compilers keeps the two builds alike.
//
// Half types are reduced in blocks: widen a block to float arrays, reduce those, narrow back.
// Each pass is a simple loop the compiler vectorizes, and the conversions below are written
// branch-free (selects, not ifs) for the same reason.
#include "reduce_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif

namespace shvd {
namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// IEEE binary16 -> binary32, exact for every input (subnormals, inf, NaN payloads).
// select(c, a, b) = c ? a : b written with masks: g++ if-converts nested ternaries in these
// conversions inconsistently, and a branch in the loop body stops vectorization.
inline uint32_t select(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

inline float h2f(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;                         // exponent and mantissa
  const uint32_t normal = (em << 13) + ((127u - 15u) << 23);  // rebias the exponent
  const uint32_t infnan = (em << 13) | 0x7f800000u;
  const uint32_t sub = bits_of(static_cast<float>(em) * 0x1p-24f);  // em * 2^-24, exact
  const uint32_t r = select(em >= 0x7c00u, infnan, select(em < 0x0400u, sub, normal));
  return float_of(sign | r);
}

// binary32 -> binary16 with round to nearest, ties to even. Overflow gives inf, NaN stays NaN
// (quiet), results below the normal range round correctly to subnormals or zero.
inline uint16_t f2h(float f) {
  const uint32_t x = bits_of(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  const uint32_t infnan = select(a > 0x7f800000u, 0x7e00u, 0x7c00u);
  // |f| < 2^-14: adding 0.5 leaves a float whose ulp is 2^-24, the half subnormal step, so the
  // FPU's own round-to-nearest-even does the rounding; subtracting 0.5's bits leaves the count.
  const uint32_t sub = bits_of(float_of(a) + 0.5f) - 0x3f000000u;
  // Normal range: rebias, then add half an ulp minus one plus the lowest kept bit (ties to
  // even). A carry out of the mantissa correctly bumps the exponent, up to inf.
  const uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
  const uint32_t r = select(a >= 0x47800000u, infnan, select(a < 0x38800000u, sub, normal));
  return static_cast<uint16_t>(r | sign);
}

inline float b2f(uint16_t b) { return float_of(uint32_t(b) << 16); }

inline uint16_t f2b(float f) {
  const uint32_t x = bits_of(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (x >> 16) | 0x40u;
  return static_cast<uint16_t>(select((x & 0x7fffffffu) > 0x7f800000u, quiet_nan, rounded));
}

// Integer sums and products wrap (two's complement) instead of being undefined behaviour.
template <class T>
inline T wrap_add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}

template <class T>
inline T wrap_mul(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    // uint32_t for 1- and 2-byte types so the promoted multiply cannot overflow int.
    using U = std::conditional_t<(sizeof(T) < 4), uint32_t, std::make_unsigned_t<T>>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return a * b;
  }
}

struct SumOp {
  template <class T> T operator()(T a, T b) const { return wrap_add(a, b); }
};
struct ProdOp {
  template <class T> T operator()(T a, T b) const { return wrap_mul(a, b); }
};
struct MinOp {
  template <class T> T operator()(T a, T b) const { return b < a ? b : a; }
};
struct MaxOp {
  template <class T> T operator()(T a, T b) const { return a < b ? b : a; }
};
// bool tensors are one byte per element; any non-zero byte counts as true, results are 0/1.
struct OrOp {
  uint8_t operator()(uint8_t a, uint8_t b) const { return uint8_t((a != 0) | (b != 0)); }
};
struct AndOp {
  uint8_t operator()(uint8_t a, uint8_t b) const { return uint8_t((a != 0) & (b != 0)); }
};

// sum_scaled_twice's outputs may each be exactly one of its inputs, element for element: no
// element is read after another index's write, so its loops are vectorized as they stand
// (restrict would be wrong there; g++ and clang otherwise add overlap checks at run time, which
// clang gives up on for four pointers and runs the loop scalar: 3-7x slower).
#if defined(__clang__)
#define SHVD_NO_OVERLAP_CHECKS _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define SHVD_NO_OVERLAP_CHECKS _Pragma("GCC ivdep")
#else
#define SHVD_NO_OVERLAP_CHECKS
#endif

// The vectorized loops, one copy per instruction set (namespaces base, avx2, avx512), each
// compiled with TARGET before its return type.
#define SHVD_VECTOR_LOOPS(NS, TARGET)                                                          \
  namespace NS {                                                                               \
  template <class T, class Op>                                                                 \
  TARGET void loop_out(T* __restrict d, const T* __restrict a, const T* __restrict b,          \
                       size_t n) {                                                             \
    Op op;                                                                                     \
    for (size_t i = 0; i < n; ++i) d[i] = op(a[i], b[i]);                                      \
  }                                                                                            \
  template <class T, class Op>                                                                 \
  TARGET void loop_into(T* __restrict d, const T* __restrict s, size_t n) {                    \
    Op op;                                                                                     \
    for (size_t i = 0; i < n; ++i) d[i] = op(d[i], s[i]);                                      \
  }                                                                                            \
  /* keeps a as the left operand */                                                            \
  template <class T, class Op>                                                                 \
  TARGET void loop_into_rev(T* __restrict d, const T* __restrict a, size_t n) {                \
    Op op;                                                                                     \
    for (size_t i = 0; i < n; ++i) d[i] = op(a[i], d[i]);                                      \
  }                                                                                            \
  /* Scaling follows Horovod's CPU rules: integers multiply in double (S) and convert back,    \
     truncating toward zero; float32 multiplies in float by the factor rounded to float (S =   \
     float), float64 in double, and the 16-bit floats in float (scale_half). */                \
  template <class T, class S>                                                                  \
  TARGET void scale_plain(T* __restrict p, size_t n, S factor) {                               \
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(static_cast<S>(p[i]) * factor);       \
  }                                                                                            \
  /* dst = (a + b) * factor in the same arithmetic as a sum then scale_plain, copied to dst2:  \
     one pass over the data instead of three (sum, scale, copy). */                            \
  template <class T, class S>                                                                  \
  TARGET void sum_scaled_twice(T* dst, T* dst2, const T* a, const T* b, size_t n, S factor) {  \
    if (factor == 1) {                                                                         \
      SHVD_NO_OVERLAP_CHECKS                                                                   \
      for (size_t i = 0; i < n; ++i) {                                                         \
        const T v = a[i] + b[i];                                                               \
        dst[i] = v;                                                                            \
        dst2[i] = v;                                                                           \
      }                                                                                        \
    } else {                                                                                   \
      SHVD_NO_OVERLAP_CHECKS                                                                   \
      for (size_t i = 0; i < n; ++i) {                                                         \
        const T v = static_cast<T>(static_cast<S>(a[i] + b[i]) * factor);                      \
        dst[i] = v;                                                                            \
        dst2[i] = v;                                                                           \
      }                                                                                        \
    }                                                                                          \
  }                                                                                            \
  }  // namespace NS

SHVD_VECTOR_LOOPS(base, )
#if defined(__x86_64__) && defined(__GNUC__)
#define SHVD_X86_VECTOR_LEVELS 1
SHVD_VECTOR_LOOPS(avx2, __attribute__((target("avx2"))))
SHVD_VECTOR_LOOPS(avx512, __attribute__((target("avx512f"))))
#endif

enum class VectorLevel { kBase, kAvx2, kAvx512 };

// The widest copy this CPU runs, found once when the library loads: CPUID for the
// instructions, XGETBV for the operating system saving their registers. By hand, not
// __builtin_cpu_supports: that needs libgcc's or compiler-rt's __cpu_model, which zig's runtime
// does not provide.
VectorLevel detect_vector_level() {
#ifdef SHVD_X86_VECTOR_LEVELS
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return VectorLevel::kBase;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28);
  if (!osxsave || !avx) return VectorLevel::kBase;
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & 0x6u) != 0x6u) return VectorLevel::kBase;  // XMM and YMM state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return VectorLevel::kBase;
  const bool avx2 = b & (1u << 5), avx512f = b & (1u << 16);
  if (avx512f && (xcr0_lo & 0xe6u) == 0xe6u) return VectorLevel::kAvx512;  // + opmask, ZMM
  if (avx2) return VectorLevel::kAvx2;
#endif
  return VectorLevel::kBase;
}

const VectorLevel vector_level = detect_vector_level();

// A call of the copy of the loop for this CPU (the arguments: the call, as written inside
// one of the namespaces).
#ifdef SHVD_X86_VECTOR_LEVELS
#define SHVD_DISPATCH(...)                                          \
  switch (vector_level) {                                           \
    case VectorLevel::kAvx512: return avx512::__VA_ARGS__;          \
    case VectorLevel::kAvx2: return avx2::__VA_ARGS__;              \
    case VectorLevel::kBase: break;                                 \
  }                                                                 \
  return base::__VA_ARGS__
#else
#define SHVD_DISPATCH(...) return base::__VA_ARGS__
#endif

template <class T, class Op>
void loop_out(T* d, const T* a, const T* b, size_t n) {
  SHVD_DISPATCH(loop_out<T, Op>(d, a, b, n));
}

template <class T, class Op>
void loop_into(T* d, const T* s, size_t n) {
  SHVD_DISPATCH(loop_into<T, Op>(d, s, n));
}

template <class T, class Op>
void loop_into_rev(T* d, const T* a, size_t n) {
  SHVD_DISPATCH(loop_into_rev<T, Op>(d, a, n));
}

template <class T, class S>
void scale_plain(T* p, size_t n, S factor) {
  SHVD_DISPATCH(scale_plain<T, S>(p, n, factor));
}

template <class T, class S>
void sum_scaled_twice(T* dst, T* dst2, const T* a, const T* b, size_t n, S factor) {
  SHVD_DISPATCH(sum_scaled_twice<T, S>(dst, dst2, a, b, n, factor));
}

// d = op(a, b) where d may be exactly a or b: pick the loop whose pointers really don't alias,
// so every case gets the vectorized restrict loop.
template <class T, class Op>
void reduce_plain(void* d, const void* a, const void* b, size_t n) {
  auto* dt = static_cast<T*>(d);
  const auto* at = static_cast<const T*>(a);
  const auto* bt = static_cast<const T*>(b);
  if (dt == at) {
    loop_into<T, Op>(dt, bt, n);
  } else if (dt == bt) {
    loop_into_rev<T, Op>(dt, at, n);
  } else {
    loop_out<T, Op>(dt, at, bt, n);
  }
}

constexpr size_t kBlock = 256;

// Half types: a whole block of a and b is read before any of d is written, so d may alias
// a or b exactly.
template <float (*Widen)(uint16_t), uint16_t (*Narrow)(float), class Op>
void reduce_half(void* d, const void* a, const void* b, size_t n) {
  auto* dh = static_cast<uint16_t*>(d);
  const auto* ah = static_cast<const uint16_t*>(a);
  const auto* bh = static_cast<const uint16_t*>(b);
  float fa[kBlock], fb[kBlock];
  Op op;
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    for (size_t i = 0; i < m; ++i) fa[i] = Widen(ah[base + i]);
    for (size_t i = 0; i < m; ++i) fb[i] = Widen(bh[base + i]);
    for (size_t i = 0; i < m; ++i) fa[i] = op(fa[i], fb[i]);
    for (size_t i = 0; i < m; ++i) dh[base + i] = Narrow(fa[i]);
  }
}

using KernelFn = void (*)(void*, const void*, const void*, size_t);

template <class Op>
KernelFn numeric_kernel(DataType t) {
  switch (t) {
    case DataType::kUInt8: return reduce_plain<uint8_t, Op>;
    case DataType::kInt8: return reduce_plain<int8_t, Op>;
    case DataType::kInt16: return reduce_plain<int16_t, Op>;
    case DataType::kUInt16: return reduce_plain<uint16_t, Op>;
    case DataType::kInt32: return reduce_plain<int32_t, Op>;
    case DataType::kInt64: return reduce_plain<int64_t, Op>;
    case DataType::kFloat16: return reduce_half<h2f, f2h, Op>;
    case DataType::kBFloat16: return reduce_half<b2f, f2b, Op>;
    case DataType::kFloat32: return reduce_plain<float, Op>;
    case DataType::kFloat64: return reduce_plain<double, Op>;
    case DataType::kBool: break;
  }
  throw OpMismatchError("unsupported dtype code " + std::to_string(static_cast<int>(t)));
}

KernelFn select_kernel(DataType t, ReduceOp op) {
  if (t == DataType::kBool) {
    switch (op) {
      case ReduceOp::kAverage:
      case ReduceOp::kSum:
      case ReduceOp::kMax: return reduce_plain<uint8_t, OrOp>;
      case ReduceOp::kMin:
      case ReduceOp::kProduct: return reduce_plain<uint8_t, AndOp>;
      default: break;
    }
  } else {
    switch (op) {
      case ReduceOp::kAverage:
      case ReduceOp::kSum: return numeric_kernel<SumOp>(t);
      case ReduceOp::kMin: return numeric_kernel<MinOp>(t);
      case ReduceOp::kMax: return numeric_kernel<MaxOp>(t);
      case ReduceOp::kProduct: return numeric_kernel<ProdOp>(t);
      default: break;
    }
  }
  if (op == ReduceOp::kAdasum) {
    throw OpMismatchError("Adasum is not element-wise: it runs as allreduce_adasum");
  }
  throw OpMismatchError("unsupported reduction op code " + std::to_string(static_cast<int>(op)));
}

// Scaling follows Horovod's CPU rules: integers multiply in double (S) and convert back,
// truncating toward zero; float32 multiplies in float by the factor rounded to float (S =
// float), float64 in double, and the 16-bit floats in float (scale_half).
template <float (*Widen)(uint16_t), uint16_t (*Narrow)(float)>
void scale_half(uint16_t* p, size_t n, double factor) {
  float f[kBlock];
  const float k = static_cast<float>(factor);
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    for (size_t i = 0; i < m; ++i) f[i] = Widen(p[base + i]);
    for (size_t i = 0; i < m; ++i) f[i] *= k;
    for (size_t i = 0; i < m; ++i) p[base + i] = Narrow(f[i]);
  }
}

}  // namespace

void reduce_into(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op) {
  KernelFn fn = select_kernel(dtype, op);
  if (count > 0) fn(dst, dst, src, count);
}

void reduce_out(void* dst, const void* a, const void* b, size_t count, DataType dtype,
                ReduceOp op) {
  KernelFn fn = select_kernel(dtype, op);
  if (count > 0) fn(dst, a, b, count);
}

void reduce_out_scaled(void* dst, void* copy_to, const void* a, const void* b, size_t count,
                       DataType dtype, ReduceOp op, double factor) {
  if (count == 0) return;
  if (op == ReduceOp::kSum || op == ReduceOp::kAverage) {
    if (dtype == DataType::kFloat32) {
      auto* d = static_cast<float*>(dst);
      auto* d2 = static_cast<float*>(copy_to);
      auto* fa = static_cast<const float*>(a);
      auto* fb = static_cast<const float*>(b);
      return sum_scaled_twice(d, d2, fa, fb, count, float(factor));  // as scale_buffer
    }
    if (dtype == DataType::kFloat64)
      return sum_scaled_twice(static_cast<double*>(dst), static_cast<double*>(copy_to),
                              static_cast<const double*>(a), static_cast<const double*>(b),
                              count, factor);
  }
  reduce_out(dst, a, b, count, dtype, op);
  scale_buffer(dst, count, dtype, factor);
  if (copy_to != dst) std::memcpy(copy_to, dst, count * dtype_size(dtype));
}

void scale_buffer(void* buf, size_t count, DataType dtype, double factor) {
  if (factor == 1.0 || count == 0) return;
  switch (dtype) {
    case DataType::kUInt8: return scale_plain(static_cast<uint8_t*>(buf), count, factor);
    case DataType::kInt8: return scale_plain(static_cast<int8_t*>(buf), count, factor);
    case DataType::kInt16: return scale_plain(static_cast<int16_t*>(buf), count, factor);
    case DataType::kUInt16: return scale_plain(static_cast<uint16_t*>(buf), count, factor);
    case DataType::kInt32: return scale_plain(static_cast<int32_t*>(buf), count, factor);
    case DataType::kInt64: return scale_plain(static_cast<int64_t*>(buf), count, factor);
    case DataType::kFloat16:
      return scale_half<h2f, f2h>(static_cast<uint16_t*>(buf), count, factor);
    case DataType::kBFloat16:
      return scale_half<b2f, f2b>(static_cast<uint16_t*>(buf), count, factor);
    case DataType::kFloat32:  // in float with the factor rounded to float, as Horovod does
      return scale_plain(static_cast<float*>(buf), count, static_cast<float>(factor));
    case DataType::kFloat64: return scale_plain(static_cast<double*>(buf), count, factor);
    case DataType::kBool: return;
  }
  throw OpMismatchError("unsupported dtype code " + std::to_string(static_cast<int>(dtype)));
}

float half_to_float(uint16_t h) { return h2f(h); }
uint16_t float_to_half(float f) { return f2h(f); }
float bfloat16_to_float(uint16_t b) { return b2f(b); }
uint16_t float_to_bfloat16(float f) { return f2b(f); }

}  // namespace shvd
