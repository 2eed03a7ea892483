// Intra-host allreduce through one shared segment that every member maps, used when all members
// of a communicator share a host. Instead of streaming bytes through pipes (a copy in, a copy
// out, per ring step), each member publishes its chunk once, reduces its own slice of every
// chunk directly out of the others' slots, and copies the finished slices back:
//
//   for each chunk (double-buffered so the next chunk's copy-in overlaps the stragglers):
//     1. copy-in   member r copies the slices owned by others into its slot, bumps `in_seq`
//     2. reduce    member r reduces slice r over all members (its own from private memory,
//                  the others' from their slots), in member order, into the shared result;
//                  bumps `reduced_seq`
//     3. copy-out  member r copies the other slices from the shared result, bumps `done_seq`
//
// Chunks are sized to stay in cache, so DRAM sees the input read once and the output written
// once. Each slice is reduced by exactly one member in a fixed order: results are bitwise equal.
//
// Large allreduces skip the slots when the kernel lets members read each other's memory
// (process_vm_readv, "cross-memory attach", which Open MPI's shared-memory transport also
// uses): each member publishes where its tensors are, reads the others' inputs of its slice
// straight into a private cache-sized buffer, reduces into its own output, and then reads the
// other slices' results straight from their reducers' outputs. Per member that is about 40 %
// less memory traffic than going through the segment. Whether peers may read each other
// (same user, ptrace policy, seccomp) is probed once when the group is set up; if any member
// cannot, every member keeps the slots.
//
// Tensors that every member can map (allocated in shared arenas, see shared_arenas.h: the torch
// adapter puts gradients there) need neither: member r reads slice r of every member's tensor
// where it lies, and writes the sum into every member's tensor. Per member that is S bytes read
// and S written instead of 2 S and 2 S, and two barriers instead of three per chunk. Whether
// every member's tensors of a response are in arenas is agreed at the start of each large
// allreduce; if one member's are not, all take the paths above.
#pragma once

#include <sched.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "collectives.h"

namespace shvd {

class SegmentedBuffer;  // the fused tensors of one allreduce seen as one array

class SharedMemoryGroup {
 public:
  // Set-up values every member takes from member 0, so differing environments cannot split
  // the group into different chunk geometries or paths.
  struct Settings {
    uint64_t chunk_bytes = 512 * 1024;  // rounded to cache lines, at least 4 KiB
    // Below this size the slots win: their copies run from cache, while the kernel pins every
    // page it copies (on a 2-core VM process_vm_readv copied at ~3 GB/s against memcpy's
    // 4.5-6.5; single copy lost at 4-8 MiB and won by 5-12 % at 16-64 MiB).
    uint64_t single_copy_min_bytes = 16 << 20;
    uint8_t single_copy = 1;  // wanted (member 0's setting), then: allowed on every member
    // Tensors in shared arenas are reduced in place from this size (below it the agreement
    // costs more than the copies it saves).
    uint64_t arena_min_bytes = 256 * 1024;
    uint8_t arenas = 1;  // wanted, then: every member may map every other's arenas
  };

  // Collective over `comm` (every member calls it for the same communicator): member 0 creates
  // the segment and sends its name over the data links; the others map it and acknowledge; then
  // the name is unlinked so nothing is left behind after a crash. Returns nullptr (on every
  // member alike) when shared memory cannot be set up, and the caller falls back to the links.
  // Member 0's `settings` apply to every member.
  static std::unique_ptr<SharedMemoryGroup> create(const Communicator& comm,
                                                   const std::string& job_id,
                                                   const Settings& settings);
  ~SharedMemoryGroup();

