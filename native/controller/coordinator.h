// Rank 0's negotiation state: which ranks have submitted which named tensors, whether their
// requests agree, and which tensors are ready on every member of their process set. Produces the
// responses every rank executes in the same order, fusing small allreduces into one.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "deadlock.h"
#include "message.h"
#include "negotiation_board.h"
#include "process_sets.h"
#include "response_cache.h"
#include "stall_inspector.h"

namespace shvd {

struct CoordinatorOptions {
  size_t fusion_threshold_bytes = 128u << 20;
  size_t cache_capacity = 1024;        // response-cache entries (0 disables; see ResponseCache)
  double stall_warning_seconds = 60;   // <= 0 disables the stall inspector
  double stall_shutdown_seconds = 0;   // > 0: abort the job after this long
  // Every rank blocked this long in collectives none can complete ends the job (deadlock.h;
  // each rank's engine reports after this long). <= 0: no deadlock check.
  double deadlock_check_seconds = 2;
};

class Coordinator {
 public:
  using Clock = std::chrono::steady_clock;

  // `cache` is the rank's response cache (the engine owns it; the coordinator numbers its ids).
  Coordinator(int world_size, ProcessSets* sets, ResponseCache* cache,
              CoordinatorOptions options);

  // Incorporates one rank's batch (cached ids are resolved to the request they stand for).
  void add_batch(const RequestBatch& batch);

  // Responses for every tensor that is ready on all members (fused where possible).
  std::vector<Response> take_ready();

  // Autotuning changes the fusion threshold between response batches.
  void set_fusion_threshold(size_t bytes) { options_.fusion_threshold_bytes = bytes; }

  bool all_shut_down() const { return int(shut_down_.size()) == world_size_; }

  // The shared-memory negotiation every rank uses for cached allreduces (nullptr: none). The
  // coordinator takes an id over from it whenever the general path must decide that id (see
  // take_over) and gives it back once answered.
  void set_board(NegotiationBoard* board) { board_ = board; }

  // Warnings for tensors some ranks submitted and others did not (stall inspector). Returns a
  // non-empty message when the stall exceeded the shutdown limit and the job must abort.
  std::string inspect_stalls(Clock::time_point now, const std::function<void(const std::string&)>& warn);

  // The deadlock check (deadlock.h): a non-empty message when every rank is blocked in
  // collectives none of which can complete, and the job must end.
  std::string inspect_deadlock(Clock::time_point now);

 private:
  struct Pending {
    std::vector<Request> by_rank;   // indexed by global rank
    std::vector<bool> present;
    int count = 0;
    Clock::time_point first_seen;
    Clock::time_point last_warned;
    bool ready = false;
    std::string refused;  // non-empty: fails at once with this message (see add_request)
  };

  void add_request(int rank, const Request& r);
  void mark_ready_if_complete(const std::string& name, Pending& p);
  // Fails `name` at once: an op other than allreduce while ranks have joined (Horovod's rule).
  void refuse_while_joined(const std::string& name, Pending& p, const Request& r);
  std::vector<int> joined_ranks() const { return {joined_.begin(), joined_.end()}; }
  void recheck_all();
  Response build_response(const std::string& name, Pending& p);
  Response build_join_response();
  // If `name` is pending and belongs to a group in `failed` (group -> error), appends an error
  // response for it to `out`, forgets it and returns true.
  bool fail_if_in_group(const std::string& name,
                        const std::unordered_map<std::string, std::string>& failed,
                        std::vector<Response>* out);
  bool needs_rank(const Pending& p, int rank) const;
  // The request of the lowest rank that submitted this tensor (nullptr if none did).
  const Request* first_request(const Pending& p) const;
  std::vector<int> missing_ranks(const Pending& p) const;
  std::vector<Response> fuse(std::vector<Response> responses) const;
  size_t response_bytes(const Response& r) const;

  const int world_size_;
  ProcessSets* sets_;
  CoordinatorOptions options_;
  std::unordered_map<std::string, Pending> pending_;
  std::deque<std::string> ready_;  // names in the order they became ready
  std::set<int> joined_;
  int last_joined_ = -1;
  std::set<int> shut_down_;
  // The steady state of a training loop: an allreduce answered before (ResponseCache::Entry::fast),
  // now sent by every member as its cache id. Counted here, per id, instead of in pending_ (no
  // request copies, no validation: the requests agreed when they were cached) and answered
  // with the cached response. Anything else (a full request for the name, join, shutdown, a
  // stall) demotes the waiting ranks into pending_ first, where the general path decides.
  struct CachedWait {
    std::vector<bool> waiting;     // ranks whose id arrived, by global rank
    int count = 0;
    Clock::time_point first_seen;
  };
  void add_cached(int rank, uint32_t id);
  void demote_cached(uint32_t id);
  ResponseCache* cache_;
  std::vector<CachedWait> waits_;        // by cache id
  std::vector<uint32_t> cached_ready_;  // fast-path ids ready on every member, in order
  StallInspector stalls_;
  DeadlockDetector deadlock_;

  // The board's ids this coordinator decides for now: disabled there, so ranks send them over
  // TCP. Arrivals already on the board are moved into pending_ (their first_seen: `since`).
  void take_over(uint32_t id, Clock::time_point since);
  void take_over_all();
  // Gives back the ids it no longer needs to decide (nothing pending, nobody joined or gone).
  void give_back();
  void inspect_board(Clock::time_point now);
  NegotiationBoard* board_ = nullptr;
  std::set<uint32_t> taken_;
  struct BoardWatch {  // an id with ranks waiting on the board, for the stall inspector
    uint64_t completions = 0;
    Clock::time_point since{};
  };
  std::vector<BoardWatch> watch_;
};

}  // namespace shvd
