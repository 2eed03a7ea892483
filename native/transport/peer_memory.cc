#include "peer_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "../common/hmac.h"

namespace shvd {

namespace {
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

ProbeTarget::ProbeTarget(bool with_memfd) {
  random_bytes(&token_, sizeof token_);
  word_ = token_;
  if (with_memfd) fd_ = make_probe_fd(token_);
}

ProbeTarget::~ProbeTarget() {
  if (fd_ >= 0) close(fd_);
}

PeerIdentity ProbeTarget::identity() const {
  PeerIdentity id;
  id.thread = uint64_t(syscall(SYS_gettid));
  id.probe_address = uint64_t(reinterpret_cast<uintptr_t>(&word_));
  id.probe_value = token_;
  id.probe_fd = uint64_t(int64_t(fd_));
  return id;
}

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

uint8_t* map_peer_fd(uint64_t thread, uint64_t fd, size_t bytes) {
  const std::string path = "/proc/" + std::to_string(thread) + "/fd/" + std::to_string(fd);
  const int local = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (local < 0) return nullptr;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, local, 0);
  close(local);
  return p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
}

bool may_read(const PeerIdentity& peer) {
  uint64_t got = 0;
  std::vector<iovec> local{{&got, sizeof got}};
  std::vector<iovec> remote{{reinterpret_cast<void*>(uintptr_t(peer.probe_address)),
                             sizeof got}};
  return read_process(pid_t(peer.thread), local, remote) == 0 && got == peer.probe_value;
}

bool may_map(const PeerIdentity& peer) {
  uint8_t* p = map_peer_fd(peer.thread, peer.probe_fd, 4096);
  if (!p) return false;
  uint64_t got;
  std::memcpy(&got, p, sizeof got);
  munmap(p, 4096);
  return got == peer.probe_value;
}

}  // namespace shvd
