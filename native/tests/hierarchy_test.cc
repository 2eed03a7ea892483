// Hierarchy::build (algorithms/hierarchical.h): which sets get a hierarchy, and the local and
// cross sub-communicators it gives each member, for hosts in blocks, interleaved, of different
// sizes.
#include <string>
#include <vector>

#include "../algorithms/hierarchical.h"
#include "harness.h"

using namespace shvd;
using shvd_test::run_test;

namespace {

// A communicator of `n` members seen by member `me`; member i's "link" is a distinct fake
// pointer (never used: build only copies them), global rank 10 + i.
Communicator comm_of(int n, int me) {
  Communicator c;
  c.rank = me;
  c.size = n;
  for (int i = 0; i < n; ++i) {
    c.links.push_back(i == me ? nullptr : reinterpret_cast<Link*>(uintptr_t(0x1000 * (i + 1))));
    c.global_ranks.push_back(10 + i);
  }
  return c;
}

std::vector<int> globals(const Communicator& c) { return c.global_ranks; }

void test_hosts_in_blocks() {
  for (int me = 0; me < 4; ++me) {
    const Communicator c = comm_of(4, me);
    auto h = Hierarchy::build(c, {"a", "a", "b", "b"});
    CHECK(h != nullptr);
    CHECK(h->hosts_contiguous && (h->host_first == std::vector<int>{0, 2}));
    const int host = me / 2, index = me % 2;
    CHECK(h->local.size == 2 && h->local.rank == index);
    CHECK(globals(h->local) == (std::vector<int>{10 + 2 * host, 11 + 2 * host}));
    CHECK(h->cross.size == 2 && h->cross.rank == host);
    CHECK(globals(h->cross) == (std::vector<int>{10 + index, 12 + index}));
    // My own entry has no link; the others are the set's links to those members.
    CHECK(h->local.links[index] == nullptr && h->cross.links[host] == nullptr);
    CHECK(h->cross.links[1 - host] == c.links[(1 - host) * 2 + index]);
  }
}

void test_interleaved_hosts() {
  // Hosts alternate: allreduce still has a hierarchy, allgather must not use it.
  const Communicator c = comm_of(6, 5);
  auto h = Hierarchy::build(c, {"a", "b", "c", "a", "b", "c"});
  CHECK(h != nullptr && !h->hosts_contiguous);
  CHECK(globals(h->local) == (std::vector<int>{12, 15}) && h->local.rank == 1);
  CHECK(globals(h->cross) == (std::vector<int>{13, 14, 15}) && h->cross.rank == 2);
}

void test_uneven_hosts() {
  // 3 + 1: one lane, the ring of local index 0 on both hosts; members 1 and 2 have none.
  const std::vector<std::string> ids{"a", "a", "a", "b"};
  for (int me = 0; me < 4; ++me) {
    auto h = Hierarchy::build(comm_of(4, me), ids);
    CHECK(h != nullptr && h->lanes == 1 && h->hosts == 2 && h->hosts_contiguous);
    CHECK((h->host_size == std::vector<int>{3, 1}) && h->my_host == (me == 3 ? 1 : 0));
    if (me == 0 || me == 3) {
      CHECK(globals(h->cross) == (std::vector<int>{10, 13}) && h->cross.rank == me / 3);
    } else {
      CHECK(globals(h->cross) == std::vector<int>{10 + me} && h->cross.rank == 0);
    }
    // The buffer is the lane's block; the further members' blocks are empty.
    CHECK(h->lane_blocks(7) == (me == 3 ? std::vector<size_t>{7}
                                        : std::vector<size_t>{7, 0, 0}));
  }
  // 3 + 2: two lanes.
  auto h = Hierarchy::build(comm_of(5, 4), {"a", "a", "a", "b", "b"});
  CHECK(h != nullptr && h->lanes == 2 && globals(h->cross) == (std::vector<int>{11, 14}));
  CHECK(h->lane_blocks(5) == (std::vector<size_t>{3, 2}));
}

void test_usable() {
  // What the autotuner may tune: allreduce where a hierarchy exists, allgather where its
  // hosts' members are consecutive too.
  auto use = Hierarchy::usable({"a", "a", "b", "b"});
  CHECK(use.allreduce && use.allgather);
  use = Hierarchy::usable({"a", "b", "a", "b"});
  CHECK(use.allreduce && !use.allgather);
  use = Hierarchy::usable({"a", "b", "c"});
  CHECK(!use.allreduce && !use.allgather);
  use = Hierarchy::usable({"a", "a"});
  CHECK(!use.allreduce && !use.allgather);
  CHECK(!Hierarchy::usable({}).allreduce);
}

void test_no_hierarchy() {
  // One host; one member per host; not a member; host ids missing.
  CHECK(Hierarchy::build(comm_of(3, 0), {"a", "a", "a"}) == nullptr);
  CHECK(Hierarchy::build(comm_of(2, 1), {"a", "b"}) == nullptr);
  CHECK(Hierarchy::build(comm_of(3, 2), {"a", "b", "c"}) == nullptr);
  CHECK(Hierarchy::build(comm_of(4, -1), {"a", "a", "b", "b"}) == nullptr);
  CHECK(Hierarchy::build(comm_of(4, 0), {"a", "a", "b"}) == nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) shvd_test::g_filter = argv[1];
  run_test("hierarchy: hosts in blocks", test_hosts_in_blocks);
  run_test("hierarchy: interleaved hosts", test_interleaved_hosts);
  run_test("hierarchy: uneven hosts", test_uneven_hosts);
  run_test("hierarchy: none where it cannot help", test_no_hierarchy);
  run_test("hierarchy: what a set of hosts can use", test_usable);
  return shvd_test::summary();
}
