#include "coordinator.h"

#include <algorithm>
#include <sstream>

namespace shvd {

namespace {

std::string ranks_str(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? ", " : "") << ranks[i];
  s << "]";
  return s.str();
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

int64_t num_elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Groups ranks by the value `key` gives them and describes the disagreement, e.g.
// "ranks [0, 2] sent [4, 3]; ranks [1] sent [5, 3]". Empty string when all agree.
template <typename Key>
std::string disagreement(const std::vector<int>& ranks, Key key) {
  // Fast path (every tensor, every step): compare the formatted values only when needed.
  const std::string first = key(ranks.front());
  bool all_same = true;
  for (size_t i = 1; i < ranks.size() && all_same; ++i) all_same = key(ranks[i]) == first;
  if (all_same) return "";
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r : ranks) {
    std::string k = key(r);
    auto it = std::find_if(groups.begin(), groups.end(), [&](auto& g) { return g.first == k; });
    if (it == groups.end()) groups.push_back({k, {r}});
    else it->second.push_back(r);
  }
  if (groups.size() <= 1) return "";
  std::ostringstream s;
  for (size_t i = 0; i < groups.size(); ++i)
    s << (i ? "; " : "") << "ranks " << ranks_str(groups[i].second) << " sent "
      << groups[i].first;
  return s.str();
}

}  // namespace

Coordinator::Coordinator(int world_size, ProcessSets* sets, CoordinatorOptions options)
    : world_size_(world_size), sets_(sets), options_(options) {}

void Coordinator::add_batch(const RequestBatch& batch) {
  for (uint32_t id : batch.cached) {
    if (id >= cache_.size()) continue;
    CacheEntry& c = cache_[id];
    // The cached response must be the one for this rank's request: a name can have been
    // answered last on another process set (a global name spelled like a scoped one).
    if (c.fast && joined_.empty() && shut_down_.empty() &&
        c.by_rank[batch.rank].process_set == c.response.process_set && !pending_.count(c.name))
      add_cached(batch.rank, id);
    else
      add_request(batch.rank, c.by_rank[batch.rank]);
  }
  for (const Request& r : batch.requests) add_request(batch.rank, r);
  if (batch.shutdown) {
    shut_down_.insert(batch.rank);
    recheck_all();
  }
}

void Coordinator::add_cached(int rank, uint32_t id) {
  CacheEntry& c = cache_[id];
  if (c.waiting.empty()) c.waiting.assign(world_size_, false);
  if (c.waiting[rank]) return;  // duplicates are rejected locally before they get here
  if (c.waiting_count == 0) c.first_seen = Clock::now();
  c.waiting[rank] = true;
  if (++c.waiting_count < c.members) return;
  c.waiting.assign(world_size_, false);
  c.waiting_count = 0;
  cached_ready_.push_back(id);
}

