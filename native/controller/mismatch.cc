#include "mismatch.h"

#include <algorithm>
#include <sstream>

namespace shvd {

namespace {

// "[4, 3]".
template <typename T>
std::string list_str(const std::vector<T>& values) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < values.size(); ++i) s << (i ? ", " : "") << values[i];
  s << "]";
  return s.str();
}

std::string shape_str(const std::vector<int64_t>& shape) { return list_str(shape); }

// Groups ranks by the value `key` gives them and describes the disagreement, e.g.
// "ranks [0, 2] sent [4, 3]; ranks [1] sent [5, 3]". Empty string when all agree.
template <typename Key>
std::string disagreement(const std::vector<int>& ranks, Key key) {
  // Fast path (every tensor, every step): compare the formatted values only when needed.
  const std::string first = key(ranks.front());
  bool all_same = true;
  for (size_t i = 1; i < ranks.size() && all_same; ++i) all_same = key(ranks[i]) == first;
  if (all_same) return "";
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r : ranks) {
    std::string k = key(r);
    auto it = std::find_if(groups.begin(), groups.end(), [&](auto& g) { return g.first == k; });
    if (it == groups.end()) groups.push_back({k, {r}});
    else it->second.push_back(r);
  }
  if (groups.size() <= 1) return "";
  std::ostringstream s;
  for (size_t i = 0; i < groups.size(); ++i)
    s << (i ? "; " : "") << "ranks " << ranks_str(groups[i].second) << " sent "
      << groups[i].first;
  return s.str();
}

// Whether every submitted request agrees with the first on everything the checks below look at
// (ragged ops: on all dimensions but the first): the common case needs no per-field diagnosis.
bool uniform_requests(const std::vector<Request>& by_rank, const std::vector<int>& submitted) {
  const Request& first = by_rank[submitted.front()];
  const bool ragged = first.op == OpType::kAllgather || first.op == OpType::kAlltoall;
  for (int r : submitted) {
    const Request& q = by_rank[r];
    const bool same =
        q.op == first.op && q.process_set == first.process_set && q.dtype == first.dtype &&
        q.group_size == first.group_size && q.group == first.group && q.root == first.root &&
        q.reduce_op == first.reduce_op && q.prescale == first.prescale &&
        q.postscale == first.postscale && q.on_gpu == first.on_gpu &&
        (ragged ? q.shape.size() == first.shape.size() &&
                      std::equal(q.shape.begin() + std::min<size_t>(1, q.shape.size()),
                                 q.shape.end(),
                                 first.shape.begin() + std::min<size_t>(1, first.shape.size()))
                : q.shape == first.shape);
    if (!same) return false;
  }
  return true;
}

}  // namespace

std::string ranks_str(const std::vector<int>& ranks) { return list_str(ranks); }

std::string joined_refusal(OpType op, const std::string& name, const std::vector<int>& joined) {
  return std::string(op_type_name(op)) + " of tensor '" + name +
         "' is not supported while ranks " + ranks_str(joined) +
         " have joined; only allreduce continues after join()";
}

Response response_skeleton(const std::string& name, const Request& first,
                           const std::vector<int>& joined) {
  Response resp = single_tensor_response(name, first.shape, first);
  resp.joined = joined;
  return resp;
}

