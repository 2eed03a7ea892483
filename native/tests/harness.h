// The few lines every standalone C++ test program here shares: CHECK, run_test (runs one named
// test, catching its failure) and the summary line ("N passed, M failed") that the pytest file
// running the program checks. Header-only: each program is one translation unit of its own.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>

namespace shvd_test {

inline int g_passed = 0, g_failed = 0;
inline const char* g_filter = nullptr;  // argv[1]: run only tests whose name contains it

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

inline void run_test(const char* name, const std::function<void()>& fn) {
  if (g_filter && !std::strstr(name, g_filter)) return;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    fn();
    ++g_passed;
    std::printf("PASS %-44s %6.2f s\n", name, seconds_since(t0));
  } catch (const std::exception& e) {
    ++g_failed;
    std::printf("FAIL %-44s %s\n", name, e.what());
  }
  std::fflush(stdout);
}

// Prints the summary; the program's exit status.
inline int summary() {
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}

}  // namespace shvd_test

#define CHECK(cond)                                                                          \
  do {                                                                                       \
    if (!(cond))                                                                             \
      throw shvd_test::Failure(std::string(__FILE__ ":") + std::to_string(__LINE__) +        \
                               ": CHECK(" #cond ") failed");                                 \
  } while (0)
