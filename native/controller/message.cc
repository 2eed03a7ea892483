// A deliberately plain encoding: little-endian fixed-width integers, length-prefixed strings and
// vectors. Both ends are the same build, so no schema evolution is needed.
#include "message.h"

#include <cstring>
#include <stdexcept>

namespace shvd {

namespace {

// Equal sizes and bytes, with no memcmp call for empty ones (libc++'s == calls it regardless;
// the response cache compares every cached request's strings and vectors once per op, so on
// the small-allreduce path those calls showed as a few percent of the wheel's core).
template <class C>
bool same_contents(const C& a, const C& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0);
}

}  // namespace

bool Request::same_params(const Request& o) const {
  return op == o.op && dtype == o.dtype && reduce_op == o.reduce_op &&
         prescale == o.prescale && postscale == o.postscale && root == o.root &&
         process_set == o.process_set && group_size == o.group_size && on_gpu == o.on_gpu &&
         same_contents(name, o.name) && same_contents(shape, o.shape) &&
         same_contents(splits, o.splits) && same_contents(group, o.group);
}

bool fusable_allreduces(const Response& a, const Response& b) {
  return a.error.empty() && b.error.empty() && a.op == OpType::kAllreduce &&
         b.op == OpType::kAllreduce && a.dtype == b.dtype && a.reduce_op == b.reduce_op &&
         a.prescale == b.prescale && a.postscale == b.postscale &&
         a.process_set == b.process_set && a.joined == b.joined && a.on_gpu == b.on_gpu;
}

namespace {

class Writer {
 public:
  template <typename T>
  void pod(T v) { out.append(reinterpret_cast<const char*>(&v), sizeof(T)); }
  void str(const std::string& s) { pod<uint32_t>(s.size()); out += s; }
  template <typename T>
  void vec(const std::vector<T>& v) {
    pod<uint32_t>(v.size());
    if (!v.empty()) out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  std::string out;
};

class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  template <typename T>
  T pod() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, s_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string str() {
    uint32_t n = pod<uint32_t>();
    need(n);
    std::string v = s_.substr(pos_, n);
    pos_ += n;
    return v;
  }
  template <typename T>
  std::vector<T> vec() {
    uint32_t n = pod<uint32_t>();
    need(size_t(n) * sizeof(T));
    std::vector<T> v(n);
    if (n) std::memcpy(v.data(), s_.data() + pos_, n * sizeof(T));
    pos_ += n * sizeof(T);
    return v;
  }

 private:
  void need(size_t n) {
    if (pos_ + n > s_.size()) throw std::runtime_error("truncated negotiation message");
  }
  const std::string& s_;
  size_t pos_ = 0;
};

void write_request(Writer& w, const Request& r) {
  w.pod<int32_t>(int32_t(r.op));
  w.str(r.name);
  w.pod<int32_t>(int32_t(r.dtype));
  w.vec(r.shape);
  w.pod<int32_t>(int32_t(r.reduce_op));
  w.pod(r.prescale);
  w.pod(r.postscale);
  w.pod(r.root);
  w.pod(r.process_set);
  w.vec(r.splits);
  w.str(r.group);
  w.pod(r.group_size);
  w.pod<uint8_t>(r.on_gpu);
}

Request read_request(Reader& rd) {
  Request r;
  r.op = OpType(rd.pod<int32_t>());
  r.name = rd.str();
  r.dtype = DataType(rd.pod<int32_t>());
  r.shape = rd.vec<int64_t>();
  r.reduce_op = ReduceOp(rd.pod<int32_t>());
  r.prescale = rd.pod<double>();
  r.postscale = rd.pod<double>();
  r.root = rd.pod<int32_t>();
  r.process_set = rd.pod<int32_t>();
  r.splits = rd.vec<int64_t>();
  r.group = rd.str();
  r.group_size = rd.pod<int32_t>();
  r.on_gpu = rd.pod<uint8_t>();
  return r;
}

}  // namespace

std::string encode(const RequestBatch& b) {
  Writer w;
  w.pod(b.rank);
  w.pod<uint8_t>(b.shutdown);
  w.vec(b.cached);
  w.pod<uint32_t>(b.requests.size());
  for (const auto& r : b.requests) write_request(w, r);
  w.pod<uint8_t>(uint8_t(b.blocked));
  w.pod<uint32_t>(b.blocked_on.size());
  for (const auto& p : b.blocked_on) {
    w.str(p.name);
    w.pod<int32_t>(int32_t(p.op));
    w.pod(p.process_set);
  }
  return std::move(w.out);
}

