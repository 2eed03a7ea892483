#include "coordinator.h"

#include <algorithm>

#include "mismatch.h"

namespace shvd {

Coordinator::Coordinator(int world_size, ProcessSets* sets, ResponseCache* cache,
                         CoordinatorOptions options)
    : world_size_(world_size),
      sets_(sets),
      options_(options),
      cache_(cache),
      stalls_(options.stall_warning_seconds, options.stall_shutdown_seconds),
      deadlock_(world_size, std::chrono::milliseconds(200)) {}

void Coordinator::add_batch(const RequestBatch& batch) {
  for (uint32_t id : batch.cached) {
    if (id >= cache_->size()) continue;
    const ResponseCache::Entry& c = cache_->entry(id);
    // With a board, an id that comes over TCP was refused there: the general path decides it.
    if (board_) {
      add_request(batch.rank, c.by_rank[batch.rank]);
      continue;
    }
    // The cached response must be the one for this rank's request: a name can have been
    // answered last on another process set (a global name spelled like a scoped one).
    if (c.fast && joined_.empty() && shut_down_.empty() &&
        c.by_rank[batch.rank].process_set == c.response.process_set && !pending_.count(c.name))
      add_cached(batch.rank, id);
    else
      add_request(batch.rank, c.by_rank[batch.rank]);
  }
  for (const Request& r : batch.requests) add_request(batch.rank, r);
  if (batch.blocked == RequestBatch::Blocked::kBlocked)
    deadlock_.blocked(batch.rank, batch.blocked_on);
  else if (batch.blocked == RequestBatch::Blocked::kMoving || !batch.requests.empty() ||
           !batch.cached.empty() || batch.shutdown)
    deadlock_.moving(batch.rank);
  if (batch.shutdown) {
    shut_down_.insert(batch.rank);
    take_over_all();
    recheck_all();
  }
}

void Coordinator::add_cached(int rank, uint32_t id) {
  if (waits_.size() <= id) waits_.resize(cache_->size());
  CachedWait& w = waits_[id];
  if (w.waiting.empty()) w.waiting.assign(world_size_, false);
  if (w.waiting[rank]) return;  // duplicates are rejected locally before they get here
  if (w.count == 0) w.first_seen = Clock::now();
  w.waiting[rank] = true;
  if (++w.count < cache_->entry(id).members) return;
  w.waiting.assign(world_size_, false);
  w.count = 0;
  cached_ready_.push_back(id);
}

void Coordinator::demote_cached(uint32_t id) {
  if (id >= waits_.size() || waits_[id].count == 0) return;
  CachedWait& w = waits_[id];
  const Clock::time_point first_seen = w.first_seen;
  std::vector<int> ranks;
  for (int r = 0; r < world_size_; ++r)
    if (w.waiting[r]) ranks.push_back(r);
  w.waiting.assign(world_size_, false);
  w.count = 0;
  const ResponseCache::Entry& c = cache_->entry(id);
  for (int r : ranks) add_request(r, c.by_rank[r]);
  auto it = pending_.find(c.name);
  if (it != pending_.end()) it->second.first_seen = it->second.last_warned = first_seen;
}

const Request* Coordinator::first_request(const Pending& p) const {
  for (int r = 0; r < world_size_; ++r)
    if (p.present[r]) return &p.by_rank[r];
  return nullptr;
}

bool Coordinator::needs_rank(const Pending& p, int rank) const {
  if (p.present[rank]) return false;
  const Request* any = first_request(p);
  if (!any) return false;
  // A joined rank submits nothing until everyone joined: allreduce goes on without it (zeros),
  // any other op fails on the ranks that did submit it (build_response), as in Horovod.
  if (joined_.count(rank)) return false;
  return sets_->index_of(any->process_set, rank) >= 0;
}

std::vector<int> Coordinator::missing_ranks(const Pending& p) const {
  std::vector<int> out;
  for (int r = 0; r < world_size_; ++r)
    if (needs_rank(p, r)) out.push_back(r);
  return out;
}

void Coordinator::add_request(int rank, const Request& r) {
  if (r.op == OpType::kJoin) {
    joined_.insert(rank);
    last_joined_ = rank;
    take_over_all();
    recheck_all();
    // Ops other than allreduce that are still waiting (cached ones were just moved to pending_)
    // fail now, as later ones will when they arrive (below).
    for (auto& kv : pending_) {
      const Request* first = first_request(kv.second);
      if (first && first->op != OpType::kAllreduce) refuse_while_joined(kv.first, kv.second, *first);
    }
    if (int(joined_.size()) == world_size_) {
      Pending& p = pending_["__join__"];
      // Sized like every other entry: loops over pending_ index present[] by rank.
      p.by_rank.resize(world_size_);
      p.present.assign(world_size_, false);
      p.ready = true;
      ready_.push_back("__join__");
    }
    return;
  }
  if (board_) {
    const int64_t id = cache_->id_of(r.name);
    if (id >= 0 && !taken_.count(uint32_t(id))) take_over(uint32_t(id), Clock::now());
  }
  auto it = pending_.find(r.name);
  if (it == pending_.end()) {
    const int64_t cached = cache_->id_of(r.name);
    if (cached >= 0) {
      demote_cached(uint32_t(cached));  // the ranks already waiting go first
      it = pending_.find(r.name);
    }
  }
  if (it == pending_.end()) {
    Pending p;
    p.by_rank.resize(world_size_);
    p.present.assign(world_size_, false);
    p.first_seen = Clock::now();
    p.last_warned = p.first_seen;
    it = pending_.emplace(r.name, std::move(p)).first;
  }
  Pending& p = it->second;
  if (p.present[rank]) return;  // duplicates are rejected locally before they get here
  p.by_rank[rank] = r;
  p.present[rank] = true;
  p.count++;
  // Only allreduce goes on while ranks have joined (Horovod's rule). Any other op fails as it
  // arrives, on the rank that sent it: waiting for the others to send it too could wait
  // forever, since ranks that skipped it while others joined number their unnamed ops apart.
  if (!joined_.empty() && r.op != OpType::kAllreduce) {
    refuse_while_joined(r.name, p, r);
    return;
  }
  mark_ready_if_complete(r.name, p);
}

void Coordinator::refuse_while_joined(const std::string& name, Pending& p, const Request& r) {
  if (p.ready || !p.refused.empty()) return;
  p.refused = joined_refusal(r.op, name, joined_ranks());
  p.ready = true;
  ready_.push_back(name);
}

void Coordinator::mark_ready_if_complete(const std::string& name, Pending& p) {
  if (p.ready) return;
  bool blocked_by_shutdown = false;
  for (int r = 0; r < world_size_; ++r) {
    if (needs_rank(p, r)) {
      if (!shut_down_.count(r)) return;
      blocked_by_shutdown = true;
    }
  }
  (void)blocked_by_shutdown;
  p.ready = true;
  ready_.push_back(name);
}

void Coordinator::recheck_all() {
  // Join and shutdown change who must take part: the general path decides for everything.
  for (uint32_t id = 0; id < waits_.size(); ++id) demote_cached(id);
  for (auto& kv : pending_) mark_ready_if_complete(kv.first, kv.second);
}

Response Coordinator::build_join_response() {
  Response resp;
  resp.op = OpType::kJoin;
  resp.names = {"__join__"};
  resp.last_joined = last_joined_;
  joined_.clear();
  return resp;
}

Response Coordinator::build_response(const std::string& name, Pending& p) {
  std::vector<int> submitted;
  for (int r = 0; r < world_size_; ++r)
    if (p.present[r]) submitted.push_back(r);
  const Request& first = p.by_rank[submitted.front()];
  if (!p.refused.empty()) {
    Response resp = response_skeleton(name, first, joined_ranks());
    resp.error = p.refused;
    return resp;
  }
  // A rank that shut down can no longer take part.
  std::vector<int> gone;
  for (int r = 0; r < world_size_; ++r)
    if (needs_rank(p, r) && shut_down_.count(r)) gone.push_back(r);
  if (!gone.empty()) {
    Response resp = response_skeleton(name, first, joined_ranks());
    resp.error_is_mismatch = false;
    resp.error = "ranks " + ranks_str(gone) + " have shut down spark_hvd and cannot complete " +
                 op_type_name(first.op) + " of tensor '" + name + "'";
    return resp;
  }
  Response resp = agreed_response(name, p.by_rank, submitted, joined_ranks(), *sets_);
  if (!resp.error.empty()) return resp;

  // Response cache: remember every rank's request so later rounds can send just the id.
  const int64_t cache_id = cache_->record(name, submitted, p.by_rank);
  resp.cache_ids = {cache_id};
  if (cache_id >= 0) {
    // Only an allreduce or barrier every member answered with nobody joined is answered the
    // same way whenever the same requests return.
    const int members = int(sets_->members(first.process_set).size());
    const bool fast = ResponseCache::fast_op(first.op) && joined_.empty() &&
                      int(submitted.size()) == members;
    cache_->set_answer(uint32_t(cache_id), resp, fast, members);
  }
  return resp;
}

size_t Coordinator::response_bytes(const Response& r) const {
  size_t total = 0;
  for (const auto& s : r.shapes) total += size_t(num_elements(s)) * dtype_size(r.dtype);
  return total;
}

std::vector<Response> Coordinator::fuse(std::vector<Response> responses) const {
  std::vector<Response> out;
  size_t last_bytes = 0;  // of out.back()
  for (auto& r : responses) {
    const size_t bytes = response_bytes(r);
    if (!out.empty()) {
      Response& last = out.back();
      if (fusable_allreduces(last, r) && last_bytes + bytes <= options_.fusion_threshold_bytes) {
        for (auto& n : r.names) last.names.push_back(std::move(n));
        for (auto& s : r.shapes) last.shapes.push_back(std::move(s));
        last.cache_ids.insert(last.cache_ids.end(), r.cache_ids.begin(), r.cache_ids.end());
        last_bytes += bytes;
        continue;
      }
    }
    out.push_back(std::move(r));
    last_bytes = bytes;
  }
  return out;
}

bool Coordinator::fail_if_in_group(const std::string& name,
                                   const std::unordered_map<std::string, std::string>& failed,
                                   std::vector<Response>* out) {
  auto it = pending_.find(name);
  if (it == pending_.end()) return false;
  const Request* any = first_request(it->second);
  if (!any || any->group.empty()) return false;
  auto g = failed.find(any->group);
  if (g == failed.end()) return false;
  Response resp = single_tensor_response(name, any->shape, *any);
  resp.error = "Grouped operation '" + any->group + "' failed, so tensor '" + name +
               "' of it fails too: " + g->second;
  out->push_back(std::move(resp));
  pending_.erase(it);
  return true;
}

std::vector<Response> Coordinator::take_ready() {
  // No holding back for stragglers here: ranks already send a step's requests in bursts
  // (Engine::in_burst_), and a rank that runs ahead would otherwise delay everyone's results.
  if (ready_.empty() && cached_ready_.empty()) return {};

  std::vector<Response> responses;
  for (uint32_t id : cached_ready_) responses.push_back(cache_->entry(id).response);
  cached_ready_.clear();
  std::deque<std::string> held;  // grouped tensors waiting for the rest of their group
  std::unordered_map<std::string, std::string> failed_groups;  // group -> its error
  std::unordered_map<std::string, int> group_ready;
  for (const auto& name : ready_) {
    if (name == "__join__") continue;
    const Request* first = first_request(pending_[name]);
    if (first && !first->group.empty()) group_ready[first->group]++;
  }
  for (const auto& name : ready_) {
    if (name == "__join__") {
      responses.push_back(build_join_response());
      pending_.erase(name);
      continue;
    }
    Pending& p = pending_[name];
    const Request* first = nullptr;
    bool group_sizes_agree = true;
    for (int r = 0; r < world_size_; ++r) {
      if (!p.present[r]) continue;
      if (!first) first = &p.by_rank[r];
      else if (p.by_rank[r].group_size != first->group_size) group_sizes_agree = false;
    }
    // Hold a grouped tensor until its whole group is ready, unless the ranks disagree about the
    // group: then build_response reports the mismatch (waiting would never end).
    if (first && !first->group.empty() && group_sizes_agree &&
        group_ready[first->group] < first->group_size) {
      held.push_back(name);
      continue;
    }
    const std::string group = first ? first->group : std::string();
    responses.push_back(build_response(name, p));
    if (!group.empty() && !responses.back().error.empty() && !failed_groups.count(group))
      failed_groups[group] = responses.back().error;
    pending_.erase(name);
  }
  // A group that failed fails as a whole, including tensors of it that some ranks never
  // submitted (their group was smaller): otherwise the ranks that did would wait forever.
  if (!failed_groups.empty()) {
    std::deque<std::string> still_held;
    for (const auto& name : held)
      if (!fail_if_in_group(name, failed_groups, &responses)) still_held.push_back(name);
    held = std::move(still_held);
    std::vector<std::string> names;
    for (const auto& kv : pending_) names.push_back(kv.first);
    for (const auto& name : names) fail_if_in_group(name, failed_groups, &responses);
  }
  ready_ = std::move(held);
  give_back();
  return fuse(std::move(responses));
}

void Coordinator::take_over(uint32_t id, Clock::time_point since) {
  if (id >= board_->ids()) return;
  taken_.insert(id);
  const uint64_t arrived = board_->steal(id);
  if (!arrived) return;
  const ResponseCache::Entry& c = cache_->entry(id);
  for (int r = 0; r < world_size_ && r < 64; ++r)
    if (arrived >> r & 1) add_request(r, c.by_rank[r]);
  auto it = pending_.find(c.name);
  if (it != pending_.end()) it->second.first_seen = it->second.last_warned = since;
}

void Coordinator::take_over_all() {
  if (!board_) return;
  const auto now = Clock::now();
  for (uint32_t id = 0; id < cache_->size(); ++id)
    if (!taken_.count(id)) take_over(id, now);
}

void Coordinator::give_back() {
  if (!board_ || taken_.empty() || !joined_.empty() || !shut_down_.empty()) return;
  for (auto it = taken_.begin(); it != taken_.end();) {
    if (pending_.count(cache_->entry(*it).name)) {
      ++it;
      continue;
    }
    board_->enable(*it);
    it = taken_.erase(it);
  }
}

void Coordinator::inspect_board(Clock::time_point now) {
  // Ranks waiting on the board for the same round of an id since the last inspections: once
  // that is longer than the warning time, the general path takes the id over and reports it.
  if (watch_.size() < cache_->size()) watch_.resize(cache_->size());
  for (uint32_t id = 0; id < cache_->size() && id < board_->ids(); ++id) {
    BoardWatch& w = watch_[id];
    if (taken_.count(id) || board_->waiting(id) == 0) {
      w.since = {};
      continue;
    }
    const uint64_t completions = board_->completions(id);
    if (w.since == Clock::time_point{} || w.completions != completions) {
      w = {completions, now};
      continue;
    }
    // `since` is the inspection that first saw them waiting (they came up to an interval
    // earlier): at a wake-up a few ms short of the warning time, take over as if it were due.
    if (now - w.since + StallInspector::kTimerSlack >= stalls_.warn_after())
      take_over(id, std::min(w.since, now - stalls_.warn_after()));
  }
}

std::string Coordinator::inspect_stalls(Clock::time_point now,
                                        const std::function<void(const std::string&)>& warn) {
  if (!stalls_.due(now)) return "";
  if (board_) inspect_board(now);
  // A tensor waiting on the fast path for long is a stall candidate: report it like any other.
  for (uint32_t id = 0; id < waits_.size(); ++id)
    if (waits_[id].count > 0 && now - waits_[id].first_seen >= stalls_.warn_after())
      demote_cached(id);
  for (auto& kv : pending_) {
    Pending& p = kv.second;
    if (p.ready || p.count == 0) continue;
    if (now - p.first_seen < stalls_.warn_after()) continue;
    std::vector<int> have;
    for (int r = 0; r < world_size_; ++r)
      if (p.present[r]) have.push_back(r);
    std::string abort =
        stalls_.inspect(kv.first, have, missing_ranks(p), p.first_seen, &p.last_warned, now, warn);
    if (!abort.empty()) return abort;
  }
  return "";
}

std::string Coordinator::inspect_deadlock(Clock::time_point now) {
  if (options_.deadlock_check_seconds <= 0) return "";
  // Something is ready to answer: it will move.
  if (!ready_.empty() || !cached_ready_.empty()) return "";
  return deadlock_.check(now, *sets_, joined_);
}

}  // namespace shvd
