// Element types, reduction ops and the exception types shared by every layer of the core.
// The numeric values are part of the C ABI (spark_hvd/common/_native.py mirrors them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace shvd {

enum class DataType : int32_t {
  kUInt8 = 0,
  kInt8 = 1,
  kInt16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kFloat16 = 5,
  kBFloat16 = 6,
  kFloat32 = 7,
  kFloat64 = 8,
  kBool = 9,
  kUInt16 = 10,  // appended: earlier codes keep their values (C ABI)
};
constexpr int kNumDataTypes = 11;

enum class ReduceOp : int32_t {
  kAverage = 0,  // Sum on the wire, divided by the set size afterwards.
  kSum = 1,
  kAdasum = 2,   // Adasum: allreduce_adasum, not an element-wise kernel.
  kMin = 3,
  kMax = 4,
  kProduct = 5,
};

size_t dtype_size(DataType t);
const char* dtype_name(DataType t);
const char* reduce_op_name(ReduceOp op);

// A peer process went away or the job was aborted: maps to HorovodInternalError in Python.
struct PeerLostError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Ranks disagreed about an op (shape, dtype, ...) or the caller passed bad input:
// maps to ValueError in Python. Raised on every rank of the process set.
struct OpMismatchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A well-formed request that is not implemented, where Horovod raised NotImplementedError too
// (Adasum over a number of ranks that is not a power of two).
struct UnsupportedError : OpMismatchError {
  using OpMismatchError::OpMismatchError;
};

}  // namespace shvd
