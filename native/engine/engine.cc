#include "engine.h"

#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>

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
  tuned_.fusion_threshold_bytes = options_.coordinator.fusion_threshold_bytes;
  tuned_.cycle_time_ms = options_.cycle_time_ms;
  tuned_.cache_enabled = cache_.enabled();
  tuned_.hierarchical_allreduce = options_.hierarchical_allreduce;
  tuned_.hierarchical_allgather = options_.hierarchical_allgather;
  if (options_.rank == 0 && options_.autotune.enabled) {
    AutotuneOptions tune = options_.autotune;
    if (!cache_.enabled()) tune.fixed |= kFixCache;  // no cache to switch on
    tune.spans_hosts = options_.cross_size > 1;
    autotuner_ = std::make_unique<Autotuner>(tune, tuned_);
    // Nothing to tune after all: the other ranks learn so with the first batch.
    params_due_ = !autotuner_->active();
  }
  // Every rank starts as "tuning" when autotuning was asked for, as rank 0 tells them.
  tuned_.tuning = options_.autotune.enabled;
  executed_params_ = tuned_;
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

void Engine::enqueue(std::vector<Entry>& entries, int64_t* ids, bool awaited) {
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
  awaited_queued_ = awaited_queued_ || awaited;
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
  if (entry.gpu.ready) gpu::forget_ready(entry.gpu);  // an op that never reached the GPU path
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
  if (c.rank >= 0 && options_.host_ids.size() == size_t(options_.size)) {
    std::vector<std::string> member_hosts;
    for (int g : c.global_ranks) member_hosts.push_back(options_.host_ids[g]);
    auto hierarchy = Hierarchy::build(c, member_hosts);
    c.hierarchy = hierarchy.get();
    if (hierarchy) hierarchies_[process_set] = std::move(hierarchy);
  }
  return communicators_.emplace(process_set, std::move(c)).first->second;
}

// ---------------------------------------------------------------------------------------------
// The loop: wait for local work or a control message, negotiate, execute.

