#include "autotune.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "../common/logging.h"

namespace shvd {

namespace {
constexpr double kMiB = 1024.0 * 1024.0;

// Horovod's seed points (fusion MiB, cycle ms): (4, 5), (32, 50), (16, 25), (8, 10), with the
// cycle times scaled into our range. Switches alternate so both values of each are seen early.
struct Seed {
  double fusion_mib, cycle_ms;
};
constexpr Seed kSeeds[] = {{4, 1}, {32, 10}, {16, 5}, {8, 2}};

double cycle_to_unit(double ms) {
  const double c = std::clamp(ms, kTuneCycleMinMs, kTuneCycleMaxMs);
  return std::log(c / kTuneCycleMinMs) / std::log(kTuneCycleMaxMs / kTuneCycleMinMs);
}
double unit_to_cycle(double u) {
  return kTuneCycleMinMs * std::pow(kTuneCycleMaxMs / kTuneCycleMinMs, std::clamp(u, 0.0, 1.0));
}
// A hierarchical switch as the model sees it: off 0, on 1, and the dispatcher's own choice
// (-1, the initial setting unless the user forced one) in between: it may be either.
double switch_to_unit(int32_t value) { return value < 0 ? 0.5 : value > 0 ? 1.0 : 0.0; }
}  // namespace

const char* Autotuner::log_header() {
  return "hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,"
         "cycle_time_ms,tensor_fusion_threshold,score";
}

Autotuner::Autotuner(const AutotuneOptions& options, const TunedParams& initial)
    : options_(options), initial_(initial), current_(initial), proposal_(initial) {
  const uint32_t fixed = options_.fixed;
  if (!(fixed & kFixFusionThreshold)) names_.push_back("fusion_threshold");
  if (!(fixed & kFixCycleTime)) names_.push_back("cycle_time");
  if (!(fixed & kFixCache)) names_.push_back("cache_enabled");
  if (options_.hierarchical_allreduce_usable && !(fixed & kFixHierarchicalAllreduce))
    names_.push_back("hierarchical_allreduce");
  if (options_.hierarchical_allgather_usable && !(fixed & kFixHierarchicalAllgather))
    names_.push_back("hierarchical_allgather");
  std::vector<bool> binary;
  for (const auto& n : names_) binary.push_back(n != "fusion_threshold" && n != "cycle_time");
  optimizer_ = std::make_unique<BayesianOptimizer>(binary, options_.noise, options_.seed);
  if (!options_.log_path.empty()) {
    log_.open(options_.log_path, std::ios::out | std::ios::trunc);
    // Only rank 0 writes it, so a failure here must not fail init on this rank alone (the
    // Python side checks the folder on every rank before init).
    if (log_.good())
      log_ << log_header() << std::endl;
    else
      log_message(LogLevel::kWarning, "autotune: cannot write the log file %s; not logging",
                  options_.log_path.c_str());
  }
  active_ = options_.enabled && !names_.empty() && options_.max_samples > 0;
  current_.tuning = proposal_.tuning = active_;
  warmup_left_ = options_.warmup_samples;
  started(Clock::now());
  waiting_ = false;
  if (active_) {
    std::string dims;
    for (const auto& n : names_) dims += (dims.empty() ? "" : ",") + n;
    log_message(LogLevel::kInfo, "autotune: tuning [%s], %d warm-up and %d samples of %d steps",
                dims.c_str(), options_.warmup_samples, options_.max_samples,
                options_.steps_per_sample);
  } else if (options_.enabled) {
    log_message(LogLevel::kWarning,
                "autotune: nothing to tune (every tunable setting was given explicitly)");
  }
}

bool Autotuner::record(const std::vector<std::string>& names, size_t bytes,
                       Clock::time_point now) {
  if (!active_ || waiting_) return false;
  int round = 0;
  for (const auto& n : names) round = std::max(round, ++counts_[n]);
  if (round > options_.steps_per_sample) {
    end_step(now);
    std::vector<double> scores = step_scores_;
    std::nth_element(scores.begin(), scores.begin() + scores.size() / 2, scores.end());
    sample_done(scores.empty() ? 0.0 : scores[scores.size() / 2], now);
    if (waiting_) return true;
    // A warm-up sample ended: this response opens the next one.
    for (const auto& m : names) counts_[m] = 1;
    step_ = 1;
    step_bytes_ = bytes;
    return false;
  }
  // The first response of the next round of names ends the step before it.
  if (round > step_) {
    if (step_ > 0) end_step(now);
    step_ = round;
  }
  step_bytes_ += bytes;
  return false;
}

void Autotuner::end_step(Clock::time_point now) {
  const double seconds = std::chrono::duration<double>(now - step_start_).count();
  if (step_bytes_ > 0) step_scores_.push_back(seconds > 0 ? double(step_bytes_) / seconds : 0.0);
  step_start_ = now;
  step_bytes_ = 0;
}

void Autotuner::started(Clock::time_point now) {
  waiting_ = false;
  current_ = proposal_;
  counts_.clear();
  step_ = 0;
  step_start_ = now;
  step_bytes_ = 0;
  step_scores_.clear();
}

std::vector<double> Autotuner::to_x(const TunedParams& p) const {
  std::vector<double> x;
  for (const auto& n : names_) {
    if (n == "fusion_threshold")
      x.push_back(std::clamp(double(p.fusion_threshold_bytes) / kMiB / kTuneFusionMaxMiB, 0.0, 1.0));
    else if (n == "cycle_time")
      x.push_back(cycle_to_unit(p.cycle_time_ms));
    else if (n == "cache_enabled")
      x.push_back(p.cache_enabled ? 1 : 0);
    else if (n == "hierarchical_allreduce")
      x.push_back(switch_to_unit(p.hierarchical_allreduce));
    else
      x.push_back(switch_to_unit(p.hierarchical_allgather));
  }
  return x;
}

TunedParams Autotuner::from_x(const std::vector<double>& x) const {
  TunedParams p = initial_;
  for (size_t i = 0; i < names_.size(); ++i) {
    const std::string& n = names_[i];
    if (n == "fusion_threshold")
      // Whole KiB: the log shows round numbers and every rank gets the exact same value.
      p.fusion_threshold_bytes = uint64_t(std::llround(x[i] * kTuneFusionMaxMiB * 1024)) * 1024;
    else if (n == "cycle_time")
      p.cycle_time_ms = std::round(unit_to_cycle(x[i]) * 1000) / 1000;
    else if (n == "cache_enabled")
      p.cache_enabled = x[i] > 0.5;
    else if (n == "hierarchical_allreduce")
      p.hierarchical_allreduce = x[i] > 0.5 ? 1 : 0;
    else
      p.hierarchical_allgather = x[i] > 0.5 ? 1 : 0;
  }
  return p;
}

std::vector<double> Autotuner::next_x() {
  if (seeds_used_ < int(std::size(kSeeds))) {
    const Seed& s = kSeeds[seeds_used_++];
    TunedParams p = initial_;
    p.fusion_threshold_bytes = uint64_t(s.fusion_mib * kMiB);
    p.cycle_time_ms = s.cycle_ms;
    const int flip = seeds_used_ % 2;  // 1, 0, 1, 0: the other value of each switch first
    p.cache_enabled = flip ? !initial_.cache_enabled : initial_.cache_enabled;
    p.hierarchical_allreduce = flip ? (initial_.hierarchical_allreduce > 0 ? 0 : 1)
                                    : (initial_.hierarchical_allreduce > 0 ? 1 : 0);
    p.hierarchical_allgather = flip ? 0 : 1;
    return to_x(p);
  }
  return optimizer_->next();
}

void Autotuner::log_row(const TunedParams& p, double score) {
  log_message(LogLevel::kInfo,
              "autotune: [hierarchical_allreduce %d, hierarchical_allgather %d, cache %d, "
              "cycle %.3f ms, fusion %.3f MiB] %.6g bytes/s",
              p.hierarchical_allreduce, p.hierarchical_allgather, int(p.cache_enabled),
              p.cycle_time_ms, double(p.fusion_threshold_bytes) / kMiB, score);
  if (!log_.is_open()) return;
  char line[256];
  std::snprintf(line, sizeof line, "%d,%d,0,%d,%.3f,%.6f,%.6g", p.hierarchical_allreduce,
                p.hierarchical_allgather, int(p.cache_enabled), p.cycle_time_ms,
                double(p.fusion_threshold_bytes) / kMiB, score);
  log_ << line << std::endl;
}

void Autotuner::sample_done(double score, Clock::time_point now) {
  if (warmup_left_ > 0) {
    --warmup_left_;
    log_message(LogLevel::kDebug, "autotune: warming up (%d samples left)", warmup_left_);
    started(now);  // same setting, a fresh sample
    return;
  }
  log_row(current_, score);
  optimizer_->add_sample(to_x(current_), score);
  if (score > best_score_ || optimizer_->samples() == 1) {
    // The setting itself, not from_x(to_x(...)): the initial one may lie outside the ranges
    // searched (a 128 MiB threshold) or leave a switch to the dispatcher.
    best_ = current_;
    best_score_ = score;
  }
  if (int(optimizer_->samples()) >= options_.max_samples) {
    proposal_ = best_;
    proposal_.tuning = false;
    active_ = false;
    log_message(LogLevel::kInfo, "autotune: done; keeping the best setting");
    log_row(proposal_, best_score_);
  } else {
    proposal_ = from_x(next_x());
    proposal_.tuning = true;
  }
  waiting_ = true;
}

}  // namespace shvd
