// The engine thread's life: construction, the queue that user threads fill, the loop (wait for
// work, bursts, sleep and wake-up), shutdown and abort. Negotiation is in negotiation.cc, the
// shared-memory negotiation board in board.cc, running a response in execute.cc.
#include "engine.h"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <exception>

#include "../include/spark_hvd.h"

namespace shvd {

namespace {
// CPUs this process may run on (its affinity mask, which container CPU sets also narrow).
int available_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return CPU_COUNT(&set);
}
}  // namespace


Engine::Engine(EngineOptions options, Mesh mesh, bool shared_memory)
    : options_(std::move(options)),
      mesh_(std::move(mesh)),
      shared_memory_(shared_memory),
      cache_(options_.coordinator.cache_capacity, options_.size) {
  tuned_.fusion_threshold_bytes = options_.coordinator.fusion_threshold_bytes;
  tuned_.cycle_time_ms = options_.cycle_time_ms;
  cycle_time_ms_ = options_.cycle_time_ms;
  tuned_.cache_enabled = cache_.enabled();
  tuned_.hierarchical_allreduce = options_.hierarchical_allreduce;
  tuned_.hierarchical_allgather = options_.hierarchical_allgather;
  if (options_.rank == 0 && options_.autotune.enabled) {
    AutotuneOptions tune = options_.autotune;
    if (!cache_.enabled()) tune.fixed |= kFixCache;  // no cache to switch on
    const Hierarchy::Use use = Hierarchy::usable(options_.host_ids);
    tune.hierarchical_allreduce_usable = use.allreduce;
    tune.hierarchical_allgather_usable = use.allgather;
    autotuner_ = std::make_unique<Autotuner>(tune, tuned_);
  }
  // Rank 0's settings are every rank's: its first batch carries them (the hierarchical
  // switches must agree, or ranks would run different algorithms on one collective).
  params_due_ = options_.rank == 0 && options_.size > 1;
  // Every rank starts as "tuning" when autotuning was asked for, as rank 0 tells them.
  tuned_.tuning = options_.autotune.enabled;
  executed_params_ = tuned_;
  sets_.reset(options_.size);
  for (const auto& ranks : options_.static_process_sets) sets_.add(ranks);
  if (options_.rank == 0)
    coordinator_ = std::make_unique<Coordinator>(options_.size, &sets_, &cache_,
                                                 options_.coordinator);
  const int cpus = available_cpus();
  // A job across hosts overlaps even without spare cores: its collectives wait on the wire
  // between hosts, which backward does not use (deferring left every byte of a step to cross
  // after backward: on the multi-host bed the mlp's step lost 20-30 ms of wire time).
  overlap_ = options_.overlap >= 0 ? options_.overlap != 0
                                   : options_.local_size * 2 <= cpus || options_.cross_size > 1;
  // With more local ranks than CPUs a spinning engine would take a core a peer computes on.
  waiter_spin_ = options_.local_size <= cpus ? kWaiterSpin : Clock::duration::zero();
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  control_inbox_.resize(options_.size);
  global_abort().reset();
  handles_.set_wait_hook([this] { request_flush(); });
  thread_ = std::thread([this] {
    // Short sleeps must be short: the default 50 us timer slack would stretch them.
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    prctl(PR_SET_NAME, "shvd-engine", 0, 0, 0);  // visible in top -H, perf, gdb
    loop();
  });
}

Engine::~Engine() {
  shutdown();
  if (wake_fd_ >= 0) close(wake_fd_);
}

