// Hierarchical allreduce and allgather for process sets whose members sit on several hosts:
// the bytes that must cross between hosts cross once per host pair and local index, over every
// member's own link at the same time, and everything else moves within the hosts (over the
// shared-memory pipes between a host's ranks where shared memory is on).
//
//   allreduce (allreduce_hierarchical): the buffer is split into one block per local index;
//     1. INTRA_HOST_REDUCESCATTER  ring reduce-scatter among my host's members: I hold my
//                                  block reduced over my host
//     2. CROSS_HOST_ALLREDUCE      allreduce of my block with the members of the same local
//                                  index on the other hosts (one ring per local index, all at
//                                  once; recursive doubling when the block is latency-bound)
//     3. INTRA_HOST_ALLGATHER      ring allgather of the blocks among my host's members
//   Large buffers go segment by segment through the three steps, pipelined: a thread of the
//   call's own runs the cross-host step of one segment while the engine thread runs the
//   intra-host steps of its neighbours, so the wire between hosts is not idle while the host's
//   members exchange.
//   Each block is reduced by one member per host and then by an allreduce whose results are
//   the same bytes on every member of its ring; the last step copies bytes: every member ends
//   with bitwise equal results.
//
//   allgather (allgather_hierarchical), with each host's members consecutive in the set, so
//   each host's blocks form one region of the output: every region is split into one piece
//   per local index;
//     1. INTRA_HOST_ALLGATHER   ring allgather among my host's members: my host's region
//     2. CROSS_HOST_ALLGATHER   ring allgather of piece (my local index) of every region with
//                               the members of my local index on the other hosts
//     3. INTRA_HOST_SHARE       per other host, ring allgather of its region's pieces among
//                               my host's members
//
// Compared with the flat ring over 2 hosts of 2 ranks, each host sends half the allreduce's
// bytes instead of three quarters (2/3 of the wire time), and half an allgather's instead of
// three quarters.
//
// Hosts with different numbers of members have no Hierarchy: their sets run the flat
// algorithms (see Hierarchy::build).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "collectives.h"

namespace shvd {

// How a communicator's members sit on hosts. Every member derives it from the same table of
// host ids (the rendezvous'), so all members agree on it, and on whether it exists, without a
// message.
struct Hierarchy {
  Communicator local;  // my host's members, in set order
  // The members with my local index, one per host, hosts in the order of their first member
  // in the set: my index here is my host's.
  Communicator cross;
  // Every host's members are consecutive in the set (what allgather_hierarchical needs);
  // host_first[h]: the set index of host h's first member.
  bool hosts_contiguous = false;
  std::vector<int> host_first;
  // The cross-host steps' scratch: they run on a thread of their own (allreduce_hierarchical).
  mutable Scratch cross_scratch;

  // The hierarchy of `comm` whose member i is on host `host_ids[i]`; nullptr when the members
  // are on one host, when some host has a single member, or when hosts have different numbers
  // of members (then each local index has no partner on some host; the flat algorithms run).
  static std::unique_ptr<Hierarchy> build(const Communicator& comm,
                                          const std::vector<std::string>& host_ids);
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

// allgather_ring's contract over comm.hierarchy, whose hosts_contiguous must hold.
void allgather_hierarchical(const Communicator& comm, void* out, const std::vector<size_t>& bytes,
                            const StepMarker& step);

}  // namespace shvd
