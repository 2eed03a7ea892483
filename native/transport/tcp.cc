// Non-blocking TCP link. try_send/try_recv never wait; waiting is wait_for_progress's job.
#include "tcp.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace shvd {

void set_nonblocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

int tcp_buffer_bytes(int64_t requested) {
  if (requested < 0) return kDefaultTcpBufferBytes;
  return static_cast<int>(std::min<int64_t>(requested, kMaxTcpBufferBytes));
}

void set_socket_buffers(int fd, int bytes) {
  if (bytes <= 0) return;
  // The kernel caps these at net.core.{w,r}mem_max; best effort, failures are not fatal.
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
}

TcpLink::TcpLink(int fd, int peer_rank) : fd_(fd), peer_rank_(peer_rank) {
  set_nonblocking(fd_);
  set_nodelay(fd_);
}

TcpLink::~TcpLink() {
  if (fd_ >= 0) ::close(fd_);
}

void TcpLink::lost(const char* what) const {
  throw PeerLostError("lost connection to rank " + std::to_string(peer_rank_) + ": " + what);
}

size_t TcpLink::try_send(const void* data, size_t n) {
  if (n == 0) return 0;
  for (;;) {
    ssize_t k = ::send(fd_, data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k >= 0) return static_cast<size_t>(k);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) return 0;
    lost(strerror(errno));
  }
}

size_t TcpLink::try_recv(void* data, size_t n) {
  if (n == 0) return 0;
  for (;;) {
    ssize_t k = ::recv(fd_, data, n, MSG_DONTWAIT);
    if (k > 0) return static_cast<size_t>(k);
    if (k == 0) lost("connection closed by peer");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    lost(strerror(errno));
  }
}

}  // namespace shvd
