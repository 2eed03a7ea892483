#include "negotiation_board.h"

#include <sched.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "../common/hmac.h"

namespace shvd {

namespace {
constexpr uint64_t kMagic = 0x7368766462726431ull;  // "shvdbrd1"
constexpr uint64_t kDisabled = 1ull << 63;
constexpr auto kFullLogTimeout = std::chrono::seconds(60);

std::string sys_error(const std::string& what) { return what + ": " + std::strerror(errno); }

uint64_t log_capacity(uint32_t ids) {
  uint64_t c = 4096;
  while (c < 4ull * ids) c <<= 1;
  return c;
}
}  // namespace

// Written by one rank each, read by the appenders: apart, so they do not share cache lines.
struct alignas(64) RankSlot {
  std::atomic<uint64_t> consumed;
  std::atomic<uint32_t> sleeping;
  std::atomic<uint32_t> cpu;  // + 1, as publish_cpu last saw it (0: unknown)
};

struct BoardLayout {
  uint64_t magic;
  uint32_t size;
  uint32_t ids;
  uint64_t capacity;
  alignas(64) std::atomic<uint32_t> lock;
  uint64_t sealed;  // under lock
  alignas(64) std::atomic<uint64_t> tail;
  RankSlot ranks[NegotiationBoard::kMaxRanks];
  // Then: arrivals[ids], completions[ids], log[capacity].
};

namespace {
size_t board_bytes(uint32_t ids, uint64_t capacity) {
  return sizeof(BoardLayout) + sizeof(uint64_t) * (2 * ids + capacity);
}
}  // namespace

std::unique_ptr<NegotiationBoard> NegotiationBoard::create(const std::string& job_id, int size,
                                                           uint32_t ids) {
  if (size > kMaxRanks) throw std::runtime_error("too many ranks for the negotiation board");
  const uint64_t capacity = log_capacity(ids);
  const size_t bytes = board_bytes(ids, capacity);
  uint8_t rnd[8];
  random_bytes(rnd, sizeof rnd);
  char hex[17];
  for (int i = 0; i < 8; ++i) std::snprintf(hex + 2 * i, 3, "%02x", rnd[i]);
  std::string safe_job;
  for (char c : job_id) safe_job += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  const std::string name = "/shvd-" + safe_job.substr(0, 64) + "-board-" + hex;
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error(sys_error("shm_open(" + name + ")"));
  // Reserve the pages now: a full /dev/shm fails here instead of with SIGBUS on first touch.
  const int err = ::posix_fallocate(fd, 0, off_t(bytes));
  void* p = err == 0 ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                     : MAP_FAILED;
  ::close(fd);
  if (p == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    throw std::runtime_error(err ? "cannot allocate the negotiation board in /dev/shm: " +
                                       std::string(std::strerror(err))
                                 : sys_error("mmap"));
  }
  auto* layout = static_cast<BoardLayout*>(p);  // zero-filled by the kernel
  layout->size = uint32_t(size);
  layout->ids = ids;
  layout->capacity = capacity;
  std::atomic_thread_fence(std::memory_order_release);
  layout->magic = kMagic;
  return std::unique_ptr<NegotiationBoard>(
      new NegotiationBoard(layout, bytes, name, 0, size, ids));
}

std::unique_ptr<NegotiationBoard> NegotiationBoard::open(const std::string& name, int rank,
                                                         int size, uint32_t ids) {
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) throw std::runtime_error(sys_error("shm_open(" + name + ")"));
  const size_t bytes = board_bytes(ids, log_capacity(ids));
  struct stat st;
  void* p = ::fstat(fd, &st) == 0 && size_t(st.st_size) == bytes
                ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                : MAP_FAILED;
  ::close(fd);
  if (p == MAP_FAILED) throw std::runtime_error("cannot map the negotiation board " + name);
  auto* layout = static_cast<BoardLayout*>(p);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (layout->magic != kMagic || layout->size != uint32_t(size) || layout->ids != ids) {
    ::munmap(p, bytes);
    throw std::runtime_error("the negotiation board " + name + " has an unexpected layout");
  }
  return std::unique_ptr<NegotiationBoard>(
      new NegotiationBoard(layout, bytes, name, rank, size, ids));
}

NegotiationBoard::NegotiationBoard(BoardLayout* layout, size_t bytes, std::string name, int rank,
                                   int size, uint32_t ids)
    : layout_(layout),
      bytes_(bytes),
      name_(std::move(name)),
      rank_(rank),
      size_(size),
      ids_(ids),
      capacity_(layout->capacity) {
  auto* after = reinterpret_cast<uint64_t*>(layout + 1);
  arrivals_ = reinterpret_cast<std::atomic<uint64_t>*>(after);
  completions_ = reinterpret_cast<std::atomic<uint64_t>*>(after + ids);
  log_ = after + 2 * ids;
  wake_fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = socket_name(rank);
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (wake_fd_ < 0 ||
      ::bind(wake_fd_, reinterpret_cast<sockaddr*>(&addr),
             socklen_t(offsetof(sockaddr_un, sun_path) + path.size())) != 0) {
    const std::string why = sys_error("binding the negotiation board's wake-up socket");
    if (wake_fd_ >= 0) ::close(wake_fd_);
    ::munmap(layout_, bytes_);
    throw std::runtime_error(why);
  }
}

NegotiationBoard::~NegotiationBoard() {
  if (rank_ == 0) unlink();
  if (wake_fd_ >= 0) ::close(wake_fd_);
  ::munmap(layout_, bytes_);
}

void NegotiationBoard::unlink() {
  if (unlinked_) return;
  unlinked_ = true;
  ::shm_unlink(name_.c_str());
}

