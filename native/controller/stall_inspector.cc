#include "stall_inspector.h"

#include <sstream>

#include "../common/types.h"
#include "mismatch.h"

namespace shvd {

StallInspector::StallInspector(double warning_seconds, double shutdown_seconds)
    : warning_seconds_(warning_seconds),
      shutdown_seconds_(shutdown_seconds),
      warn_after_(std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(warning_seconds > 0 ? warning_seconds : 0))),
      abort_after_(std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(shutdown_seconds > 0 ? shutdown_seconds : 0))) {}

bool StallInspector::due(Clock::time_point now) {
  if (!enabled() || now - last_check_ + kTimerSlack < kInterval) return false;
  last_check_ = now;
  return true;
}

std::string StallInspector::inspect(const std::string& name, const std::vector<int>& have,
                                    const std::vector<int>& missing, Clock::time_point first_seen,
                                    Clock::time_point* last_warned, Clock::time_point now,
                                    const Warn& warn) const {
  const auto age = now - first_seen;
  if (age < warn_after_) return "";
  std::ostringstream msg;
  msg << "tensor '" << name << "' was submitted by ranks " << ranks_str(have) << " but "
      << describe_ranks(missing) << (missing.size() == 1 ? " has" : " have")
      << " not submitted it for "
      << int(std::chrono::duration<double>(age).count()) << " s";
  if (shutdown_seconds_ > 0 && age >= abort_after_)
    return "stall inspector: " + msg.str() + " (SPARK_HVD_STALL_SHUTDOWN_TIME_SECONDS exceeded)";
  if (now - *last_warned >= warn_after_ || *last_warned == first_seen) {
    *last_warned = now;
    warn("Stall detected: " + msg.str() +
         ". One or more ranks may be stuck, or they submit tensors in a different set or "
         "under different names.");
  }
  return "";
}

}  // namespace shvd
