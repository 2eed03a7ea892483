#include "bayes_opt.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace shvd {

namespace {
constexpr double kLengthLadder[] = {0.08, 0.15, 0.25, 0.4, 0.6, 1.0};
constexpr int kRandomCandidates = 2000;
constexpr int kLocalCandidates = 500;  // around each of the best few samples
constexpr double kXi = 0.1;

// Solves L z = b (forward) then L^T x = z (backward) for the lower-triangular n x n `l`.
std::vector<double> cholesky_solve(const std::vector<double>& l, size_t n, std::vector<double> b) {
  for (size_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < i; ++k) b[i] -= l[i * n + k] * b[k];
    b[i] /= l[i * n + i];
  }
  for (size_t i = n; i-- > 0;) {
    for (size_t k = i + 1; k < n; ++k) b[i] -= l[k * n + i] * b[k];
    b[i] /= l[i * n + i];
  }
  return b;
}
}  // namespace

double GaussianProcess::kernel(const std::vector<double>& a, const std::vector<double>& b) const {
  double d2 = 0;
  for (size_t i = 0; i < a.size(); ++i) d2 += (a[i] - b[i]) * (a[i] - b[i]);
  return std::exp(-d2 / (2 * length_ * length_));
}

double GaussianProcess::factorise() {
  const size_t n = x_.size();
  chol_.assign(n * n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j <= i; ++j) {
      double s = kernel(x_[i], x_[j]) + (i == j ? noise_ + 1e-9 : 0.0);
      for (size_t k = 0; k < j; ++k) s -= chol_[i * n + k] * chol_[j * n + k];
      if (i == j) {
        if (s <= 0) return -std::numeric_limits<double>::infinity();
        chol_[i * n + i] = std::sqrt(s);
      } else {
        chol_[i * n + j] = s / chol_[j * n + j];
      }
    }
  }
  alpha_ = cholesky_solve(chol_, n, y_);
  // log p(y) = -y^T alpha / 2 - sum log L_ii - n log(2 pi) / 2
  double fit = 0, logdet = 0;
  for (size_t i = 0; i < n; ++i) {
    fit += y_[i] * alpha_[i];
    logdet += std::log(chol_[i * n + i]);
  }
  return -0.5 * fit - logdet - 0.5 * double(n) * std::log(2 * M_PI);
}

void GaussianProcess::fit(const std::vector<std::vector<double>>& x, const std::vector<double>& y) {
  if (x.size() != y.size() || x.empty())
    throw std::invalid_argument("GaussianProcess::fit needs as many targets as points, > 0");
  x_ = x;
  double sum = 0, sq = 0;
  for (double v : y) sum += v;
  y_mean_ = sum / double(y.size());
  for (double v : y) sq += (v - y_mean_) * (v - y_mean_);
  y_scale_ = std::sqrt(sq / double(y.size()));
  if (!(y_scale_ > 0)) y_scale_ = std::max(std::abs(y_mean_), 1.0);
  y_.clear();
  for (double v : y) y_.push_back((v - y_mean_) / y_scale_);
  double best = -std::numeric_limits<double>::infinity(), best_length = kLengthLadder[0];
  for (double l : kLengthLadder) {
    length_ = l;
    const double likelihood = factorise();
    if (likelihood > best) {
      best = likelihood;
      best_length = l;
    }
  }
  length_ = best_length;
  factorise();
}

void GaussianProcess::predict(const std::vector<double>& x, double* mean, double* stddev) const {
  const size_t n = x_.size();
  std::vector<double> k(n);
  double m = 0;
  for (size_t i = 0; i < n; ++i) {
    k[i] = kernel(x, x_[i]);
    m += k[i] * alpha_[i];
  }
  // var = k(x, x) - v^T v with L v = k
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < i; ++j) k[i] -= chol_[i * n + j] * k[j];
    k[i] /= chol_[i * n + i];
  }
  double var = 1.0;
  for (double v : k) var -= v * v;
  *mean = m * y_scale_ + y_mean_;
  *stddev = std::sqrt(std::max(var, 0.0)) * y_scale_;
}

double expected_improvement(double mean, double stddev, double best, double xi) {
  const double gain = mean - best - xi;
  if (stddev <= 0) return std::max(gain, 0.0);
  const double z = gain / stddev;
  const double pdf = std::exp(-0.5 * z * z) / std::sqrt(2 * M_PI);
  const double cdf = 0.5 * std::erfc(-z * M_SQRT1_2);
  return gain * cdf + stddev * pdf;
}

BayesianOptimizer::BayesianOptimizer(std::vector<bool> binary, double noise, uint64_t seed)
    : binary_(std::move(binary)), gp_(noise), rng_(seed) {}

void BayesianOptimizer::add_sample(const std::vector<double>& x, double y) {
  if (x.size() != binary_.size())
    throw std::invalid_argument("BayesianOptimizer: sample of the wrong dimension");
  x_.push_back(x);
  y_.push_back(y);
}

std::vector<double> BayesianOptimizer::random_point() {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> x(binary_.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = binary_[i] ? (u(rng_) < 0.5 ? 0.0 : 1.0) : u(rng_);
  return x;
}

std::vector<double> BayesianOptimizer::perturbed(const std::vector<double>& x, double spread) {
  std::normal_distribution<double> step(0.0, spread);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> out = x;
  for (size_t i = 0; i < out.size(); ++i) {
    if (binary_[i]) {
      if (u(rng_) < 0.2) out[i] = 1.0 - out[i];  // flip a switch now and then
    } else {
      out[i] = std::clamp(out[i] + step(rng_), 0.0, 1.0);
    }
  }
  return out;
}

std::vector<double> BayesianOptimizer::next() {
  if (y_.empty()) return random_point();
  gp_.fit(x_, y_);
  // The incumbent as the model sees it (its mean at the best sample): with noisy scores the
  // raw maximum overstates it and EI would stop exploring.
  double incumbent = -std::numeric_limits<double>::infinity();
  for (const auto& x : x_) {
    double m, s;
    gp_.predict(x, &m, &s);
    incumbent = std::max(incumbent, m);
  }
  double scale = 0;
  {
    double m, s;
    gp_.predict(random_point(), &m, &s);
    scale = std::max(s, 1e-12);  // xi relative to the prior spread
  }
  std::vector<double> best_candidate = random_point();
  double best_ei = -1;
  auto consider = [&](std::vector<double> c) {
    double m, s;
    gp_.predict(c, &m, &s);
    const double ei = expected_improvement(m, s, incumbent, kXi * scale);
    if (ei > best_ei) {
      best_ei = ei;
      best_candidate = std::move(c);
    }
  };
  for (int i = 0; i < kRandomCandidates; ++i) consider(random_point());
  // Local candidates around the best three samples, at two spreads.
  std::vector<size_t> order(y_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return y_[a] > y_[b]; });
  for (size_t r = 0; r < std::min<size_t>(3, order.size()); ++r)
    for (int i = 0; i < kLocalCandidates / 3; ++i)
      consider(perturbed(x_[order[r]], i % 2 ? 0.05 : 0.15));
  return best_candidate;
}

const std::vector<double>& BayesianOptimizer::best_x() const {
  if (y_.empty()) throw std::logic_error("BayesianOptimizer: no samples");
  return x_[size_t(std::max_element(y_.begin(), y_.end()) - y_.begin())];
}

double BayesianOptimizer::best_y() const {
  if (y_.empty()) throw std::logic_error("BayesianOptimizer: no samples");
  return *std::max_element(y_.begin(), y_.end());
}

}  // namespace shvd