std::string NegotiationBoard::socket_name(int rank) const {
  // Abstract (leading NUL): nothing in the file system, gone with the last descriptor.
  std::string s(1, '\0');
  s += "shvd" + name_ + "-" + std::to_string(rank);
  return s.substr(0, sizeof(sockaddr_un::sun_path));
}

NegotiationBoard::Arrival NegotiationBoard::arrive(uint32_t id, int rank, uint64_t members) {
  const uint64_t mine = 1ull << rank;
  uint64_t w = arrivals_[id].load(std::memory_order_acquire);
  for (;;) {
    if (w & kDisabled) return Arrival::kRefused;
    uint64_t next = w | mine;
    const bool complete = (next & members) == members;
    if (complete) next = 0;  // the next round starts empty
    if (arrivals_[id].compare_exchange_weak(w, next, std::memory_order_acq_rel)) {
      if (!complete) return Arrival::kWaiting;
      completions_[id].fetch_add(1, std::memory_order_relaxed);
      return Arrival::kCompleted;
    }
  }
}

uint64_t NegotiationBoard::steal(uint32_t id) {
  return arrivals_[id].exchange(kDisabled, std::memory_order_acq_rel) & ~kDisabled;
}

void NegotiationBoard::enable(uint32_t id) {
  arrivals_[id].fetch_and(~kDisabled, std::memory_order_acq_rel);
}

uint64_t NegotiationBoard::waiting(uint32_t id) const {
  return arrivals_[id].load(std::memory_order_acquire) & ~kDisabled;
}

uint64_t NegotiationBoard::completions(uint32_t id) const {
  return completions_[id].load(std::memory_order_relaxed);
}

void NegotiationBoard::lock() {
  for (int spins = 0; layout_->lock.exchange(1, std::memory_order_acquire) != 0; ++spins)
    if (spins > 64) std::this_thread::yield();
}

void NegotiationBoard::unlock() { layout_->lock.store(0, std::memory_order_release); }

void NegotiationBoard::append(const uint64_t* entries, size_t n) {
  if (n == 0) return;
  if (n > capacity_ / 2) {  // never more than the ring holds
    append(entries, capacity_ / 2);
    append(entries + capacity_ / 2, n - capacity_ / 2);
    return;
  }
  const auto give_up = std::chrono::steady_clock::now() + kFullLogTimeout;
  lock();
  uint64_t tail = layout_->tail.load(std::memory_order_relaxed);
  for (;;) {
    uint64_t oldest = tail;
    for (int r = 0; r < size_; ++r)
      oldest = std::min(oldest, layout_->ranks[r].consumed.load(std::memory_order_acquire));
    if (tail + n - oldest <= capacity_) break;
    unlock();
    if (std::chrono::steady_clock::now() > give_up)
      throw std::runtime_error("the negotiation board's log stayed full for a minute: a rank "
                               "stopped reading it");
    wake_sleepers();
    std::this_thread::yield();
    lock();
    tail = layout_->tail.load(std::memory_order_relaxed);
  }
  for (size_t i = 0; i < n; ++i, ++tail) {
    const uint64_t entry = entries[i];
    const bool fuse = tail > layout_->sealed && !(entry & kMarker) &&
                      !(log_[(tail - 1) & (capacity_ - 1)] & kMarker);
    log_[tail & (capacity_ - 1)] = entry | (fuse ? kFuseWithPrevious : 0);
  }
  // seq_cst: ordered before reading the sleeping flags (a rank raises its flag, then looks at
  // the tail: one of the two sees the other).
  layout_->tail.store(tail, std::memory_order_seq_cst);
  unlock();
  wake_sleepers();
}

uint64_t NegotiationBoard::tail() const { return layout_->tail.load(std::memory_order_seq_cst); }

uint64_t NegotiationBoard::seal() {
  lock();
  const uint64_t tail = layout_->tail.load(std::memory_order_relaxed);
  layout_->sealed = tail;
  unlock();
  return tail;
}

uint64_t NegotiationBoard::entry(uint64_t position) const {
  return log_[position & (capacity_ - 1)] & ~kFuseWithPrevious;
}

bool NegotiationBoard::fuses(uint64_t position) const {
  return (log_[position & (capacity_ - 1)] & kFuseWithPrevious) != 0;
}

void NegotiationBoard::consumed(uint64_t position) {
  layout_->ranks[rank_].consumed.store(position, std::memory_order_release);
}

void NegotiationBoard::publish_cpu() {
  const int cpu = sched_getcpu();
  layout_->ranks[rank_].cpu.store(cpu >= 0 ? uint32_t(cpu) + 1 : 0, std::memory_order_relaxed);
}

int NegotiationBoard::cpu_of(int rank) const {
  return int(layout_->ranks[rank].cpu.load(std::memory_order_relaxed)) - 1;
}

void NegotiationBoard::set_sleeping(bool sleeping) {
  layout_->ranks[rank_].sleeping.store(sleeping ? 1 : 0, std::memory_order_seq_cst);
}

void NegotiationBoard::drain_wake_fd() {
  char buf[64];
  while (::recv(wake_fd_, buf, sizeof buf, MSG_DONTWAIT) > 0) {
  }
}

void NegotiationBoard::wake_sleepers() {
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || !layout_->ranks[r].sleeping.load(std::memory_order_seq_cst)) continue;
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string path = socket_name(r);
    std::memcpy(addr.sun_path, path.data(), path.size());
    const char byte = 1;
    // Fails harmlessly when the peer's buffer is full (it has wake-ups pending anyway) or it
    // has gone (the engine notices that through its links).
    ::sendto(wake_fd_, &byte, 1, MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&addr),
             socklen_t(offsetof(sockaddr_un, sun_path) + path.size()));
  }
}

}  // namespace shvd
