#include "engine.h"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <cstring>

#include "../common/logging.h"
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
  sets_.reset(options_.size);
  for (const auto& ranks : options_.static_process_sets) sets_.add(ranks);
  if (options_.rank == 0)
    coordinator_ = std::make_unique<Coordinator>(options_.size, &sets_, &cache_,
                                                 options_.coordinator);
  const int cpus = available_cpus();
  overlap_ = options_.overlap >= 0 ? options_.overlap != 0 : options_.local_size * 2 <= cpus;
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

void Engine::enqueue(std::vector<Entry>& entries, int64_t* ids) {
  std::lock_guard<std::mutex> lock(queue_mu_);
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
  for (size_t i = 0; i < entries.size(); ++i) {
    ids[i] = handles_.create(&entries[i].state);
    queue_.push_back(std::move(entries[i]));
  }
  last_enqueue_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  work_pending_.store(true);
  if (sleeping_.load()) {
    uint64_t one = 1;
    ssize_t ignored = write(wake_fd_, &one, sizeof one);
    (void)ignored;
  }
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
  entry.state->error_kind = error_kind;
  entry.state->error = error;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    in_flight_.erase(entry.request.name);
  }
  handles_.mark_done(entry.state);
}

void Engine::send_frame(Link* link, const std::string& payload) {
  uint32_t n = payload.size();
  std::string frame(reinterpret_cast<const char*>(&n), sizeof n);
  frame += payload;
  link->send(frame.data(), frame.size());
}

std::vector<std::string> Engine::read_frames(int peer) {
  // One non-blocking read per call instead of a poll plus two reads per message: the control
  // path is on every collective's critical path.
  Link* link = mesh_.control[peer].get();
  std::string& inbox = control_inbox_[peer];
  char buf[64 * 1024];
  std::exception_ptr closed;
  try {
    for (size_t n; (n = link->try_recv(buf, sizeof buf)) > 0;) inbox.append(buf, n);
  } catch (const PeerLostError&) {
    // The peer may have sent its last words (shutdown, the reason for an abort) just before
    // closing: deliver those frames first; the next read reports the closed link.
    closed = std::current_exception();
  }
  std::vector<std::string> frames;
  size_t pos = 0;
  while (inbox.size() - pos >= sizeof(uint32_t)) {
    uint32_t n;
    std::memcpy(&n, inbox.data() + pos, sizeof n);
    if (inbox.size() - pos - sizeof n < n) break;
    frames.emplace_back(inbox, pos + sizeof n, n);
    pos += sizeof n + n;
  }
  inbox.erase(0, pos);
  if (closed && frames.empty()) std::rethrow_exception(closed);
  return frames;
}

const Communicator& Engine::communicator(int process_set) {
  auto it = communicators_.find(process_set);
  if (it != communicators_.end()) return it->second;
  Communicator c;
  c.global_ranks = sets_.members(process_set);
  c.size = int(c.global_ranks.size());
  c.rank = sets_.index_of(process_set, options_.rank);
  bool all_shared_memory = c.size > 1;
  for (int g : c.global_ranks) {
    Link* link = g == options_.rank ? nullptr : mesh_.data[g].get();
    c.links.push_back(link);
    if (link && !link->is_shared_memory()) all_shared_memory = false;
  }
  // Every member builds this communicator while executing the same response, so the
  // collective set-up of the shared segment lines up across members.
  if (all_shared_memory && c.rank >= 0) {
    auto group = SharedMemoryGroup::create(c, options_.job_id, options_.shm_group);
    c.shm_group = group.get();
    shm_groups_[process_set] = std::move(group);
  }
  return communicators_.emplace(process_set, std::move(c)).first->second;
}

// ---------------------------------------------------------------------------------------------
// The loop: wait for local work or a control message, negotiate, execute.

