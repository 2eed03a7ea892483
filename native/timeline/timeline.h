// Chrome-trace (chrome://tracing, Perfetto) timeline of every tensor's phases: negotiation,
// fusion-buffer copies and the collective itself. Written by rank 0, which sees negotiation for
// every rank. Named as Horovod's: one row ("process") per op and tensor, "allreduce.<name>";
// negotiation as NEGOTIATE_<OP>, the collective as <OP> (ALLREDUCE, ...) with the path and the
// fusion-buffer copies inside it; CYCLE_START marks engine cycles when asked for.
#pragma once

#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <unordered_map>

#include "../common/types.h"

namespace shvd {

class Timeline {
 public:
  ~Timeline() { stop(); }
  // Opens `path` (truncating) and starts recording. Returns false with errno-style message.
  bool start(const std::string& path, bool mark_cycles, std::string* error);
  void stop();
  bool active() const { return file_ != nullptr; }
  bool mark_cycles() const { return mark_cycles_; }

  // Phases of tensor `tensor` of an `op`: the row is "<op>.<tensor>" (allreduce.grad.0).
  void begin(OpType op, const std::string& tensor, const char* phase);
  void end(OpType op, const std::string& tensor, const char* phase);
  void instant(OpType op, const std::string& tensor, const std::string& what);
  // An instant event on a row of its own named `row` (not a tensor's): "autotune".
  void mark(const std::string& row, const std::string& what);
  void cycle();

  // ALLREDUCE, ALLGATHER, ...: the phase a collective runs in.
  static const char* op_phase(OpType op);
  // NEGOTIATE_ALLREDUCE, ...: from a tensor's submission until every member has it.
  static const char* negotiate_phase(OpType op);

 private:
  int row_for(OpType op, const std::string& tensor);  // requires mu_
  int row_named(const std::string& label);            // requires mu_
  void write_event(int row, const char* ph, const std::string& name);  // requires mu_
  long long now_us() const;

  std::mutex mu_;
  FILE* file_ = nullptr;
  bool mark_cycles_ = false;
  bool first_event_ = true;
  std::chrono::steady_clock::time_point t0_;
  std::unordered_map<std::string, int> rows_;  // by "<op>.<tensor>"
};

}  // namespace shvd
