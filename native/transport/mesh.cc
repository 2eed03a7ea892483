// Mesh construction. Phase 1 brings up every TCP connection at once with one poll() loop
// (connects to lower ranks, accepts from higher ranks, and rank 0's control connections), each
// connection a small handshake state machine, so a stranger that connects and stalls costs the
// job nothing. Phase 2 turns same-host pairs into shared-memory pipes over the authenticated
// sockets.
//
// Handshake (acceptor A, connector C; all integers little endian):
//   A -> C  nonce_a[32]
//   C -> A  rank u32 | pid u32 | purpose u8 | nonce_b[32] |
//           HMAC(secret, nonce_a | rank | pid | purpose | nonce_b | "spark_hvd-connect")
//   A -> C  HMAC(secret, nonce_b | "spark_hvd-accept")
// Both MACs cover a fresh nonce of the verifying side, so a recorded handshake cannot be
// replayed, and the two tags differ, so one side's answer cannot be reflected back as the other's.
#include "mesh.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

#include "../common/hmac.h"
#include "../common/logging.h"
#include "shm.h"
#include "tcp.h"

namespace shvd {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint8_t kPurposeData = 1;
constexpr uint8_t kPurposeControl = 2;
constexpr size_t kNonceBytes = 32;
constexpr size_t kHelloBytes = 4 + 4 + 1 + kNonceBytes + 32;
constexpr char kConnectTag[] = "spark_hvd-connect";
constexpr char kAcceptTag[] = "spark_hvd-accept";
// A connection must finish its handshake this fast once accepted; legitimate peers answer in
// microseconds, strangers are dropped.
constexpr auto kHandshakeTimeout = std::chrono::seconds(2);
constexpr auto kRetryDelay = std::chrono::milliseconds(100);
constexpr size_t kMaxPendingIncoming = 256;
constexpr int kMaxRejectionLogs = 5;

std::string sys_error(const char* what) { return std::string(what) + ": " + strerror(errno); }

void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get_u32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

Digest connect_mac(const std::string& secret, const uint8_t* nonce_a, const uint8_t* hello) {
  // hello = rank | pid | purpose | nonce_b (the first 41 bytes of the message).
  std::string m(reinterpret_cast<const char*>(nonce_a), kNonceBytes);
  m.append(reinterpret_cast<const char*>(hello), 9 + kNonceBytes);
  m.append(kConnectTag);
  return hmac_sha256(secret, m.data(), m.size());
}

Digest accept_mac(const std::string& secret, const uint8_t* nonce_b) {
  std::string m(reinterpret_cast<const char*>(nonce_b), kNonceBytes);
  m.append(kAcceptTag);
  return hmac_sha256(secret, m.data(), m.size());
}

std::string describe_peer(const sockaddr_storage& sa) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (sa.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&sa);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (sa.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&sa);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

// One connection being brought up. Each step writes `out`, then reads exactly `need` bytes
// into `in` (never more: the next protocol phase's bytes must stay in the socket).
struct Conn {
  // Connector: kConnecting -> kAwaitNonce -> kAwaitReply. Acceptor: kAwaitHello -> kSendReply.
  enum Step { kConnecting, kAwaitNonce, kAwaitReply, kAwaitHello, kSendReply };
  int fd = -1;
  bool outgoing = false;
  int target = -1;  // outgoing: index into MeshBuilder::outgoing_
  Step step = kConnecting;
  int peer_rank = -1;
  int peer_pid = 0;
  uint8_t purpose = kPurposeData;
  std::vector<uint8_t> out;
  size_t out_off = 0;
  std::vector<uint8_t> in;
  size_t need = 0;
  uint8_t nonce[kNonceBytes];  // our own nonce (A for the acceptor, B for the connector)
  Clock::time_point deadline;  // incoming: handshake deadline
  std::string peer_desc;       // "ip:port" for logs
};

enum class Pump { kWait, kDone, kFail };

class MeshBuilder {
 public:
  MeshBuilder(Endpoint& ep, const MeshOptions& o) : ep_(ep), o_(o) {
    start_ = Clock::now();
    deadline_ = start_ + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double>(o.timeout_seconds));
    data_fd_.assign(o.size, -1);
    control_fd_.assign(o.size, -1);
    peer_pid_.assign(o.size, 0);
    for (int q = 0; q < o.rank; ++q) outgoing_.push_back({q, kPurposeData, start_});
    if (o.rank > 0) outgoing_.push_back({0, kPurposeControl, start_});
  }

