// Bayesian optimisation on the unit cube, small enough for autotuning (autotune.h): a Gaussian
// process with a squared-exponential kernel, fitted exactly (Cholesky) to a few tens of samples,
// and the next point chosen by maximising expected improvement over random and local
// candidates. Horovod does the same with Eigen and L-BFGS; at these sizes a dense solve and a
// few thousand candidate evaluations cost well under a millisecond, and the core stays free of
// dependencies.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace shvd {

// Gaussian-process regression: y ~ GP(0, k) + noise, k(a, b) = exp(-|a - b|^2 / (2 l^2)).
// Targets are normalised (mean 0, deviation 1) before fitting, so `noise` is relative to the
// spread of the observed scores (Horovod's HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE).
class GaussianProcess {
 public:
  explicit GaussianProcess(double noise) : noise_(noise) {}

  // Fits to the samples; the length scale is the one of a fixed ladder that maximises the
  // marginal likelihood (a grid search is exact enough for a handful of dimensions).
  void fit(const std::vector<std::vector<double>>& x, const std::vector<double>& y);
  // Posterior mean and standard deviation at `x`, in the units of the fitted y.
  void predict(const std::vector<double>& x, double* mean, double* stddev) const;
  double length_scale() const { return length_; }

 private:
  double kernel(const std::vector<double>& a, const std::vector<double>& b) const;
  // Factorises K + noise I with the current length scale; returns the log marginal likelihood
  // (or -inf when the matrix is not positive definite).
  double factorise();

  double noise_;
  double length_ = 0.3;
  std::vector<std::vector<double>> x_;
  std::vector<double> y_;  // normalised
  double y_mean_ = 0, y_scale_ = 1;
  std::vector<double> chol_;   // lower triangle of K + noise I, row-major n x n
  std::vector<double> alpha_;  // (K + noise I)^-1 y
};

// Expected improvement of a prediction over the best value seen so far (maximisation), with
// exploration margin `xi`.
double expected_improvement(double mean, double stddev, double best, double xi);

// Proposes points of [0, 1]^d (some dimensions may be binary: only 0 or 1) to maximise an
// unknown function from noisy samples.
class BayesianOptimizer {
 public:
  BayesianOptimizer(std::vector<bool> binary, double noise, uint64_t seed);

  void add_sample(const std::vector<double>& x, double y);
  size_t samples() const { return y_.size(); }
  // The point of highest expected improvement (random when there are no samples yet).
  std::vector<double> next();
  // The sample with the highest observed value.
  const std::vector<double>& best_x() const;
  double best_y() const;

 private:
  std::vector<double> random_point();
  std::vector<double> perturbed(const std::vector<double>& x, double spread);

  std::vector<bool> binary_;
  GaussianProcess gp_;
  std::mt19937_64 rng_;
  std::vector<std::vector<double>> x_;
  std::vector<double> y_;
};

}  // namespace shvd
