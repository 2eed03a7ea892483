// A point-to-point byte stream to one peer. Algorithms are written against this interface only,
// so the same ring/tree code runs over TCP sockets and over shared-memory pipes.
//
// Links are used by the engine thread only (no locking). Every blocking call gives up with
// PeerLostError when the peer dies or the job is aborted (see AbortFlag), never hangs.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../common/types.h"

namespace shvd {

// Set by whoever notices a failure first (controller, a link, shutdown); every wait loop polls
// it so a rank blocked on a healthy link still leaves promptly when another link failed.
class AbortFlag {
 public:
  void raise(const std::string& why);
  bool raised() const { return raised_.load(std::memory_order_acquire); }
  std::string reason() const;
  void reset();
  // Throws PeerLostError(reason) if raised.
  void check() const;

 private:
  std::atomic<bool> raised_{false};
  mutable std::mutex mu_;
  std::string reason_;
};

class Link {
 public:
  virtual ~Link() = default;

  // Non-blocking progress: move as many bytes as possible without waiting and return how many
  // moved (0 when the peer is not ready). Throw PeerLostError on a closed/broken peer.
  virtual size_t try_send(const void* data, size_t n) = 0;
  virtual size_t try_recv(void* data, size_t n) = 0;

  // A pollable file descriptor (TCP) or -1 (shared memory, progressed by spinning/sleeping).
  virtual int fd() const = 0;
  virtual bool is_shared_memory() const = 0;
  // Checked while waiting on a link without fd: false once the peer process is gone.
  virtual bool peer_alive() const = 0;
  virtual int peer_rank() const = 0;

  // Blocking forms, implemented on top of try_send/try_recv and wait_for_progress.
  void send(const void* data, size_t n);
  void recv(void* data, size_t n);
};

// Waits until one of `links` may make progress (readable/writable for TCP, a short spin/yield/
// sleep backoff for shared memory), checking `abort` and peer liveness. `iteration` counts the
// caller's consecutive idle rounds so the backoff grows (spin first: small messages need
// microsecond latency; sleep later: two cores must not be burnt by a waiting rank).
void wait_for_progress(Link* const* links, int nlinks, bool want_send, bool want_recv,
                       int iteration);

// The same wait with a direction per link. Prefer it when different links wait for different
// directions (send to one neighbour, receive from another): the flag form above asks every TCP
// link for both, and an idle socket is always writable, so its poll() would return at once and
// the caller would spin. Null links are skipped.
struct LinkWait {
  Link* link = nullptr;
  bool send = false;
  bool recv = false;
};
void wait_for_progress(const LinkWait* waits, int nwaits, int iteration);

// Full-duplex transfer: sends `sn` bytes to `to` while receiving `rn` bytes from `from`,
// progressing both so neither side deadlocks on full buffers. `to`/`from` may be the same link
// or null (then that half is skipped).
void send_recv(Link* to, const void* sbuf, size_t sn, Link* from, void* rbuf, size_t rn);

// The process-wide abort flag every link consults.
AbortFlag& global_abort();

// A collective in which no byte moves to or from the links a rank waits on for this long throws
// PeerLostError from wait_for_progress (<= 0: no bound). A lost host is the peer timeout's job
// (set_peer_timeout in tcp.h); this catches a peer whose kernel still answers but whose process
// does not move (frozen with SIGSTOP, stuck in a debugger or in swap) while the others are
// inside a collective with it, where the stall inspector, which watches negotiation, cannot
// see it. The engine sets it to SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS.
void set_no_progress_timeout(double seconds);

// The timer of that bound, for wait_for_progress and for wait loops of their own (the
// shared-memory group's): make one (or restart it) when a wait begins; check() throws
// PeerLostError naming `peer_ranks` once the bound passed without the wait ending. Reads the
// clock only while a bound is set.
class NoProgressWatch {
 public:
  NoProgressWatch() { restart(); }
  void restart();
  bool bounded() const { return bound_ns_ > 0; }
  void check(const std::vector<int>& peer_ranks,
             std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now()) const;

 private:
  int64_t bound_ns_ = 0;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace shvd
