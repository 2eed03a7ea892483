// Negotiation messages between workers and the coordinator (rank 0), and their byte encoding.
// A worker sends a RequestBatch whenever it has new tensors; the coordinator answers every rank
// with the same sequence of ResponseBatches, which all ranks execute in order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../common/types.h"

namespace shvd {


// What one rank asks for one named tensor.
struct Request {
  OpType op = OpType::kAllreduce;
  std::string name;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  ReduceOp reduce_op = ReduceOp::kSum;
  double prescale = 1.0;
  double postscale = 1.0;
  int32_t root = 0;            // broadcast: root rank within the process set
  int32_t process_set = 0;
  std::vector<int64_t> splits; // alltoall: rows sent to each member
  std::string group;           // grouped ops: negotiated and answered together
  int32_t group_size = 0;
  bool on_gpu = false;         // a CUDA tensor (each rank's own device)

  bool same_params(const Request& o) const;
};

// A collective a blocked rank waits for (the deadlock check, deadlock.h).
struct PendingOp {
  std::string name;
  OpType op = OpType::kAllreduce;
  int32_t process_set = 0;
};

struct RequestBatch {
  int32_t rank = 0;
  std::vector<Request> requests;
  std::vector<uint32_t> cached;  // response-cache ids standing for a request seen before
  bool shutdown = false;
  // The deadlock check: the rank is blocked on `blocked_on` (kBlocked), or moves again after
  // such a report (kMoving).
  enum class Blocked : uint8_t { kNoChange = 0, kBlocked = 1, kMoving = 2 };
  Blocked blocked = Blocked::kNoChange;
  std::vector<PendingOp> blocked_on;
};

// The coordinator's decision for one or more tensors (several = fused into one collective).
struct Response {
  OpType op = OpType::kAllreduce;
  std::vector<std::string> names;
  std::string error;           // non-empty: every member fails these tensors with this message
  bool error_is_mismatch = true;  // ValueError (mismatch/bad input) vs HorovodInternalError
  DataType dtype = DataType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  double prescale = 1.0;
  double postscale = 1.0;
  int32_t root = 0;
  int32_t process_set = 0;
  std::vector<std::vector<int64_t>> shapes;  // per name: the (first member's) shape
  std::vector<int64_t> first_dims;           // allgather: names x members
  std::vector<int64_t> splits_matrix;        // alltoall: members x members, row = sender
  std::vector<int32_t> joined;               // global ranks that had joined (contribute zeros)
  int32_t last_joined = -1;                  // join: the last rank to join
  std::vector<int64_t> cache_ids;            // per name: response-cache id or -1
  bool on_gpu = false;                       // CUDA tensors: the GPU path runs it
};

// A response for the one tensor `name` of `shape`, with the collective's parameters (op, dtype,
// reduction, scaling, root, process set, device kind) taken from `from`: the request it
// answers, or the fused response it was part of. The one place those fields are copied.
template <typename From>
Response single_tensor_response(const std::string& name, const std::vector<int64_t>& shape,
                                const From& from) {
  Response r;
  r.op = from.op;
  r.names = {name};
  r.dtype = from.dtype;
  r.reduce_op = from.reduce_op;
  r.prescale = from.prescale;
  r.postscale = from.postscale;
  r.root = from.root;
  r.process_set = from.process_set;
  r.shapes = {shape};
  r.on_gpu = from.on_gpu;
  return r;
}

// Whether two allreduce responses can run as one fused collective (same dtype, reduction,
// scaling, process set, joined ranks and device kind).
bool fusable_allreduces(const Response& a, const Response& b);

// The engine's run-time settings that autotuning changes (controller/autotune.h). Rank 0 sends
// new values with a response batch; every rank applies them where it executes that batch, before
// its responses, so all ranks switch at the same point of the same sequence.
struct TunedParams {
  uint64_t fusion_threshold_bytes = 128u << 20;
  double cycle_time_ms = 0.5;
  bool cache_enabled = true;  // ranks send response-cache ids for requests answered before
  // Hierarchical collectives where a process set spans hosts: -1 the dispatcher decides, 0 off,
  // 1 on (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE / _ALLGATHER).
  int32_t hierarchical_allreduce = -1;
  int32_t hierarchical_allgather = -1;
  bool tuning = false;  // still sampling (false: the final, best values)

  bool operator==(const TunedParams& o) const {
    return fusion_threshold_bytes == o.fusion_threshold_bytes &&
           cycle_time_ms == o.cycle_time_ms && cache_enabled == o.cache_enabled &&
           hierarchical_allreduce == o.hierarchical_allreduce &&
           hierarchical_allgather == o.hierarchical_allgather && tuning == o.tuning;
  }
};

struct ResponseBatch {
  std::vector<Response> responses;
  bool has_params = false;  // `params` apply from this batch on
  TunedParams params;
  bool shutdown = false;
  std::string abort;  // non-empty: the job is being torn down (a peer died)
  // Elastic: the newest host-change notice rank 0 was given (shvd_post_notice); ops every rank
  // completes from this batch on carry it (HandleState::notice).
  bool has_notice = false;
  int64_t notice = 0;
};

std::string encode(const RequestBatch& b);
RequestBatch decode_request_batch(const std::string& bytes);
std::string encode(const ResponseBatch& b);
ResponseBatch decode_response_batch(const std::string& bytes);

}  // namespace shvd
