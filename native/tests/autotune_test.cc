// Autotuning's parts without a job: the Gaussian process, the Bayesian optimiser on functions
// whose maximum is known, the tuner's sampling (steps, warm-up, fixed settings, the log) and
// the settings' place in the response batch encoding.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <unistd.h>

#include "../controller/autotune.h"
#include "../controller/bayes_opt.h"
#include "../controller/message.h"
#include "harness.h"

using namespace shvd;

namespace {

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

// Feeds the tuner steps of two tensors until it proposes a setting; returns the steps taken.
int steps_until_proposal(Autotuner& t, double score_bytes, int limit = 1000) {
  auto now = Autotuner::Clock::now();
  for (int step = 1; step <= limit; ++step) {
    for (const char* name : {"grad.a", "grad.b"}) {
      now += std::chrono::milliseconds(1);
      if (t.record({name}, size_t(score_bytes), now)) return step;
    }
  }
  return -1;
}

// Autotuning on, with `warmup` warm-up samples and `samples` samples of `steps` steps.
AutotuneOptions tuning(int warmup, int steps, int samples) {
  AutotuneOptions o;
  o.enabled = true;
  o.warmup_samples = warmup;
  o.steps_per_sample = steps;
  o.max_samples = samples;
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && argv[1][0]) shvd_test::g_filter = argv[1];

  shvd_test::run_test("gp_interpolates_its_samples", [] {
    GaussianProcess gp(1e-6);
    std::vector<std::vector<double>> x;
    std::vector<double> y;
    for (int i = 0; i <= 10; ++i) {
      x.push_back({i / 10.0});
      y.push_back(100 + 20 * std::sin(6 * i / 10.0));
    }
    gp.fit(x, y);
    for (size_t i = 0; i < x.size(); ++i) {
      double m, s;
      gp.predict(x[i], &m, &s);
      CHECK(std::abs(m - y[i]) < 0.5);
      CHECK(s < 1.0);
    }
    double m, s;
    gp.predict({0.55}, &m, &s);  // between samples: close to the function
    CHECK(std::abs(m - (100 + 20 * std::sin(3.3))) < 2);
  });

  shvd_test::run_test("expected_improvement_prefers_uncertain_and_better", [] {
    CHECK(expected_improvement(1.0, 0.0, 0.5, 0) == 0.5);
    CHECK(expected_improvement(0.0, 0.0, 0.5, 0) == 0.0);
    CHECK(expected_improvement(0.5, 1.0, 0.5, 0) > expected_improvement(0.5, 0.1, 0.5, 0));
    CHECK(expected_improvement(0.6, 0.1, 0.5, 0) > expected_improvement(0.4, 0.1, 0.5, 0));
  });

  shvd_test::run_test("bayes_opt_finds_a_known_maximum", [] {
    // A smooth 2-D bowl plus a switch worth 20 %, observed with 2 % noise: 20 samples land
    // within 5 % of the maximum (a 5 x 5 x 2 grid needs 50).
    std::mt19937_64 noise_rng(7);
    std::normal_distribution<double> noise(0, 0.02);
    auto f = [](const std::vector<double>& x) {
      return (1 - (x[0] - 0.3) * (x[0] - 0.3) - (x[1] - 0.7) * (x[1] - 0.7)) *
             (x[2] > 0.5 ? 1.0 : 0.8);
    };
    int hits = 0;
    for (uint64_t seed = 1; seed <= 5; ++seed) {
      BayesianOptimizer opt({false, false, true}, 0.05, seed);
      for (int i = 0; i < 20; ++i) {
        const std::vector<double> x = opt.next();
        CHECK(x.size() == 3 && x[0] >= 0 && x[0] <= 1 && x[1] >= 0 && x[1] <= 1);
        CHECK(x[2] == 0.0 || x[2] == 1.0);
        opt.add_sample(x, f(x) * (1 + noise(noise_rng)));
      }
      std::printf("  seed %d: best f %.3f at (%.2f %.2f %.0f)\n", int(seed), f(opt.best_x()),
                  opt.best_x()[0], opt.best_x()[1], opt.best_x()[2]);
      if (f(opt.best_x()) > 0.95) ++hits;
    }
    CHECK(hits >= 4);
  });