  ~MeshBuilder() {
    for (auto& c : conns_) ::close(c.fd);
    for (int fd : data_fd_) if (fd >= 0) ::close(fd);
    for (int fd : control_fd_) if (fd >= 0) ::close(fd);
  }

  Mesh build() {
    connect_all();
    Mesh mesh;
    mesh.data.resize(o_.size);
    mesh.control.resize(o_.size);
    setup_shared_memory(mesh);
    int shm_links = 0;
    for (const auto& link : mesh.data) shm_links += link ? 1 : 0;  // only shm pipes so far
    for (int q = 0; q < o_.size; ++q) {
      const double timeout = o_.peer_timeout_seconds;
      const std::string& addr = o_.peers[q].host;
      if (data_fd_[q] >= 0 && !mesh.data[q])
        mesh.data[q].reset(new TcpLink(data_fd_[q], q, timeout, addr));
      data_fd_[q] = -1;
      if (control_fd_[q] >= 0) mesh.control[q].reset(new TcpLink(control_fd_[q], q, timeout, addr));
      control_fd_[q] = -1;
    }
    log_message(LogLevel::kDebug, "rank %d: connected to %d peer(s) in %.3f s, %d over shared "
                "memory", o_.rank, o_.size - 1,
                std::chrono::duration<double>(Clock::now() - start_).count(), shm_links);
    return mesh;
  }

 private:
  // A connection this rank must make (data to a lower rank, control to rank 0).
  struct Target {
    int rank;
    uint8_t purpose;
    Clock::time_point retry_at;
    bool active = false;  // a Conn for it is in flight
    bool done = false;
  };

  // ---- phase 1: TCP connections ------------------------------------------------------------

  bool incoming_complete() const {
    for (int q = o_.rank + 1; q < o_.size; ++q) if (data_fd_[q] < 0) return false;
    if (o_.rank == 0) {
      for (int q = 1; q < o_.size; ++q) if (control_fd_[q] < 0) return false;
    }
    return true;
  }

  bool outgoing_complete() const {
    return std::all_of(outgoing_.begin(), outgoing_.end(), [](const Target& t) { return t.done; });
  }

  void connect_all() {
    while (!(incoming_complete() && outgoing_complete())) {
      global_abort().check();
      auto now = Clock::now();
      if (now >= deadline_) throw_timeout();
      for (size_t i = 0; i < outgoing_.size(); ++i) {
        const Target& t = outgoing_[i];
        if (!t.done && !t.active && now >= t.retry_at) start_connect(i);
      }
      expire_handshakes(now);

      std::vector<pollfd> fds;
      fds.push_back({ep_.fd(), POLLIN, 0});
      for (auto& c : conns_) {
        bool writing = c.step == Conn::kConnecting || c.out_off < c.out.size();
        fds.push_back({c.fd, static_cast<short>(writing ? POLLOUT : POLLIN), 0});
      }
      int rc = ::poll(fds.data(), fds.size(), 20);
      if (rc < 0 && errno != EINTR) throw PeerLostError(sys_error("poll"));
      if (rc <= 0) continue;
      // Pump existing connections first (indices match fds[1..]), then accept new ones.
      for (size_t i = conns_.size(); i-- > 0;) {
        if (fds[i + 1].revents == 0) continue;
        std::string why;
        Pump p = pump(conns_[i], &why);
        if (p == Pump::kWait) continue;
        Conn c = std::move(conns_[i]);
        conns_.erase(conns_.begin() + i);
        if (p == Pump::kDone) {
          finish(c);
        } else {
          fail(c, why);
        }
      }
      if (fds[0].revents & POLLIN) accept_pending();
    }
  }

