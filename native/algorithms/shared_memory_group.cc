#include "shared_memory_group.h"

#include <fcntl.h>
#include <sched.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <chrono>
#include <cstring>
#include <string>

#include "../common/hmac.h"
#include "reduce_kernels.h"
#include "shared_arenas.h"

namespace shvd {

namespace {
constexpr size_t kLine = 64;
// A fused response with more tensors than this keeps the slots (its tensors are small).
constexpr size_t kMaxSingleCopySegments = 256;
constexpr size_t kTableBytes = kMaxSingleCopySegments * 2 * sizeof(uint64_t);
static_assert(kMaxSingleCopySegments <= IOV_MAX, "one process_vm_readv per slice");
enum { kIn = 0, kReduced = 1, kDone = 2, kArenaCheck = 3, kArenaDone = 4 };

struct alignas(kLine) Counter {
  std::atomic<uint64_t> value;
  char pad[kLine - sizeof(std::atomic<uint64_t>)];
};

// Copies the `remote` ranges of process `pid` into the `local` ranges (equal total length),
// resuming after partial transfers. Returns 0, or the errno of the failure.
int read_process(pid_t pid, std::vector<iovec>& local, std::vector<iovec>& remote) {
  size_t l = 0, r = 0;  // first range not yet complete
  auto advance = [](std::vector<iovec>& v, size_t& first, size_t n) {
    while (n > 0) {
      const size_t step = std::min(n, v[first].iov_len);
      v[first].iov_base = static_cast<uint8_t*>(v[first].iov_base) + step;
      v[first].iov_len -= step;
      n -= step;
      if (v[first].iov_len == 0) ++first;
    }
    while (first < v.size() && v[first].iov_len == 0) ++first;
  };
  advance(local, l, 0);
  advance(remote, r, 0);
  while (l < local.size() && r < remote.size()) {
    const ssize_t got = process_vm_readv(pid, &local[l], local.size() - l, &remote[r],
                                         remote.size() - r, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return got < 0 ? errno : EIO;
    advance(local, l, size_t(got));
    advance(remote, r, size_t(got));
  }
  return 0;
}

inline void cpu_relax() { __builtin_ia32_pause(); }

// Moves the calling thread off `cpu` to another CPU of its affinity mask, preferring one that
// `taken` (CPUs other members run on) does not name, and restores the mask: a one-off
// migration, not pinning. False when the mask allows no other CPU.
bool move_to_other_cpu(int cpu, const cpu_set_t& taken) {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return false;
  int target = -1, fallback = -1;
  for (int i = 1; i < CPU_SETSIZE && target < 0; ++i) {
    const int c = (cpu + i) % CPU_SETSIZE;
    if (c == cpu || !CPU_ISSET(c, &allowed)) continue;
    if (!CPU_ISSET(c, &taken)) target = c;
    else if (fallback < 0) fallback = c;
  }
  if (target < 0) target = fallback;
  if (target < 0) return false;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(target, &one);
  if (sched_setaffinity(0, sizeof one, &one) != 0) return false;  // migrates before returning
  sched_setaffinity(0, sizeof allowed, &allowed);
  return true;
}
}  // namespace

// Per member: progress counters (three for the chunks of the copying paths, two for the arena
// path's agreement and end) and where it runs, each on its own cache line. `cpu` is
// (collective << 16) | (CPU + 1): a CPU published during an earlier collective is stale (the
// thread may have moved since) and is ignored.
// `id` is written once at set-up: the member's engine thread (the address space to read;
// the main thread may have exited while the engine runs, and a thread id names the process
// as well), and the address and value of a private word the others read to find out whether
// they may read this member's memory, and the memfd the others map to find out whether they
// may map this member's arenas.
struct SharedMemoryGroup::Control {
  Counter seq[5];
  Counter cpu;
  struct alignas(kLine) {
    uint64_t thread, probe_address, probe_value, probe_fd;
  } id;
};

// Layout: every member's Control, every member's table (input and output address of each
// tensor of the current single-copy allreduce, or arena and offset on the arena path), every
// member's arena directory, then the slots and results.
constexpr size_t kDirectoryBytes = kMaxArenas * 2 * sizeof(uint64_t);
static size_t control_bytes(int members) { return sizeof(SharedMemoryGroup::Control) * members; }
static size_t header_bytes(int members) {
  return control_bytes(members) + (kTableBytes + kDirectoryBytes) * members;
}

SharedMemoryGroup::SharedMemoryGroup(void* base, size_t bytes, int members,
                                     const Settings& settings)
    : base_(base), bytes_(bytes), members_(members), chunk_bytes_(settings.chunk_bytes),
      single_copy_min_bytes_(settings.single_copy_min_bytes),
      single_copy_(settings.single_copy != 0), arenas_(settings.arenas != 0),
      arena_min_bytes_(settings.arena_min_bytes), peer_arenas_(members) {}

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

namespace {
// Whether this process may read `peer`'s memory: reads its probe word through the kernel.
bool may_read(const SharedMemoryGroup::Control& peer) {
  uint64_t got = 0;
  std::vector<iovec> local{{&got, sizeof got}};
  std::vector<iovec> remote{{reinterpret_cast<void*>(uintptr_t(peer.id.probe_address)),
                             sizeof got}};
  return read_process(pid_t(peer.id.thread), local, remote) == 0 && got == peer.id.probe_value;
}

// Maps `bytes` of file descriptor `fd` of the process that thread `thread` belongs to, through
// /proc (allowed when this process may inspect that one). nullptr on failure.
uint8_t* map_peer_fd(uint64_t thread, uint64_t fd, size_t bytes) {
  const std::string path = "/proc/" + std::to_string(thread) + "/fd/" + std::to_string(fd);
  const int local = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (local < 0) return nullptr;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, local, 0);
  close(local);
  return p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
}

// Whether this process may map `peer`'s arenas: maps its probe memfd and checks the token.
bool may_map(const SharedMemoryGroup::Control& peer) {
  uint8_t* p = map_peer_fd(peer.id.thread, peer.id.probe_fd, 4096);
  if (!p) return false;
  uint64_t got;
  std::memcpy(&got, p, sizeof got);
  munmap(p, 4096);
  return got == peer.id.probe_value;
}

// A memfd holding `token`, for the peers' may_map (-1 when memfds are unavailable).
int make_probe_fd(uint64_t token) {
  const int fd = memfd_create("spark_hvd_probe", MFD_CLOEXEC);
  if (fd < 0) return -1;
  if (ftruncate(fd, 4096) != 0 || pwrite(fd, &token, sizeof token, 0) != ssize_t(sizeof token)) {
    close(fd);
    return -1;
  }
  return fd;
}
}  // namespace

std::unique_ptr<SharedMemoryGroup> SharedMemoryGroup::create(const Communicator& comm,
                                                             const std::string& job_id,
                                                             const Settings& wanted) {
  Settings settings;
  // A member whose own setting refuses arenas makes no probe memfd and so votes "no": arenas
  // are used only where every member allows them.
  const bool wanted_arenas = wanted.arenas != 0;
  void* base = MAP_FAILED;
  size_t bytes = 0;
  auto bytes_for = [&](const Settings& s) {
    return header_bytes(comm.size) + (size_t(comm.size) * 2 + 2) * s.chunk_bytes;
  };
  // The others read this word and map this memfd while probing; both live until every
  // member has reported.
  volatile uint64_t probe_word = 0;
  int probe_fd = -1;
  auto publish_identity = [&] {
    uint64_t token;
    random_bytes(reinterpret_cast<uint8_t*>(&token), sizeof token);
    probe_word = token;
    if (wanted_arenas) probe_fd = make_probe_fd(token);
    auto& id = static_cast<Control*>(base)[comm.rank].id;
    id.thread = uint64_t(syscall(SYS_gettid));  // create() and allreduce() run on the engine
    id.probe_address = uint64_t(reinterpret_cast<uintptr_t>(&probe_word));
    id.probe_value = token;
    id.probe_fd = uint64_t(int64_t(probe_fd));
  };
  uint8_t ok = 1;
  if (comm.rank == 0) {
    settings = wanted;
    settings.chunk_bytes = std::max<uint64_t>(4096, wanted.chunk_bytes / kLine * kLine);
    bytes = bytes_for(settings);
    uint8_t rnd[8];
    random_bytes(rnd, sizeof rnd);
    char hex[17];
    for (int i = 0; i < 8; ++i) snprintf(hex + 2 * i, 3, "%02x", rnd[i]);
    std::string name = "/shvd-" + job_id + "-group-" + hex;
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0 && posix_fallocate(fd, 0, off_t(bytes)) == 0)
      base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0) close(fd);
    ok = base != MAP_FAILED;
    if (ok) {
      std::memset(base, 0, header_bytes(comm.size));
      publish_identity();
    }
    const uint32_t len = ok ? uint32_t(name.size()) : 0;
    for (int m = 1; m < comm.size; ++m) {
      comm.link(m)->send(&len, sizeof len);
      if (len) {
        comm.link(m)->send(&settings, sizeof settings);
        comm.link(m)->send(name.data(), len);
      }
    }
    for (int m = 1; m < comm.size; ++m) {
      uint8_t ack = 0;
      comm.link(m)->recv(&ack, 1);
      ok = ok && ack;
    }
    if (base != MAP_FAILED) shm_unlink(name.c_str());
    for (int m = 1; m < comm.size; ++m) comm.link(m)->send(&ok, 1);
  } else {
    uint32_t len = 0;
    comm.link(0)->recv(&len, sizeof len);
    std::string name(len, '\0');
    if (len) {
      comm.link(0)->recv(&settings, sizeof settings);
      comm.link(0)->recv(&name[0], len);
      bytes = bytes_for(settings);
      int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
      if (fd >= 0) {
        base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
      }
      if (base != MAP_FAILED) publish_identity();
    }
    uint8_t ack = base != MAP_FAILED;
    comm.link(0)->send(&ack, 1);
    comm.link(0)->recv(&ok, 1);  // everyone must have mapped it, or nobody uses it
  }
  if (!ok) {
    if (probe_fd >= 0) close(probe_fd);
    if (base != MAP_FAILED) munmap(base, bytes);
    return nullptr;
  }
  // Every identity is published (member 0 wrote its own before sending the name, the others
  // theirs before acknowledging). Each feature only if every member may use it on every other:
  // `mine` is this member's verdict, the result everybody's (member 0 collects and answers).
  auto agree = [&](uint8_t mine) {
    uint8_t all = mine;
    if (comm.rank == 0) {
      for (int m = 1; m < comm.size; ++m) {
        uint8_t theirs = 0;
        comm.link(m)->recv(&theirs, 1);
        all = all && theirs;
      }
      for (int m = 1; m < comm.size; ++m) comm.link(m)->send(&all, 1);
    } else {
      comm.link(0)->send(&all, 1);
      comm.link(0)->recv(&all, 1);
    }
    return all;
  };
  auto every_peer = [&](bool (*check)(const Control&)) {
    uint8_t all = 1;
    for (int m = 0; m < comm.size; ++m)
      if (m != comm.rank) all = all && check(static_cast<Control*>(base)[m]);
    return all;
  };
  if (settings.single_copy) settings.single_copy = agree(every_peer(may_read));
  if (settings.arenas) settings.arenas = agree(probe_fd >= 0 && every_peer(may_map));
  if (probe_fd >= 0) close(probe_fd);  // every member has probed it
  return std::unique_ptr<SharedMemoryGroup>(
      new SharedMemoryGroup(base, bytes, comm.size, settings));
}

