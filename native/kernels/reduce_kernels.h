// Element-wise reduction kernels: dst[i] = op(dst[i], src[i]) for every dtype and op.
// float16/bfloat16 are widened to float for the arithmetic and rounded back (round to nearest
// even), so half-precision sums are as accurate as one rounding per step allows.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/types.h"

namespace shvd {

// dst = op(dst, src), `count` elements. Average reduces as Sum (scaling happens separately).
// bool: Sum/Max = logical or, Min/Product = logical and.
void reduce_into(void* dst, const void* src, size_t count, DataType dtype, ReduceOp op);

// dst = op(a, b) (out-of-place form; dst may alias a or b).
void reduce_out(void* dst, const void* a, const void* b, size_t count, DataType dtype,
                ReduceOp op);

// dst = op(a, b) scaled by `factor` (as scale_buffer would), also written to `copy_to` (dst and
// copy_to may each alias a or b, element for element): one pass for float Sum/Average.
void reduce_out_scaled(void* dst, void* copy_to, const void* a, const void* b, size_t count,
                       DataType dtype, ReduceOp op, double factor);

// buf[i] *= factor. Integers: multiply in double and round toward zero like Horovod's CPU path.
// Not defined for bool (no-op).
void scale_buffer(void* buf, size_t count, DataType dtype, double factor);

// Conversions used by kernels and tests.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bfloat16_to_float(uint16_t b);
uint16_t float_to_bfloat16(float f);

}  // namespace shvd