  void start_connect(size_t i) {
    Target& t = outgoing_[i];
    const PeerAddress& pa = o_.peers.at(t.rank);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    std::string port = std::to_string(pa.port);
    int gai = ::getaddrinfo(pa.host.c_str(), port.c_str(), &hints, &res);
    if (gai != 0 || !res) {
      last_error_[t.rank] = "cannot resolve " + pa.host + ": " + gai_strerror(gai);
      t.retry_at = Clock::now() + kRetryDelay;
      return;
    }
    int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      ::freeaddrinfo(res);
      throw PeerLostError(sys_error("socket"));
    }
    set_socket_buffers(fd, ep_.tcp_buffer_bytes());
    int rc = ::connect(fd, res->ai_addr, res->ai_addrlen);
    ::freeaddrinfo(res);
    if (rc != 0 && errno != EINPROGRESS) {
      last_error_[t.rank] = sys_error(("connect to " + pa.host + ":" + port).c_str());
      ::close(fd);
      t.retry_at = Clock::now() + kRetryDelay;
      return;
    }
    Conn c;
    c.fd = fd;
    c.outgoing = true;
    c.target = static_cast<int>(i);
    c.step = Conn::kConnecting;
    c.peer_rank = t.rank;
    c.purpose = t.purpose;
    c.peer_desc = pa.host + ":" + port;
    conns_.push_back(std::move(c));
    t.active = true;
  }

  void accept_pending() {
    for (;;) {
      sockaddr_storage sa{};
      socklen_t len = sizeof(sa);
      int fd = ::accept4(ep_.fd(), reinterpret_cast<sockaddr*>(&sa), &len,
                         SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN, or a connection that died in the backlog
      if (conns_.size() >= kMaxPendingIncoming + outgoing_.size()) {
        ::close(fd);  // flooded: drop rather than run out of descriptors
        continue;
      }
      Conn c;
      c.fd = fd;
      c.outgoing = false;
      c.step = Conn::kAwaitHello;  // after sending our nonce
      c.peer_desc = describe_peer(sa);
      c.deadline = Clock::now() + kHandshakeTimeout;
      random_bytes(c.nonce, kNonceBytes);
      c.out.assign(c.nonce, c.nonce + kNonceBytes);
      c.need = kHelloBytes;
      conns_.push_back(std::move(c));
    }
  }

  // Moves bytes for one connection until it must wait, finishes, or fails.
  Pump pump(Conn& c, std::string* why) {
    if (c.step == Conn::kConnecting) {
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err == EINPROGRESS || err == EALREADY) return Pump::kWait;
      if (err != 0) {
        *why = "connect to " + c.peer_desc + ": " + strerror(err);
        return Pump::kFail;
      }
      c.step = Conn::kAwaitNonce;
      c.need = kNonceBytes;
    }
    for (;;) {
      while (c.out_off < c.out.size()) {
        ssize_t k = ::send(c.fd, c.out.data() + c.out_off, c.out.size() - c.out_off,
                           MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
          return Pump::kWait;
        }
        if (k < 0) {
          *why = sys_error("send");
          return Pump::kFail;
        }
        c.out_off += static_cast<size_t>(k);
      }
      while (c.in.size() < c.need) {
        uint8_t buf[128];
        size_t want = std::min(sizeof(buf), c.need - c.in.size());
        ssize_t k = ::recv(c.fd, buf, want, MSG_DONTWAIT);
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
          return Pump::kWait;
        }
        if (k <= 0) {
          *why = k == 0 ? "connection closed during the handshake" : sys_error("recv");
          return Pump::kFail;
        }
        c.in.insert(c.in.end(), buf, buf + k);
      }
      Pump p = advance(c, why);
      if (p != Pump::kWait) return p;
    }
  }

  // A step's bytes are complete: check them and set up the next step (kWait = keep pumping).
  Pump advance(Conn& c, std::string* why) {
    switch (c.step) {
      case Conn::kAwaitNonce: {
        // Connector: prove we know the secret, over the acceptor's nonce.
        uint8_t hello[kHelloBytes];
        put_u32(hello, static_cast<uint32_t>(o_.rank));
        put_u32(hello + 4, static_cast<uint32_t>(::getpid()));
        hello[8] = c.purpose;
        random_bytes(c.nonce, kNonceBytes);
        std::memcpy(hello + 9, c.nonce, kNonceBytes);
        Digest mac = connect_mac(o_.secret, c.in.data(), hello);
        std::memcpy(hello + 9 + kNonceBytes, mac.data(), mac.size());
        c.out.assign(hello, hello + kHelloBytes);
        c.out_off = 0;
        c.in.clear();
        c.need = 32;
        c.step = Conn::kAwaitReply;
        return Pump::kWait;
      }
      case Conn::kAwaitReply: {
        Digest got, want = accept_mac(o_.secret, c.nonce);
        std::copy(c.in.begin(), c.in.end(), got.begin());
        if (!digest_equal(got, want)) {
          *why = "rank " + std::to_string(c.peer_rank) + " at " + c.peer_desc +
                 " answered without proving it knows the job secret";
          return Pump::kFail;
        }
        return Pump::kDone;
      }
      case Conn::kAwaitHello: {
        const uint8_t* h = c.in.data();
        Digest got, want = connect_mac(o_.secret, c.nonce, h);
        std::copy(h + 9 + kNonceBytes, h + kHelloBytes, got.begin());
        if (!digest_equal(got, want)) {
          *why = "bad handshake";
          return Pump::kFail;
        }
        int r = static_cast<int>(get_u32(h));
        uint8_t purpose = h[8];
        bool ok = (purpose == kPurposeData && r > o_.rank && r < o_.size) ||
                  (purpose == kPurposeControl && o_.rank == 0 && r > 0 && r < o_.size);
        if (!ok) {
          *why = "unexpected rank " + std::to_string(r) + " (purpose " +
                 std::to_string(purpose) + ")";
          return Pump::kFail;
        }
        c.peer_rank = r;
        c.peer_pid = static_cast<int>(get_u32(h + 4));
        c.purpose = purpose;
        Digest reply = accept_mac(o_.secret, h + 9);
        c.out.assign(reply.begin(), reply.end());
        c.out_off = 0;
        c.in.clear();
        c.need = 0;
        c.step = Conn::kSendReply;
        return Pump::kWait;
      }
      case Conn::kSendReply:
        return Pump::kDone;
      case Conn::kConnecting:
        break;
    }
    *why = "internal error: unexpected handshake step";
    return Pump::kFail;
  }

  void finish(Conn& c) {
    auto& slots = c.purpose == kPurposeControl ? control_fd_ : data_fd_;
    // A newer connection from the same rank replaces an older one: the peer only reconnects
    // after giving up on the old one.
    if (slots[c.peer_rank] >= 0) ::close(slots[c.peer_rank]);
    slots[c.peer_rank] = c.fd;
    if (!c.outgoing) peer_pid_[c.peer_rank] = c.peer_pid;
    c.fd = -1;
    if (c.outgoing) outgoing_[c.target].done = true;
  }

  void fail(Conn& c, const std::string& why) {
    ::close(c.fd);
    c.fd = -1;
    if (!c.outgoing) {
      // Strangers and broken peers are dropped; accepting carries on. A misconfigured rank
      // retries every 100 ms, so only the first few rejections are logged.
      if (++rejected_ <= kMaxRejectionLogs) {
        log_message(LogLevel::kWarning, "rejected an unauthenticated connection from %s (%s)%s",
                    c.peer_desc.c_str(), why.c_str(),
                    rejected_ == kMaxRejectionLogs ? "; not logging further rejections" : "");
      }
      return;
    }
    last_error_[c.peer_rank] = why;
    outgoing_[c.target].active = false;
    outgoing_[c.target].retry_at = Clock::now() + kRetryDelay;
  }

  void expire_handshakes(Clock::time_point now) {
    for (size_t i = conns_.size(); i-- > 0;) {
      if (conns_[i].outgoing || now < conns_[i].deadline) continue;
      Conn c = std::move(conns_[i]);
      conns_.erase(conns_.begin() + i);
      fail(c, "handshake timed out");
    }
  }

  [[noreturn]] void throw_timeout() {
    std::set<int> missing;
    for (const Target& t : outgoing_) if (!t.done) missing.insert(t.rank);
    for (int q = o_.rank + 1; q < o_.size; ++q) if (data_fd_[q] < 0) missing.insert(q);
    if (o_.rank == 0) {
      for (int q = 1; q < o_.size; ++q) if (control_fd_[q] < 0) missing.insert(q);
    }
    std::string list, details;
    for (int q : missing) {
      list += (list.empty() ? "" : ", ") + std::to_string(q);
      auto it = last_error_.find(q);
      if (it != last_error_.end()) {
        if (!details.empty()) details += "; ";
        details += "rank " + std::to_string(q) + ": " + it->second;
      }
    }
    std::string msg = "timed out after " + format_seconds(o_.timeout_seconds) +
                      " s waiting for ranks [" + list + "] to connect";
    if (!details.empty()) msg += " (" + details + ")";
    msg += ". Check that every rank started, can reach the others' addresses, and uses the same "
           "job secret.";
    throw ConnectTimeoutError(msg);
  }

  // ---- phase 2: shared memory for same-host pairs ------------------------------------------

  bool wants_shm(int q) const {
    return o_.use_shared_memory && q != o_.rank && !o_.peers[q].host_id.empty() &&
           o_.peers[q].host_id == o_.peers[o_.rank].host_id;
  }

  void io_all(int fd, int q, void* buf, size_t n, bool sending) {
    auto* p = static_cast<uint8_t*>(buf);
    while (n > 0) {
      global_abort().check();
      if (Clock::now() >= deadline_) {
        throw PeerLostError("timed out after " + format_seconds(o_.timeout_seconds) +
                            " s setting up shared memory with rank " + std::to_string(q));
      }
      ssize_t k = sending ? ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT)
                          : ::recv(fd, p, n, MSG_DONTWAIT);
      if (k > 0) {
        p += k;
        n -= static_cast<size_t>(k);
        continue;
      }
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        pollfd pfd{fd, static_cast<short>(sending ? POLLOUT : POLLIN), 0};
        ::poll(&pfd, 1, 20);
        continue;
      }
      throw PeerLostError("lost connection to rank " + std::to_string(q) +
                          " while setting up shared memory: " +
                          (k == 0 ? std::string("connection closed") : strerror(errno)));
    }
  }

  void warn_no_shm(int q, const std::string& why) {
    log_message(LogLevel::kWarning,
                "ranks %d and %d share a host but cannot use shared memory (%s); using TCP",
                std::min(o_.rank, q), std::max(o_.rank, q), why.c_str());
  }

  // Lower rank creates and offers; higher rank opens and answers 1 (using it) or 0 (TCP).
  // Every offer is sent before any answer is awaited, so no rank waits on a rank that waits
  // on it.
  void setup_shared_memory(Mesh& mesh) {
    std::map<int, std::unique_ptr<SharedMemoryPipe>> offered;
    for (int q = o_.rank + 1; q < o_.size; ++q) {
      if (!wants_shm(q)) continue;
      std::string name;
      try {
        if (!process_alive(peer_pid_[q])) {
          throw std::runtime_error("process " + std::to_string(peer_pid_[q]) +
                                   " is not visible from here (another PID namespace?)");
        }
        auto pipe = SharedMemoryPipe::create(o_.job_id, o_.rank, q, peer_pid_[q],
                                             shm_pipe_capacity(o_.shm_pipe_bytes));
        name = pipe->name();
        offered[q] = std::move(pipe);
      } catch (const std::runtime_error& e) {
        warn_no_shm(q, e.what());
      }
      uint8_t head[5];
      put_u32(head, static_cast<uint32_t>(::getpid()));
      head[4] = static_cast<uint8_t>(name.size());
      io_all(data_fd_[q], q, head, sizeof(head), true);
      io_all(data_fd_[q], q, &name[0], name.size(), true);
    }
    for (int q = 0; q < o_.rank; ++q) {
      if (!wants_shm(q)) continue;
      uint8_t head[5];
      io_all(data_fd_[q], q, head, sizeof(head), false);
      std::string name(head[4], '\0');
      io_all(data_fd_[q], q, &name[0], name.size(), false);
      uint8_t ack = 0;
      if (!name.empty()) {
        int pid = static_cast<int>(get_u32(head));
        try {
          if (!process_alive(pid)) {
            throw std::runtime_error("process " + std::to_string(pid) +
                                     " is not visible from here");
          }
          mesh.data[q] = SharedMemoryPipe::open(name, o_.rank, q, pid);
          ack = 1;
        } catch (const std::runtime_error& e) {
          warn_no_shm(q, e.what());
        }
      }
      if (name.empty()) continue;  // nothing offered, so no answer is awaited
      io_all(data_fd_[q], q, &ack, 1, true);
      if (ack) {
        ::close(data_fd_[q]);  // control links (and pid checks) detect this peer's death now
        data_fd_[q] = -1;
      }
    }
    for (auto& kv : offered) {
      int q = kv.first;
      uint8_t ack = 0;
      io_all(data_fd_[q], q, &ack, 1, false);
      kv.second->unlink();  // opened (or refused) by the peer: the name is no longer needed
      if (ack == 1) {
        mesh.data[q] = std::move(kv.second);
        ::close(data_fd_[q]);
        data_fd_[q] = -1;
      }
    }
  }

  Endpoint& ep_;
  const MeshOptions& o_;
  Clock::time_point start_, deadline_;
  std::vector<Target> outgoing_;
  std::vector<Conn> conns_;
  std::vector<int> data_fd_, control_fd_, peer_pid_;
  std::map<int, std::string> last_error_;
  int rejected_ = 0;
};

}  // namespace