void Engine::loop() {
  try {
    set_up_board();
    while (!finished_) {
      const bool burst_over = wait_for_work();
      if (timeline_.active()) timeline_.cycle();
      if (options_.rank == 0) run_coordinator(burst_over);
      else run_worker(burst_over);
    }
  } catch (const std::exception& e) {
    abort_job(e.what());
  }
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
  // Wake at least once a second: the coordinator's stall inspector runs on wake-ups.
  const auto deadline = Clock::now() + std::chrono::seconds(1);

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
    if (work_pending_.load() || board_has_work()) break;
    if (ncontrol && poll(control_fds, ncontrol, 0) > 0) break;
    std::this_thread::yield();
  }
  if (!work_pending_.load() && !board_has_work() &&
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
  if (board_) {
    // Raise the flag, then look: an append either saw the flag (and wakes us through the
    // socket) or happened before the look.
    board_->set_sleeping(true);
    if (board_has_work()) {
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

// Takes the queue, moves its entries into the table and turns them into requests (cached ids
// where the same request was answered before); sends them when the burst is over (see
// in_burst_).
void Engine::submit_queued(bool burst_over) {
  bool awaited = false;
  std::vector<Entry> entries = take_queue(&awaited);
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
  if (awaited) {
    // What the caller's wait would do a moment later (see wait_for_work): end the burst and
    // send its requests now.
    in_burst_ = false;
    flush = true;
  }
  for (Entry& e : entries) {
    const Request& req = e.request;
    if (timeline_.active()) timeline_.begin(req.name, "NEGOTIATE");
    // Autotuning may switch the cache off: the requests then go out in full.
    const int64_t cached = tuned_.cache_enabled ? cache_.lookup(req) : -1;
    const ResponseCache::Answer* answer = cached >= 0 ? cache_.answer(uint32_t(cached)) : nullptr;
    // On the board, the id stands for its cached response, which must be for this process set
    // (a name can have been answered last on another one).
    if (cached >= 0 && !(board_ && answer && answer->response.process_set != req.process_set))
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
  if (board_ && !batch.cached.empty()) {
    size_t refused = 0;  // those go to the coordinator
    std::vector<uint64_t> completed;
    for (uint32_t id : batch.cached)
      if (!arrive_on_board(id, &completed)) batch.cached[refused++] = id;
    batch.cached.resize(refused);
    board_->append(completed.data(), completed.size());
  }
  if (batch.requests.empty() && batch.cached.empty() && !batch.shutdown) return;
  if (options_.rank == 0)
    coordinator_->add_batch(batch);
  else
    send_frame(mesh_.control[0].get(), encode(batch));
  batch = RequestBatch();
}

void Engine::run_coordinator(bool burst_over) {
  submit_queued(burst_over);
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
  if (!batch.responses.empty() || batch.shutdown) send_batch(std::move(batch));
  read_board();
  // A sample ended while executing: the new setting goes out at once, on its own (waiting for
  // the next responses would measure the next sample's first ops with the old one).
  if (params_due_ && !finished_) {
    send_batch(ResponseBatch());
    read_board();
  }
}

void Engine::send_batch(ResponseBatch batch) {
  if (params_due_) {
    batch.has_params = true;
    batch.params = autotuner_->proposal();
    params_due_ = false;
  }
  const std::string frame = encode(batch);
  // With a board, every rank executes the batch where its marker stands in the log.
  if (board_) board_->append(NegotiationBoard::kMarker | (batches_sent_++ & NegotiationBoard::kValueMask));
  for (int r = 1; r < options_.size; ++r) send_frame(mesh_.control[r].get(), frame);
  if (board_) tcp_batches_.push_back(std::move(batch));
  else run_batch(batch);
}

void Engine::run_batch(const ResponseBatch& batch) {
  if (batch.has_params) apply_params(batch.params);
  for (const Response& resp : batch.responses) execute(resp);
  if (batch.shutdown) finished_ = true;
}

void Engine::apply_params(const TunedParams& params) {
  tuned_ = params;
  ++tuned_generation_;
  board_fusion_bytes_ = params.fusion_threshold_bytes;
  if (coordinator_) coordinator_->set_fusion_threshold(params.fusion_threshold_bytes);
  if (autotuner_) autotuner_->started(Clock::now());
}

void Engine::note_collective(const Response& resp) {
  if (executed_generation_ != tuned_generation_) {
    std::lock_guard<std::mutex> lock(executed_mu_);
    executed_params_ = tuned_;
    executed_generation_ = tuned_generation_;
  }
  // Rank 0 measures only while tuning: once the best setting is kept, nothing to count.
  if (!autotuner_ || !autotuner_->active()) return;
  size_t bytes = 0;
  for (const auto& shape : resp.shapes) {
    size_t n = dtype_size(resp.dtype);
    for (int64_t d : shape) n *= size_t(d);
    bytes += n;
  }
  if (autotuner_->record(resp.names, bytes, Clock::now())) params_due_ = true;
}

TunedParams Engine::executed_params(uint64_t* generation) const {
  std::lock_guard<std::mutex> lock(executed_mu_);
  *generation = executed_generation_;
  return executed_params_;
}

void Engine::run_worker(bool burst_over) {
  submit_queued(burst_over);
  for (const std::string& frame : read_frames(0)) {
    ResponseBatch batch = decode_response_batch(frame);
    if (!batch.abort.empty()) throw PeerLostError(batch.abort);
    if (board_) {
      tcp_batches_.push_back(std::move(batch));
      continue;
    }
    run_batch(batch);
    if (finished_) break;
  }
  read_board();
}

// ---------------------------------------------------------------------------------------------
// Shared-memory negotiation

std::string Engine::receive_frame(int peer) {
  const auto give_up = Clock::now() + std::chrono::seconds(60);
  Link* link = mesh_.control[peer].get();
  for (;;) {
    std::vector<std::string> frames = read_frames(peer);
    if (!frames.empty()) {
      // Frames that came with it (rank 0's first response batch can follow its last set-up
      // message at once) go back to the inbox, in order, for the loop to read.
      std::string rest;
      for (size_t i = 1; i < frames.size(); ++i) {
        const uint32_t n = uint32_t(frames[i].size());
        rest.append(reinterpret_cast<const char*>(&n), sizeof n);
        rest += frames[i];
      }
      control_inbox_[peer].insert(0, rest);
      return frames.front();
    }
    if (Clock::now() > give_up)
      throw PeerLostError("rank " + std::to_string(peer) +
                          " did not answer while setting up the shared-memory negotiation");
    pollfd fd{link->fd(), POLLIN, 0};
    if (fd.fd >= 0) poll(&fd, 1, 100);
    else std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void Engine::set_up_board() {
  // Every rank computes the same answer here (all ranks on one host or not); rank 0 then
  // decides whether there is a board, and tells the others.
  if (options_.size < 2 || options_.local_size != options_.size) return;
  if (options_.rank == 0) {
    if (options_.shm_negotiation && shared_memory_ && cache_.enabled() &&
        options_.size <= NegotiationBoard::kMaxRanks) {
      try {
        board_ = NegotiationBoard::create(options_.job_id, options_.size,
                                          uint32_t(options_.coordinator.cache_capacity));
      } catch (const std::exception& e) {
        log_message(LogLevel::kDebug, "shared-memory negotiation unavailable: %s", e.what());
      }
    }
    const std::string offer =
        board_ ? board_->name() + " " + std::to_string(board_->ids()) + " " +
                     std::to_string(options_.coordinator.fusion_threshold_bytes)
               : "";
    for (int r = 1; r < options_.size; ++r) send_frame(mesh_.control[r].get(), offer);
    if (!board_) return;
    bool everyone = true;
    for (int r = 1; r < options_.size; ++r) everyone = receive_frame(r) == "ok" && everyone;
    for (int r = 1; r < options_.size; ++r) send_frame(mesh_.control[r].get(), everyone ? "on" : "off");
    board_->unlink();  // everyone who will map it has
    if (!everyone) {
      board_.reset();
      return;
    }
    board_fusion_bytes_ = options_.coordinator.fusion_threshold_bytes;
    coordinator_->set_board(board_.get());
    log_message(LogLevel::kDebug, "cached allreduces are negotiated through shared memory (%s)",
                board_->name().c_str());
    return;
  }
  const std::string offer = receive_frame(0);
  if (offer.empty()) return;
  char name[256];
  unsigned long ids = 0, fusion = 0;
  std::string reply = "no";
  if (std::sscanf(offer.c_str(), "%255s %lu %lu", name, &ids, &fusion) == 3) {
    try {
      board_ = NegotiationBoard::open(name, options_.rank, options_.size, uint32_t(ids));
      reply = "ok";
    } catch (const std::exception& e) {
      log_message(LogLevel::kDebug, "shared-memory negotiation unavailable: %s", e.what());
    }
  }
  send_frame(mesh_.control[0].get(), reply);
  if (receive_frame(0) != "on") board_.reset();
  board_fusion_bytes_ = fusion;
}

bool Engine::arrive_on_board(uint32_t id, std::vector<uint64_t>* completed) {
  const ResponseCache::Answer* answer = cache_.answer(id);
  if (!answer || id >= board_->ids() || !(answer->members >> options_.rank & 1)) return false;
  switch (board_->arrive(id, options_.rank, answer->members)) {
    case NegotiationBoard::Arrival::kRefused: return false;
    case NegotiationBoard::Arrival::kWaiting: return true;
    case NegotiationBoard::Arrival::kCompleted: break;
  }
  completed->push_back(id);
  return true;
}

bool Engine::board_has_work() const {
  if (!board_ || board_->tail() == board_read_) return false;
  // A marker whose batch has not arrived yet waits for the control link, not for the board.
  return !(board_->entry(board_read_) & NegotiationBoard::kMarker) || !tcp_batches_.empty();
}

void Engine::read_board() {
  if (!board_ || board_->tail() == board_read_) return;
  const uint64_t end = board_->seal();
  while (board_read_ < end && !finished_) {
    const uint64_t entry = board_->entry(board_read_);
    if (entry & NegotiationBoard::kMarker) {
      if (tcp_batches_.empty()) break;  // still on its way
      ResponseBatch batch = std::move(tcp_batches_.front());
      tcp_batches_.pop_front();
      ++board_read_;
      run_batch(batch);
      continue;
    }
    const ResponseCache::Answer* answer = cache_.answer(uint32_t(entry));
    if (!answer)
      throw std::logic_error("negotiation board: no cached response for id " +
                             std::to_string(entry));
    Response fused = answer->response;
    size_t bytes = answer->bytes;
    ++board_read_;
    // The entries appended while this one was unsealed, as far as they fit into one collective
    // (every rank holds the same answers, so every rank splits the same way).
    while (board_read_ < end && board_->fuses(board_read_)) {
      const ResponseCache::Answer* next = cache_.answer(uint32_t(board_->entry(board_read_)));
      if (!next || !fusable_allreduces(fused, next->response) ||
          bytes + next->bytes > board_fusion_bytes_)
        break;
      fused.names.push_back(next->response.names[0]);
      fused.shapes.push_back(next->response.shapes[0]);
      fused.cache_ids.push_back(next->response.cache_ids[0]);
      bytes += next->bytes;
      ++board_read_;
    }
    if (timeline_.active())
      for (const auto& name : fused.names)
        if (table_.count(name)) {
          timeline_.end(name, "NEGOTIATE");
          timeline_.begin(name, "QUEUE");
        }
    execute(fused, true);
  }
  board_->consumed(board_read_);
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

// ---------------------------------------------------------------------------------------------

void Engine::execute(const Response& resp, bool from_board) {
  last_activity_ = Clock::now();
  if (!from_board) cache_.remember_answers(resp, sets_);
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
        hierarchies_.erase(resp.root);
        if (gpu_) gpu_->forget_set(resp.root);
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
    note_collective(resp);
    const Communicator& comm = communicator(resp.process_set);
    if (resp.on_gpu) {
      if (!gpu_)
        gpu_ = std::make_unique<gpu::GpuPath>(*this, options_.rank, options_.job_id,
                                              options_.shared_gpu);
      gpu_->execute(resp, entries, comm, resp.process_set, timeline_);  // completes them
    } else {
      run_on_host(resp, entries, comm);
      for (Entry* e : entries)
        if (e) complete(*e);
    }
  }
  for (const auto& name : resp.names) table_.erase(name);
}

}  // namespace shvd