  // The three allreduces of the concatenation of `tensors` (each read from its `in`, the result
  // written to its `out`) without a fusion buffer: the reduced values are multiplied by `scale`
  // (Average, postscale) before anyone copies them out. Which one runs is the dispatcher's
  // choice (dispatch.cc), the same on every member; none of them does anything for zero
  // elements.
  //
  // In place in the members' shared arenas; false (on every member alike, nothing done) when
  // some member's tensors are not all in its arenas. Worth the agreement it costs from
  // arena_min_bytes on, where every member allows arenas (arenas_worth_checking).
  bool allreduce_in_arenas(const Communicator& comm, const std::vector<TensorSpan>& tensors,
                           DataType dtype, ReduceOp op, double scale);
  // Reading the peers' tensors with process_vm_readv, where every member allows it, for
  // allreduces of at least single_copy_min_bytes (single_copy_suits).
  void allreduce_single_copy(const Communicator& comm, const std::vector<TensorSpan>& tensors,
                             DataType dtype, ReduceOp op, double scale);
  // Through the segment's slots: always possible.
  void allreduce_through_slots(const Communicator& comm, const std::vector<TensorSpan>& tensors,
                               DataType dtype, ReduceOp op, double scale);

  // Whether `bytes` in all are large enough for the arena agreement, with arenas allowed on
  // every member (settings agreed at set-up: the same answer on every member).
  bool arenas_worth_checking(size_t bytes) const;
  // Whether single copy suits an allreduce of `tensors` tensors of `bytes` in all (the same
  // answer on every member: it depends only on the response and on settings agreed at set-up).
  bool single_copy_suits(size_t bytes, size_t tensors) const;

  struct Control;  // per-member progress counters at the start of the segment

 private:
  struct Chunk;
  struct Plan {  // one collective's chunking, the same on every member
    size_t count, esize, chunk_elems, chunks;
    uint64_t base_seq;  // chunk k has sequence number base_seq + k + 1
    int n;
    Chunk chunk(size_t k) const;
  };
  // Starts a collective of `count` elements: takes its sequence numbers, publishes my CPU.
  Plan start(const Communicator& comm, size_t count, size_t esize, size_t chunk_bytes);
  SharedMemoryGroup(void* base, size_t bytes, int members, const Settings& settings);
  void slots_allreduce(const Communicator& comm, const SegmentedBuffer& data, const Plan& plan,
                       DataType dtype, ReduceOp op, double scale);
  void single_copy_allreduce(const Communicator& comm, const SegmentedBuffer& data,
                             const Plan& plan, DataType dtype, ReduceOp op, double scale);
  uint8_t* peer_arena(const Communicator& comm, int member, int arena);
  void begin_collective(const Communicator& comm);
  void wait_all(const Communicator& comm, int which, uint64_t target);
  uint64_t publish_cpu(const Communicator& comm);  // this member's CPU + 1 (0: unknown)
  uint64_t peer_cpu(int member) const;  // its CPU + 1 in this collective, else 0
  cpu_set_t member_cpus(const Communicator& comm) const;  // CPUs the other members are on
  uint8_t* slot(int member, int buffer) const;
  uint8_t* result(int buffer) const;
  uint64_t* table(int member) const;  // where a member's tensors are, for single-copy reads
  uint64_t* arena_directory(int member) const;  // per arena of a member: its fd and size

  void* base_;
  size_t bytes_;
  int members_;
  size_t chunk_bytes_;
  size_t single_copy_min_bytes_;
  bool single_copy_;
  bool arenas_;
  size_t arena_min_bytes_;
  uint64_t arena_checks_ = 0;  // arena agreements so far, identical on every member
  struct PeerArena {
    uint8_t* base;
    size_t bytes;
  };
  std::vector<std::vector<PeerArena>> peer_arenas_;  // [member][arena], mapped on first use
  std::vector<uint8_t> peer_slices_;  // single copy: the peers' inputs of my slice of a chunk
  uint64_t chunks_done_ = 0;  // chunks processed so far, identical on every member
  bool moved_ = false;        // this collective already moved off a CPU shared with a peer
  uint64_t collective_ = 0;   // allreduces run so far, identical on every member
};

}  // namespace shvd
