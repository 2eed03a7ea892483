// The collective algorithms, written against Link only (no knowledge of negotiation, fusion or
// frameworks). Which one runs is chosen in one place, dispatch.{h,cc}. Each lives in its own
// file:
//   allreduce_ring.cc               ring reduce-scatter + ring allgather (bandwidth-bound)
//   allreduce_recursive_doubling.cc log2(n) whole-buffer exchanges (latency-bound)
//   allreduce_adasum.cc             Adasum's pairwise combination over a binary tree
//   allreduce_shm_slots.cc          one host: through the slots of a shared segment
//   allreduce_shm_single_copy.cc    one host: reading the peers' tensors (process_vm_readv)
//   allreduce_shm_arena.cc          one host: in place in shared arenas
//   allgather_ring.cc, broadcast_tree.cc, alltoall_pairwise.cc, reducescatter_ring.cc
//   hierarchical.{h,cc}             sets spanning hosts: within each host, then across hosts
// and what they share: collective_helpers.cc (offsets, the pipelined send-receive-reduce step),
// kernels/reduce_kernels.{h,cc} (element-wise reduction per dtype and op),
// shared_memory_group.{h,cc} with shared_memory_group_internal.h (the one-host group the shm_*
// files run in), cpu_placement.{h,cc} and shared_arenas.{h,cc} (memory every member can map).
//
// Every member of the communicator calls the same function with consistent arguments (the
// controller guarantees that); results are bitwise identical on every member.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "../common/types.h"
#include "../transport/communicator.h"

namespace shvd {

// One tensor of a response: read from `in`, result written to `out` (may alias); `count`
// elements.
struct TensorSpan {
  const void* in;
  void* out;
  size_t count;
};

// Marks the beginning (true) and the end (false) of a named step inside an algorithm, for the
// timeline; empty when nothing records.
using StepMarker = std::function<void(const char* step, bool begin)>;

// Messages at or below this many bytes use recursive doubling (latency-bound); above it the ring
// (bandwidth-bound), see dispatch.cc. Overridable with SPARK_HVD_RING_THRESHOLD.
constexpr size_t kDefaultRingThresholdBytes = 64 * 1024;

// An allreduce of `count` elements (`bytes`) over `members` is latency-bound when it is small or
// has fewer elements than members (the ring's blocks would be empty): recursive doubling takes
// it, the ring the rest. The dispatcher's rule, and the hierarchical cross-host step's.
inline bool allreduce_latency_bound(size_t bytes, size_t count, int members,
                                    size_t ring_threshold_bytes) {
  return bytes <= ring_threshold_bytes || count < size_t(members);
}

// In-place allreduces of `count` elements. Average is reduced as Sum (the caller scales).
void allreduce_ring(const Communicator& comm, void* buf, size_t count, DataType dtype,
                    ReduceOp op, Scratch& scratch);
void allreduce_recursive_doubling(const Communicator& comm, void* buf, size_t count,
                                  DataType dtype, ReduceOp op, Scratch& scratch);

// In-place Adasum of consecutive tensors (`tensor_counts` elements each) over a power-of-two
// number of members; floating-point dtypes only (adasum_supports).
bool adasum_supports(DataType dtype);
void allreduce_adasum(const Communicator& comm, void* buf,
                      const std::vector<size_t>& tensor_counts, DataType dtype, Scratch& scratch);

// Reduce-scatter of `buf` (all members' full inputs, in place) into blocks: member i ends with
// the reduction of block i (elements [offsets[i], offsets[i] + counts[i])) in place in `buf`.
void reducescatter_ring(const Communicator& comm, void* buf, const std::vector<size_t>& counts,
                        DataType dtype, ReduceOp op, Scratch& scratch);

// out holds every member's block back to back (bytes[i] from member i); my block must already
// be at its place in `out`.
void allgather_ring(const Communicator& comm, void* out, const std::vector<size_t>& bytes);
// The same with each member's block at its own offset in `base` (offsets[i], bytes[i] from
// member i), in any order and with gaps between them.
void allgather_ring_at(const Communicator& comm, void* base, const std::vector<size_t>& offsets,
                       const std::vector<size_t>& bytes);

// Binomial-tree broadcast of `bytes` from member `root`.
void broadcast_tree(const Communicator& comm, void* buf, size_t bytes, int root);

// Pairwise exchange: send_bytes[i] bytes from `in` (blocks back to back) go to member i, and
// recv_bytes[i] bytes from member i land in `out` (blocks back to back).
void alltoall_pairwise(const Communicator& comm, const void* in,
                       const std::vector<size_t>& send_bytes, void* out,
                       const std::vector<size_t>& recv_bytes);

// Helpers shared by the algorithm files.
std::vector<size_t> prefix_offsets(const std::vector<size_t>& sizes);
// `count` split into `n` blocks as evenly as possible (the first count % n one larger).
std::vector<size_t> even_blocks(size_t count, int n);
// Sends `sn` bytes to `to` while receiving `rn` bytes from `from` into `scratch_in` and reducing
// them into `dst` segment by segment as they arrive, so the transfer overlaps the arithmetic.
void send_recv_reduce(Link* to, const void* sbuf, size_t sn, Link* from, void* dst,
                      void* scratch_in, size_t rn, DataType dtype, ReduceOp op);

}  // namespace shvd
