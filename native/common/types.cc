// Names and sizes of the ABI enums; used for buffer arithmetic and for error messages that a user
// reads ("dtype mismatch: float32 vs int64"), so names follow NumPy/torch spelling.
#include "types.h"

#include <cstdio>
#include <map>
#include <mutex>

namespace shvd {

size_t dtype_size(DataType t) {
  switch (t) {
    case DataType::kUInt8:
    case DataType::kInt8:
    case DataType::kBool:
      return 1;
    case DataType::kInt16:
    case DataType::kUInt16:
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
    case DataType::kInt32:
    case DataType::kFloat32:
      return 4;
    case DataType::kInt64:
    case DataType::kFloat64:
      return 8;
  }
  throw OpMismatchError("unknown dtype code " + std::to_string(static_cast<int>(t)));
}

const char* op_type_name(OpType op) {
  switch (op) {
    case OpType::kAllreduce: return "allreduce";
    case OpType::kAllgather: return "allgather";
    case OpType::kBroadcast: return "broadcast";
    case OpType::kAlltoall: return "alltoall";
    case OpType::kReducescatter: return "reducescatter";
    case OpType::kBarrier: return "barrier";
    case OpType::kJoin: return "join";
    case OpType::kAddProcessSet: return "add_process_set";
    case OpType::kRemoveProcessSet: return "remove_process_set";
  }
  return "unknown";
}

const char* dtype_name(DataType t) {
  switch (t) {
    case DataType::kUInt8: return "uint8";
    case DataType::kInt8: return "int8";
    case DataType::kInt16: return "int16";
    case DataType::kUInt16: return "uint16";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kBool: return "bool";
  }
  return "unknown";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAverage: return "Average";
    case ReduceOp::kSum: return "Sum";
    case ReduceOp::kAdasum: return "Adasum";
    case ReduceOp::kMin: return "Min";
    case ReduceOp::kMax: return "Max";
    case ReduceOp::kProduct: return "Product";
  }
  return "unknown";
}

namespace {
std::mutex g_hosts_mu;
std::vector<std::string> g_rank_hosts;
}  // namespace

void set_rank_hosts(std::vector<std::string> hosts) {
  std::lock_guard<std::mutex> lock(g_hosts_mu);
  g_rank_hosts = std::move(hosts);
}

std::string describe_rank(int rank) {
  std::lock_guard<std::mutex> lock(g_hosts_mu);
  std::string out = "rank " + std::to_string(rank);
  if (rank >= 0 && size_t(rank) < g_rank_hosts.size() && !g_rank_hosts[rank].empty())
    out += " on " + g_rank_hosts[rank];
  return out;
}

std::string describe_ranks(const std::vector<int>& ranks) {
  std::lock_guard<std::mutex> lock(g_hosts_mu);
  // Hosts in order of their first rank, each with its ranks.
  std::vector<std::pair<std::string, std::string>> by_host;
  std::map<std::string, size_t> index;
  for (int r : ranks) {
    std::string host = r >= 0 && size_t(r) < g_rank_hosts.size() ? g_rank_hosts[r] : "";
    auto it = index.find(host);
    if (it == index.end()) {
      it = index.emplace(host, by_host.size()).first;
      by_host.emplace_back(host, "");
    }
    std::string& list = by_host[it->second].second;
    list += (list.empty() ? "" : ", ") + std::to_string(r);
  }
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < by_host.size(); ++i) {
    out += (i ? "; " : "") + by_host[i].second;
    if (!by_host[i].first.empty()) out += " on " + by_host[i].first;
  }
  return out;
}

std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}

}  // namespace shvd