void Engine::enqueue(std::vector<Entry>& entries, int64_t* ids, bool awaited) {
  std::unique_lock<std::mutex> lock(queue_mu_);
  if (!abort_reason_.empty())
    throw PeerLostError("spark_hvd job was aborted: " + abort_reason_);
  if (stopped_ || shutdown_requested_)
    throw std::logic_error("spark_hvd has been shut down; call init() again first");
  // Marking a name in flight also finds a duplicate within `entries`; on one, the names marked
  // by this call are unmarked again, so nothing is queued (all or none).
  for (size_t i = 0; i < entries.size(); ++i) {
    const std::string& n = entries[i].request.name;
    if (in_flight_.insert(n).second) continue;
    for (size_t j = 0; j < i; ++j) in_flight_.erase(entries[j].request.name);
    throw OpMismatchError("A collective named '" + n +
                          "' is already in flight on this rank; names must be unique until "
                          "the previous op with that name completes");
  }
  for (size_t i = 0; i < entries.size(); ++i) ids[i] = handles_.create(&entries[i].state);
  if (awaited && entries.size() == 1 && board_ready_.load(std::memory_order_acquire)) {
    // A synchronous op: run it on this thread when the board can agree on it (fast_path.cc).
    lock.unlock();
    if (run_here(entries[0])) return;
    lock.lock();
    if (stopped_ || !abort_reason_.empty()) {
      // The engine ended meanwhile: nobody will take the queue any more.
      const std::string why =
          abort_reason_.empty() ? "spark_hvd was shut down before this collective completed"
                                : "spark_hvd job was aborted: " + abort_reason_;
      lock.unlock();
      complete(entries[0], SHVD_ERR_INTERNAL, why);
      handles_.wake_waiters();
      return;
    }
  }
  for (size_t i = 0; i < entries.size(); ++i) queue_.push_back(std::move(entries[i]));
  awaited_queued_ = awaited_queued_ || awaited;
  last_enqueue_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  work_pending_.store(true);
  if (sleeping_.load()) {
    uint64_t one = 1;
    ssize_t ignored = write(wake_fd_, &one, sizeof one);
    (void)ignored;
  }
}

void Engine::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    if (stopped_ || !abort_reason_.empty() || !abort_requested_.empty()) return;
    abort_requested_ = why.empty() ? std::string("aborted") : why;
  }
  // A collective in progress stops at its next wait (every link wait checks the flag); an idle
  // engine wakes up and ends the job (loop()).
  global_abort().raise(why);
  uint64_t one = 1;
  ssize_t ignored = write(wake_fd_, &one, sizeof one);
  (void)ignored;
}

void Engine::post_notice(int64_t id) {
  for (int64_t seen = posted_notice_.load(); id > seen;)
    if (posted_notice_.compare_exchange_weak(seen, id)) break;
  work_pending_.store(true);
  uint64_t one = 1;
  ssize_t ignored = write(wake_fd_, &one, sizeof one);
  (void)ignored;
}

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    shutdown_requested_ = true;
  }
  uint64_t one = 1;
  ssize_t ignored = write(wake_fd_, &one, sizeof one);
  (void)ignored;
  if (thread_.joinable()) thread_.join();
  timeline_.stop();
}

void Engine::complete(Entry& entry, int error_kind, const std::string& error) {
  if (entry.gpu.ready) gpu::forget_ready(entry.gpu);  // an op that never reached the GPU path
  entry.state->notice = notice_.load(std::memory_order_relaxed);
  entry.state->error_kind = error_kind;
  entry.state->error = error;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    in_flight_.erase(entry.request.name);
  }
  handles_.mark_done(entry.state);
}

// ---------------------------------------------------------------------------------------------
// The loop: wait for local work or a control message, negotiate, execute.

void Engine::loop() {
  try {
    {
      std::lock_guard<std::mutex> executor(executor_mu_);
      set_up_board();
      board_ready_.store(board_ != nullptr, std::memory_order_release);
    }
    while (!finished_) {
      const bool burst_over = wait_for_work();
      {
        std::lock_guard<std::mutex> lock(queue_mu_);
        if (!abort_requested_.empty()) throw PeerLostError(abort_requested_);
      }
      std::lock_guard<std::mutex> executor(executor_mu_);
      if (timeline_.active()) timeline_.cycle();
      if (options_.rank == 0) run_coordinator(burst_over);
      else run_worker(burst_over);
      report_blocked();
    }
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> executor(executor_mu_);
    abort_job(e.what());
  }
  std::lock_guard<std::mutex> executor(executor_mu_);  // a user thread may still run its op
  gpu_.reset();  // waits for the GPU work in flight (failed at once after an abort)
  // Ops still pending at a coordinated shutdown can never complete.
  std::vector<Entry> queued;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stopped_ = true;
    queued.swap(queue_);
  }
  const std::string why = "spark_hvd was shut down before this collective completed";
  for (auto& kv : table_) complete(kv.second, SHVD_ERR_INTERNAL, why);
  for (auto& e : queued) complete(e, SHVD_ERR_INTERNAL, why);
  table_.clear();
  handles_.wake_waiters();
}

