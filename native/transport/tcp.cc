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

void set_peer_timeout(int fd, double seconds) {
  if (seconds <= 0) return;
  const int ms = static_cast<int>(std::min(seconds * 1000.0, 2e9));
  const int secs = std::max(1, static_cast<int>(seconds));
  const int one = 1;
  // Probes start after half the timeout of silence and repeat about ten times within the other
  // half; with TCP_USER_TIMEOUT set the kernel ends the connection at the first probe that finds
  // the peer silent for the whole timeout (the probe count then does not matter).
  const int idle = std::max(1, secs / 2);
  const int interval = std::max(1, secs / 20);
  const int count = std::max(1, (secs - idle) / interval + 1);
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof(ms));
}

TcpLink::TcpLink(int fd, int peer_rank, double peer_timeout_seconds, std::string peer_desc)
    : fd_(fd),
      peer_rank_(peer_rank),
      peer_timeout_seconds_(peer_timeout_seconds),
      peer_desc_(std::move(peer_desc)) {
  set_nonblocking(fd_);
  set_nodelay(fd_);
  set_peer_timeout(fd_, peer_timeout_seconds_);
}

TcpLink::~TcpLink() {
  if (fd_ >= 0) ::close(fd_);
}

void TcpLink::lost(int err) const {
  std::string msg = "lost connection to " + describe_rank(peer_rank_);
  // The address, unless the host table already names the peer by it.
  if (!peer_desc_.empty() && msg.find(peer_desc_) == std::string::npos) msg += " at " + peer_desc_;
  msg += std::string(": ") + (err == 0 ? "connection closed by peer" : strerror(err));
  if (err == ETIMEDOUT && peer_timeout_seconds_ > 0)
    msg += " (no answer from its host for " + format_seconds(peer_timeout_seconds_) +
           " s, SPARK_HVD_PEER_TIMEOUT_SECONDS: the host is down or the network to it is cut)";
  throw PeerLostError(msg);
}

size_t TcpLink::try_send(const void* data, size_t n) {
  if (n == 0) return 0;
  for (;;) {
    ssize_t k = ::send(fd_, data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k >= 0) return static_cast<size_t>(k);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) return 0;
    lost(errno);
  }
}

size_t TcpLink::try_recv(void* data, size_t n) {
  if (n == 0) return 0;
  for (;;) {
    ssize_t k = ::recv(fd_, data, n, MSG_DONTWAIT);
    if (k > 0) return static_cast<size_t>(k);
    if (k == 0) lost(0);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    lost(errno);
  }
}

}  // namespace shvd
