// Blocking transfers and the shared wait loop. Every wait goes through wait_for_progress so
// that abort, peer death and the CPU backoff policy are decided in one place.
#include "link.h"

#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "../common/cpu_relax.h"

namespace shvd {

void AbortFlag::raise(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The first reason wins: later ones are usually consequences of the first failure.
    if (raised_.load(std::memory_order_relaxed)) return;
    reason_ = why;
  }
  raised_.store(true, std::memory_order_release);
}

std::string AbortFlag::reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reason_;
}

void AbortFlag::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  reason_.clear();
  raised_.store(false, std::memory_order_release);
}

void AbortFlag::check() const {
  if (raised()) throw PeerLostError(reason());
}

AbortFlag& global_abort() {
  static AbortFlag flag;
  return flag;
}

namespace {
// In nanoseconds so the wait loop reads it without a lock; 0 = no bound.
std::atomic<int64_t> g_no_progress_ns{0};
}  // namespace

void set_no_progress_timeout(double seconds) {
  g_no_progress_ns.store(seconds > 0 ? int64_t(seconds * 1e9) : 0, std::memory_order_relaxed);
}

void Link::send(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  LinkWait w{this, true, false};
  int idle = 0;
  while (n > 0) {
    size_t k = try_send(p, n);
    p += k;
    n -= k;
    if (k > 0) {
      idle = 0;
    } else {
      wait_for_progress(&w, 1, idle++);
    }
  }
}

void Link::recv(void* data, size_t n) {
  auto* p = static_cast<uint8_t*>(data);
  LinkWait w{this, false, true};
  int idle = 0;
  while (n > 0) {
    size_t k = try_recv(p, n);
    p += k;
    n -= k;
    if (k > 0) {
      idle = 0;
    } else {
      wait_for_progress(&w, 1, idle++);
    }
  }
}

namespace {

// Backoff for links without a file descriptor. A waiting rank spins first (a small message
// arrives within microseconds), then yields its core, then sleeps in growing steps: with two
// cores and several ranks per host, a spinning rank would steal the core its peer needs.
constexpr int kSpinRounds = 2000;
constexpr int kYieldRounds = 2000;
constexpr long kMaxSleepNs = 100 * 1000;
// Pure TCP waits sleep in poll() for at most this long between abort checks.
constexpr int kPollTimeoutMs = 50;
// How often a waiting rank asks shared-memory links whether their peer process still exists.
constexpr auto kLivenessInterval = std::chrono::milliseconds(10);


long sleep_ns_for(int iteration) {
  // 2, 4, 8, ... µs, doubling every 32 idle rounds, capped.
  int step = std::min(16, (iteration - kSpinRounds - kYieldRounds) / 32);
  return std::min(kMaxSleepNs, 2000L << step);
}

[[noreturn]] void throw_no_progress(std::vector<int> peers, int64_t bound_ns) {
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  throw PeerLostError("no data moved to or from " + describe_ranks(peers) + " for " +
                      format_seconds(bound_ns / 1e9) +
                      " s inside a collective (SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS): a peer "
                      "process is frozen or stuck, or its host is unreachable");
}

// The current run of idle rounds of wait_for_progress (restarted at its iteration 0).
thread_local NoProgressWatch t_idle;

void check_progress(const LinkWait* waits, int n, std::chrono::steady_clock::time_point now) {
  if (!t_idle.bounded()) return;
  std::vector<int> peers;
  for (int i = 0; i < n; ++i)
    if (waits[i].link) peers.push_back(waits[i].link->peer_rank());
  t_idle.check(peers, now);
}

void check_liveness(const LinkWait* waits, int n) {
  thread_local auto last = std::chrono::steady_clock::time_point{};
  auto now = std::chrono::steady_clock::now();
  if (now - last < kLivenessInterval) return;
  last = now;
  for (int i = 0; i < n; ++i) {
    Link* l = waits[i].link;
    if (l && l->is_shared_memory() && !l->peer_alive()) {
      // Closed: it failed (its own error names the cause, often a lost host) and let go.
      throw PeerLostError(describe_rank(l->peer_rank()) +
                          " left the collective (it failed or died)");
    }
  }
  check_progress(waits, n, now);
}

}  // namespace

void NoProgressWatch::restart() {
  bound_ns_ = g_no_progress_ns.load(std::memory_order_relaxed);
  if (bound_ns_ > 0) start_ = std::chrono::steady_clock::now();
}

