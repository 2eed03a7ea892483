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
