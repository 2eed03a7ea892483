#include "shared_memory_group.h"

#include <fcntl.h>
#include <sched.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "../common/hmac.h"
#include "reduce_kernels.h"

namespace shvd {

namespace {
constexpr size_t kLine = 64;
constexpr size_t kDefaultChunkBytes = 512 * 1024;
enum { kIn = 0, kReduced = 1, kDone = 2 };

struct alignas(kLine) Counter {
  std::atomic<uint64_t> value;
  char pad[kLine - sizeof(std::atomic<uint64_t>)];
};

size_t chunk_bytes_from_env() {
  const char* v = std::getenv("SPARK_HVD_SHM_CHUNK_BYTES");
  size_t c = v ? std::strtoull(v, nullptr, 10) : kDefaultChunkBytes;
  return std::max<size_t>(4096, c / kLine * kLine);
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

// Per member: three progress counters and where it runs, each on its own cache line. `cpu` is
// (collective << 16) | (CPU + 1): a CPU published during an earlier collective is stale (the
// thread may have moved since) and is ignored.
struct SharedMemoryGroup::Control {
  Counter seq[3];
  Counter cpu;
};

static size_t control_bytes(int members) { return sizeof(SharedMemoryGroup::Control) * members; }

SharedMemoryGroup::SharedMemoryGroup(void* base, size_t bytes, int members, size_t chunk_bytes)
    : base_(base), bytes_(bytes), members_(members), chunk_bytes_(chunk_bytes) {}

SharedMemoryGroup::~SharedMemoryGroup() { munmap(base_, bytes_); }

uint8_t* SharedMemoryGroup::slot(int member, int buffer) const {
  return static_cast<uint8_t*>(base_) + control_bytes(members_) +
         (size_t(member) * 2 + buffer) * chunk_bytes_;
}

uint8_t* SharedMemoryGroup::result(int buffer) const {
  return static_cast<uint8_t*>(base_) + control_bytes(members_) +
         (size_t(members_) * 2 + buffer) * chunk_bytes_;
}

std::unique_ptr<SharedMemoryGroup> SharedMemoryGroup::create(const Communicator& comm,
                                                             const std::string& job_id) {
  const size_t chunk = chunk_bytes_from_env();
  const size_t bytes = control_bytes(comm.size) + (size_t(comm.size) * 2 + 2) * chunk;
  void* base = MAP_FAILED;
  uint8_t ok = 1;
  if (comm.rank == 0) {
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
    if (ok) std::memset(base, 0, control_bytes(comm.size));
    const uint32_t len = ok ? uint32_t(name.size()) : 0;
    for (int m = 1; m < comm.size; ++m) {
      comm.link(m)->send(&len, sizeof len);
      if (len) comm.link(m)->send(name.data(), len);
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
    if (len) comm.link(0)->recv(&name[0], len);
    if (len) {
      int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
      if (fd >= 0) {
        base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
      }
    }
    uint8_t ack = base != MAP_FAILED;
    comm.link(0)->send(&ack, 1);
    comm.link(0)->recv(&ok, 1);  // everyone must have mapped it, or nobody uses it
  }
  if (!ok) {
    if (base != MAP_FAILED) munmap(base, bytes);
    return nullptr;
  }
  return std::unique_ptr<SharedMemoryGroup>(new SharedMemoryGroup(base, bytes, comm.size, chunk));
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

namespace {

// The fused tensors seen as one logical array of bytes.
class SegmentedBuffer {
 public:
  SegmentedBuffer(const std::vector<SharedMemoryGroup::Segment>& segments, size_t esize)
      : segments_(segments), esize_(esize) {
    size_t pos = 0;
    for (const auto& s : segments) {
      starts_.push_back(pos);
      pos += s.count * esize;
    }
    starts_.push_back(pos);
  }
  size_t bytes() const { return starts_.back(); }

  // Calls fn(in, out, length, offset_within_range) for each piece of [pos, pos + len).
  template <typename F>
  void for_range(size_t pos, size_t len, F fn) const {
    size_t i = std::upper_bound(starts_.begin(), starts_.end(), pos) - starts_.begin() - 1;
    size_t done = 0;
    while (done < len) {
      const size_t off = pos + done - starts_[i];
      const size_t n = std::min(len - done, starts_[i + 1] - starts_[i] - off);
      if (n > 0)
        fn(static_cast<const uint8_t*>(segments_[i].in) + off,
           static_cast<uint8_t*>(segments_[i].out) + off, n, done);
      done += n;
      ++i;
    }
  }

 private:
  const std::vector<SharedMemoryGroup::Segment>& segments_;
  size_t esize_;
  std::vector<size_t> starts_;
};

}  // namespace

void SharedMemoryGroup::allreduce(const Communicator& comm, const std::vector<Segment>& segments,
                                  DataType dtype, ReduceOp op, double scale) {
  const int n = members_, me = comm.rank;
  const size_t esize = dtype_size(dtype);
  const SegmentedBuffer data(segments, esize);
  const size_t count = data.bytes() / esize;
  if (count == 0) return;
  // Chunk and slice boundaries fall on element boundaries.
  const size_t chunk_elems = std::max<size_t>(n, chunk_bytes_ / esize / n * n);
  const size_t chunks = (count + chunk_elems - 1) / chunk_elems;
  const uint64_t base_seq = chunks_done_;
  chunks_done_ += chunks;
  moved_ = false;
  collective_ = (collective_ + 1) & 0xffffffffffffULL;  // the same count on every member
  publish_cpu(comm);
  auto* ctl = static_cast<Control*>(base_);
  Counter* mine = ctl[me].seq;

  // Geometry of chunk k: sequence number, buffer, and slice i = elements [lo(i), lo(i+1)).
  struct Chunk {
    uint64_t seq;
    int b;
    size_t first, elems;
  };
  auto chunk = [&](size_t k) {
    const size_t first = k * chunk_elems;
    return Chunk{base_seq + k + 1, int((base_seq + k + 1) & 1), first,
                 std::min(chunk_elems, count - first)};
  };
  auto lo = [&](const Chunk& c, int i) { return c.elems * size_t(i) / n; };
  auto slice_pos = [&](const Chunk& c, int i) { return (c.first + lo(c, i)) * esize; };
  auto slice_bytes = [&](const Chunk& c, int i) { return (lo(c, i + 1) - lo(c, i)) * esize; };

  // 1. copy-in: the slices other members reduce go into my slot.
  auto copy_in = [&](const Chunk& c) {
    if (c.seq > 2) wait_all(comm, kDone, c.seq - 2);  // slot last read two chunks ago
    for (int i = 0; i < n; ++i) {
      if (i == me) continue;
      uint8_t* dst = slot(me, c.b) + lo(c, i) * esize;
      data.for_range(slice_pos(c, i), slice_bytes(c, i),
                     [&](const uint8_t* in, uint8_t*, size_t len, size_t at) {
                       std::memcpy(dst + at, in, len);
                     });
    }
    mine[kIn].value.store(c.seq, std::memory_order_release);
  };

  copy_in(chunk(0));
  for (size_t k = 0; k < chunks; ++k) {
    const Chunk c = chunk(k);
    // 2. reduce my slice in member order (mine straight from my tensors) into the result.
    wait_all(comm, kIn, c.seq);
    uint8_t* out = result(c.b) + lo(c, me) * esize;
    // Members 0..n-2 are summed into the shared result, then the last one is added, scaled
    // and written to both the result and my own tensor in one pass.
    data.for_range(slice_pos(c, me), slice_bytes(c, me),
                   [&](const uint8_t* in, uint8_t* dst, size_t len, size_t at) {
                     auto src = [&](int m) -> const uint8_t* {
                       return m == me ? in : slot(m, c.b) + lo(c, me) * esize + at;
                     };
                     const size_t e = len / esize;
                     if (n > 2) reduce_out(out + at, src(0), src(1), e, dtype, op);
                     for (int m = 2; m < n - 1; ++m) reduce_into(out + at, src(m), e, dtype, op);
                     reduce_out_scaled(out + at, dst, n > 2 ? out + at : src(0), src(n - 1), e,
                                       dtype, op, scale);
                   });
    mine[kReduced].value.store(c.seq, std::memory_order_release);
    // Software pipelining: publish the next chunk before waiting for the others' reductions,
    // so a member that runs late finds its inputs ready instead of stalling everyone.
    if (k + 1 < chunks) copy_in(chunk(k + 1));

    // 3. copy-out everybody else's slices.
    wait_all(comm, kReduced, c.seq);
    for (int i = 0; i < n; ++i) {
      if (i == me) continue;
      const uint8_t* src = result(c.b) + lo(c, i) * esize;
      data.for_range(slice_pos(c, i), slice_bytes(c, i),
                     [&](const uint8_t*, uint8_t* dst, size_t len, size_t at) {
                       std::memcpy(dst, src + at, len);
                     });
    }
    mine[kDone].value.store(c.seq, std::memory_order_release);
  }
}

}  // namespace shvd