void Engine::loop() {
  try {
    while (!finished_) {
      const bool burst_over = wait_for_work();
      if (timeline_.active()) timeline_.cycle();
      if (options_.rank == 0) run_coordinator(burst_over);
      else run_worker(burst_over);
    }
  } catch (const std::exception& e) {
    abort_job(e.what());
  }
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
  for (auto& link : mesh_.control)
    if (link) fds.push_back({link->fd(), POLLIN, 0});
  pollfd* control_fds = fds.data() + 1;
  const nfds_t ncontrol = fds.size() - 1;
  // Wake at least once a second: the coordinator's stall inspector runs on wake-ups.
  const auto deadline = Clock::now() + std::chrono::seconds(1);

  if (in_burst_) {
    // Sleep through the burst. The seq_cst pairs batching_/waiters() and
    // batching_/flush_requested_ make sure a user thread that starts waiting either sees
    // batching_ and wakes us, or is seen here.
    batching_.store(true);
    if (handles_.waiters() == 0 && !flush_requested_.load())
      sleep_until(fds, std::min(deadline, burst_until_));
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
    if (work_pending_.load()) break;
    if (ncontrol && poll(control_fds, ncontrol, 0) > 0) break;
    std::this_thread::yield();
  }
  if (!work_pending_.load() && !(ncontrol && poll(control_fds, ncontrol, 0) > 0)) {
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
  const auto wait = std::max<int64_t>(
      0, std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now()).count());
  timespec ts{time_t(wait / 1000000000), long(wait % 1000000000)};
  ppoll(fds.data(), fds.size(), &ts, nullptr);
}

void Engine::request_flush() {
  flush_requested_.store(true);
  if (!batching_.load()) return;
  uint64_t one = 1;
  ssize_t ignored = write(wake_fd_, &one, sizeof one);
  (void)ignored;
}

std::vector<Entry> Engine::take_queue() {
  std::lock_guard<std::mutex> lock(queue_mu_);
  std::vector<Entry> out;
  out.swap(queue_);
  if (!out.empty()) {
    last_activity_ = Clock::now();
    // Room for a burst like this one: a step's gradients then queue without reallocating.
    queue_.reserve(out.size());
  }
  return out;
}

// Moves new local entries into the table and turns them into requests (cached ids where the
// same request was answered before); sends them when the burst is over (see in_burst_).
void Engine::submit(std::vector<Entry> entries, bool burst_over) {
  RequestBatch& batch = unsent_;
  batch.rank = options_.rank;
  bool flush = burst_over;
  if (!entries.empty() && !in_burst_) {
    in_burst_ = true;
    // A poll from before this burst asked about an op already answered: it must not end the
    // new burst at once.
    flush_requested_.store(false);
    burst_started_ = last_activity_;
    // Deferring, nothing but a waiter (or the cap) ends the burst: sleep until the cap
    // instead of waking every cycle to look.
    burst_until_ = burst_started_ + (overlap_ ? 1 : kMaxDeferredCycles) * cycle_time();
    // Overlapping, the first op after a pause goes out at once: latency-bound loops and the
    // first gradient of a step do not wait for the window.
    flush = flush || overlap_;
  }
  for (Entry& e : entries) {
    const Request& req = e.request;
    if (timeline_.active()) timeline_.begin(req.name, "NEGOTIATE");
    const int64_t cached = cache_.lookup(req);
    if (cached >= 0)
      batch.cached.push_back(uint32_t(cached));
    else
      batch.requests.push_back(req);
    table_.emplace(req.name, std::move(e));
  }
  bool shutdown;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    shutdown = shutdown_requested_ && queue_.empty();
  }
  if (shutdown && !shutdown_sent_) {
    batch.shutdown = true;
    shutdown_sent_ = true;
    flush = true;
  }
  if (flush) flush_requests();
}

void Engine::flush_requests() {
  RequestBatch& batch = unsent_;
  if (batch.requests.empty() && batch.cached.empty() && !batch.shutdown) return;
  if (options_.rank == 0)
    coordinator_->add_batch(batch);
  else
    send_frame(mesh_.control[0].get(), encode(batch));
  batch = RequestBatch();
}

void Engine::run_coordinator(bool burst_over) {
  submit(take_queue(), burst_over);
  for (int r = 1; r < options_.size; ++r) {
    for (const std::string& frame : read_frames(r)) {
      RequestBatch b = decode_request_batch(frame);
      last_activity_ = Clock::now();
      if (timeline_.active())
        for (const auto& q : b.requests) timeline_.instant(q.name, "rank " + std::to_string(b.rank) + " ready");
      coordinator_->add_batch(b);
    }
  }
  const auto now = Clock::now();
  std::string stall = coordinator_->inspect_stalls(now, [](const std::string& msg) {
    log_message(LogLevel::kWarning, "%s", msg.c_str());
  });
  if (!stall.empty()) throw PeerLostError(stall);

  ResponseBatch batch;
  batch.responses = coordinator_->take_ready();
  if (timeline_.active()) {
    // Negotiated: from here until its collective starts, a tensor waits behind earlier ones.
    for (const Response& resp : batch.responses)
      for (const auto& name : resp.names)
        if (table_.count(name)) {
          timeline_.end(name, "NEGOTIATE");
          timeline_.begin(name, "QUEUE");
        }
  }
  batch.shutdown = coordinator_->all_shut_down();
  if (batch.responses.empty() && !batch.shutdown) return;
  const std::string frame = encode(batch);
  for (int r = 1; r < options_.size; ++r) send_frame(mesh_.control[r].get(), frame);
  for (const Response& resp : batch.responses) execute(resp);
  if (batch.shutdown) finished_ = true;
}

