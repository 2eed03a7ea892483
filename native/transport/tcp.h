// TCP data/control link: the transport that needs nothing installed and works across hosts.
#pragma once

#include <cstdint>

#include "link.h"

namespace shvd {

class TcpLink : public Link {
 public:
  // Takes ownership of a connected, authenticated socket and switches it to non-blocking mode
  // with TCP_NODELAY (collectives send many small messages; Nagle would add 40 ms stalls).
  TcpLink(int fd, int peer_rank);
  ~TcpLink() override;
  TcpLink(const TcpLink&) = delete;
  TcpLink& operator=(const TcpLink&) = delete;

  size_t try_send(const void* data, size_t n) override;
  size_t try_recv(void* data, size_t n) override;
  int fd() const override { return fd_; }
  bool is_shared_memory() const override { return false; }
  // A dead peer shows up as EOF or a reset on the socket itself.
  bool peer_alive() const override { return true; }
  int peer_rank() const override { return peer_rank_; }

 private:
  [[noreturn]] void lost(const char* what) const;
  int fd_;
  int peer_rank_;
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
void set_nodelay(int fd);

}  // namespace shvd
