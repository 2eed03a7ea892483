// The stall inspector: a tensor that some ranks submitted and others have not for a long time
// usually means a rank is stuck, or the ranks submit different tensors (or names). Warns about
// it periodically and, past a limit, tells the coordinator to abort the job.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace shvd {

class StallInspector {
 public:
  using Clock = std::chrono::steady_clock;
  using Warn = std::function<void(const std::string&)>;

  // warning_seconds <= 0 disables the inspector; shutdown_seconds > 0: abort after this long.
  StallInspector(double warning_seconds, double shutdown_seconds);

  bool enabled() const { return warning_seconds_ > 0; }
  // Whether to inspect now: enabled, and at most every kInterval.
  bool due(Clock::time_point now);
  // How long a tensor may wait before it counts as stalled.
  Clock::duration warn_after() const { return warn_after_; }

  // Inspects one tensor that ranks `have` submitted at `first_seen` and ranks `missing` have
  // not: warns through `warn` once per warning period (`last_warned` is the tensor's own
  // bookkeeping, equal to first_seen until the first warning), and returns the message to abort
  // the job with once it waited past the shutdown limit (empty otherwise).
  std::string inspect(const std::string& name, const std::vector<int>& have,
                      const std::vector<int>& missing, Clock::time_point first_seen,
                      Clock::time_point* last_warned, Clock::time_point now,
                      const Warn& warn) const;

  static constexpr std::chrono::milliseconds kInterval{500};
  // Rank 0's engine wakes every kInterval to inspect; a wake-up a few ms early must not count
  // as too early (the inspection, or a board stall, would then wait for the next wake-up).
  static constexpr std::chrono::milliseconds kTimerSlack{20};

 private:
  double warning_seconds_;
  double shutdown_seconds_;
  Clock::duration warn_after_;
  Clock::duration abort_after_;
  Clock::time_point last_check_{};
};

}  // namespace shvd
