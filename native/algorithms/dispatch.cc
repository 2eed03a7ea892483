// The table of rules that chooses each collective's algorithm (see dispatch.h), and the thin
// adapters between CollectiveCall and each algorithm's own signature.
#include "dispatch.h"

#include <climits>
#include <cstring>
#include <stdexcept>
#include <string>

#include "../mpi/mpi_backend.h"
#include "hierarchical.h"
#include "../kernels/reduce_kernels.h"
#include "shared_memory_group.h"

namespace shvd {

namespace {

// ---------------------------------------------------------------------------------------------
// Predicates.

bool always(const CollectiveCase&) { return true; }

bool on_gpu(const CollectiveCase& c) { return c.on_gpu; }

// A set of one exchanges nothing.
bool alone(const CollectiveCase& c) { return c.comm->size == 1; }

bool adasum(const CollectiveCase& c) { return c.reduce_op == ReduceOp::kAdasum; }

// Every member shares this host: the set has a shared-memory group.
bool on_one_host(const CollectiveCase& c) { return c.comm->shm_group != nullptr; }

// The group reads each tensor and writes each result itself. Every member must decide alike:
// the group applies postscale to the slices each member reduces, so one member on this path and
// another packing a fusion buffer (a joined rank has no entries) would leave some slices
// unscaled. The response, not local state, decides (`complete` covers joined ranks).
bool on_one_host_tensors(const CollectiveCase& c) {
  return on_one_host(c) && c.complete && !c.prescaled && c.reduce_op != ReduceOp::kAdasum;
}

bool in_arenas_tensors(const CollectiveCase& c) {
  return on_one_host_tensors(c) && c.comm->shm_group->arenas_worth_checking(c.bytes());
}
bool small_tensors(const CollectiveCase& c) {
  return on_one_host_tensors(c) && c.comm->shm_group->small_suits(c.bytes());
}
bool single_copy_tensors(const CollectiveCase& c) {
  return on_one_host_tensors(c) && c.comm->shm_group->single_copy_suits(c.bytes(), c.tensors);
}
// The same paths on a packed buffer: one span, so one tensor for single copy's limit.
bool in_arenas_buffer(const CollectiveCase& c) {
  return on_one_host(c) && c.comm->shm_group->arenas_worth_checking(c.bytes());
}
bool small_buffer(const CollectiveCase& c) {
  return on_one_host(c) && c.comm->shm_group->small_suits(c.bytes());
}
bool single_copy_buffer(const CollectiveCase& c) {
  return on_one_host(c) && c.comm->shm_group->single_copy_suits(c.bytes(), 1);
}

// Latency-bound (collectives.h): small, or fewer elements than members.
bool latency_bound(const CollectiveCase& c) {
  return allreduce_latency_bound(c.bytes(), c.count, c.comm->size, c.ring_threshold_bytes);
}

// The members sit on several hosts, more than one on some (comm->hierarchy), and the setting
// does not turn it off. Automatic allreduce leaves latency-bound ones to recursive doubling, which
// takes fewer steps.
bool hierarchical_allreduce(const CollectiveCase& c) {
  return c.comm->hierarchy && c.hierarchical != 0 && (c.hierarchical == 1 || !latency_bound(c));
}
// Every tensor where it lies (no prescale, nobody joined: as on one host), reduced in place in
// the hosts' shared arenas where a host's members have them there.
bool hierarchical_allreduce_tensors(const CollectiveCase& c) {
  return hierarchical_allreduce(c) && c.complete && !c.prescaled &&
         c.reduce_op != ReduceOp::kAdasum;
}
// CUDA tensors, chosen as the CPU path's hierarchical allreduce is, where every host has the
// same number of members (NCCL's reduce-scatter within a host hands every member an equal
// block, so every member must have a lane): the GPU path runs NCCL within the host, across
// hosts per lane, and within the host again.
bool gpu_hierarchical_allreduce(const CollectiveCase& c) {
  if (!c.on_gpu || c.reduce_op == ReduceOp::kAdasum || !hierarchical_allreduce(c)) return false;
  const Hierarchy& h = *c.comm->hierarchy;
  for (int members : h.host_size)
    if (members != h.lanes) return false;
  return true;
}
// Allgather also needs each host's members consecutive in the set.
bool hierarchical_allgather(const CollectiveCase& c) {
  return c.comm->hierarchy && c.comm->hierarchy->hosts_contiguous && c.hierarchical != 0;
}

// MPI operations are on (HOROVOD_CPU_OPERATIONS=MPI, the same on every rank: init checks it),
// the set exchanges something, and MPI can take the reduction (Adasum stays ours). A
// reducescatter's blocks must fit MPI's int counts (the other ops split or re-type theirs).
bool through_mpi(const CollectiveCase& c) {
  return mpi::active() && c.comm->size > 1 && mpi::supports(c.dtype, c.reduce_op) &&
         (c.op != OpType::kReducescatter || c.count <= size_t(INT_MAX));
}

// ---------------------------------------------------------------------------------------------
// Adapters. A kBuffer allreduce of zero elements exchanges nothing.

const TensorSpan& buffer(const CollectiveCall& k) { return k.tensors.front(); }

bool run_local_allreduce(const CollectiveCall& k) {
  const size_t esize = dtype_size(k.dtype);
  for (const TensorSpan& t : k.tensors) {
    if (t.out != t.in) std::memcpy(t.out, t.in, t.count * esize);
    if (k.prescale != 1.0) scale_buffer(t.out, t.count, k.dtype, k.prescale);
    if (k.postscale != 1.0) scale_buffer(t.out, t.count, k.dtype, k.postscale);
  }
  return true;
}

bool run_shm_arena(const CollectiveCall& k) {
  return k.comm.shm_group->allreduce_in_arenas(k.comm, k.tensors, k.dtype, k.reduce_op,
                                               k.postscale);
}
bool run_shm_single_copy(const CollectiveCall& k) {
  k.comm.shm_group->allreduce_single_copy(k.comm, k.tensors, k.dtype, k.reduce_op, k.postscale);
  return true;
}
bool run_shm_small(const CollectiveCall& k) {
  k.comm.shm_group->allreduce_small(k.comm, k.tensors, k.dtype, k.reduce_op, k.postscale);
  return true;
}
bool run_shm_slots(const CollectiveCall& k) {
  k.comm.shm_group->allreduce_through_slots(k.comm, k.tensors, k.dtype, k.reduce_op,
                                            k.postscale);
  return true;
}

bool run_adasum(const CollectiveCall& k) {
  allreduce_adasum(k.comm, buffer(k).out, k.blocks, k.dtype, k.scratch);
  return true;
}
bool run_recursive_doubling(const CollectiveCall& k) {
  if (buffer(k).count > 0)
    allreduce_recursive_doubling(k.comm, buffer(k).out, buffer(k).count, k.dtype, k.reduce_op,
                                 k.scratch);
  return true;
}
bool run_ring(const CollectiveCall& k) {
  if (buffer(k).count > 0)
    allreduce_ring(k.comm, buffer(k).out, buffer(k).count, k.dtype, k.reduce_op, k.scratch);
  return true;
}

bool run_hierarchical_allreduce(const CollectiveCall& k) {
  allreduce_hierarchical(k.comm, buffer(k).out, buffer(k).count, k.dtype, k.reduce_op,
                         k.ring_threshold_bytes, k.scratch, k.step);
  return true;
}
bool run_hierarchical_allreduce_tensors(const CollectiveCall& k) {
  allreduce_hierarchical_tensors(k.comm, k.tensors, k.dtype, k.reduce_op, k.postscale,
                                 k.ring_threshold_bytes, k.scratch, k.step);
  return true;
}
bool run_hierarchical_allgather(const CollectiveCall& k) {
  allgather_hierarchical(k.comm, k.tensors[0].out, k.blocks, k.scratch, k.step);
  return true;
}

bool run_allgather_ring(const CollectiveCall& k) {
  allgather_ring(k.comm, k.tensors[0].out, k.blocks);
  return true;
}
bool run_broadcast_tree(const CollectiveCall& k) {
  broadcast_tree(k.comm, k.tensors[0].out, k.tensors[0].count * dtype_size(k.dtype), k.root);
  return true;
}
bool run_alltoall_pairwise(const CollectiveCall& k) {
  alltoall_pairwise(k.comm, k.tensors[0].in, k.blocks, k.tensors[0].out, k.recv_blocks);
  return true;
}
bool run_reducescatter_ring(const CollectiveCall& k) {
  reducescatter_ring(k.comm, k.tensors[0].out, k.blocks, k.dtype, k.reduce_op, k.scratch);
  return true;
}

// MPI (mpi/mpi_backend.h): the engine's buffers as the other rows take them.
bool run_mpi_allreduce(const CollectiveCall& k) {
  if (buffer(k).count > 0)
    mpi::allreduce(k.comm, buffer(k).out, buffer(k).count, k.dtype, k.reduce_op);
  return true;
}
bool run_mpi_allgather(const CollectiveCall& k) {
  mpi::allgather(k.comm, k.tensors[0].out, k.blocks);
  return true;
}
bool run_mpi_broadcast(const CollectiveCall& k) {
  mpi::broadcast(k.comm, k.tensors[0].out, k.tensors[0].count * dtype_size(k.dtype), k.root);
  return true;
}
bool run_mpi_alltoall(const CollectiveCall& k) {
  mpi::alltoall(k.comm, k.tensors[0].in, k.blocks, k.tensors[0].out, k.recv_blocks);
  return true;
}
bool run_mpi_reducescatter(const CollectiveCall& k) {
  mpi::reducescatter(k.comm, k.tensors[0].out, k.blocks, k.dtype, k.reduce_op, k.scratch);
  return true;
}

// ---------------------------------------------------------------------------------------------
// The rules, in order: the first row of the response's op whose predicate holds runs it.
//
// Adding an algorithm is adding a row (and its file).
constexpr Algorithm kAlgorithms[] = {
    // CUDA tensors: the GPU path (gpu/gpu_path.h) chooses NCCL or host staging itself and names
    // the path it took in the timeline (NCCL_ALLREDUCE, ..., CUDA_HOST_STAGED). The engine hands
    // it the hierarchical row's choice.
    {OpType::kAllreduce, kNcclHierarchicalAllreduce, gpu_hierarchical_allreduce,
     Staging::kDevice, nullptr},
    {OpType::kAllreduce, "GPU", on_gpu, Staging::kDevice, nullptr},
    {OpType::kAllgather, "GPU", on_gpu, Staging::kDevice, nullptr},
    {OpType::kBroadcast, "GPU", on_gpu, Staging::kDevice, nullptr},
    {OpType::kAlltoall, "GPU", on_gpu, Staging::kDevice, nullptr},
    {OpType::kReducescatter, "GPU", on_gpu, Staging::kDevice, nullptr},
    {OpType::kAllreduce, "LOCAL_ALLREDUCE", alone, Staging::kTensors, run_local_allreduce},
    // MPI operations asked for: every collective MPI can take goes through it, ahead of the
    // core's own paths (the engine packs, prescales and, for Average, divides as usual).
    {OpType::kAllreduce, "MPI_ALLREDUCE", through_mpi, Staging::kBuffer, run_mpi_allreduce},
    {OpType::kAllgather, "MPI_ALLGATHER", through_mpi, Staging::kBuffer, run_mpi_allgather},
    {OpType::kBroadcast, "MPI_BROADCAST", through_mpi, Staging::kBuffer, run_mpi_broadcast},
    {OpType::kAlltoall, "MPI_ALLTOALL", through_mpi, Staging::kBuffer, run_mpi_alltoall},
    {OpType::kReducescatter, "MPI_REDUCESCATTER", through_mpi, Staging::kBuffer,
     run_mpi_reducescatter},
    // One host, each tensor read and written where it lies. The arena path (every member's
    // tensors in shared arenas, reduced in place) declines when some member's are not.
    {OpType::kAllreduce, "SHM_ARENA_ALLREDUCE", in_arenas_tensors, Staging::kTensors,
     run_shm_arena},
    {OpType::kAllreduce, "SHM_SINGLE_COPY_ALLREDUCE", single_copy_tensors, Staging::kTensors,
     run_shm_single_copy},
    {OpType::kAllreduce, "SHM_SMALL_ALLREDUCE", small_tensors, Staging::kTensors, run_shm_small},
    {OpType::kAllreduce, "SHM_ALLREDUCE", on_one_host_tensors, Staging::kTensors, run_shm_slots},
    {OpType::kAllreduce, "ADASUM_ALLREDUCE", adasum, Staging::kBuffer, run_adasum},
    // One host, but prescaled or with a joined rank: the same paths on a packed buffer.
    {OpType::kAllreduce, "SHM_ARENA_ALLREDUCE", in_arenas_buffer, Staging::kBuffer,
     run_shm_arena},
    {OpType::kAllreduce, "SHM_SINGLE_COPY_ALLREDUCE", single_copy_buffer, Staging::kBuffer,
     run_shm_single_copy},
    {OpType::kAllreduce, "SHM_SMALL_ALLREDUCE", small_buffer, Staging::kBuffer, run_shm_small},
    {OpType::kAllreduce, "SHM_ALLREDUCE", on_one_host, Staging::kBuffer, run_shm_slots},
    // Several hosts (hierarchical.h): tensors where they lie (in place where a host's members
    // have them in shared arenas; each host decides for itself, the same bytes cross either
    // way), else packed.
    {OpType::kAllreduce, "HIERARCHICAL_ALLREDUCE", hierarchical_allreduce_tensors,
     Staging::kTensors, run_hierarchical_allreduce_tensors},
    {OpType::kAllreduce, "HIERARCHICAL_ALLREDUCE", hierarchical_allreduce, Staging::kBuffer,
     run_hierarchical_allreduce},
    {OpType::kAllreduce, "RECURSIVE_DOUBLING_ALLREDUCE", latency_bound, Staging::kBuffer,
     run_recursive_doubling},
    {OpType::kAllreduce, "RING_ALLREDUCE", always, Staging::kBuffer, run_ring},
    {OpType::kAllgather, "HIERARCHICAL_ALLGATHER", hierarchical_allgather, Staging::kBuffer,
     run_hierarchical_allgather},
    {OpType::kAllgather, "RING_ALLGATHER", always, Staging::kBuffer, run_allgather_ring},
    {OpType::kBroadcast, "TREE_BROADCAST", always, Staging::kBuffer, run_broadcast_tree},
    {OpType::kAlltoall, "PAIRWISE_ALLTOALL", always, Staging::kBuffer, run_alltoall_pairwise},
    {OpType::kReducescatter, "RING_REDUCESCATTER", always, Staging::kBuffer,
     run_reducescatter_ring},
};

}  // namespace

const Algorithm& choose_algorithm(const CollectiveCase& c, const Algorithm* after) {
  const Algorithm* row = after ? after + 1 : std::begin(kAlgorithms);
  for (; row != std::end(kAlgorithms); ++row)
    if (row->op == c.op && row->applies(c)) return *row;
  throw std::logic_error(std::string("no algorithm for ") + op_type_name(c.op) +
                         (after ? std::string(" after ") + after->name : std::string()));
}

const Algorithm& run_algorithm(const CollectiveCase& c, const Algorithm& first,
                               const CollectiveCall& call) {
  const Algorithm* row = &first;
  if (row->staging == Staging::kDevice)
    throw std::logic_error(std::string("algorithm table: ") + row->name +
                           " hands the response to the GPU path; it has nothing to run here");
  while (!row->run(call)) {
    const Algorithm& next = choose_algorithm(c, row);
    // The caller staged the tensors for the first row; a row that declines must be followed
    // by rows that take them the same way.
    if (next.staging != row->staging)
      throw std::logic_error(std::string("algorithm table: ") + next.name + " follows " +
                             row->name + ", which may decline, with another staging");
    row = &next;
  }
  return *row;
}

}  // namespace shvd
