// Hierarchical allreduce and allgather for process sets whose members sit on several hosts:
// the bytes that must cross between hosts cross once per host pair and local index, over every
// member's own link at the same time, and everything else moves within the hosts (over the
// shared-memory pipes between a host's ranks where shared memory is on).
//
//   allreduce (allreduce_hierarchical): the buffer is split into one block per lane (local
//   index below the smallest host's number of members; see Hierarchy);
//     1. INTRA_HOST_REDUCESCATTER  ring reduce-scatter among my host's members: I hold my
//                                  block reduced over my host (members past the lanes: none)
//     2. CROSS_HOST_ALLREDUCE      allreduce of my block with the members of the same local
//                                  index on the other hosts (one ring per lane, all at
//                                  once; recursive doubling when the block is latency-bound)
//     3. INTRA_HOST_ALLGATHER      ring allgather of the blocks among my host's members
//   Large buffers go segment by segment through the three steps, pipelined: the hierarchy's
//   helper thread (CrossHostWorker, started at the first such call and kept for the set's
//   life) runs the cross-host step of one segment while the engine thread runs the intra-host
//   steps of its neighbours, so the wire between hosts is not idle while the host's members
//   exchange.
//   Each block is reduced by one member per host and then by an allreduce whose results are
//   the same bytes on every member of its ring; the last step copies bytes: every member ends
//   with bitwise equal results.
//   Tensors in the shared arenas of every member of a host (gradients, with the torch
//   adapter's allocator) skip the pipes and the fusion buffer (allreduce_hierarchical_tensors):
//   each lane's member reduces its block of every member's tensors where they lie into a
//   buffer of its own, which crosses between hosts, and writes the result into every member's
//   tensors; per member about a third of the memory traffic of packing, piping and unpacking.
//   Each host decides that alone: the same segments and blocks cross either way.
//
//   allgather (allgather_hierarchical), with each host's members consecutive in the set, so
//   each host's blocks form one region of the output: every region is split into one piece
//   per lane;
//     1. INTRA_HOST_ALLGATHER   ring allgather among my host's members: my host's region
//     2. CROSS_HOST_ALLGATHER   ring allgather of piece (my lane) of every region with the
//                               members of my lane on the other hosts
//     3. INTRA_HOST_SHARE       per other host, ring allgather of its region's pieces among
//                               my host's members
//   Pieces over one segment go through steps 2 and 3 segment by segment, pipelined on the
//   hierarchy's helper thread as allreduce's are: one segment crosses while the previous one
//   is shared within the host.
//
// Compared with the flat ring over 2 hosts of 2 ranks, each host sends half the allreduce's
// bytes instead of three quarters (2/3 of the wire time), and half an allgather's instead of
// three quarters. Hosts of different sizes (3 + 1) have as many lanes as the smallest host has
// members: fewer parallel rings, but still each host's data crosses once (a flat ring over
// 3 + 1 ranks sends 1.5 times the buffer out of each host, one lane once).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "collectives.h"
#include "shared_memory_group.h"

namespace shvd {

// Runs the cross-host steps of a pipelined collective on a thread of its own (hierarchical.cc).
class CrossHostWorker;

// How a communicator's members sit on hosts. Every member derives it from the same table of
// host ids (the rendezvous'), so all members agree on it, and on whether it exists, without a
// message.
struct Hierarchy {
  int hosts = 0;    // hosts in the order of their first member in the set
  int my_host = 0;
  // Cross-host rings, one per local index below the smallest host's number of members: lane i
  // joins the members of local index i of every host. Hosts with more members than lanes
  // give their further members empty blocks (they reduce and share within the host only).
  int lanes = 0;
  Communicator local;  // my host's members, in set order
  // My lane's ring, hosts in order (my index there is my host's); just me past the lanes.
  Communicator cross;
  // Every host's members are consecutive in the set (what allgather_hierarchical needs);
  // host_first[h] / host_size[h]: the set index of host h's first member, its members.
  bool hosts_contiguous = false;
  std::vector<int> host_first, host_size;
  // The cross-host steps' scratch: they run on a thread of their own (allreduce_hierarchical).
  mutable Scratch cross_scratch;
  // That thread, made at the first pipelined call (a new thread per call cost a creation and
  // a join, each a scheduling delay of up to milliseconds on a busy host).
  mutable std::unique_ptr<CrossHostWorker> cross_worker;
  // My host's members' shared-memory group, when every link among them is shared memory (the
  // engine sets it up with the set's communicator): allreduce_hierarchical_tensors works in
  // place in their arenas through it.
  std::unique_ptr<SharedMemoryGroup> host_group;
  // allreduce_hierarchical_tensors' buffers: my lane's blocks (in arenas), or the tensors
  // packed (otherwise).
  mutable std::vector<uint8_t> lane_buffer, packed;

  Hierarchy();
  ~Hierarchy();

  // `total` split into one block per lane, then empty blocks up to my host's size: how a
  // buffer (or a host's region) is shared among the host's members.
  std::vector<size_t> lane_blocks(size_t total) const;

  // The hierarchy of `comm` whose member i is on host `host_ids[i]`; nullptr when the members
  // are on one host or each host has a single one (nothing to do within hosts).
  static std::unique_ptr<Hierarchy> build(const Communicator& comm,
                                          const std::vector<std::string>& host_ids);
  // Without building it: whether such a set has a hierarchy (what hierarchical allreduce
  // needs), and whether it has its hosts' members consecutive too (allgather).
  struct Use {
    bool allreduce = false, allgather = false;
  };
  static Use usable(const std::vector<std::string>& host_ids);
};

// Allreduces larger than this are cut into segments of this size whose steps overlap: one
// segment crosses between hosts while its neighbours move within the host.
constexpr size_t kHierarchicalSegmentBytes = 4 << 20;

// In-place allreduce of `count` elements (Average is reduced as Sum: the caller scales) over
// comm.hierarchy. `ring_threshold_bytes`: the cross-host step of a block up to this size runs
// recursive doubling instead of the ring. `step` names the three steps for the timeline.
void allreduce_hierarchical(const Communicator& comm, void* buf, size_t count, DataType dtype,
                            ReduceOp op, size_t ring_threshold_bytes, Scratch& scratch,
                            const StepMarker& step);

// The same over `tensors` where they lie (Staging::kTensors; no prescale), the result scaled by
// `scale`: in place in my host's members' shared arenas when every one of them has its tensors
// there (agreed within the host), else packed into one buffer for allreduce_hierarchical.
void allreduce_hierarchical_tensors(const Communicator& comm,
                                    const std::vector<TensorSpan>& tensors, DataType dtype,
                                    ReduceOp op, double scale, size_t ring_threshold_bytes,
                                    Scratch& scratch, const StepMarker& step);

// allgather_ring's contract over comm.hierarchy, whose hosts_contiguous must hold. Pieces over
// kHierarchicalSegmentBytes cross in segments, pipelined with the sharing within the host.
void allgather_hierarchical(const Communicator& comm, void* out, const std::vector<size_t>& bytes,
                            Scratch& scratch, const StepMarker& step);

}  // namespace shvd