bool Engine::wait_for_work() {
  std::vector<pollfd> fds;
  fds.push_back({wake_fd_, POLLIN, 0});
  fds.push_back({board_ ? board_->wake_fd() : -1, POLLIN, 0});  // poll skips a negative fd
  for (auto& link : mesh_.control)
    if (link) fds.push_back({link->fd(), POLLIN, 0});
  pollfd* control_fds = fds.data() + 2;
  const nfds_t ncontrol = fds.size() - 2;
  // Wake at least once a second, and rank 0 once per stall inspection: the coordinator's
  // stall inspector runs on wake-ups (a tensor stalled on the board is noticed at the first
  // one, and reported a warning time later).
  const bool inspecting = options_.rank == 0 && options_.coordinator.stall_warning_seconds > 0;
  const auto deadline = Clock::now() + (inspecting ? Clock::duration(StallInspector::kInterval)
                                                   : Clock::duration(std::chrono::seconds(1)));

  if (in_burst_) {
    // Sleep through the burst. The seq_cst pairs batching_/waiters() and
    // batching_/flush_requested_ make sure a user thread that starts waiting either sees
    // batching_ and wakes us, or is seen here.
    batching_.store(true);
    const auto awaited_now = [this] { return handles_.waiters() > 0 || flush_requested_.load(); };
    // A synchronous op's wait follows its enqueue within microseconds: look for it briefly
    // before paying for a sleep and a wake-up (not with more local ranks than CPUs).
    for (const auto until = Clock::now() + std::min<Clock::duration>(waiter_spin_, kBurstSpin);
         !awaited_now() && Clock::now() < until;)
      std::this_thread::yield();
    if (!awaited_now()) sleep_until(fds, std::min(deadline, burst_until_));
    batching_.store(false);
    drain_wake_fd(fds[0]);
    bool shutdown;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      shutdown = shutdown_requested_;
    }
    const bool awaited = flush_requested_.exchange(false) || handles_.waiters() > 0;
    const auto now = Clock::now();
    if (!awaited && !shutdown) {
      // A peer's message alone (a response to execute) does not end the burst: flushing on
      // it would answer each response with a small batch, and fusion would fragment.
      if (now < burst_until_) return false;
      // The window ended. Keep collecting while the user still submits without a pause (or,
      // deferring, until somebody waits), up to a cap, so a step's gradients go out as one
      // batch instead of one per cycle. The cap only bounds how long an op nobody waits for
      // can sit here; deferring, a backward pass's gradients should all wait for step().
      const auto last_enqueue = Clock::time_point(Clock::duration(last_enqueue_.load()));
      const bool submitting = now - last_enqueue < kSubmissionPause;
      const int max_cycles = overlap_ ? kMaxBurstCycles : kMaxDeferredCycles;
      if ((submitting || !overlap_) && now - burst_started_ < max_cycles * cycle_time()) {
        burst_until_ = now + cycle_time();
        return false;
      }
    }
    in_burst_ = false;
    work_pending_.store(false);
    last_activity_ = now;  // the burst's requests go out now: its responses are due soon
    return true;
  }

  // Spin while recently active: a sleep/wake pair costs more than a small collective. While a
  // user thread waits for a result, its response is due as soon as the peers catch up: spin
  // longer then (the waiting thread is blocked, so its core is otherwise idle).
  const Clock::duration spin = std::chrono::microseconds(int64_t(options_.spin_microseconds));
  const Clock::duration window = handles_.waiters() > 0 ? std::max(spin, waiter_spin_) : spin;
  const auto spin_until = last_activity_ + window;
  while (Clock::now() < std::min(spin_until, deadline)) {
    // A user thread runs its op (run_here): a spinning engine would only take its core.
    if (running_here_.load()) break;
    if (work_pending_.load() || board_needs_engine()) break;
    if (ncontrol && poll(control_fds, ncontrol, 0) > 0) break;
    std::this_thread::yield();
  }
  if (!work_pending_.load() && !board_needs_engine() &&
      !(ncontrol && poll(control_fds, ncontrol, 0) > 0)) {
    sleeping_.store(true);
    // Re-check after announcing sleep: an enqueue that missed the flag already set
    // work_pending_, one that saw it writes the eventfd.
    if (!work_pending_.load()) sleep_until(fds, deadline);
    sleeping_.store(false);
  }
  drain_wake_fd(fds[0]);
  work_pending_.store(false);
  return false;
}

