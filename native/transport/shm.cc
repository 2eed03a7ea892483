// Shared-memory pipe. Each direction is a ring of `capacity` bytes with two monotonically
// increasing 64-bit counters: head (bytes written, stored only by the producer) and tail (bytes
// read, stored only by the consumer). The producer publishes data with a release store of head
// and the consumer acquires it, so no locks are needed; counters never wrap in practice.
#include "shm.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "../common/hmac.h"

namespace shvd {

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory counters need lock-free");

// Every field the other process writes lives on its own cache line, so the producer's and the
// consumer's stores never contend for one line.
struct alignas(64) ShmRing {
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
};

struct ShmSegment {
  uint64_t magic;
  uint64_t capacity;
  alignas(64) std::atomic<uint32_t> closed[2];  // set by side i when it lets go of the pipe
  alignas(64) ShmRing ring[2];                  // ring[i]: written by side i, read by the other
};

namespace {

constexpr uint64_t kMagic = 0x7368766470697065ULL;  // "shvdpipe"
// Publish progress at least every this many bytes so the consumer starts copying while the
// producer is still writing a large message (and the copies stay cache-sized).
constexpr size_t kPublishChunk = 256u << 10;

size_t data_offset() { return (sizeof(ShmSegment) + 4095) / 4096 * 4096; }

std::string sanitize(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-') out += c;
    if (out.size() >= 64) break;
  }
  return out.empty() ? "job" : out;
}

std::string sys_error(const std::string& what) { return what + ": " + strerror(errno); }

}  // namespace

size_t shm_pipe_capacity(int64_t requested) {
  int64_t v = requested > 0 ? requested : int64_t(kDefaultShmPipeBytes);
  v = std::max<int64_t>(64 << 10, std::min<int64_t>(v, int64_t(1) << 30));
  return static_cast<size_t>((v + 4095) / 4096 * 4096);
}

