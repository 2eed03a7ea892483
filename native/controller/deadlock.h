// The deadlock check: ranks blocked in collectives that can never match. Each rank's engine
// reports when its user threads have waited for results, with nothing new submitted or
// executed, for the check's delay (EngineOptions::deadlock_check_seconds), naming the
// collectives it still waits for, and withdraws the report when it moves again. When every
// rank has reported and no reported collective has been submitted by every member that must
// take part (the others are blocked too, so none ever will), nothing can complete: the
// coordinator ends the job with an error that names what each rank waits for, instead of
// waiting for the stall inspector's timeout (which may be off). A second look at least
// `confirm` later, with no report changed, confirms it (a frame on its way, a board entry not
// yet read).
#pragma once

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "message.h"
#include "process_sets.h"

namespace shvd {

class DeadlockDetector {
 public:
  using Clock = std::chrono::steady_clock;

  DeadlockDetector(int world_size, Clock::duration confirm)
      : world_size_(world_size), confirm_(confirm) {}

  // A rank's report (RequestBatch::blocked): blocked on `ops`, or moving again.
  void blocked(int rank, std::vector<PendingOp> ops);
  void moving(int rank);

  // A non-empty message when every rank is blocked and none of the collectives they wait for
  // can complete, confirmed by a second call at least `confirm` after the first with no report
  // changed in between. `joined`: ranks in join(), which every allreduce goes on without.
  std::string check(Clock::time_point now, const ProcessSets& sets, const std::set<int>& joined);

  // What check() decides, without the confirmation: empty when some collective can complete
  // or some rank is not blocked.
  std::string diagnose(const ProcessSets& sets, const std::set<int>& joined) const;

 private:
  const int world_size_;
  const Clock::duration confirm_;
  std::map<int, std::vector<PendingOp>> reports_;
  uint64_t version_ = 0;  // changes with every report
  uint64_t suspected_version_ = 0;
  Clock::time_point suspected_at_{};
  bool suspected_ = false;
};

}  // namespace shvd