void Engine::drain_wake_fd(const pollfd& fd) {
  if (fd.revents & POLLIN) {
    uint64_t v;
    ssize_t ignored = read(wake_fd_, &v, sizeof v);
    (void)ignored;
  }
}

void Engine::sleep_until(std::vector<pollfd>& fds, Clock::time_point deadline) {
  // While a user thread reads the log (run_here) the flag stays down; it raises it when it
  // leaves (sleeping_ was set before this, and it reads sleeping_ after leaving).
  if (board_ && running_here_.load() == 0) {
    // Raise the flag, then look: an append either saw the flag (and wakes us through the
    // socket) or happened before the look.
    board_->set_sleeping(true);
    if (board_needs_engine()) {
      board_->set_sleeping(false);
      return;
    }
  }
  const auto wait = std::max<int64_t>(
      0, std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now()).count());
  timespec ts{time_t(wait / 1000000000), long(wait % 1000000000)};
  ppoll(fds.data(), fds.size(), &ts, nullptr);
  if (board_) {
    board_->set_sleeping(false);
    if (fds[1].revents & POLLIN) board_->drain_wake_fd();
  }
}

void Engine::request_flush() {
  flush_requested_.store(true);
  if (!batching_.load()) return;
  uint64_t one = 1;
  ssize_t ignored = write(wake_fd_, &one, sizeof one);
  (void)ignored;
}

std::vector<Entry> Engine::take_queue(bool* awaited) {
  std::lock_guard<std::mutex> lock(queue_mu_);
  std::vector<Entry> out;
  out.swap(queue_);
  *awaited = awaited_queued_;
  awaited_queued_ = false;
  if (!out.empty()) {
    last_activity_ = Clock::now();
    // Room for a burst like this one: a step's gradients then queue without reallocating.
    queue_.reserve(out.size());
  }
  return out;
}

void Engine::abort_job(const std::string& why) {
  global_abort().raise(why);
  // Best effort: tell the workers why before the connections close, so their errors name the
  // real cause rather than "lost connection to rank 0".
  if (options_.rank == 0) {
    ResponseBatch b;
    b.abort = why;
    std::string payload = encode(b);
    uint32_t n = payload.size();
    std::string frame(reinterpret_cast<const char*>(&n), sizeof n);
    frame += payload;
    for (int r = 1; r < options_.size; ++r) {
      try {
        if (mesh_.control[r]) mesh_.control[r]->try_send(frame.data(), frame.size());
      } catch (...) {
      }
    }
  }
  std::vector<Entry> queued;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    abort_reason_ = why;
    queued.swap(queue_);
  }
  if (gpu_) gpu_->abort("spark_hvd job aborted: " + why);
  for (auto& kv : table_) complete(kv.second, SHVD_ERR_INTERNAL, "spark_hvd job aborted: " + why);
  for (auto& e : queued) complete(e, SHVD_ERR_INTERNAL, "spark_hvd job aborted: " + why);
  handles_.wake_waiters();
  table_.clear();
  // Closing our links makes peers blocked on us fail fast too.
  mesh_.data.clear();
  mesh_.control.clear();
  communicators_.clear();
  shm_groups_.clear();
  hierarchies_.clear();
  finished_ = true;
}

}  // namespace shvd
