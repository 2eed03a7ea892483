// Element types, reduction ops and the exception types shared by every layer of the core.
// The numeric values are the C ABI's codes (SHVD_DTYPE_*, SHVD_REDUCE_* in spark_hvd.h, which
// bindings read at load through shvd_abi_codes); the static_asserts below keep them equal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "../include/spark_hvd.h"

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
static_assert(int(DataType::kUInt8) == SHVD_DTYPE_UINT8 &&
                  int(DataType::kInt8) == SHVD_DTYPE_INT8 &&
                  int(DataType::kInt16) == SHVD_DTYPE_INT16 &&
                  int(DataType::kInt32) == SHVD_DTYPE_INT32 &&
                  int(DataType::kInt64) == SHVD_DTYPE_INT64 &&
                  int(DataType::kFloat16) == SHVD_DTYPE_FLOAT16 &&
                  int(DataType::kBFloat16) == SHVD_DTYPE_BFLOAT16 &&
                  int(DataType::kFloat32) == SHVD_DTYPE_FLOAT32 &&
                  int(DataType::kFloat64) == SHVD_DTYPE_FLOAT64 &&
                  int(DataType::kBool) == SHVD_DTYPE_BOOL &&
                  int(DataType::kUInt16) == SHVD_DTYPE_UINT16 && kNumDataTypes == SHVD_NUM_DTYPES,
              "DataType must equal the SHVD_DTYPE_* codes of spark_hvd.h");

enum class ReduceOp : int32_t {
  kAverage = 0,  // Sum on the wire, divided by the set size afterwards.
  kSum = 1,
  kAdasum = 2,   // Adasum: allreduce_adasum, not an element-wise kernel.
  kMin = 3,
  kMax = 4,
  kProduct = 5,
};
constexpr int kNumReduceOps = 6;
static_assert(int(ReduceOp::kAverage) == SHVD_REDUCE_AVERAGE &&
                  int(ReduceOp::kSum) == SHVD_REDUCE_SUM &&
                  int(ReduceOp::kAdasum) == SHVD_REDUCE_ADASUM &&
                  int(ReduceOp::kMin) == SHVD_REDUCE_MIN &&
                  int(ReduceOp::kMax) == SHVD_REDUCE_MAX &&
                  int(ReduceOp::kProduct) == SHVD_REDUCE_PRODUCT &&
                  kNumReduceOps == SHVD_NUM_REDUCE_OPS,
              "ReduceOp must equal the SHVD_REDUCE_* codes of spark_hvd.h");

// What a request asks for: the collectives and the control ops that are negotiated like them.
enum class OpType : int32_t {
  kAllreduce = 0,
  kAllgather = 1,
  kBroadcast = 2,
  kAlltoall = 3,
  kReducescatter = 4,
  kBarrier = 5,
  kJoin = 6,
  kAddProcessSet = 7,     // splits = the member ranks
  kRemoveProcessSet = 8,  // root = the process set id
};
static_assert(int(OpType::kAllreduce) == SHVD_OP_ALLREDUCE &&
                  int(OpType::kAllgather) == SHVD_OP_ALLGATHER &&
                  int(OpType::kBroadcast) == SHVD_OP_BROADCAST &&
                  int(OpType::kAlltoall) == SHVD_OP_ALLTOALL &&
                  int(OpType::kReducescatter) == SHVD_OP_REDUCESCATTER &&
                  int(OpType::kBarrier) == SHVD_OP_BARRIER && int(OpType::kJoin) == SHVD_OP_JOIN &&
                  int(OpType::kAddProcessSet) == SHVD_OP_ADD_PROCESS_SET &&
                  int(OpType::kRemoveProcessSet) == SHVD_OP_REMOVE_PROCESS_SET,
              "OpType must equal the SHVD_OP_* codes of spark_hvd.h");
const char* op_type_name(OpType op);

size_t dtype_size(DataType t);

// Elements of a tensor of `shape` (1 for a scalar), or of its dimensions from `from` on (a row).
inline int64_t num_elements(const std::vector<int64_t>& shape, size_t from = 0) {
  int64_t n = 1;
  for (size_t i = from; i < shape.size(); ++i) n *= shape[i];
  return n;
}
const char* dtype_name(DataType t);
const char* reduce_op_name(ReduceOp op);

// Error messages name ranks with their host: "rank 2 on node-b". The table (host of each global
// rank, from the mesh's peer list) is set once at init; without it ranks are bare numbers.
void set_rank_hosts(std::vector<std::string> hosts);
std::string describe_rank(int rank);
// "ranks 2, 3 on node-b; 5 on node-c" (or "ranks 2, 3" without a host table).
std::string describe_ranks(const std::vector<int>& ranks);
// Seconds as a user set them: 5, 0.25.
std::string format_seconds(double s);

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