void Coordinator::demote_cached(CacheEntry& c) {
  if (c.waiting_count == 0) return;
  const Clock::time_point first_seen = c.first_seen;
  std::vector<int> ranks;
  for (int r = 0; r < world_size_; ++r)
    if (c.waiting[r]) ranks.push_back(r);
  c.waiting.assign(world_size_, false);
  c.waiting_count = 0;
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
  auto it = pending_.find(r.name);
  if (it == pending_.end()) {
    auto cached = cache_by_name_.find(r.name);
    if (cached != cache_by_name_.end() && cache_[cached->second].waiting_count > 0) {
      demote_cached(cache_[cached->second]);  // the ranks already waiting go first
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
  p.refused = joined_refusal(r.op, name);
  p.ready = true;
  ready_.push_back(name);
}

std::string Coordinator::joined_refusal(OpType op, const std::string& name) const {
  return std::string(op_type_name(op)) + " of tensor '" + name +
         "' is not supported while ranks " +
         ranks_str(std::vector<int>(joined_.begin(), joined_.end())) +
         " have joined; only allreduce continues after join()";
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
  for (CacheEntry& c : cache_) demote_cached(c);
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
  Response resp;
  resp.op = first.op;
  resp.names = {name};
  resp.dtype = first.dtype;
  resp.reduce_op = first.reduce_op;
  resp.prescale = first.prescale;
  resp.postscale = first.postscale;
  resp.root = first.root;
  resp.process_set = first.process_set;
  resp.shapes = {first.shape};
  resp.joined.assign(joined_.begin(), joined_.end());
  auto fail = [&](const std::string& what) {
    resp.error = what;
    return resp;
  };
  if (!p.refused.empty()) return fail(p.refused);
  const auto tensor = [&name] { return "tensor '" + name + "'"; };  // for error messages
  auto by = [&](auto field) {
    return [&, field](int r) { return field(p.by_rank[r]); };
  };

  // A rank that shut down can no longer take part.
  std::vector<int> gone;
  for (int r = 0; r < world_size_; ++r)
    if (needs_rank(p, r) && shut_down_.count(r)) gone.push_back(r);
  if (!gone.empty()) {
    resp.error_is_mismatch = false;
    return fail("ranks " + ranks_str(gone) + " have shut down spark_hvd and cannot complete " +
                op_type_name(first.op) + " of " + tensor());
  }
  // Fast path for the common case (every step of a training loop): identical requests need no
  // per-field diagnosis.
  const bool ragged = first.op == OpType::kAllgather || first.op == OpType::kAlltoall;
  bool uniform = true;
  for (int r : submitted) {
    const Request& q = p.by_rank[r];
    uniform = uniform && q.op == first.op && q.process_set == first.process_set &&
              q.dtype == first.dtype && q.group_size == first.group_size && q.group == first.group &&
              q.root == first.root && q.reduce_op == first.reduce_op &&
              q.prescale == first.prescale && q.postscale == first.postscale &&
              (ragged ? q.shape.size() == first.shape.size() &&
                            std::equal(q.shape.begin() + std::min<size_t>(1, q.shape.size()),
                                       q.shape.end(),
                                       first.shape.begin() + std::min<size_t>(1, first.shape.size()))
                      : q.shape == first.shape);
  }
  std::string d;
  if (!uniform) d = disagreement(submitted, by([](const Request& q) { return std::string(op_type_name(q.op)); }));
  if (!d.empty()) return fail("Mismatched collective operations for " + tensor() + ": " + d);
  if (!uniform) d = disagreement(submitted, by([](const Request& q) { return std::to_string(q.process_set); }));
  if (!d.empty()) return fail("Mismatched process sets for " + tensor() + ": " + d);
  if (first.op != OpType::kBarrier && first.op != OpType::kAddProcessSet &&
      first.op != OpType::kRemoveProcessSet) {
    if (!uniform) d = disagreement(submitted, by([](const Request& q) { return std::string(dtype_name(q.dtype)); }));
    if (!d.empty()) return fail("Mismatched data types for " + tensor() + ": " + d);
  }
  if (!uniform) d = disagreement(submitted, by([](const Request& q) { return std::to_string(q.group_size) + " tensors in group '" + q.group + "'"; }));
  if (!d.empty()) return fail("Mismatched grouped operation for " + tensor() + ": " + d);
  if (!joined_.empty() && first.op != OpType::kAllreduce) {
    return fail(joined_refusal(first.op, name));
  }
  switch (first.op) {
    case OpType::kAllreduce:
    case OpType::kReducescatter:
    case OpType::kBroadcast:
      if (!uniform) d = disagreement(submitted, by([](const Request& q) { return shape_str(q.shape); }));
      if (!d.empty()) return fail("Mismatched shapes for " + tensor() + " in " + op_type_name(first.op) + ": " + d);
      if (first.op == OpType::kBroadcast) {
        if (!uniform) d = disagreement(submitted, by([](const Request& q) { return "root rank " + std::to_string(q.root); }));
        if (!d.empty()) return fail("Mismatched root ranks for " + tensor() + " in broadcast: " + d);
      } else {
        if (!uniform) d = disagreement(submitted, by([](const Request& q) {
          std::ostringstream s;
          s << "op " << reduce_op_name(q.reduce_op) << " prescale " << q.prescale << " postscale " << q.postscale;
          return s.str();
        }));
        if (!d.empty()) return fail("Mismatched reduction for " + tensor() + ": " + d);
      }
      break;
    case OpType::kAllgather:
    case OpType::kAlltoall: {
      const std::vector<int> members = sets_->members(first.process_set);
      if (!uniform) d = disagreement(submitted, by([](const Request& q) {
        if (q.shape.empty()) return std::string("a scalar");
        return "trailing dims " + shape_str(std::vector<int64_t>(q.shape.begin() + 1, q.shape.end()));
      }));
      if (!d.empty())
        return fail("Mismatched shapes for " + tensor() + " in " + op_type_name(first.op) +
                    " (all dimensions but the first must agree): " + d);
      if (first.op == OpType::kAllgather) {
        for (int g : members) resp.first_dims.push_back(p.by_rank[g].shape.empty() ? 1 : p.by_rank[g].shape[0]);
      } else {
        for (int g : members) {
          const auto& s = p.by_rank[g].splits;
          if (s.size() != members.size())
            return fail("Mismatched splits for " + tensor() + " in alltoall: rank " + std::to_string(g) +
                        " gave " + std::to_string(s.size()) + " splits for a process set of " +
                        std::to_string(members.size()) + " ranks");
          resp.splits_matrix.insert(resp.splits_matrix.end(), s.begin(), s.end());
        }
      }
      break;
    }
    case OpType::kAddProcessSet:
      d = disagreement(submitted, by([](const Request& q) { return "ranks " + shape_str(q.splits); }));
      if (!d.empty()) return fail("Mismatched add_process_set calls: " + d);
      resp.splits_matrix = first.splits;
      break;
    case OpType::kRemoveProcessSet:
      d = disagreement(submitted, by([](const Request& q) { return "process set " + std::to_string(q.root); }));
      if (!d.empty()) return fail("Mismatched remove_process_set calls: " + d);
      break;
    default:
      break;
  }

  // Response cache: remember every rank's request so later rounds can send just the id.
  int64_t cache_id = -1;
  if (options_.cache_capacity > 0 && first.op != OpType::kAddProcessSet &&
      first.op != OpType::kRemoveProcessSet && first.group.empty()) {
    auto c = cache_by_name_.find(name);
    if (c != cache_by_name_.end()) {
      cache_id = c->second;
    } else if (cache_.size() < options_.cache_capacity) {
      cache_id = cache_.size();
      cache_.emplace_back();
      cache_.back().name = name;
      cache_.back().by_rank.resize(world_size_);
      cache_by_name_[name] = uint32_t(cache_id);
    }
    if (cache_id >= 0)
      for (int r : submitted) {
        Request& cached = cache_[cache_id].by_rank[r];
        if (!cached.same_params(p.by_rank[r]))
          cached = p.by_rank[r];
      }
  }
  resp.cache_ids = {cache_id};
  if (cache_id >= 0) {
    // Only an allreduce every member answered with nobody joined, is answered the same way
    // whenever the same requests return.
    CacheEntry& c = cache_[cache_id];
    const int members = int(sets_->members(first.process_set).size());
    c.fast = first.op == OpType::kAllreduce && joined_.empty() &&
             int(submitted.size()) == members;
    c.members = members;
    if (c.fast) c.response = resp;
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
    if (!out.empty() && r.error.empty() && r.op == OpType::kAllreduce) {
      Response& last = out.back();
      if (last.error.empty() && last.op == OpType::kAllreduce && last.dtype == r.dtype &&
          last.reduce_op == r.reduce_op && last.prescale == r.prescale &&
          last.postscale == r.postscale && last.process_set == r.process_set &&
          last.joined == r.joined && last_bytes + bytes <= options_.fusion_threshold_bytes) {
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
  Response resp;
  resp.op = any->op;
  resp.names = {name};
  resp.dtype = any->dtype;
  resp.process_set = any->process_set;
  resp.shapes = {any->shape};
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
  for (uint32_t id : cached_ready_) responses.push_back(cache_[id].response);
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
  return fuse(std::move(responses));
}

std::string Coordinator::inspect_stalls(Clock::time_point now,
                                        const std::function<void(const std::string&)>& warn) {
  if (options_.stall_warning_seconds <= 0) return "";
  if (now - last_stall_check_ < std::chrono::milliseconds(500)) return "";
  last_stall_check_ = now;
  const auto warn_after = std::chrono::duration<double>(options_.stall_warning_seconds);
  const auto abort_after = std::chrono::duration<double>(options_.stall_shutdown_seconds);
  // A tensor waiting on the fast path for long is a stall candidate: report it like any other.
  for (CacheEntry& c : cache_)
    if (c.waiting_count > 0 && now - c.first_seen >= warn_after) demote_cached(c);
  for (auto& kv : pending_) {
    Pending& p = kv.second;
    if (p.ready || p.count == 0) continue;
    const auto age = now - p.first_seen;
    if (age < warn_after) continue;
    std::vector<int> have;
    for (int r = 0; r < world_size_; ++r)
      if (p.present[r]) have.push_back(r);
    const std::vector<int> missing = missing_ranks(p);
    std::ostringstream msg;
    msg << "tensor '" << kv.first << "' was submitted by ranks " << ranks_str(have)
        << " but ranks " << ranks_str(missing) << " have not submitted it for "
        << int(std::chrono::duration<double>(age).count()) << " s";
    if (options_.stall_shutdown_seconds > 0 && age >= abort_after)
      return "stall inspector: " + msg.str() + " (SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS exceeded)";
    if (now - p.last_warned >= warn_after || p.last_warned == p.first_seen) {
      p.last_warned = now;
      warn("Stall detected: " + msg.str() +
           ". One or more ranks may be stuck, or they submit tensors in a different set or "
           "under different names.");
    }
  }
  return "";
}

}  // namespace shvd
