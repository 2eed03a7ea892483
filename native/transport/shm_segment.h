// One shared-memory segment mapped by every member of a group of processes on one host, set up
// over the links between them (the shared-memory group's, algorithms/shared_memory_group.h):
// member 0 creates it under a random name and sends the name over the links, the others map it
// and acknowledge, then the name is unlinked so nothing is left behind after a crash.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "link.h"

namespace shvd {

struct GroupSegment {
  void* base = nullptr;  // nullptr: not set up (on every member alike)
  size_t bytes = 0;
};

// Collective over `links` (links[m]: the link to member m, nullptr for myself, member `me`).
// Member 0 sends its `params_bytes` at `params` to every other member, whose own are
// overwritten before `bytes_for()` (which reads them) sizes the segment: differing settings
// cannot give the members different layouts. Member 0 creates the segment, named
// `name_prefix` + random hex, and zeroes its first `zeroed_bytes`. Each member calls
// `on_mapped(base)` once it has mapped the segment, before any other member may look at it
// (member 0 before sending the name, the others before acknowledging). Returns an empty
// GroupSegment on every member alike when any member could not create or map it; the caller
// munmaps a mapped one.
GroupSegment map_group_segment(const std::vector<Link*>& links, int me,
                               const std::string& name_prefix, void* params,
                               size_t params_bytes, const std::function<size_t()>& bytes_for,
                               size_t zeroed_bytes, const std::function<void(void*)>& on_mapped);

// Every member's `mine`, ANDed, over the same links (member 0 collects and answers).
bool all_members_agree(const std::vector<Link*>& links, int me, bool mine);

}  // namespace shvd
