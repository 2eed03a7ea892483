// A process set as the collectives see it: this member's index, the data links to the other
// members, and what was set up for them (a one-host shared-memory group, a split across hosts).
// Below the algorithms so that every data path (the core's algorithms, MPI, the GPU path) takes
// the same description of its members.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "link.h"

namespace shvd {

// Set up for a communicator by the algorithms' layer (algorithms/shared_memory_group.h,
// hierarchical.h); here only pointed to.
class SharedMemoryGroup;
struct Hierarchy;

// The members of one process set and the data links between them.
struct Communicator {
  int rank = 0;                  // my index among the members
  int size = 1;
  std::vector<Link*> links;      // links[i]: data link to member i (nullptr for myself)
  std::vector<int> global_ranks; // member index -> global rank (for error messages)
  // Set when every member shares this host: allreduce then runs through one shared segment.
  SharedMemoryGroup* shm_group = nullptr;
  // Set when the members sit on several hosts, more than one on some: the sub-communicators
  // of the hierarchical algorithms (hierarchical.h).
  const Hierarchy* hierarchy = nullptr;

  Link* link(int member) const { return links[member]; }
};

// Reusable scratch memory owned by the engine thread (grown on demand, never shrunk).
class Scratch {
 public:
  void* get(size_t bytes) {
    if (storage_.size() < bytes) storage_.resize(bytes);
    return storage_.data();
  }

 private:
  std::vector<uint8_t> storage_;
};

}  // namespace shvd
