#include "shared_memory_group.h"

#include <sys/mman.h>
#include <time.h>

#include <optional>
#include <string>

#include "../common/cpu_relax.h"
#include "../transport/shm_segment.h"
#include "shared_arenas.h"
#include "shared_memory_group_internal.h"

namespace shvd {

namespace {

// Layout: every member's Control, every member's table (input and output address of each
// tensor of the current single-copy allreduce, or arena and offset on the arena path), every
// member's arena directory, then the slots and results.
constexpr size_t kDirectoryBytes = kMaxArenas * 2 * sizeof(uint64_t);
size_t control_bytes(int members) { return sizeof(SharedMemoryGroup::Control) * members; }
size_t header_bytes(int members) {
  return control_bytes(members) + (kTableBytes + kDirectoryBytes) * members;
}

// Where each member publishes its CPU.
std::vector<std::atomic<uint64_t>*> cpu_words(void* base, int members) {
  std::vector<std::atomic<uint64_t>*> words;
  for (int m = 0; m < members; ++m)
    words.push_back(&static_cast<SharedMemoryGroup::Control*>(base)[m].cpu.value);
  return words;
}
}  // namespace

SharedMemoryGroup::SharedMemoryGroup(void* base, size_t bytes, int members, int me,
                                     const Settings& settings)
    : base_(base), bytes_(bytes), members_(members), chunk_bytes_(settings.chunk_bytes),
      single_copy_min_bytes_(settings.single_copy_min_bytes),
      single_copy_(settings.single_copy != 0), arenas_(settings.arenas != 0),
      arena_min_bytes_(settings.arena_min_bytes), peer_arenas_(members),
      placement_(cpu_words(base, members), me) {}

SharedMemoryGroup::~SharedMemoryGroup() {
  for (auto& arenas : peer_arenas_)
    for (auto& a : arenas)
      if (a.base) munmap(a.base, a.bytes);
  munmap(base_, bytes_);
}

uint8_t* SharedMemoryGroup::slot(int member, int buffer) const {
  return static_cast<uint8_t*>(base_) + header_bytes(members_) +
         (size_t(member) * 2 + buffer) * chunk_bytes_;
}

uint8_t* SharedMemoryGroup::result(int buffer) const {
  return static_cast<uint8_t*>(base_) + header_bytes(members_) +
         (size_t(members_) * 2 + buffer) * chunk_bytes_;
}

uint64_t* SharedMemoryGroup::table(int member) const {
  return reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(base_) + control_bytes(members_) +
                                     kTableBytes * size_t(member));
}

uint64_t* SharedMemoryGroup::arena_directory(int member) const {
  return reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(base_) + control_bytes(members_) +
                                     kTableBytes * size_t(members_) +
                                     kDirectoryBytes * size_t(member));
}

std::unique_ptr<SharedMemoryGroup> SharedMemoryGroup::create(const Communicator& comm,
                                                             const std::string& job_id,
                                                             const Settings& wanted) {
  Settings settings = wanted;  // member 0's reach every member
  settings.chunk_bytes = std::max<uint64_t>(4096, wanted.chunk_bytes / kLine * kLine);
  // The others read this member's probe target while probing; it lives until every member has
  // reported. A member whose own setting refuses arenas makes no probe memfd and so votes "no":
  // arenas are used only where every member allows them.
  std::optional<ProbeTarget> probe;
  const GroupSegment segment = map_group_segment(
      comm.links, comm.rank, "/shvd-" + job_id + "-group-", &settings, sizeof settings,
      [&] { return header_bytes(comm.size) + (size_t(comm.size) * 2 + 2) * settings.chunk_bytes; },
      header_bytes(comm.size), [&](void* base) {
        probe.emplace(wanted.arenas != 0);
        static_cast<Control*>(base)[comm.rank].id = probe->identity();
      });
  if (!segment.base) return nullptr;
  // Every identity is published (member 0 wrote its own before sending the name, the others
  // theirs before acknowledging). Each feature only if every member may use it on every other.
  auto every_peer = [&](bool (*check)(const PeerIdentity&)) {
    bool all = true;
    for (int m = 0; m < comm.size; ++m)
      if (m != comm.rank) all = all && check(static_cast<Control*>(segment.base)[m].id);
    return all;
  };
  if (settings.single_copy)
    settings.single_copy = all_members_agree(comm.links, comm.rank, every_peer(may_read));
  if (settings.arenas)
    settings.arenas =
        all_members_agree(comm.links, comm.rank, probe->has_memfd() && every_peer(may_map));
  return std::unique_ptr<SharedMemoryGroup>(
      new SharedMemoryGroup(segment.base, segment.bytes, comm.size, comm.rank, settings));
}

void SharedMemoryGroup::wait_all(const Communicator& comm, int which, uint64_t target) {
  Control* ctl = control();
  // Two members on one CPU: one moves (CpuPlacement); until then, spinning would only hold the
  // CPU the peer needs, so it yields at once instead.
  uint64_t my_cpu = placement_.publish();
  for (int m = 0; m < members_; ++m) {
    if (m == comm.rank) continue;
    std::atomic<uint64_t>& v = ctl[m].seq[which].value;
    int idle = 0;
    const NoProgressWatch watch;
    while (v.load(std::memory_order_acquire) < target) {
      const bool shared_cpu = my_cpu != 0 && placement_.of(m) == my_cpu;
      if (shared_cpu && placement_.move_off_shared_cpu(m, &my_cpu)) continue;
      if (++idle < 4000 && !shared_cpu) {
        cpu_relax();
      } else {
        // Peers are slow (or gone): let others have the core, and watch for failures.
        if ((idle & 255) == 0) {
          global_abort().check();
          if (!comm.link(m)->peer_alive())
            throw PeerLostError(describe_rank(comm.global_ranks[m]) +
                                " left a shared-memory allreduce (it failed or died)");
          watch.check({comm.global_ranks[m]});
        }
        // Long waits sleep: on an oversubscribed machine a yielding spinner still takes CPU
        // from the very peer it waits for.
        if (idle < 12000) {
          sched_yield();
        } else {
          timespec ts{0, 20000};
          nanosleep(&ts, nullptr);
        }
      }
    }
  }
}

SharedMemoryGroup::Plan SharedMemoryGroup::start(size_t count, size_t esize,
                                                 size_t chunk_bytes) {
  Plan p;
  p.count = count;
  p.esize = esize;
  p.chunk_elems = std::max<size_t>(members_, chunk_bytes / esize / members_ * members_);
  p.chunks = (count + p.chunk_elems - 1) / p.chunk_elems;
  p.base_seq = chunks_done_;
  p.n = members_;
  chunks_done_ += p.chunks;
  placement_.begin_collective();
  return p;
}

SharedMemoryGroup::Chunk SharedMemoryGroup::Plan::chunk(size_t k) const {
  const size_t first = k * chunk_elems;
  const uint64_t seq = base_seq + k + 1;
  return Chunk{seq, int(seq & 1), first, std::min(chunk_elems, count - first), n, esize};
}

bool SharedMemoryGroup::single_copy_suits(size_t bytes, size_t tensors) const {
  return single_copy_ && tensors <= kMaxSingleCopySegments && bytes >= single_copy_min_bytes_;
}

bool SharedMemoryGroup::arenas_worth_checking(size_t bytes) const {
  return arenas_ && bytes > 0 && bytes >= arena_min_bytes_;
}

}  // namespace shvd