  shvd_test::run_test("tuner_samples_steps_warms_up_and_logs", [] {
    char path[] = "/tmp/shvd_autotune_testXXXXXX";
    const int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    AutotuneOptions o;
    o.enabled = true;
    o.log_path = path;
    o.warmup_samples = 2;
    o.steps_per_sample = 3;
    o.max_samples = 4;
    TunedParams initial;
    initial.fusion_threshold_bytes = 1 << 20;
    initial.cycle_time_ms = 0.5;
    Autotuner t(o, initial);
    CHECK(t.active());
    CHECK(t.dimensions().size() == 3);  // one host: no hierarchical switches
    // Warm-up samples end without a proposal; the first real sample after 3 steps more.
    // (A sample ends at the first tensor of the step after its last one.)
    CHECK(steps_until_proposal(t, 1000) == 3 * 3 + 1);
    CHECK(!t.record({"grad.a"}, 1, Autotuner::Clock::now()));  // nothing while waiting
    std::vector<TunedParams> seen{t.proposal()};
    for (int i = 0; i < 3; ++i) {
      t.started(Autotuner::Clock::now());
      CHECK(steps_until_proposal(t, 1000 * (i + 2)) == 3 + 1);
      seen.push_back(t.proposal());
    }
    CHECK(!t.active());
    CHECK(!seen.back().tuning && seen.front().tuning);
    // The best sample was the last one measured (the highest bytes per step): kept.
    CHECK(seen.back() == [&] { TunedParams p = seen[2]; p.tuning = false; return p; }());
    const auto lines = read_lines(path);
    CHECK(lines.size() == 1 + 4 + 1);
    CHECK(lines[0] == Autotuner::log_header());
    CHECK(lines[1].rfind("-1,-1,0,1,0.500,1.000000,", 0) == 0);  // the initial setting first
    CHECK(lines[5] == lines[4]);  // the best row repeats the best sample
    unlink(path);
  });

  shvd_test::run_test("tuner_keeps_fixed_settings", [] {
    AutotuneOptions o = tuning(0, 1, 6);
    o.fixed = kFixFusionThreshold | kFixCache;
    o.hierarchical_allreduce_usable = o.hierarchical_allgather_usable = true;
    TunedParams initial;
    initial.fusion_threshold_bytes = 12345;
    Autotuner t(o, initial);
    CHECK(t.dimensions() == (std::vector<std::string>{"cycle_time", "hierarchical_allreduce",
                                                        "hierarchical_allgather"}));
    bool cycle_changed = false, hierarchical_on = false;
    for (int i = 0; i < 6; ++i) {
      CHECK(steps_until_proposal(t, 100 + i) > 0);
      CHECK(t.proposal().fusion_threshold_bytes == 12345 && t.proposal().cache_enabled);
      cycle_changed = cycle_changed || t.proposal().cycle_time_ms != initial.cycle_time_ms;
      hierarchical_on = hierarchical_on || t.proposal().hierarchical_allreduce == 1;
      t.started(Autotuner::Clock::now());
    }
    CHECK(cycle_changed && hierarchical_on && !t.active());
    AutotuneOptions all_fixed = o;
    all_fixed.fixed = kFixFusionThreshold | kFixCycleTime | kFixCache;
    all_fixed.hierarchical_allreduce_usable = all_fixed.hierarchical_allgather_usable = false;
    CHECK(!Autotuner(all_fixed, initial).active());
    // A switch the set's hierarchy cannot use is not tuned: hosts not in blocks (allgather).
    AutotuneOptions interleaved = o;
    interleaved.hierarchical_allgather_usable = false;
    CHECK(Autotuner(interleaved, initial).dimensions() ==
          (std::vector<std::string>{"cycle_time", "hierarchical_allreduce"}));
  });

  shvd_test::run_test("tuner_scores_the_median_step", [] {
    // Two samples of 5 steps with the same bytes per step: the first has one step 50x slower
    // (another job's burst), the second runs every step 1.2x slower. The median step decides:
    // the first scores higher (the mean would have picked the second).
    Autotuner t(tuning(0, 5, 2), TunedParams{});
    auto run = [&](std::vector<int> step_ms) {
      auto now = Autotuner::Clock::now();
      t.started(now);
      for (int ms : step_ms) {
        CHECK(!t.record({"grad.a"}, 1000, now));
        now += std::chrono::milliseconds(ms);
      }
      return t.record({"grad.a"}, 1000, now);  // the sixth round ends the sample
    };
    CHECK(run({10, 10, 500, 10, 10}));
    CHECK(run({12, 12, 12, 12, 12}));
    CHECK(!t.active());
    // The setting kept is the first sample's (the initial one): its median step was faster.
    CHECK(t.proposal().fusion_threshold_bytes == TunedParams{}.fusion_threshold_bytes);
  });

  shvd_test::run_test("settings_travel_in_a_response_batch", [] {
    ResponseBatch b;
    CHECK(!decode_response_batch(encode(b)).has_params);
    b.has_params = true;
    b.params.fusion_threshold_bytes = 3 << 20;
    b.params.cycle_time_ms = 2.5;
    b.params.cache_enabled = false;
    b.params.hierarchical_allreduce = 1;
    b.params.hierarchical_allgather = 0;
    b.params.tuning = true;
    b.responses.emplace_back();
    b.responses.back().names = {"x"};
    const ResponseBatch d = decode_response_batch(encode(b));
    CHECK(d.has_params && d.params == b.params && d.responses.size() == 1);
  });

  return shvd_test::summary();
}
