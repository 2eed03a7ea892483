#include "process_sets.h"

#include <algorithm>

namespace shvd {

void ProcessSets::reset(int world_size) {
  std::lock_guard<std::mutex> lock(mu_);
  sets_.clear();
  std::vector<int> all(world_size);
  for (int i = 0; i < world_size; ++i) all[i] = i;
  sets_[0] = all;
  next_id_ = 1;
}

int ProcessSets::add(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  std::lock_guard<std::mutex> lock(mu_);
  int id = next_id_++;
  sets_[id] = std::move(ranks);
  return id;
}

bool ProcessSets::remove(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  return id != 0 && sets_.erase(id) > 0;
}

bool ProcessSets::exists(int id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return sets_.count(id) > 0;
}

std::vector<int> ProcessSets::members(int id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sets_.find(id);
  return it == sets_.end() ? std::vector<int>{} : it->second;
}

int ProcessSets::index_of(int id, int global_rank) const {
  return membership(id, global_rank).index;
}

ProcessSets::Membership ProcessSets::membership(int id, int global_rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  Membership m;
  auto it = sets_.find(id);
  if (it == sets_.end()) return m;
  const std::vector<int>& ranks = it->second;
  m.size = int(ranks.size());
  auto pos = std::lower_bound(ranks.begin(), ranks.end(), global_rank);
  if (pos != ranks.end() && *pos == global_rank) m.index = int(pos - ranks.begin());
  return m;
}

int ProcessSets::find(const std::vector<int>& ranks) const {
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& kv : sets_)
    if (kv.second == sorted) return kv.first;
  return -1;
}

std::vector<int> ProcessSets::ids() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> out;
  for (const auto& kv : sets_) out.push_back(kv.first);
  return out;
}

}  // namespace shvd