Endpoint::Endpoint(const std::string& bind_host, int64_t tcp_buffer_bytes)
    : tcp_buffer_bytes_(shvd::tcp_buffer_bytes(tcp_buffer_bytes)) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const char* host = bind_host.empty() ? nullptr : bind_host.c_str();
  int gai = ::getaddrinfo(host, "0", &hints, &res);
  if (gai != 0 || !res) {
    throw std::runtime_error("cannot resolve bind address '" + bind_host + "': " +
                             gai_strerror(gai));
  }
  fd_ = ::socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd_ < 0) {
    ::freeaddrinfo(res);
    throw std::runtime_error(sys_error("socket"));
  }
  int one = 1;
  ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  set_socket_buffers(fd_, tcp_buffer_bytes_);  // accepted sockets inherit these
  int rc = ::bind(fd_, res->ai_addr, res->ai_addrlen);
  ::freeaddrinfo(res);
  if (rc != 0 || ::listen(fd_, 1024) != 0) {
    std::string why = sys_error(("cannot listen on " + bind_host).c_str());
    ::close(fd_);
    throw std::runtime_error(why);
  }
  sockaddr_storage sa{};
  socklen_t len = sizeof(sa);
  ::getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len);
  port_ = ntohs(sa.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&sa)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&sa)->sin_port);
}

Endpoint::~Endpoint() {
  if (fd_ >= 0) ::close(fd_);
}

Mesh build_mesh(Endpoint& endpoint, const MeshOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size ||
      static_cast<int>(options.peers.size()) != options.size) {
    throw OpMismatchError("build_mesh: rank " + std::to_string(options.rank) + ", size " +
                          std::to_string(options.size) + " and " +
                          std::to_string(options.peers.size()) + " peer addresses do not agree");
  }
  MeshBuilder builder(endpoint, options);
  return builder.build();
}

}  // namespace shvd
