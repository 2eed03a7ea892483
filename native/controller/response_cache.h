// The response cache: once the coordinator has answered a tensor's requests, a rank that asks for
// the same tensor with the same parameters again sends a small id instead of the request, and an
// allreduce every member answered the same way is answered again without being re-validated.
//
// One object per rank, with two views of the same ids that must agree (the invariant this class
// owns): the coordinator numbers entries as it answers requests (rank 0's view: every rank's
// request per id), and every rank learns the ids from the responses it executes, which all ranks
// receive in the same order (the rank's view: name -> id and its own request). A rank sends id k
// for a request only when the coordinator's entry k holds exactly that request for that rank,
// because both were recorded from the same answered request and entries are never renumbered.
// Every rank also keeps the answers (the response per id), which are identical on every rank for
// the same reason: the shared-memory fast path (negotiation_board.h) executes them by id.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "message.h"
#include "process_sets.h"

namespace shvd {

class ResponseCache {
 public:
  struct Entry {
    std::string name;
    std::vector<Request> by_rank;  // every rank's request, as last answered (indexed by rank)
    // An allreduce that every member of `members` submitted with nobody joined: the same
    // requests are answered with `response` again, no validation needed.
    bool fast = false;
    Response response;
    int members = 0;
  };

  // capacity 0 disables the cache (nothing is recorded, every lookup misses).
  ResponseCache(size_t capacity, int world_size);

  bool enabled() const { return capacity_ > 0; }

  // --- The rank's view (every rank) ---------------------------------------------------------
  // The id that stands for `own`, or -1 when this rank never had that exact request answered.
  int64_t lookup(const Request& own) const;
  // After executing a response that gave `name` the id `id`: later identical requests of this
  // rank can send the id. Ignores ids < 0 (not cached).
  void remember(const std::string& name, int64_t id, const Request& own);

  // The ops whose cached answer is the same whenever the same requests return, so the fast
  // path may give it by id: allreduce, and barrier (whose answer is only its completion).
  static bool fast_op(OpType op) { return op == OpType::kAllreduce || op == OpType::kBarrier; }

  // The answer the fast path gives an id: a fast_op answered without error or joined ranks.
  struct Answer {
    Response response;     // for this one name
    uint64_t members = 0;  // bits of the process set's global ranks (fast path: < 64 ranks)
    size_t bytes = 0;
  };
  // Records the answers `resp` gives its cached names (called for every response a rank
  // executes, member or not, so the tables agree on every rank).
  void remember_answers(const Response& resp, const ProcessSets& sets);
  // The answer for `id`, or nullptr when the fast path may not answer it.
  const Answer* answer(uint32_t id) const;

  // --- The coordinator's view (rank 0) -------------------------------------------------------
  size_t size() const { return entries_.size(); }
  Entry& entry(uint32_t id) { return entries_[id]; }
  const Entry& entry(uint32_t id) const { return entries_[id]; }
  // The id of `name`, or -1.
  int64_t id_of(const std::string& name) const;
  // Records the answered requests of the ranks in `submitted` (by_rank is indexed by rank)
  // under `name`'s id, numbering a new entry when there is room. Returns the id, or -1 when the
  // request cannot be cached (the cache is full or disabled, or the op is not cacheable:
  // process-set changes and grouped ops).
  int64_t record(const std::string& name, const std::vector<int>& submitted,
                 const std::vector<Request>& by_rank);
  // Sets how entry `id` is answered next time (see Entry::fast).
  void set_answer(uint32_t id, const Response& response, bool fast, int members);

  // Whether a request of this kind is ever cached.
  static bool cacheable(const Request& r);

 private:
  const size_t capacity_;
  const int world_size_;
  std::vector<Entry> entries_;
  std::unordered_map<std::string, uint32_t> by_name_;
  // The rank's view: name -> (id, this rank's request as last answered).
  std::unordered_map<std::string, std::pair<uint32_t, Request>> own_;
  std::vector<Answer> answers_;  // by id
  std::vector<bool> answered_;   // by id: answers_[id] holds a fast-path answer
};

}  // namespace shvd
