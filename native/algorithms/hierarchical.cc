// Hierarchical allreduce and allgather (see hierarchical.h): three steps, each an existing
// ring (or recursive doubling) on a sub-communicator of the set.
#include "hierarchical.h"

#include <algorithm>

namespace shvd {

namespace {

// Marks one step for the timeline while it runs.
class Step {
 public:
  Step(const StepMarker& marker, const char* name) : marker_(marker), name_(name) {
    if (marker_) marker_(name_, true);
  }
  ~Step() {
    if (marker_) marker_(name_, false);
  }

 private:
  const StepMarker& marker_;
  const char* name_;
};

// The sub-communicator of `comm` made of the members `members` (set indices, in order).
Communicator sub_communicator(const Communicator& comm, const std::vector<int>& members) {
  Communicator sub;
  sub.size = int(members.size());
  for (int i = 0; i < sub.size; ++i) {
    const int m = members[i];
    if (m == comm.rank) sub.rank = i;
    sub.links.push_back(comm.links[m]);
    sub.global_ranks.push_back(comm.global_ranks[m]);
  }
  return sub;
}

}  // namespace

std::unique_ptr<Hierarchy> Hierarchy::build(const Communicator& comm,
                                            const std::vector<std::string>& host_ids) {
  if (comm.rank < 0 || int(host_ids.size()) != comm.size) return nullptr;
  // Hosts in the order of their first member; each host's members in set order.
  std::vector<std::string> hosts;
  std::vector<std::vector<int>> members;
  for (int i = 0; i < comm.size; ++i) {
    auto it = std::find(hosts.begin(), hosts.end(), host_ids[i]);
    if (it == hosts.end()) {
      hosts.push_back(host_ids[i]);
      members.emplace_back();
      it = hosts.end() - 1;
    }
    members[it - hosts.begin()].push_back(i);
  }
  const size_t local_size = members[0].size();
  if (hosts.size() < 2 || local_size < 2) return nullptr;
  for (const auto& m : members)
    if (m.size() != local_size) return nullptr;

  auto h = std::make_unique<Hierarchy>();
  const int my_host = int(std::find(hosts.begin(), hosts.end(), host_ids[comm.rank]) -
                          hosts.begin());
  h->local = sub_communicator(comm, members[my_host]);
  std::vector<int> same_index;
  for (const auto& m : members) same_index.push_back(m[h->local.rank]);
  h->cross = sub_communicator(comm, same_index);
  h->hosts_contiguous = true;
  for (const auto& m : members) {
    h->host_first.push_back(m.front());
    h->hosts_contiguous = h->hosts_contiguous && m.back() - m.front() + 1 == int(m.size());
  }
  return h;
}

void allreduce_hierarchical(const Communicator& comm, void* buf, size_t count, DataType dtype,
                            ReduceOp op, size_t ring_threshold_bytes, Scratch& scratch,
                            const StepMarker& step) {
  const Hierarchy& h = *comm.hierarchy;
  const size_t esize = dtype_size(dtype);
  // Block i is reduced within each host by local member i. Every member of one cross ring has
  // the same local index, so the same block size, and chooses the same cross-host algorithm.
  const std::vector<size_t> counts = even_blocks(count, h.local.size);
  {
    Step s(step, "INTRA_HOST_REDUCESCATTER");
    reducescatter_ring(h.local, buf, counts, dtype, op, scratch);
  }
  {
    Step s(step, "CROSS_HOST_ALLREDUCE");
    const size_t mine = counts[h.local.rank];
    void* block = static_cast<uint8_t*>(buf) + prefix_offsets(counts)[h.local.rank] * esize;
    if (mine * esize <= ring_threshold_bytes || mine < size_t(h.cross.size)) {
      if (mine > 0) allreduce_recursive_doubling(h.cross, block, mine, dtype, op, scratch);
    } else {
      allreduce_ring(h.cross, block, mine, dtype, op, scratch);
    }
  }
  Step s(step, "INTRA_HOST_ALLGATHER");
  std::vector<size_t> bytes(counts);
  for (size_t& b : bytes) b *= esize;
  allgather_ring(h.local, buf, bytes);
}

void allgather_hierarchical(const Communicator& comm, void* out, const std::vector<size_t>& bytes,
                            const StepMarker& step) {
  const Hierarchy& h = *comm.hierarchy;
  const int hosts = h.cross.size, local_size = h.local.size;
  const int my_host = h.cross.rank, my_index = h.local.rank;
  const std::vector<size_t> offsets = prefix_offsets(bytes);
  auto* base = static_cast<uint8_t*>(out);
  // Host g's region: the blocks of its members, back to back; and its pieces, one per local
  // index, back to back.
  std::vector<size_t> region_at(hosts), region_bytes(hosts);
  std::vector<std::vector<size_t>> pieces(hosts);
  for (int g = 0; g < hosts; ++g) {
    const int first = h.host_first[g];
    region_at[g] = offsets[first];
    region_bytes[g] = offsets[first + local_size] - offsets[first];
    pieces[g] = even_blocks(region_bytes[g], local_size);
  }
  {
    Step s(step, "INTRA_HOST_ALLGATHER");
    std::vector<size_t> mine(bytes.begin() + h.host_first[my_host],
                             bytes.begin() + h.host_first[my_host] + local_size);
    allgather_ring(h.local, base + region_at[my_host], mine);
  }
  {
    Step s(step, "CROSS_HOST_ALLGATHER");
    std::vector<size_t> at(hosts), len(hosts);
    for (int g = 0; g < hosts; ++g) {
      at[g] = region_at[g] + prefix_offsets(pieces[g])[my_index];
      len[g] = pieces[g][my_index];
    }
    allgather_ring_at(h.cross, base, at, len);
  }
  Step s(step, "INTRA_HOST_SHARE");
  for (int g = 0; g < hosts; ++g)
    if (g != my_host) allgather_ring(h.local, base + region_at[g], pieces[g]);
}

}  // namespace shvd