void Engine::run_worker(bool burst_over) {
  submit(take_queue(), burst_over);
  for (const std::string& frame : read_frames(0)) {
    ResponseBatch batch = decode_response_batch(frame);
    if (!batch.abort.empty()) throw PeerLostError(batch.abort);
    for (const Response& resp : batch.responses) execute(resp);
    if (batch.shutdown) {
      finished_ = true;
      break;
    }
  }
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
  for (auto& kv : table_) complete(kv.second, SHVD_ERR_INTERNAL, "spark_hvd job aborted: " + why);
  for (auto& e : queued) complete(e, SHVD_ERR_INTERNAL, "spark_hvd job aborted: " + why);
  handles_.wake_waiters();
  table_.clear();
  // Closing our links makes peers blocked on us fail fast too.
  mesh_.data.clear();
  mesh_.control.clear();
  communicators_.clear();
  shm_groups_.clear();
  finished_ = true;
}

// ---------------------------------------------------------------------------------------------

void Engine::execute(const Response& resp) {
  last_activity_ = Clock::now();
  execute_response(resp);
  handles_.wake_waiters();
}

void Engine::execute_response(const Response& resp) {
  // Process-set bookkeeping happens on every rank, members or not, so ids stay in step.
  if (resp.op == OpType::kAddProcessSet || resp.op == OpType::kRemoveProcessSet) {
    int id = -1;
    if (resp.error.empty()) {
      if (resp.op == OpType::kAddProcessSet) {
        std::vector<int> ranks(resp.splits_matrix.begin(), resp.splits_matrix.end());
        id = sets_.add(ranks);
      } else {
        sets_.remove(resp.root);
        communicators_.erase(resp.root);
        shm_groups_.erase(resp.root);
        id = resp.root;
      }
    }
    auto it = table_.find(resp.names[0]);
    if (it != table_.end()) {
      it->second.state->ints = {id};
      complete(it->second, resp.error.empty() ? 0 : SHVD_ERR_INVALID, resp.error);
      table_.erase(it);
    }
    return;
  }
  if (resp.op == OpType::kJoin) {
    auto it = table_.find("__join__");
    if (it != table_.end()) {
      it->second.state->ints = {resp.last_joined};
      complete(it->second);
      table_.erase(it);
    }
    return;
  }
  const int my_index = sets_.index_of(resp.process_set, options_.rank);
  std::vector<Entry*> entries;
  for (const auto& name : resp.names) {
    auto it = table_.find(name);
    entries.push_back(it == table_.end() ? nullptr : &it->second);
    if (it != table_.end() && timeline_.active()) timeline_.end(name, "QUEUE");
  }
  // Keep the response cache in step with the coordinator's.
  for (size_t i = 0; i < resp.names.size() && i < resp.cache_ids.size(); ++i)
    if (entries[i]) cache_.remember(resp.names[i], resp.cache_ids[i], entries[i]->request);

  if (!resp.error.empty()) {
    for (Entry* e : entries)
      if (e) complete(*e, resp.error_is_mismatch ? SHVD_ERR_INVALID : SHVD_ERR_INTERNAL, resp.error);
  } else if (my_index >= 0) {
    const Communicator& comm = communicator(resp.process_set);
    switch (resp.op) {
      case OpType::kAllreduce: run_allreduce(resp, entries, comm); break;
      case OpType::kAllgather: run_allgather(resp, *entries[0], comm); break;
      case OpType::kBroadcast: run_broadcast(resp, *entries[0], comm); break;
      case OpType::kAlltoall: run_alltoall(resp, *entries[0], comm); break;
      case OpType::kReducescatter: run_reducescatter(resp, *entries[0], comm); break;
      case OpType::kBarrier: break;
      default: break;
    }
    for (Entry* e : entries)
      if (e) complete(*e);
  }
  for (const auto& name : resp.names) table_.erase(name);
}

}  // namespace shvd