void NoProgressWatch::check(const std::vector<int>& peer_ranks,
                            std::chrono::steady_clock::time_point now) const {
  if (bound_ns_ > 0 && now - start_ >= std::chrono::nanoseconds(bound_ns_))
    throw_no_progress(peer_ranks, bound_ns_);
}

void wait_for_progress(const LinkWait* waits, int nwaits, int iteration) {
  global_abort().check();
  if (iteration == 0) t_idle.restart();
  pollfd fds[16];
  std::vector<pollfd> many;
  pollfd* pfds = fds;
  if (nwaits > 16) {
    many.resize(nwaits);
    pfds = many.data();
  }
  int nfds = 0;
  bool any_shm = false;
  for (int i = 0; i < nwaits; ++i) {
    Link* l = waits[i].link;
    if (!l) continue;
    if (l->is_shared_memory() || l->fd() < 0) {
      any_shm = true;
      continue;
    }
    short events = (waits[i].send ? POLLOUT : 0) | (waits[i].recv ? POLLIN : 0);
    pfds[nfds++] = pollfd{l->fd(), events, 0};
  }

  if (!any_shm) {
    // POLLHUP/POLLERR also wake us; the caller's next try_send/try_recv then throws.
    if (nfds > 0 && ::poll(pfds, nfds, kPollTimeoutMs) < 0 && errno != EINTR) {
      throw PeerLostError(std::string("poll failed: ") + strerror(errno));
    }
    global_abort().check();
    if (t_idle.bounded()) check_progress(waits, nwaits, std::chrono::steady_clock::now());
    return;
  }

  // Reading the clock costs more than a spin round, so spinning ranks look only now and then.
  if (iteration >= kSpinRounds || (iteration & 255) == 255) check_liveness(waits, nwaits);
  if (iteration < kSpinRounds) {
    cpu_relax();
    return;
  }
  if (iteration < kSpinRounds + kYieldRounds) {
    sched_yield();
    return;
  }
  // Sleeping phase. The default 50 µs timer slack would turn every short sleep into a long one;
  // this thread only ever sleeps to wait for peers, so ask for precise wakeups (thread-local).
  thread_local bool slack_set = false;
  if (!slack_set) {
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    slack_set = true;
  }
  timespec ts{0, sleep_ns_for(iteration)};
  if (nfds > 0) {
    // Mixed TCP + shared memory: sleep in ppoll so TCP readiness ends the sleep early.
    ::ppoll(pfds, nfds, &ts, nullptr);
  } else {
    ::nanosleep(&ts, nullptr);
  }
  global_abort().check();
}

void wait_for_progress(Link* const* links, int nlinks, bool want_send, bool want_recv,
                       int iteration) {
  LinkWait waits[16];
  std::vector<LinkWait> many;
  LinkWait* w = waits;
  if (nlinks > 16) {
    many.resize(nlinks);
    w = many.data();
  }
  for (int i = 0; i < nlinks; ++i) w[i] = LinkWait{links[i], want_send, want_recv};
  wait_for_progress(w, nlinks, iteration);
}

void send_recv(Link* to, const void* sbuf, size_t sn, Link* from, void* rbuf, size_t rn) {
  const auto* sp = static_cast<const uint8_t*>(sbuf);
  auto* rp = static_cast<uint8_t*>(rbuf);
  if (!to) sn = 0;
  if (!from) rn = 0;
  size_t sent = 0, received = 0;
  int idle = 0;
  while (sent < sn || received < rn) {
    size_t moved = 0;
    if (sent < sn) {
      size_t k = to->try_send(sp + sent, sn - sent);
      sent += k;
      moved += k;
    }
    if (received < rn) {
      size_t k = from->try_recv(rp + received, rn - received);
      received += k;
      moved += k;
    }
    if (moved > 0) {
      idle = 0;
      continue;
    }
    // Wait only for the directions still pending, each on its own link.
    LinkWait waits[2];
    int n = 0;
    if (to == from) {
      waits[n++] = LinkWait{to, sent < sn, received < rn};
    } else {
      if (sent < sn) waits[n++] = LinkWait{to, true, false};
      if (received < rn) waits[n++] = LinkWait{from, false, true};
    }
    wait_for_progress(waits, n, idle++);
  }
}

}  // namespace shvd
