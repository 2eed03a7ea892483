// Intra-host allreduce through one shared segment that every member maps, used when all members
// of a communicator share a host. Instead of streaming bytes through pipes (a copy in, a copy
// out, per ring step), each member reduces its own slice of the data directly out of the others'
// memory. Three algorithms, one per file, which the dispatcher chooses among (dispatch.cc):
//
//   allreduce_shm_slots.cc        each member copies its chunk into its slot of the segment,
//                                 reduces its slice out of everyone's slots, copies results out
//   allreduce_shm_small.cc        small ones: each member copies its input into its slot and
//                                 reduces everyone's copies itself (one wait instead of two)
//   allreduce_shm_single_copy.cc  members read each other's tensors with process_vm_readv
//                                 where the kernel allows it (large allreduces)
//   allreduce_shm_arena.cc        tensors every member can map (shared arenas) are reduced in
//                                 place, no copy at all
//
// This file's class holds what they share: the segment (transport/shm_segment.h) with each
// member's progress counters, the chunking, the barrier-like wait on the other members (with
// CpuPlacement, cpu_placement.h), and the set-up, which probes once whether members may read
// each other's memory and map each other's arenas (transport/peer_memory.h): a path some member
// may not use is used by none. Each slice is reduced by exactly one member in member order, on
// every path: results are bitwise equal across members and paths.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "collectives.h"
#include "cpu_placement.h"

namespace shvd {

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

  // Collective over `comm` (every member calls it for the same communicator, on its engine
  // thread): sets up the segment over the data links (map_group_segment) and probes which paths
  // every member may use. Returns nullptr (on every member alike) when shared memory cannot be
  // set up, and the caller falls back to the links. Member 0's `settings` apply to every
  // member.
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
  // allreduce_shm_arena.cc: in place in the members' shared arenas; false (on every member
  // alike, nothing done) when some member's tensors are not all in its arenas. Worth the
  // agreement it costs from arena_min_bytes on, where every member allows arenas
  // (arenas_worth_checking).
  bool allreduce_in_arenas(const Communicator& comm, const std::vector<TensorSpan>& tensors,
                           DataType dtype, ReduceOp op, double scale);
  // The arena path's agreement and end, for collectives of other shapes in place in the
  // members' arenas (hierarchical.cc). map_members_arenas: whether every member's `tensors`
  // are all in shared arenas (decided together: the same answer on every member); if so,
  // (*views)[m] are member m's tensors as this process maps them, and every member must call
  // release_members_arenas once it has done with them (nobody returns its tensors while
  // another member may still write into them).
  bool map_members_arenas(const Communicator& comm, const std::vector<TensorSpan>& tensors,
                          size_t esize, std::vector<std::vector<TensorSpan>>* views);
  void release_members_arenas(const Communicator& comm);
  // allreduce_shm_single_copy.cc: reading the peers' tensors with process_vm_readv, where
  // every member allows it, for allreduces of at least single_copy_min_bytes
  // (single_copy_suits).
  void allreduce_single_copy(const Communicator& comm, const std::vector<TensorSpan>& tensors,
                             DataType dtype, ReduceOp op, double scale);
  // allreduce_shm_slots.cc: through the segment's slots, always possible.
  void allreduce_through_slots(const Communicator& comm, const std::vector<TensorSpan>& tensors,
                               DataType dtype, ReduceOp op, double scale);
  // allreduce_shm_small.cc: small allreduces through the slots with one wait (small_suits).
  void allreduce_small(const Communicator& comm, const std::vector<TensorSpan>& tensors,
                       DataType dtype, ReduceOp op, double scale);
  // Whether `bytes` in all are small enough for allreduce_small (settings agreed at set-up:
  // the same answer on every member).
  bool small_suits(size_t bytes) const;

  // Whether `bytes` in all are large enough for the arena agreement, with arenas allowed on
  // every member (settings agreed at set-up: the same answer on every member).
  bool arenas_worth_checking(size_t bytes) const;
  // Whether single copy suits an allreduce of `tensors` tensors of `bytes` in all (the same
  // answer on every member: it depends only on the response and on settings agreed at set-up).
  bool single_copy_suits(size_t bytes, size_t tensors) const;

  // Per member, at the start of the segment (shared_memory_group_internal.h).
  struct Control;

 private:
  struct Chunk;
  struct Plan {  // one collective's chunking, the same on every member
    size_t count, esize, chunk_elems, chunks;
    uint64_t base_seq;  // chunk k has sequence number base_seq + k + 1
    int n;
    Chunk chunk(size_t k) const;
  };
  // Starts a collective of `count` elements: takes its sequence numbers, publishes my CPU.
  Plan start(size_t count, size_t esize, size_t chunk_bytes);
  SharedMemoryGroup(void* base, size_t bytes, int members, int me, const Settings& settings);
  uint8_t* peer_arena(const Communicator& comm, int member, int arena);
  // Waits until every other member's counter `which` has reached `target`.
  void wait_all(const Communicator& comm, int which, uint64_t target);
  Control* control() const { return static_cast<Control*>(base_); }
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
  CpuPlacement placement_;
};

}  // namespace shvd
