// The registry of process sets: id -> sorted global ranks. Id 0 is the global set. Read by user
// threads (rank/size queries, validation) and the engine thread, changed only by the engine
// thread while executing a negotiated add/remove, so every rank assigns the same ids.
#pragma once

#include <map>
#include <mutex>
#include <vector>

namespace shvd {

class ProcessSets {
 public:
  void reset(int world_size);
  // Returns the new id (ids are never reused within one init).
  int add(std::vector<int> ranks);
  bool remove(int id);
  bool exists(int id) const;
  // Sorted global ranks; empty if the set does not exist.
  std::vector<int> members(int id) const;
  // Index of `global_rank` in set `id`, or -1.
  int index_of(int id, int global_rank) const;
  // Size of set `id` (-1 if it does not exist) and the index of `global_rank` in it (-1 if not
  // a member): what validating an op needs, under one lock and without copying the members.
  struct Membership {
    int size = -1;
    int index = -1;
  };
  Membership membership(int id, int global_rank) const;
  // Id of an existing set with exactly these ranks, or -1.
  int find(const std::vector<int>& ranks) const;
  std::vector<int> ids() const;

 private:
  mutable std::mutex mu_;
  std::map<int, std::vector<int>> sets_;
  int next_id_ = 1;
};

}  // namespace shvd
