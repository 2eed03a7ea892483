#include "timeline.h"

#include <cerrno>
#include <cstring>

namespace shvd {

namespace {
std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') { out += '\\'; out += c; }
    else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else out += c;
  }
  return out;
}
}  // namespace

bool Timeline::start(const std::string& path, bool mark_cycles, std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_) {
    fputs("\n]\n", file_);
    fclose(file_);
    file_ = nullptr;
  }
  file_ = fopen(path.c_str(), "w");
  if (!file_) {
    *error = "cannot open timeline file '" + path + "': " + strerror(errno);
    return false;
  }
  fputs("[\n", file_);
  first_event_ = true;
  mark_cycles_ = mark_cycles;
  rows_.clear();
  t0_ = std::chrono::steady_clock::now();
  return true;
}

void Timeline::stop() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!file_) return;
  fputs("\n]\n", file_);
  fclose(file_);
  file_ = nullptr;
}

long long Timeline::now_us() const {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now() - t0_).count();
}

const char* Timeline::op_phase(OpType op) {
  switch (op) {
    case OpType::kAllreduce: return "ALLREDUCE";
    case OpType::kAllgather: return "ALLGATHER";
    case OpType::kBroadcast: return "BROADCAST";
    case OpType::kAlltoall: return "ALLTOALL";
    case OpType::kReducescatter: return "REDUCESCATTER";
    case OpType::kBarrier: return "BARRIER";
    case OpType::kJoin: return "JOIN";
    case OpType::kAddProcessSet: return "ADD_PROCESS_SET";
    case OpType::kRemoveProcessSet: return "REMOVE_PROCESS_SET";
  }
  return "COLLECTIVE";
}

const char* Timeline::negotiate_phase(OpType op) {
  switch (op) {
    case OpType::kAllreduce: return "NEGOTIATE_ALLREDUCE";
    case OpType::kAllgather: return "NEGOTIATE_ALLGATHER";
    case OpType::kBroadcast: return "NEGOTIATE_BROADCAST";
    case OpType::kAlltoall: return "NEGOTIATE_ALLTOALL";
    case OpType::kReducescatter: return "NEGOTIATE_REDUCESCATTER";
    case OpType::kBarrier: return "NEGOTIATE_BARRIER";
    case OpType::kJoin: return "NEGOTIATE_JOIN";
    case OpType::kAddProcessSet: return "NEGOTIATE_ADD_PROCESS_SET";
    case OpType::kRemoveProcessSet: return "NEGOTIATE_REMOVE_PROCESS_SET";
  }
  return "NEGOTIATE";
}

int Timeline::row_for(OpType op, const std::string& tensor) {
  return row_named(std::string(op_type_name(op)) + "." + tensor);
}

int Timeline::row_named(const std::string& label) {
  auto it = rows_.find(label);
  if (it != rows_.end()) return it->second;
  int row = int(rows_.size()) + 1;
  rows_[label] = row;
  fprintf(file_, "%s{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": \"%s\"}}",
          first_event_ ? "" : ",\n", row, json_escape(label).c_str());
  first_event_ = false;
  return row;
}

void Timeline::write_event(int row, const char* ph, const std::string& name) {
  fprintf(file_, "%s{\"name\": \"%s\", \"ph\": \"%s\", \"ts\": %lld, \"pid\": %d, \"tid\": 0%s}",
          first_event_ ? "" : ",\n", json_escape(name).c_str(), ph, now_us(), row,
          ph[0] == 'i' ? ", \"s\": \"p\"" : "");
  first_event_ = false;
  // Readable while the job runs, as Horovod's writer leaves it (its tests read the file right
  // after an op); the timeline is a debugging aid, so a write per event is an accepted cost.
  fflush(file_);
}

void Timeline::begin(OpType op, const std::string& tensor, const char* phase) {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_) write_event(row_for(op, tensor), "B", phase);
}

void Timeline::end(OpType op, const std::string& tensor, const char* phase) {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_) write_event(row_for(op, tensor), "E", phase);
}

void Timeline::instant(OpType op, const std::string& tensor, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_) write_event(row_for(op, tensor), "i", what);
}

void Timeline::mark(const std::string& row, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_) write_event(row_named(row), "i", what);
}

void Timeline::cycle() {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ && mark_cycles_) write_event(0, "i", "CYCLE_START");
}

}  // namespace shvd