bool process_alive(int pid) {
  if (pid <= 0) return true;  // unknown pid: rely on the closed flag and the control link
  if (::kill(pid, 0) != 0 && errno != EPERM) return false;
  // kill() succeeds on a zombie until its parent reaps it; a zombie will never read or write.
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return true;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* paren = std::strrchr(buf, ')');  // the command name may itself contain ')'
  if (paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X')) return false;
  return true;
}

std::unique_ptr<SharedMemoryPipe> SharedMemoryPipe::create(const std::string& job_id,
                                                           int my_rank, int peer_rank,
                                                           int peer_pid, size_t capacity) {
  const size_t bytes = data_offset() + 2 * capacity;
  uint8_t rnd[8];
  random_bytes(rnd, sizeof(rnd));
  char hex[17];
  for (int i = 0; i < 8; ++i) std::snprintf(hex + 2 * i, 3, "%02x", rnd[i]);
  std::string name = "/shvd-" + sanitize(job_id) + "-" +
                     std::to_string(std::min(my_rank, peer_rank)) + "-" +
                     std::to_string(std::max(my_rank, peer_rank)) + "-" + hex;

  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error(sys_error("shm_open(" + name + ")"));
  // Reserve the pages now: on a full /dev/shm (64 MiB in a default Docker container) a sparse
  // segment would kill us with SIGBUS on first touch; fallocate fails cleanly instead.
  int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  void* p = MAP_FAILED;
  if (err == 0) p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (err != 0 || p == MAP_FAILED) {
    std::string why = err != 0 ? std::string("cannot allocate ") + std::to_string(bytes) +
                                     " bytes in /dev/shm: " + strerror(err)
                               : sys_error("mmap");
    ::close(fd);
    ::shm_unlink(name.c_str());
    throw std::runtime_error(why);
  }
  ::close(fd);
  auto* seg = new (p) ShmSegment;
  seg->capacity = capacity;
  for (int i = 0; i < 2; ++i) {
    seg->closed[i].store(0, std::memory_order_relaxed);
    seg->ring[i].head.store(0, std::memory_order_relaxed);
    seg->ring[i].tail.store(0, std::memory_order_relaxed);
  }
  std::atomic_thread_fence(std::memory_order_release);
  seg->magic = kMagic;
  return std::unique_ptr<SharedMemoryPipe>(
      new SharedMemoryPipe(seg, bytes, capacity, name, 0, peer_rank, peer_pid));
}

std::unique_ptr<SharedMemoryPipe> SharedMemoryPipe::open(const std::string& name, int my_rank,
                                                         int peer_rank, int peer_pid) {
  (void)my_rank;
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error(sys_error("shm_open(" + name + ")"));
  struct stat st;
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < data_offset()) {
    ::close(fd);
    throw std::runtime_error("shared-memory segment " + name + " is too small");
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw std::runtime_error(sys_error("mmap(" + name + ")"));
  auto* seg = static_cast<ShmSegment*>(p);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (seg->magic != kMagic || data_offset() + 2 * seg->capacity != bytes) {
    ::munmap(p, bytes);
    throw std::runtime_error("shared-memory segment " + name + " has an unexpected layout");
  }
  return std::unique_ptr<SharedMemoryPipe>(
      new SharedMemoryPipe(seg, bytes, seg->capacity, name, 1, peer_rank, peer_pid));
}

SharedMemoryPipe::SharedMemoryPipe(ShmSegment* seg, size_t map_bytes, size_t capacity,
                                   std::string name, int side, int peer_rank, int peer_pid)
    : seg_(seg),
      map_bytes_(map_bytes),
      capacity_(capacity),
      name_(std::move(name)),
      side_(side),
      peer_rank_(peer_rank),
      peer_pid_(peer_pid) {
  auto* base = reinterpret_cast<uint8_t*>(seg) + data_offset();
  send_data_ = base + side * capacity;
  recv_data_ = base + (1 - side) * capacity;
  send_head_ = seg_->ring[side].head.load(std::memory_order_relaxed);
  peer_tail_cache_ = seg_->ring[side].tail.load(std::memory_order_acquire);
  recv_tail_ = seg_->ring[1 - side].tail.load(std::memory_order_relaxed);
  peer_head_cache_ = seg_->ring[1 - side].head.load(std::memory_order_acquire);
}

SharedMemoryPipe::~SharedMemoryPipe() {
  // Release: everything we wrote is visible before the peer sees us closed.
  seg_->closed[side_].store(1, std::memory_order_release);
  if (side_ == 0) unlink();
  ::munmap(seg_, map_bytes_);
}

void SharedMemoryPipe::unlink() {
  if (unlinked_) return;
  unlinked_ = true;
  ::shm_unlink(name_.c_str());
}

bool SharedMemoryPipe::peer_gone() const {
  if (peer_closed_ || peer_died_) return true;
  if (seg_->closed[1 - side_].load(std::memory_order_acquire)) {
    peer_closed_ = true;
  } else if (!process_alive(peer_pid_)) {
    peer_died_ = true;
  }
  return peer_closed_ || peer_died_;
}

bool SharedMemoryPipe::peer_alive() const {
  if (!peer_gone()) return true;
  return seg_->ring[1 - side_].head.load(std::memory_order_acquire) != recv_tail_;
}

void SharedMemoryPipe::lost() const {
  throw PeerLostError("rank " + std::to_string(peer_rank_) +
                      (peer_died_ ? " died" : " closed its end"));
}

size_t SharedMemoryPipe::try_send(const void* data, size_t n) {
  // Nobody will ever read what we write to a closed or dead peer.
  if (peer_closed_ || peer_died_ || seg_->closed[1 - side_].load(std::memory_order_relaxed)) {
    peer_closed_ = peer_closed_ || !peer_died_;
    lost();
  }
  ShmRing& ring = seg_->ring[side_];
  if (capacity_ - (send_head_ - peer_tail_cache_) < n) {
    peer_tail_cache_ = ring.tail.load(std::memory_order_acquire);
  }
  size_t room = capacity_ - static_cast<size_t>(send_head_ - peer_tail_cache_);
  size_t total = std::min(n, room);
  const auto* src = static_cast<const uint8_t*>(data);
  size_t done = 0;
  while (done < total) {
    size_t pos = static_cast<size_t>(send_head_ % capacity_);
    size_t len = std::min({total - done, capacity_ - pos, kPublishChunk});
    std::memcpy(send_data_ + pos, src + done, len);
    done += len;
    send_head_ += len;
    ring.head.store(send_head_, std::memory_order_release);
  }
  return total;
}

size_t SharedMemoryPipe::try_recv(void* data, size_t n) {
  if (n == 0) return 0;
  ShmRing& ring = seg_->ring[1 - side_];
  if (peer_head_cache_ - recv_tail_ < n) {
    peer_head_cache_ = ring.head.load(std::memory_order_acquire);
  }
  size_t total = std::min(n, static_cast<size_t>(peer_head_cache_ - recv_tail_));
  if (total == 0) {
    // Empty. If the peer is gone (closed flag, or pid found dead by peer_alive()), re-read head
    // after seeing that: its last bytes were published before it closed.
    if (peer_closed_ || peer_died_ || seg_->closed[1 - side_].load(std::memory_order_acquire)) {
      peer_closed_ = peer_closed_ || !peer_died_;
      peer_head_cache_ = ring.head.load(std::memory_order_acquire);
      if (peer_head_cache_ == recv_tail_) lost();
      total = std::min(n, static_cast<size_t>(peer_head_cache_ - recv_tail_));
    } else {
      return 0;
    }
  }
  auto* dst = static_cast<uint8_t*>(data);
  size_t done = 0;
  while (done < total) {
    size_t pos = static_cast<size_t>(recv_tail_ % capacity_);
    size_t len = std::min({total - done, capacity_ - pos, kPublishChunk});
    std::memcpy(dst + done, recv_data_ + pos, len);
    done += len;
    recv_tail_ += len;
    ring.tail.store(recv_tail_, std::memory_order_release);
  }
  return total;
}

}  // namespace shvd
