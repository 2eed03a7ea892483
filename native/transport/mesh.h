// Builds the job's connections: an authenticated TCP control link from every worker to the
// coordinator (rank 0), and a data link between every pair of ranks (a shared-memory pipe when
// both ranks are on the same host and shared memory is enabled, TCP otherwise).
//
// Two phases so the rendezvous can publish our address before anyone connects:
//   1. Endpoint::open() binds a listening socket on the interface we need (port 0 = any).
//   2. The Python bootstrap exchanges "host:port" (+ host id, pid) of every rank.
//   3. build_mesh() connects to lower ranks, accepts higher ranks, authenticates each connection
//      with an HMAC challenge on the job secret (mutual), and sets up shared-memory pipes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "link.h"

namespace shvd {

struct PeerAddress {
  std::string host;     // address to connect to
  int port = 0;
  std::string host_id;  // equal host ids => same machine => shared memory possible
  std::string hostname;  // the machine's own name, for error messages (may be empty)
};

struct MeshOptions {
  int rank = 0;
  int size = 1;
  std::vector<PeerAddress> peers;  // indexed by rank, includes ourselves
  std::string secret;              // raw bytes of the job secret
  std::string job_id;              // names shared-memory segments
  bool use_shared_memory = true;
  double timeout_seconds = 30.0;   // whole mesh must be up within this
  double peer_timeout_seconds = 25.0;  // TCP links: a silent peer host is lost after this long
  int64_t shm_pipe_bytes = 0;      // capacity of each pipe direction (shm_pipe_capacity())
};

class Endpoint {
 public:
  // Binds to `bind_host` ("0.0.0.0", "127.0.0.1", an interface's address). Throws on failure.
  // `tcp_buffer_bytes` (tcp_buffer_bytes() in tcp.h: < 0 default, 0 kernel autotuning) sizes
  // the buffers of every data socket of the mesh: the listening socket's now (the sockets it
  // accepts inherit them), the ones build_mesh() connects later. It is given here and not to
  // build_mesh() because peers may connect as soon as our port is published.
  explicit Endpoint(const std::string& bind_host, int64_t tcp_buffer_bytes = -1);
  ~Endpoint();
  int port() const { return port_; }
  int fd() const { return fd_; }
  int tcp_buffer_bytes() const { return tcp_buffer_bytes_; }

 private:
  int fd_ = -1;
  int port_ = 0;
  int tcp_buffer_bytes_ = 0;
};

struct Mesh {
  // data[r]: link to rank r (nullptr for r == own rank).
  std::vector<std::unique_ptr<Link>> data;
  // control[r]: TCP link for negotiation. Rank 0 holds one per worker; a worker holds only
  // control[0]. Other entries nullptr. These sockets also tell us quickly that a peer died.
  std::vector<std::unique_ptr<Link>> control;
};

// Ranks did not all connect within the timeout (shvd_init reports SHVD_ERR_CONNECT, so that
// the bootstrap can add which addresses the ranks advertised).
struct ConnectTimeoutError : PeerLostError {
  using PeerLostError::PeerLostError;
};

// Throws ConnectTimeoutError when the connections are not all made in time, PeerLostError on
// another failure of a legitimate peer; connections that fail authentication (strangers) are
// dropped and waited past.
Mesh build_mesh(Endpoint& endpoint, const MeshOptions& options);

}  // namespace shvd
