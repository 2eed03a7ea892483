// Autotuning (Horovod's HOROVOD_AUTOTUNE): while training runs, rank 0 measures the bytes its
// collectives move per second over samples of a few steps each, and searches the engine's
// run-time settings (TunedParams: fusion threshold, cycle time, response cache on/off,
// hierarchical allreduce / allgather on/off) for the fastest, with Bayesian optimisation
// (bayes_opt.h). The engine sends each new setting with a response batch, so every rank
// switches at the same point (message.h, TunedParams); when the samples are spent it keeps the
// best setting for the rest of the job.
//
// A step is counted as Horovod counts it: a sample ends when some tensor name has been executed
// `steps_per_sample` times since the sample began and comes again. A sample's score is the
// median of its steps' scores (bytes over the step's time, a step running from the first
// response of one round of names to the first of the next): one slow step, another job's burst
// on a shared machine, does not decide which setting wins. The first `warmup_samples` samples
// (start-up, caches filling) are measured but not used. Settings the user gave
// explicitly are fixed, not tuned. Each sample is logged as Horovod logs it, one CSV row
// (the settings and the score), followed by one row with the best setting when tuning ends.
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "bayes_opt.h"
#include "message.h"

namespace shvd {

// Which settings the user fixed (not tuned); the values of shvd_init_options.autotune_fixed.
constexpr uint32_t kFixFusionThreshold = 1;
constexpr uint32_t kFixCycleTime = 2;
constexpr uint32_t kFixCache = 4;
constexpr uint32_t kFixHierarchicalAllreduce = 8;
constexpr uint32_t kFixHierarchicalAllgather = 16;

struct AutotuneOptions {
  bool enabled = false;
  std::string log_path;  // CSV of the samples, written by rank 0 ("" for none)
  int warmup_samples = 3;
  int steps_per_sample = 10;
  int max_samples = 20;   // Bayesian samples (HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES)
  double noise = 0.8;     // HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE
  uint32_t fixed = 0;     // kFix* bits
  // Whether the global set has a hierarchy that the switch would use (algorithms/
  // hierarchical.h: several hosts, more than one rank on some; allgather also needs each
  // host's ranks consecutive): only such a switch is tuned.
  bool hierarchical_allreduce_usable = false;
  bool hierarchical_allgather_usable = false;
  uint64_t seed = 12345;
};

// Ranges searched (Horovod's fusion range; the cycle range fits this engine's burst window,
// whose default is 0.5 ms, searched on a log scale).
constexpr double kTuneFusionMaxMiB = 64;
constexpr double kTuneCycleMinMs = 0.1;
constexpr double kTuneCycleMaxMs = 20;

// Rank 0's tuner. Engine thread only.
class Autotuner {
 public:
  using Clock = std::chrono::steady_clock;

  Autotuner(const AutotuneOptions& options, const TunedParams& initial);

  // Still sampling (a new setting may come).
  bool active() const { return active_; }
  // Rank 0 executed a response of `bytes` for these tensors. True when a sample ended and a
  // new setting is due: proposal() is it; the engine sends it and calls started() where rank 0
  // applies it. Nothing is measured in between.
  bool record(const std::vector<std::string>& names, size_t bytes, Clock::time_point now);
  const TunedParams& proposal() const { return proposal_; }
  void started(Clock::time_point now);

  // The dimensions searched, by name (fusion_threshold, cycle_time, cache_enabled,
  // hierarchical_allreduce, hierarchical_allgather).
  const std::vector<std::string>& dimensions() const { return names_; }
  // The CSV header Horovod writes (and so do we).
  static const char* log_header();

 private:
  void sample_done(double score, Clock::time_point now);
  std::vector<double> to_x(const TunedParams& p) const;
  TunedParams from_x(const std::vector<double>& x) const;
  // The first proposals: Horovod's seed points, then the model's choice.
  std::vector<double> next_x();
  void log_row(const TunedParams& p, double score);

  AutotuneOptions options_;
  TunedParams initial_, current_, proposal_;
  TunedParams best_;  // the best sample's setting
  double best_score_ = 0;
  std::vector<std::string> names_;
  std::unique_ptr<BayesianOptimizer> optimizer_;
  std::ofstream log_;
  bool active_ = false;
  bool waiting_ = false;  // a proposal is on its way
  int warmup_left_ = 0;
  int seeds_used_ = 0;
  std::unordered_map<std::string, int> counts_;
  // The sample's steps: the round of names the current one is (the highest count so far),
  // when it began and the bytes since, and the finished steps' scores.
  int step_ = 0;
  Clock::time_point step_start_;
  size_t step_bytes_ = 0;
  std::vector<double> step_scores_;
  void end_step(Clock::time_point now);
};

}  // namespace shvd