namespace {
constexpr uint64_t kCpuBits = 0xffff;
}  // namespace

uint64_t SharedMemoryGroup::publish_cpu(const Communicator& comm) {
  const int cpu = sched_getcpu();
  const uint64_t mine = cpu >= 0 ? uint64_t(cpu) + 1 : 0;  // 0: unknown
  static_cast<Control*>(base_)[comm.rank].cpu.value.store((collective_ << 16) | mine,
                                                          std::memory_order_relaxed);
  return mine;
}

uint64_t SharedMemoryGroup::peer_cpu(int member) const {
  const uint64_t v = static_cast<const Control*>(base_)[member].cpu.value.load(
      std::memory_order_relaxed);
  return (v >> 16) == collective_ ? (v & kCpuBits) : 0;
}

cpu_set_t SharedMemoryGroup::member_cpus(const Communicator& comm) const {
  cpu_set_t taken;
  CPU_ZERO(&taken);
  for (int m = 0; m < members_; ++m) {
    const uint64_t c = m == comm.rank ? 0 : peer_cpu(m);
    if (c != 0 && c <= CPU_SETSIZE) CPU_SET(int(c - 1), &taken);
  }
  return taken;
}

void SharedMemoryGroup::wait_all(const Communicator& comm, int which, uint64_t target) {
  auto* ctl = static_cast<Control*>(base_);
  // The scheduler sometimes wakes two members' engine threads on one CPU (wake-up placement
  // follows the waker) while another CPU idles; the collective then runs serially at half
  // speed until load balancing moves one, which takes milliseconds. So members publish their
  // CPU, and the lower-numbered of two that share one moves itself once per collective to
  // another CPU it may run on (the affinity mask is left as it was). Until then, spinning would
  // only hold the CPU the peer needs: it yields at once instead.
  uint64_t my_cpu = publish_cpu(comm);
  for (int m = 0; m < members_; ++m) {
    if (m == comm.rank) continue;
    std::atomic<uint64_t>& v = ctl[m].seq[which].value;
    int idle = 0;
    while (v.load(std::memory_order_acquire) < target) {
      const bool shared_cpu = my_cpu != 0 && peer_cpu(m) == my_cpu;
      if (shared_cpu && comm.rank < m && !moved_ && move_to_other_cpu(int(my_cpu) - 1,
                                                                      member_cpus(comm))) {
        moved_ = true;
        my_cpu = publish_cpu(comm);
        continue;
      }
      if (++idle < 4000 && !shared_cpu) {
        cpu_relax();
      } else {
        // Peers are slow (or gone): let others have the core, and watch for failures.
        if ((idle & 255) == 0) {
          global_abort().check();
          if (!comm.link(m)->peer_alive())
            throw PeerLostError("rank " + std::to_string(comm.global_ranks[m]) +
                                " died during a shared-memory allreduce");
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


// The fused tensors seen as one logical array of bytes.
class SegmentedBuffer {
 public:
  SegmentedBuffer(const std::vector<TensorSpan>& segments, size_t esize)
      : segments_(segments), esize_(esize) {
    size_t pos = 0;
    for (const auto& s : segments) {
      starts_.push_back(pos);
      pos += s.count * esize;
    }
    starts_.push_back(pos);
  }
  size_t bytes() const { return starts_.back(); }
  const std::vector<TensorSpan>& segments() const { return segments_; }

  // Calls fn(segment, offset_in_segment, length, offset_within_range) for each piece of
  // [pos, pos + len).
  template <typename F>
  void for_pieces(size_t pos, size_t len, F fn) const {
    size_t i = std::upper_bound(starts_.begin(), starts_.end(), pos) - starts_.begin() - 1;
    size_t done = 0;
    while (done < len) {
      const size_t off = pos + done - starts_[i];
      const size_t n = std::min(len - done, starts_[i + 1] - starts_[i] - off);
      if (n > 0) fn(i, off, n, done);
      done += n;
      ++i;
    }
  }

  // Calls fn(in, out, length, offset_within_range) for each piece of [pos, pos + len).
  template <typename F>
  void for_range(size_t pos, size_t len, F fn) const {
    for_pieces(pos, len, [&](size_t i, size_t off, size_t n, size_t at) {
      fn(static_cast<const uint8_t*>(segments_[i].in) + off,
         static_cast<uint8_t*>(segments_[i].out) + off, n, at);
    });
  }

 private:
  const std::vector<TensorSpan>& segments_;
  size_t esize_;
  std::vector<size_t> starts_;
};

namespace {

// Reduces one piece of my slice over every member in member order (src(m): member m's input),
// partial sums in `acc` (may alias src(0) or src(1)); the scaled result goes to `out` and
// `copy_to`. Both paths reduce alike, so they give bitwise equal results.
template <typename Src>
void reduce_members(int n, Src src, uint8_t* acc, uint8_t* out, uint8_t* copy_to, size_t count,
                    DataType dtype, ReduceOp op, double scale) {
  if (n > 2) reduce_out(acc, src(0), src(1), count, dtype, op);
  for (int m = 2; m < n - 1; ++m) reduce_into(acc, src(m), count, dtype, op);
  reduce_out_scaled(out, copy_to, n > 2 ? acc : src(0), src(n - 1), count, dtype, op, scale);
}

}  // namespace

// Chunk k of a collective: its sequence number, which slot buffer it uses, and its slices
// (slice i = elements [lo(i), lo(i + 1)) of the chunk). Boundaries fall on elements.
struct SharedMemoryGroup::Chunk {
  uint64_t seq;
  int b;
  size_t first, elems;
  int n;
  size_t esize;
  size_t lo(int i) const { return elems * size_t(i) / n; }
  size_t slice_pos(int i) const { return (first + lo(i)) * esize; }
  size_t slice_bytes(int i) const { return (lo(i + 1) - lo(i)) * esize; }
};

SharedMemoryGroup::Plan SharedMemoryGroup::start(const Communicator& comm, size_t count,
                                                 size_t esize, size_t chunk_bytes) {
  Plan p;
  p.count = count;
  p.esize = esize;
  p.chunk_elems = std::max<size_t>(members_, chunk_bytes / esize / members_ * members_);
  p.chunks = (count + p.chunk_elems - 1) / p.chunk_elems;
  p.base_seq = chunks_done_;
  p.n = members_;
  chunks_done_ += p.chunks;
  begin_collective(comm);
  return p;
}

void SharedMemoryGroup::begin_collective(const Communicator& comm) {
  moved_ = false;
  collective_ = (collective_ + 1) & 0xffffffffffffULL;  // the same count on every member
  publish_cpu(comm);
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

void SharedMemoryGroup::allreduce_through_slots(const Communicator& comm,
                                                const std::vector<TensorSpan>& tensors,
                                                DataType dtype, ReduceOp op, double scale) {
  const size_t esize = dtype_size(dtype);
  const SegmentedBuffer data(tensors, esize);
  if (data.bytes() == 0) return;
  slots_allreduce(comm, data, start(comm, data.bytes() / esize, esize, chunk_bytes_), dtype, op,
                  scale);
}

void SharedMemoryGroup::allreduce_single_copy(const Communicator& comm,
                                              const std::vector<TensorSpan>& tensors,
                                              DataType dtype, ReduceOp op, double scale) {
  const size_t esize = dtype_size(dtype);
  const SegmentedBuffer data(tensors, esize);
  if (data.bytes() == 0) return;
  // Single copy's chunks live in private buffers, not in the segment's slots: twice the slot
  // size halves its barriers and process_vm_readv calls (16 MiB took 1.76-1.91 ms instead of
  // 2.26-2.38 here; 4 and 64 MiB unchanged).
  single_copy_allreduce(comm, data, start(comm, data.bytes() / esize, esize, 2 * chunk_bytes_),
                        dtype, op, scale);
}

void SharedMemoryGroup::slots_allreduce(const Communicator& comm, const SegmentedBuffer& data,
                                        const Plan& plan, DataType dtype, ReduceOp op,
                                        double scale) {
  const int n = members_, me = comm.rank;
  const size_t esize = plan.esize;
  Counter* mine = static_cast<Control*>(base_)[me].seq;

  // 1. copy-in: the slices other members reduce go into my slot.
  auto copy_in = [&](const Chunk& c) {
    if (c.seq > 2) wait_all(comm, kDone, c.seq - 2);  // slot last read two chunks ago
    for (int i = 0; i < n; ++i) {
      if (i == me) continue;
      uint8_t* dst = slot(me, c.b) + c.lo(i) * esize;
      data.for_range(c.slice_pos(i), c.slice_bytes(i),
                     [&](const uint8_t* in, uint8_t*, size_t len, size_t at) {
                       std::memcpy(dst + at, in, len);
                     });
    }
    mine[kIn].value.store(c.seq, std::memory_order_release);
  };

  copy_in(plan.chunk(0));
  for (size_t k = 0; k < plan.chunks; ++k) {
    const Chunk c = plan.chunk(k);
    // 2. reduce my slice in member order (mine straight from my tensors) into the result:
    // partial sums in the shared result, the last member added, scaled and written to both
    // the result and my own tensor in one pass.
    wait_all(comm, kIn, c.seq);
    uint8_t* out = result(c.b) + c.lo(me) * esize;
    data.for_range(c.slice_pos(me), c.slice_bytes(me),
                   [&](const uint8_t* in, uint8_t* dst, size_t len, size_t at) {
                     auto src = [&](int m) -> const uint8_t* {
                       return m == me ? in : slot(m, c.b) + c.lo(me) * esize + at;
                     };
                     reduce_members(n, src, out + at, out + at, dst, len / esize, dtype, op,
                                    scale);
                   });
    mine[kReduced].value.store(c.seq, std::memory_order_release);
    // Software pipelining: publish the next chunk before waiting for the others' reductions,
    // so a member that runs late finds its inputs ready instead of stalling everyone.
    if (k + 1 < plan.chunks) copy_in(plan.chunk(k + 1));

    // 3. copy-out everybody else's slices.
    wait_all(comm, kReduced, c.seq);
    for (int i = 0; i < n; ++i) {
      if (i == me) continue;
      const uint8_t* src = result(c.b) + c.lo(i) * esize;
      data.for_range(c.slice_pos(i), c.slice_bytes(i),
                     [&](const uint8_t*, uint8_t* dst, size_t len, size_t at) {
                       std::memcpy(dst, src + at, len);
                     });
    }
    mine[kDone].value.store(c.seq, std::memory_order_release);
  }
}

// The same chunks and slices as the slots path, but member r reads the others' inputs of its
// slice with process_vm_readv into `peer_slices_` (private, cache-sized), reduces into its own
// output, and then reads every other slice's result from the output of the member that reduced
// it. Which member may touch what, and when:
//   - my input slice i (i != me) is read by member i during its reduce of the chunk; I write my
//     output slice i (the same memory when in place) only after i has published that reduce;
//   - my output slice `me` is read by the others after I publish its reduce, and I leave it
//     alone from then on; the final barrier keeps the caller from reusing the tensors while a
//     peer may still read them;
//   - the table (where my tensors are) is written before kIn is published and stays unchanged
//     until the final barrier.
void SharedMemoryGroup::single_copy_allreduce(const Communicator& comm,
                                              const SegmentedBuffer& data, const Plan& plan,
                                              DataType dtype, ReduceOp op, double scale) {
  const int n = members_, me = comm.rank;
  const size_t esize = plan.esize;
  const uint64_t base_seq = plan.base_seq;
  const size_t slice_cap = plan.chunk_elems / n * esize;
  auto* ctl = static_cast<Control*>(base_);
  Counter* mine = ctl[me].seq;

  uint64_t* my_table = table(me);
  for (size_t i = 0; i < data.segments().size(); ++i) {
    my_table[2 * i] = uint64_t(reinterpret_cast<uintptr_t>(data.segments()[i].in));
    my_table[2 * i + 1] = uint64_t(reinterpret_cast<uintptr_t>(data.segments()[i].out));
  }
  mine[kIn].value.store(base_seq + 1, std::memory_order_release);
  wait_all(comm, kIn, base_seq + 1);

  if (peer_slices_.size() < slice_cap * (n - 1)) peer_slices_.resize(slice_cap * (n - 1));
  auto peer_slice = [&](int m) {
    return peer_slices_.data() + size_t(m < me ? m : m - 1) * slice_cap;
  };
  std::vector<iovec> local, remote;
  // Reads member m's bytes [pos, pos + len) of the logical array (its inputs, or its outputs
  // when `outputs`) into `local`, which the caller has filled.
  auto read_member = [&](int m, size_t pos, size_t len, bool outputs) {
    remote.clear();
    const uint64_t* t = table(m);
    data.for_pieces(pos, len, [&](size_t i, size_t off, size_t piece, size_t) {
      remote.push_back({reinterpret_cast<void*>(uintptr_t(t[2 * i + outputs]) + off), piece});
    });
    const int err = read_process(pid_t(ctl[m].id.thread), local, remote);
    if (err == 0) return;
    // A failed read usually means a member is gone, maybe not m: a third rank's death can
    // make m abort and release its tensors while I read them. Name the real cause.
    auto lost = [&](int member) {
      return PeerLostError("rank " + std::to_string(comm.global_ranks[member]) +
                           " died during a shared-memory allreduce");
    };
    global_abort().check();
    for (int other = 0; other < n; ++other)
      if (other != me && !comm.link(other)->peer_alive()) throw lost(other);
    if (err == ESRCH) throw lost(m);
    throw std::runtime_error("shared-memory allreduce: reading the tensors of rank " +
                             std::to_string(comm.global_ranks[m]) + " failed (" +
                             strerror(err) + "); memory the kernel cannot read across "
                             "processes needs SPARK_HVD_SHM_SINGLE_COPY=0");
  };

  auto reduce = [&](const Chunk& c) {
    const size_t pos = c.slice_pos(me), len = c.slice_bytes(me);
    for (int m = 0; m < n; ++m) {
      if (m == me) continue;
      local.assign(1, {peer_slice(m), len});
      read_member(m, pos, len, false);
    }
    // Member order, as on the slots path. With more than two members the partial sum goes to
    // a private buffer already read (never to my output: in place, it is one of the inputs).
    data.for_range(pos, len, [&](const uint8_t* in, uint8_t* dst, size_t piece, size_t at) {
      auto src = [&](int m) -> const uint8_t* { return m == me ? in : peer_slice(m) + at; };
      uint8_t* acc = n > 2 ? peer_slice(me == 0 ? 1 : 0) + at : nullptr;
      reduce_members(n, src, acc, dst, dst, piece / esize, dtype, op, scale);
    });
    mine[kReduced].value.store(c.seq, std::memory_order_release);
  };

  auto copy_out = [&](const Chunk& c) {
    wait_all(comm, kReduced, c.seq);
    for (int m = 0; m < n; ++m) {
      if (m == me) continue;
      local.clear();
      data.for_range(c.slice_pos(m), c.slice_bytes(m),
                     [&](const uint8_t*, uint8_t* dst, size_t piece, size_t) {
                       local.push_back({dst, piece});
                     });
      read_member(m, c.slice_pos(m), c.slice_bytes(m), true);
    }
  };

  // One chunk ahead: my next slice is reduced before I wait for the others' current ones.
  reduce(plan.chunk(0));
  for (size_t k = 0; k < plan.chunks; ++k) {
    if (k + 1 < plan.chunks) reduce(plan.chunk(k + 1));
    copy_out(plan.chunk(k));
  }
  mine[kDone].value.store(base_seq + plan.chunks, std::memory_order_release);
  wait_all(comm, kDone, base_seq + plan.chunks);
}

uint8_t* SharedMemoryGroup::peer_arena(const Communicator& comm, int member, int arena) {
  auto& mapped = peer_arenas_[member];
  if (mapped.size() <= size_t(arena)) mapped.resize(size_t(arena) + 1, PeerArena{nullptr, 0});
  PeerArena& a = mapped[arena];
  if (!a.base) {
    const uint64_t* dir = arena_directory(member);
    const auto& id = static_cast<Control*>(base_)[member].id;
    a.bytes = size_t(dir[2 * arena + 1]);
    a.base = map_peer_fd(id.thread, dir[2 * arena], a.bytes);
    if (!a.base)
      throw std::runtime_error("shared-memory allreduce: mapping the gradient arena of rank " +
                               std::to_string(comm.global_ranks[member]) + " failed (" +
                               strerror(errno) + "); SPARK_HVD_SHARED_GRADIENTS=0 keeps "
                               "gradients in private memory");
  }
  return a.base;
}

// Member r reduces elements [count * r / n, count * (r + 1) / n) of the response, reading every
// member's inputs where they lie and writing the result into every member's outputs. Nobody else
// reads or writes those elements of any member's tensors, so the only waits are the agreement
// (every member's inputs are complete and its table is published) and the end (every member's
// outputs are complete before anyone returns them to the framework).
bool SharedMemoryGroup::allreduce_in_arenas(const Communicator& comm,
                                            const std::vector<TensorSpan>& segments,
                                            DataType dtype, ReduceOp op, double scale) {
  const int n = members_, me = comm.rank;
  const size_t esize = dtype_size(dtype);
  const SegmentedBuffer data(segments, esize);
  if (data.bytes() == 0) return false;
  auto* ctl = static_cast<Control*>(base_);
  Counter* mine = ctl[me].seq;
  uint64_t* my_table = table(me);
  uint64_t* my_directory = arena_directory(me);

  // 1. Agree: am I all in arenas? My table and directory are written before I say so.
  bool in_arenas = segments.size() <= kMaxSingleCopySegments;
  for (size_t i = 0; in_arenas && i < segments.size(); ++i) {
    const size_t bytes = segments[i].count * esize;
    int arena_in, arena_out;
    uint64_t offset_in, offset_out;
    in_arenas = shared_arena_locate(segments[i].in, bytes, &arena_in, &offset_in) &&
                shared_arena_locate(segments[i].out, bytes, &arena_out, &offset_out);
    if (!in_arenas) break;
    for (int a : {arena_in, arena_out}) {
      if (my_directory[2 * a + 1] != 0) continue;
      const ArenaInfo info = shared_arena_info(a);
      my_directory[2 * a] = uint64_t(info.fd);
      my_directory[2 * a + 1] = uint64_t(info.bytes);
    }
    my_table[2 * i] = (uint64_t(arena_in) << 48) | offset_in;
    my_table[2 * i + 1] = (uint64_t(arena_out) << 48) | offset_out;
  }
  begin_collective(comm);
  const uint64_t check = ++arena_checks_;
  // The low bit carries the answer. No member gets past this collective before every member
  // has read it, so the counter still holds this check's value when the others look.
  mine[kArenaCheck].value.store(2 * check + (in_arenas ? 1 : 0), std::memory_order_release);
  wait_all(comm, kArenaCheck, 2 * check);
  bool all = in_arenas;
  for (int m = 0; m < n && all; ++m)
    all = (ctl[m].seq[kArenaCheck].value.load(std::memory_order_acquire) & 1) != 0;
  if (!all) return false;

  // 2. Every member's tensors, as this process sees them.
  constexpr uint64_t kOffsetBits = (uint64_t(1) << 48) - 1;
  std::vector<std::vector<TensorSpan>> views(size_t(n), segments);
  for (int m = 0; m < n; ++m) {
    if (m == me) continue;
    const uint64_t* t = table(m);
    for (size_t i = 0; i < segments.size(); ++i) {
      views[m][i].in = peer_arena(comm, m, int(t[2 * i] >> 48)) + (t[2 * i] & kOffsetBits);
      views[m][i].out =
          peer_arena(comm, m, int(t[2 * i + 1] >> 48)) + (t[2 * i + 1] & kOffsetBits);
    }
  }

  // 3. My share, in cache-sized pieces, members in order as on the other paths (bitwise equal
  // results). With more than two members partial sums go to a private buffer.
  const size_t count = data.bytes() / esize;
  const size_t lo = count * size_t(me) / n, hi = count * size_t(me + 1) / n;
  const size_t piece_elems = std::max<size_t>(1, chunk_bytes_ / esize);
  if (n > 2 && peer_slices_.size() < piece_elems * esize) peer_slices_.resize(piece_elems * esize);
  for (size_t first = lo; first < hi; first += piece_elems) {
    const size_t len = std::min(piece_elems, hi - first) * esize;
    data.for_pieces(first * esize, len, [&](size_t i, size_t off, size_t bytes, size_t at) {
      auto src = [&](int m) {
        return static_cast<const uint8_t*>(views[m][i].in) + off;
      };
      auto out = [&](int m) { return static_cast<uint8_t*>(views[m][i].out) + off; };
      if (n == 2) {
        reduce_out_scaled(out(me), out(1 - me), src(0), src(1), bytes / esize, dtype, op, scale);
        return;
      }
      reduce_members(n, src, peer_slices_.data() + at, out(me), out(me), bytes / esize, dtype,
                     op, scale);
      for (int m = 0; m < n; ++m)
        if (m != me) std::memcpy(out(m), out(me), bytes);
    });
  }

  // 4. Nobody hands its tensors back while another member may still write into them.
  mine[kArenaDone].value.store(check, std::memory_order_release);
  wait_all(comm, kArenaDone, check);
  shared_arena_count_inplace();
  return true;
}

}  // namespace shvd
