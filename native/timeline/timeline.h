// Chrome-trace (chrome://tracing, Perfetto) timeline of every tensor's phases: negotiation,
// fusion-buffer copies and the collective itself. One row ("process") per tensor name.
// Written by rank 0, which sees negotiation for every rank.
#pragma once

#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>

namespace shvd {

class Timeline {
 public:
  ~Timeline() { stop(); }
  // Opens `path` (truncating) and starts recording. Returns false with errno-style message.
  bool start(const std::string& path, bool mark_cycles, std::string* error);
  void stop();
  bool active() const { return file_ != nullptr; }
  bool mark_cycles() const { return mark_cycles_; }

  void begin(const std::string& tensor, const char* phase);
  void end(const std::string& tensor, const char* phase);
  void instant(const std::string& tensor, const std::string& what);
  void cycle();

 private:
  int row_for(const std::string& tensor);  // requires mu_
  void write_event(int row, const char* ph, const std::string& name);  // requires mu_
  long long now_us() const;

  std::mutex mu_;
  FILE* file_ = nullptr;
  bool mark_cycles_ = false;
  bool first_event_ = true;
  std::chrono::steady_clock::time_point t0_;
  std::unordered_map<std::string, int> rows_;
};

}  // namespace shvd
