// Negotiation over TCP: every rank sends its requests (or cached ids) to rank 0's coordinator in
// length-prefixed frames on its control link; rank 0 answers with response batches that every
// rank executes in the same order. With a negotiation board (board.cc) the batches are executed
// where their markers stand in the shared log instead of on arrival.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>

#include "../common/logging.h"
#include "engine.h"

namespace shvd {

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

// Takes the queue, moves its entries into the table and turns them into requests (cached ids
// where the same request was answered before); sends them when the burst is over (see
// in_burst_).
void Engine::submit_queued(bool burst_over) {
  bool awaited = false;
  std::vector<Entry> entries = take_queue(&awaited);
  if (!entries.empty()) {
    moved_at_ = Clock::now();
    // Before these ops can complete anything (on the board, unseen by the coordinator).
    if (blocked_reported_) send_blocked_state(RequestBatch::Blocked::kMoving);
  }
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
    if (timeline_.active()) timeline_.begin(req.op, req.name, Timeline::negotiate_phase(req.op));
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
  progress();
}

void Engine::run_worker(bool burst_over) {
  submit_queued(burst_over);
  progress();
}

void Engine::progress() {
  if (options_.rank != 0) {
    for (const std::string& frame : read_frames(0)) {
      ResponseBatch batch = decode_response_batch(frame);
      if (!batch.abort.empty()) throw PeerLostError(batch.abort);
      if (board_) {
        tcp_batches_.push_back(std::move(batch));
        tcp_batches_queued_.store(tcp_batches_.size(), std::memory_order_relaxed);
        continue;
      }
      run_batch(batch);
      if (finished_) break;
    }
    read_board();
    return;
  }
  for (int r = 1; r < options_.size; ++r) {
    for (const std::string& frame : read_frames(r)) {
      RequestBatch b = decode_request_batch(frame);
      if (on_engine_thread()) last_activity_ = Clock::now();
      if (timeline_.active())
        for (const auto& q : b.requests)
          timeline_.instant(q.op, q.name, "rank " + std::to_string(b.rank) + " ready");
      coordinator_->add_batch(b);
    }
  }
  const auto now = Clock::now();
  std::string stall = coordinator_->inspect_stalls(now, [](const std::string& msg) {
    log_message(LogLevel::kWarning, "%s", msg.c_str());
  });
  if (!stall.empty()) throw PeerLostError(stall);
  // A board entry not yet executed here may be what completes a blocked rank's op.
  if (!board_has_work()) {
    const std::string deadlock = coordinator_->inspect_deadlock(now);
    if (!deadlock.empty()) throw PeerLostError(deadlock);
  }

  ResponseBatch batch;
  batch.responses = coordinator_->take_ready();
  for (const Response& resp : batch.responses) mark_negotiated(resp);
  batch.shutdown = coordinator_->all_shut_down();
  if (!batch.responses.empty() || batch.shutdown) send_batch(std::move(batch));
  read_board();
  // A sample ended while executing, or a notice was posted: it goes out at once, on its own
  // (waiting for the next responses would measure the next sample's first ops with the old
  // setting, or hold the notice back while every rank waits in a collective).
  if ((params_due_ || posted_notice_.load() > sent_notice_) && !finished_) {
    send_batch(ResponseBatch());
    read_board();
  }
}

void Engine::mark_negotiated(const Response& resp) {
  if (!timeline_.active()) return;
  // Negotiated: from here until its collective starts, a tensor waits behind earlier ones.
  for (const auto& name : resp.names)
    if (table_.count(name)) {
      timeline_.end(resp.op, name, Timeline::negotiate_phase(resp.op));
      timeline_.begin(resp.op, name, "QUEUE");
    }
}

void Engine::send_batch(ResponseBatch batch) {
  if (params_due_) {
    batch.has_params = true;
    batch.params = autotuner_ ? autotuner_->proposal() : tuned_;
    params_due_ = false;
  }
  const int64_t posted = posted_notice_.load();
  if (posted > sent_notice_) {
    batch.has_notice = true;
    batch.notice = sent_notice_ = posted;
  }
  const std::string frame = encode(batch);
  // With a board, every rank executes the batch where its marker stands in the log.
  if (board_) board_->append(NegotiationBoard::kMarker | (batches_sent_++ & NegotiationBoard::kValueMask));
  for (int r = 1; r < options_.size; ++r) send_frame(mesh_.control[r].get(), frame);
  if (board_) {
    tcp_batches_.push_back(std::move(batch));
    tcp_batches_queued_.store(tcp_batches_.size(), std::memory_order_relaxed);
  } else {
    run_batch(batch);
  }
}

void Engine::run_batch(const ResponseBatch& batch) {
  if (batch.has_params) apply_params(batch.params);
  if (batch.has_notice) notice_.store(batch.notice, std::memory_order_relaxed);
  for (const Response& resp : batch.responses) execute(resp);
  if (batch.shutdown) finished_ = true;
}

void Engine::apply_params(const TunedParams& params) {
  // The first settings are rank 0's own (its first batch carries them): generation 0 still,
  // but every rank's next collective reports them.
  if (rank0_params_applied_) ++tuned_generation_;
  else executed_stale_ = true;
  rank0_params_applied_ = true;
  if (timeline_.active() && !(params == tuned_)) {
    char what[192];
    std::snprintf(what, sizeof what,
                  "AUTOTUNE fusion_threshold=%llu cycle_time_ms=%.3f cache=%d "
                  "hierarchical_allreduce=%d hierarchical_allgather=%d tuning=%d",
                  static_cast<unsigned long long>(params.fusion_threshold_bytes),
                  params.cycle_time_ms, int(params.cache_enabled), params.hierarchical_allreduce,
                  params.hierarchical_allgather, int(params.tuning));
    timeline_.mark("autotune", what);
  }
  tuned_ = params;
  cycle_time_ms_.store(params.cycle_time_ms, std::memory_order_relaxed);
  board_fusion_bytes_ = params.fusion_threshold_bytes;
  if (coordinator_) coordinator_->set_fusion_threshold(params.fusion_threshold_bytes);
  if (autotuner_) autotuner_->started(Clock::now());
}

void Engine::note_collective(const Response& resp) {
  if (executed_generation_ != tuned_generation_ || executed_stale_) {
    std::lock_guard<std::mutex> lock(executed_mu_);
    executed_params_ = tuned_;
    executed_generation_ = tuned_generation_;
    executed_stale_ = false;
  }
  // Rank 0 measures only while tuning: once the best setting is kept, nothing to count.
  if (!autotuner_ || !autotuner_->active()) return;
  size_t bytes = 0;
  for (const auto& shape : resp.shapes) bytes += size_t(num_elements(shape)) * dtype_size(resp.dtype);
  if (autotuner_->record(resp.names, bytes, Clock::now())) params_due_ = true;
}

TunedParams Engine::executed_params(uint64_t* generation) const {
  std::lock_guard<std::mutex> lock(executed_mu_);
  *generation = executed_generation_;
  return executed_params_;
}

void Engine::report_blocked() {
  const double after = options_.coordinator.deadlock_check_seconds;
  if (after <= 0 || options_.size < 2 || finished_) return;
  const auto now = Clock::now();
  if (blocked_reported_) {
    // Executed something since (taking new ops sends the notice in submit_queued), or nobody
    // waits any more.
    if (moved_at_ > blocked_reported_at_ || handles_.waiters() == 0 || table_.empty())
      send_blocked_state(RequestBatch::Blocked::kMoving);
    return;
  }
  if (handles_.waiters() == 0 || table_.empty() ||
      now - moved_at_ < std::chrono::duration<double>(after))
    return;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    if (!queue_.empty()) return;
  }
  send_blocked_state(RequestBatch::Blocked::kBlocked);
}

void Engine::send_blocked_state(RequestBatch::Blocked state) {
  RequestBatch b;
  b.rank = options_.rank;
  b.blocked = state;
  if (state == RequestBatch::Blocked::kBlocked) {
    for (const auto& kv : table_)
      b.blocked_on.push_back({kv.first, kv.second.request.op, kv.second.request.process_set});
    std::sort(b.blocked_on.begin(), b.blocked_on.end(),
              [](const PendingOp& a, const PendingOp& o) { return a.name < o.name; });
  }
  blocked_reported_ = state == RequestBatch::Blocked::kBlocked;
  blocked_reported_at_ = Clock::now();
  if (options_.rank == 0) coordinator_->add_batch(b);
  else send_frame(mesh_.control[0].get(), encode(b));
}

}  // namespace shvd
