// TCP data/control link: the transport that needs nothing installed and works across hosts.
#pragma once

#include <cstdint>
#include <string>

#include "link.h"

namespace shvd {

class TcpLink : public Link {
 public:
  // Takes ownership of a connected, authenticated socket and switches it to non-blocking mode
  // with TCP_NODELAY (collectives send many small messages; Nagle would add 40 ms stalls).
  // `peer_timeout_seconds` > 0 bounds how long the peer's host may stay silent (see
  // set_peer_timeout); `peer_desc` names the peer's address in errors.
  TcpLink(int fd, int peer_rank, double peer_timeout_seconds = 0, std::string peer_desc = "");
  ~TcpLink() override;
  TcpLink(const TcpLink&) = delete;
  TcpLink& operator=(const TcpLink&) = delete;

  size_t try_send(const void* data, size_t n) override;
  size_t try_recv(void* data, size_t n) override;
  int fd() const override { return fd_; }
  bool is_shared_memory() const override { return false; }
  // A dead peer shows up as EOF or a reset on the socket itself; a lost host or link as
  // ETIMEDOUT once the peer timeout passed without an acknowledgement.
  bool peer_alive() const override { return true; }
  int peer_rank() const override { return peer_rank_; }

 private:
  // `err`: the errno of the failed call, 0 for an orderly close.
  [[noreturn]] void lost(int err) const;
  int fd_;
  int peer_rank_;
  double peer_timeout_seconds_;
  std::string peer_desc_;
};

// Socket buffer sizes of data sockets (shvd_listen's tcp_buffer_bytes, from
// SPARK_HVD_TCP_BUFFER_BYTES): negative asks for the default, 0 leaves the kernel's autotuning
// alone, larger values are capped at 1 GiB. tcp_buffer_bytes() turns a requested value into
// the one set_socket_buffers() applies.
constexpr int kDefaultTcpBufferBytes = 4 << 20;
constexpr int kMaxTcpBufferBytes = 1 << 30;
int tcp_buffer_bytes(int64_t requested);
// Call before connect()/listen(): the TCP window scale is fixed by the handshake, and accepted
// sockets inherit the listening socket's buffers. `bytes` <= 0 does nothing.
void set_socket_buffers(int fd, int bytes);
void set_nonblocking(int fd);

// A host that vanishes (power, kernel panic, cable or link down) sends no FIN and no RST: a
// socket to it would wait forever. This bounds that wait to about `seconds` of silence from the
// peer's kernel, whatever the socket is doing: TCP_USER_TIMEOUT ends a connection whose sent
// data stays unacknowledged that long (and, since Linux 5.11, one whose zero-window probes go
// unanswered), and keepalive probes, sent after half the timeout of silence and every second or
// so after, catch a connection that is only waiting to receive. The bound is on silence, not on
// a transfer's length: a slow link keeps acknowledging, and so does the kernel of a peer whose
// process is merely busy or frozen (that case is the stall inspector's). `seconds` <= 0 leaves
// the kernel's defaults (about 15 minutes with data in flight, 2 hours idle).
void set_peer_timeout(int fd, double seconds);
void set_nodelay(int fd);

}  // namespace shvd