RequestBatch decode_request_batch(const std::string& bytes) {
  Reader rd(bytes);
  RequestBatch b;
  b.rank = rd.pod<int32_t>();
  b.shutdown = rd.pod<uint8_t>();
  b.cached = rd.vec<uint32_t>();
  uint32_t n = rd.pod<uint32_t>();
  for (uint32_t i = 0; i < n; ++i) b.requests.push_back(read_request(rd));
  b.blocked = RequestBatch::Blocked(rd.pod<uint8_t>());
  const uint32_t blocked_on = rd.pod<uint32_t>();
  for (uint32_t i = 0; i < blocked_on; ++i) {
    PendingOp p;
    p.name = rd.str();
    p.op = OpType(rd.pod<int32_t>());
    p.process_set = rd.pod<int32_t>();
    b.blocked_on.push_back(std::move(p));
  }
  return b;
}

std::string encode(const ResponseBatch& b) {
  Writer w;
  w.pod<uint8_t>(b.shutdown);
  w.str(b.abort);
  w.pod<uint8_t>(b.has_params);
  if (b.has_params) {
    w.pod(b.params.fusion_threshold_bytes);
    w.pod(b.params.cycle_time_ms);
    w.pod<uint8_t>(b.params.cache_enabled);
    w.pod(b.params.hierarchical_allreduce);
    w.pod(b.params.hierarchical_allgather);
    w.pod<uint8_t>(b.params.tuning);
  }
  w.pod<uint8_t>(b.has_notice);
  if (b.has_notice) w.pod(b.notice);
  w.pod<uint32_t>(b.responses.size());
  for (const auto& r : b.responses) {
    w.pod<int32_t>(int32_t(r.op));
    w.pod<uint32_t>(r.names.size());
    for (const auto& n : r.names) w.str(n);
    w.str(r.error);
    w.pod<uint8_t>(r.error_is_mismatch);
    w.pod<int32_t>(int32_t(r.dtype));
    w.pod<int32_t>(int32_t(r.reduce_op));
    w.pod(r.prescale);
    w.pod(r.postscale);
    w.pod(r.root);
    w.pod(r.process_set);
    w.pod<uint32_t>(r.shapes.size());
    for (const auto& s : r.shapes) w.vec(s);
    w.vec(r.first_dims);
    w.vec(r.splits_matrix);
    w.vec(r.joined);
    w.pod(r.last_joined);
    w.vec(r.cache_ids);
    w.pod<uint8_t>(r.on_gpu);
  }
  return std::move(w.out);
}

ResponseBatch decode_response_batch(const std::string& bytes) {
  Reader rd(bytes);
  ResponseBatch b;
  b.shutdown = rd.pod<uint8_t>();
  b.abort = rd.str();
  b.has_params = rd.pod<uint8_t>();
  if (b.has_params) {
    b.params.fusion_threshold_bytes = rd.pod<uint64_t>();
    b.params.cycle_time_ms = rd.pod<double>();
    b.params.cache_enabled = rd.pod<uint8_t>();
    b.params.hierarchical_allreduce = rd.pod<int32_t>();
    b.params.hierarchical_allgather = rd.pod<int32_t>();
    b.params.tuning = rd.pod<uint8_t>();
  }
  b.has_notice = rd.pod<uint8_t>();
  if (b.has_notice) b.notice = rd.pod<int64_t>();
  uint32_t n = rd.pod<uint32_t>();
  b.responses.resize(n);
  for (auto& r : b.responses) {
    r.op = OpType(rd.pod<int32_t>());
    uint32_t nn = rd.pod<uint32_t>();
    for (uint32_t i = 0; i < nn; ++i) r.names.push_back(rd.str());
    r.error = rd.str();
    r.error_is_mismatch = rd.pod<uint8_t>();
    r.dtype = DataType(rd.pod<int32_t>());
    r.reduce_op = ReduceOp(rd.pod<int32_t>());
    r.prescale = rd.pod<double>();
    r.postscale = rd.pod<double>();
    r.root = rd.pod<int32_t>();
    r.process_set = rd.pod<int32_t>();
    uint32_t ns = rd.pod<uint32_t>();
    for (uint32_t i = 0; i < ns; ++i) r.shapes.push_back(rd.vec<int64_t>());
    r.first_dims = rd.vec<int64_t>();
    r.splits_matrix = rd.vec<int64_t>();
    r.joined = rd.vec<int32_t>();
    r.last_joined = rd.pod<int32_t>();
    r.cache_ids = rd.vec<int64_t>();
    r.on_gpu = rd.pod<uint8_t>();
  }
  return b;
}

}  // namespace shvd
