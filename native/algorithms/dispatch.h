// Which algorithm runs a collective: one ordered table of rules (kAlgorithms in dispatch.cc)
// for every collective. For a response on a process set, the first row of its op whose
// predicate holds runs it; the row also says how the engine hands it the tensors (Staging) and
// names the path for the timeline. The engine packs, calls the chosen row and unpacks
// (engine/execute.cc); the algorithm files know nothing of the choice.
//
// Every way a response can run is a row: CUDA tensors' rows come first and hand the response to
// the GPU path (gpu/gpu_path.h); with MPI operations on (mpi/mpi_backend.h) the MPI rows come
// next for every op MPI can take; then the core's own algorithms.
//
// Every fact a predicate looks at is the same on every member of the set (the response, the
// communicator and settings agreed when the set was set up), so every member runs the same row
// without exchanging a message about it.
#pragma once

#include <cstddef>
#include <vector>

#include "../common/types.h"
#include "collectives.h"

namespace shvd {

// How the engine hands a row the tensors of a response.
enum class Staging {
  // The algorithm reads each tensor's input and writes its output itself, prescale and
  // postscale included (CollectiveCall::prescale, postscale): no fusion-buffer copies.
  kTensors,
  // One buffer reduced in place: a lone tensor's output, or the fusion buffer the engine packs
  // the tensors into (zeros for tensors a joined rank never submitted) and unpacks afterwards.
  // The engine applies prescale and postscale (the call's are 1). The other collectives' rows
  // all take buffers the engine lays out as CollectiveCall describes.
  kBuffer,
  // The tensors live on a GPU: the engine hands the whole response, its entries included, to
  // the GPU path, which runs it (NCCL, or through host memory and these rows again) and
  // completes the entries itself when its stream has passed them. Such a row has no `run`.
  kDevice,
};

// What the rules look at.
struct CollectiveCase {
  OpType op = OpType::kAllreduce;
  const Communicator* comm = nullptr;
  DataType dtype = DataType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  size_t tensors = 0;  // in the response
  size_t count = 0;    // elements of all of them together
  // Every member submitted every tensor of the response (nobody has joined).
  bool complete = true;
  bool prescaled = false;  // the response has a prescale factor other than 1
  bool on_gpu = false;     // CUDA tensors (a kDevice row); the GPU path's host runs: false
  size_t ring_threshold_bytes = kDefaultRingThresholdBytes;
  // Hierarchical algorithms for this op where the set spans hosts (comm->hierarchy): 1 always,
  // 0 never, -1 automatic (allreduce: when bandwidth-bound; allgather: always). The engine
  // copies it from its settings for every response, so a change between cycles (the same on
  // every rank) takes effect with the next response.
  int hierarchical = -1;

  size_t bytes() const { return count * dtype_size(dtype); }
};

// One collective as an algorithm receives it. Which fields an op reads:
//   allreduce     tensors: kTensors, every tensor; kBuffer, one span (in == out) and `blocks`
//                 the elements of each tensor in it (Adasum combines each tensor on its own)
//   allgather     tensors[0].out: every member's block back to back, mine already in place;
//                 blocks: bytes of each member's block
//   broadcast     tensors[0].out: `count` elements, the root's input already there; root
//   alltoall      tensors[0].in / .out: the blocks sent / received back to back; blocks /
//                 recv_blocks: bytes sent to / received from each member
//   reducescatter tensors[0]: every member's full input, reduced in place; blocks: elements of
//                 each member's block
struct CollectiveCall {
  const Communicator& comm;
  Scratch& scratch;
  DataType dtype = DataType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  std::vector<TensorSpan> tensors;
  std::vector<size_t> blocks;
  std::vector<size_t> recv_blocks;
  int root = 0;
  double prescale = 1.0, postscale = 1.0;  // Staging::kTensors only
  size_t ring_threshold_bytes = kDefaultRingThresholdBytes;
  StepMarker step;  // names an algorithm's steps in the timeline (empty: not recording)

  CollectiveCall(const Communicator& c, Scratch& s) : comm(c), scratch(s) {}
};

// One row of the table.
struct Algorithm {
  OpType op;
  const char* name;  // what the timeline shows for the path, inside the op's phase
  bool (*applies)(const CollectiveCase&);
  Staging staging;
  // Runs the collective. False when the row declines after all (decided collectively, the
  // same on every member, with nothing changed: the arena path agrees whether every member's
  // tensors are in arenas); the next row that applies runs instead, with the same staging.
  // Null for kDevice rows.
  bool (*run)(const CollectiveCall&);
};

// The name of the row that hands a CUDA allreduce over several hosts to the GPU path's
// hierarchical NCCL allreduce (the engine tells the GPU path so).
constexpr const char* kNcclHierarchicalAllreduce = "NCCL_HIERARCHICAL_ALLREDUCE";

// The first row after `after` (nullptr: from the top) for `c`. Every op with a row has a last
// row that always applies. Barrier has none: the negotiation that answers it is the barrier.
const Algorithm& choose_algorithm(const CollectiveCase& c, const Algorithm* after = nullptr);

// Runs `first` (chosen for `c`) and, while rows decline, the next ones. Returns the row that
// ran.
const Algorithm& run_algorithm(const CollectiveCase& c, const Algorithm& first,
                               const CollectiveCall& call);

}  // namespace shvd