Response agreed_response(const std::string& name, const std::vector<Request>& by_rank,
                         const std::vector<int>& submitted, const std::vector<int>& joined,
                         const ProcessSets& sets) {
  const Request& first = by_rank[submitted.front()];
  Response resp = response_skeleton(name, first, joined);
  auto fail = [&](const std::string& what) {
    resp.error = what;
    return resp;
  };
  const auto tensor = [&name] { return "tensor '" + name + "'"; };  // for error messages
  auto by = [&](auto field) {
    return [&, field](int r) { return field(by_rank[r]); };
  };
  const bool uniform = uniform_requests(by_rank, submitted);
  std::string d;
  if (!uniform) d = disagreement(submitted, by([](const Request& q) { return std::string(op_type_name(q.op)); }));
  if (!d.empty()) return fail("Mismatched collective operations for " + tensor() + ": " + d);
  if (!uniform) d = disagreement(submitted, by([](const Request& q) { return std::to_string(q.process_set); }));
  if (!d.empty()) return fail("Mismatched process sets for " + tensor() + ": " + d);
  if (first.op != OpType::kBarrier && first.op != OpType::kAddProcessSet &&
      first.op != OpType::kRemoveProcessSet) {
    if (!uniform) d = disagreement(submitted, by([](const Request& q) { return std::string(dtype_name(q.dtype)); }));
    if (!d.empty()) return fail("Mismatched data types for " + tensor() + ": " + d);
  }
  if (!uniform) d = disagreement(submitted, by([](const Request& q) { return std::string(q.on_gpu ? "a CUDA tensor" : "a host tensor"); }));
  if (!d.empty()) return fail("Mismatched CPU/GPU device selection for " + tensor() + ": " + d);
  if (!uniform) d = disagreement(submitted, by([](const Request& q) { return std::to_string(q.group_size) + " tensors in group '" + q.group + "'"; }));
  if (!d.empty()) return fail("Mismatched grouped operation for " + tensor() + ": " + d);
  if (!joined.empty() && first.op != OpType::kAllreduce)
    return fail(joined_refusal(first.op, name, joined));
  switch (first.op) {
    case OpType::kAllreduce:
    case OpType::kReducescatter:
    case OpType::kBroadcast:
      if (!uniform) d = disagreement(submitted, by([](const Request& q) { return shape_str(q.shape); }));
      if (!d.empty()) return fail("Mismatched shapes for " + tensor() + " in " + op_type_name(first.op) + ": " + d);
      if (first.op == OpType::kBroadcast) {
        if (!uniform) d = disagreement(submitted, by([](const Request& q) { return "root rank " + std::to_string(q.root); }));
        if (!d.empty()) return fail("Mismatched root ranks for " + tensor() + " in broadcast: " + d);
      } else {
        if (!uniform) d = disagreement(submitted, by([](const Request& q) {
          std::ostringstream s;
          s << "op " << reduce_op_name(q.reduce_op) << " prescale " << q.prescale << " postscale " << q.postscale;
          return s.str();
        }));
        if (!d.empty()) return fail("Mismatched reduction for " + tensor() + ": " + d);
      }
      break;
    case OpType::kAllgather:
    case OpType::kAlltoall: {
      const std::vector<int> members = sets.members(first.process_set);
      if (!uniform) d = disagreement(submitted, by([](const Request& q) {
        if (q.shape.empty()) return std::string("a scalar");
        return "trailing dims " + shape_str(std::vector<int64_t>(q.shape.begin() + 1, q.shape.end()));
      }));
      if (!d.empty())
        return fail("Mismatched shapes for " + tensor() + " in " + op_type_name(first.op) +
                    " (all dimensions but the first must agree): " + d);
      if (first.op == OpType::kAllgather) {
        for (int g : members) resp.first_dims.push_back(by_rank[g].shape.empty() ? 1 : by_rank[g].shape[0]);
      } else {
        for (int g : members) {
          const auto& s = by_rank[g].splits;
          if (s.size() != members.size())
            return fail("Mismatched splits for " + tensor() + " in alltoall: rank " + std::to_string(g) +
                        " gave " + std::to_string(s.size()) + " splits for a process set of " +
                        std::to_string(members.size()) + " ranks");
          resp.splits_matrix.insert(resp.splits_matrix.end(), s.begin(), s.end());
        }
      }
      break;
    }
    case OpType::kAddProcessSet:
      d = disagreement(submitted, by([](const Request& q) { return "ranks " + shape_str(q.splits); }));
      if (!d.empty()) return fail("Mismatched add_process_set calls: " + d);
      resp.splits_matrix = first.splits;
      break;
    case OpType::kRemoveProcessSet:
      d = disagreement(submitted, by([](const Request& q) { return "process set " + std::to_string(q.root); }));
      if (!d.empty()) return fail("Mismatched remove_process_set calls: " + d);
      break;
    default:
      break;
  }
  return resp;
}

}  // namespace shvd
