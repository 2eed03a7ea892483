#include "response_cache.h"

namespace shvd {

ResponseCache::ResponseCache(size_t capacity, int world_size)
    : capacity_(capacity), world_size_(world_size) {}

int64_t ResponseCache::lookup(const Request& own) const {
  auto it = own_.find(own.name);
  if (it == own_.end() || !it->second.second.same_params(own)) return -1;
  return it->second.first;
}

void ResponseCache::remember(const std::string& name, int64_t id, const Request& own) {
  if (id < 0) return;
  auto& slot = own_[name];
  if (slot.first != uint32_t(id) || !slot.second.same_params(own)) slot = {uint32_t(id), own};
}

void ResponseCache::remember_answers(const Response& resp, const ProcessSets& sets) {
  const bool fast = fast_op(resp.op) && resp.error.empty() && resp.joined.empty();
  uint64_t members = 0;
  if (fast)
    for (int g : sets.members(resp.process_set)) members |= g < 64 ? 1ull << g : 0;
  for (size_t i = 0; i < resp.names.size() && i < resp.cache_ids.size(); ++i) {
    const int64_t id = resp.cache_ids[i];
    if (id < 0) continue;
    if (answers_.size() <= size_t(id)) {
      answers_.resize(size_t(id) + 1);
      answered_.resize(size_t(id) + 1, false);
    }
    answered_[id] = fast;
    if (!fast) continue;
    Answer& a = answers_[id];
    a.response = single_tensor_response(resp.names[i], resp.shapes[i], resp);
    a.response.cache_ids = {id};
    a.members = members;
    a.bytes = size_t(num_elements(resp.shapes[i])) * dtype_size(resp.dtype);
  }
}

const ResponseCache::Answer* ResponseCache::answer(uint32_t id) const {
  return id < answered_.size() && answered_[id] ? &answers_[id] : nullptr;
}

int64_t ResponseCache::id_of(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? -1 : int64_t(it->second);
}

bool ResponseCache::cacheable(const Request& r) {
  return r.op != OpType::kAddProcessSet && r.op != OpType::kRemoveProcessSet && r.group.empty();
}

int64_t ResponseCache::record(const std::string& name, const std::vector<int>& submitted,
                              const std::vector<Request>& by_rank) {
  if (capacity_ == 0 || submitted.empty() || !cacheable(by_rank[submitted.front()])) return -1;
  int64_t id = id_of(name);
  if (id < 0) {
    if (entries_.size() >= capacity_) return -1;
    id = int64_t(entries_.size());
    entries_.emplace_back();
    entries_.back().name = name;
    entries_.back().by_rank.resize(world_size_);
    by_name_[name] = uint32_t(id);
  }
  for (int r : submitted) {
    Request& cached = entries_[id].by_rank[r];
    if (!cached.same_params(by_rank[r])) cached = by_rank[r];
  }
  return id;
}

void ResponseCache::set_answer(uint32_t id, const Response& response, bool fast, int members) {
  Entry& e = entries_[id];
  e.fast = fast;
  e.members = members;
  if (fast) e.response = response;
}

}  // namespace shvd
