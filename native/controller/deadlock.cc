#include "deadlock.h"

#include <algorithm>

namespace shvd {

void DeadlockDetector::blocked(int rank, std::vector<PendingOp> ops) {
  reports_[rank] = std::move(ops);
  ++version_;
}

void DeadlockDetector::moving(int rank) {
  if (reports_.erase(rank)) ++version_;
}

std::string DeadlockDetector::diagnose(const ProcessSets& sets,
                                       const std::set<int>& joined) const {
  if (int(reports_.size()) < world_size_) return "";
  // Who waits for each collective: (process set, name) -> reporting ranks.
  std::map<std::pair<int32_t, std::string>, std::set<int>> waiting;
  std::map<std::pair<int32_t, std::string>, OpType> ops;
  for (const auto& [rank, pending] : reports_)
    for (const PendingOp& p : pending) {
      waiting[{p.process_set, p.name}].insert(rank);
      ops[{p.process_set, p.name}] = p.op;
    }
  std::map<std::pair<int32_t, std::string>, std::vector<int>> missing;
  for (const auto& [key, ranks] : waiting) {
    std::vector<int> must;
    if (ops[key] == OpType::kJoin) {
      for (int r = 0; r < world_size_; ++r) must.push_back(r);
    } else {
      must = sets.members(key.first);
    }
    std::vector<int>& absent = missing[key];
    for (int r : must)
      if (!ranks.count(r) && !(joined.count(r) && ops[key] == OpType::kAllreduce))
        absent.push_back(r);
    if (absent.empty()) return "";  // it can complete
  }
  std::string msg =
      "deadlock: every rank waits for a collective that a rank it needs never submitted, so "
      "none can complete:";
  for (const auto& [rank, pending] : reports_) {
    msg += " " + describe_rank(rank) + " waits for";
    size_t shown = 0;
    for (const PendingOp& p : pending) {
      if (shown++ == 3) {
        msg += " and " + std::to_string(pending.size() - 3) + " more";
        break;
      }
      msg += std::string(shown > 1 ? "," : "") + " " + op_type_name(p.op) + " '" + p.name + "'";
      const std::vector<int>& absent = missing[{p.process_set, p.name}];
      if (!absent.empty()) msg += " (not submitted by " + describe_ranks(absent) + ")";
    }
    msg += ";";
  }
  msg.back() = '.';
  msg += " The ranks submitted their collectives in different orders, or a rank skipped or "
         "renamed one: every member of a process set must submit the same named collectives "
         "(SPARK_HVD_DEADLOCK_CHECK_SECONDS=0 turns this check off)";
  return msg;
}

std::string DeadlockDetector::check(Clock::time_point now, const ProcessSets& sets,
                                    const std::set<int>& joined) {
  std::string msg = diagnose(sets, joined);
  if (msg.empty()) {
    suspected_ = false;
    return "";
  }
  if (!suspected_ || suspected_version_ != version_) {
    suspected_ = true;
    suspected_version_ = version_;
    suspected_at_ = now;
    return "";
  }
  return now - suspected_at_ >= confirm_ ? msg : "";
}

}  // namespace shvd
