// Executing one negotiated response: moving tensors in and out of the fusion buffer, scaling,
// and calling the algorithm. Every member of the process set runs the same code on the same
// response, so buffer sizes and algorithm choices agree without further messages.
#include <cstring>

#include "../algorithms/reduce_kernels.h"
#include "engine.h"

namespace shvd {

namespace {

int64_t num_elements(const std::vector<int64_t>& shape, size_t from = 0) {
  int64_t n = 1;
  for (size_t i = from; i < shape.size(); ++i) n *= shape[i];
  return n;
}

// Runs `body` inside a timeline phase for every named tensor (no-op when not recording).
template <typename F>
void phase(Timeline& tl, const std::vector<std::string>& names, const char* what, F body) {
  const bool on = tl.active();
  if (on)
    for (const auto& n : names) tl.begin(n, what);
  body();
  if (on)
    for (const auto& n : names) tl.end(n, what);
}

const char* phase_name(OpType op) {
  switch (op) {
    case OpType::kAllreduce: return "ALLREDUCE";
    case OpType::kAllgather: return "ALLGATHER";
    case OpType::kBroadcast: return "BROADCAST";
    case OpType::kAlltoall: return "ALLTOALL";
    case OpType::kReducescatter: return "REDUCESCATTER";
    default: return "COLLECTIVE";
  }
}

double final_scale(const Response& r, int set_size) {
  double f = r.postscale;
  if (r.reduce_op == ReduceOp::kAverage) f /= set_size;
  return f;
}

}  // namespace

void Engine::run_allreduce(const Response& r, std::vector<Entry*>& entries,
                           const Communicator& comm) {
  const size_t esize = dtype_size(r.dtype);
  std::vector<size_t> counts;
  size_t total = 0;
  for (const auto& s : r.shapes) {
    counts.push_back(size_t(num_elements(s)));
    total += counts.back();
  }
  const double post = final_scale(r, comm.size);
  // Reduces tensors [first, last) of the response, laid out back to back in `buf`, in place
  // (Adasum combines each tensor on its own).
  auto reduce = [&](void* buf, size_t first, size_t last) {
    size_t count = 0;
    for (size_t i = first; i < last; ++i) count += counts[i];
    if (r.prescale != 1.0) scale_buffer(buf, count, r.dtype, r.prescale);
    if (r.reduce_op == ReduceOp::kAdasum)
      allreduce_adasum(comm, buf, {counts.begin() + first, counts.begin() + last}, r.dtype,
                       scratch_);
    else
      allreduce(comm, buf, count, r.dtype, r.reduce_op, scratch_, options_.ring_threshold_bytes);
    if (post != 1.0) scale_buffer(buf, count, r.dtype, post);
  };

  // Shared-memory fast path: the group reads each tensor and writes each result directly, so
  // fused responses skip the fusion-buffer copies and averaging costs no extra pass.
  // Every member must take the same path: the group applies `post` to the slices each member
  // reduces, so one member on the direct path and another on the fallback (a joined rank has no
  // entries) would leave some slices unscaled. The response, not local state, decides.
  bool direct = comm.shm_group && r.prescale == 1.0 && r.joined.empty() &&
                r.reduce_op != ReduceOp::kAdasum;
  for (Entry* e : entries) direct = direct && e;
  if (direct) {
    std::vector<SharedMemoryGroup::Segment> segments;
    for (size_t i = 0; i < entries.size(); ++i)
      segments.push_back({entries[i]->input, entries[i]->output, counts[i]});
    // The members agree on the path inside the group: the timeline names it afterwards, as
    // an empty phase at the end of ALLREDUCE.
    phase(timeline_, r.names, "ALLREDUCE", [&] {
      const char* how = comm.shm_group->allreduce(comm, segments, r.dtype, r.reduce_op, post);
      phase(timeline_, r.names, how, [] {});
    });
    return;
  }
  // Tensors reduced in their own output buffers, without the fusion buffer's copies in and out:
  // a lone tensor, or every tensor when the set has one member (nothing is exchanged then).
  if (comm.size == 1 || (entries.size() == 1 && entries[0])) {
    phase(timeline_, r.names, "ALLREDUCE", [&] {
      for (size_t i = 0; i < entries.size(); ++i) {
        Entry* e = entries[i];
        if (!e) continue;
        if (e->output != e->input) std::memcpy(e->output, e->input, counts[i] * esize);
        reduce(e->output, i, i + 1);
      }
    });
    return;
  }
  auto* fused = static_cast<uint8_t*>(fusion_.reserve(total * esize));
  phase(timeline_, r.names, "MEMCPY_IN_FUSION_BUFFER", [&] {
    size_t off = 0;
    for (size_t i = 0; i < entries.size(); ++i) {
      const size_t bytes = counts[i] * esize;
      // A rank that has joined contributes zeros for tensors it never submitted.
      if (entries[i]) std::memcpy(fused + off, entries[i]->input, bytes);
      else std::memset(fused + off, 0, bytes);
      off += bytes;
    }
  });
  phase(timeline_, r.names, "ALLREDUCE", [&] { reduce(fused, 0, counts.size()); });
  phase(timeline_, r.names, "MEMCPY_OUT_FUSION_BUFFER", [&] {
    size_t off = 0;
    for (size_t i = 0; i < entries.size(); ++i) {
      const size_t bytes = counts[i] * esize;
      if (entries[i]) std::memcpy(entries[i]->output, fused + off, bytes);
      off += bytes;
    }
  });
}

void Engine::run_allgather(const Response& r, Entry& e, const Communicator& comm) {
  const auto& shape = e.request.shape;
  const size_t row_bytes = size_t(num_elements(shape, 1)) * dtype_size(r.dtype);
  std::vector<size_t> bytes;
  int64_t rows = 0;
  for (int64_t d : r.first_dims) {
    bytes.push_back(size_t(d) * row_bytes);
    rows += d;
  }
  HandleState& out = *e.state;
  out.output.resize(size_t(rows) * row_bytes);
  out.output_shape = shape.empty() ? std::vector<int64_t>{rows} : shape;
  out.output_shape[0] = rows;
  size_t my_offset = 0;
  for (int i = 0; i < comm.rank; ++i) my_offset += bytes[i];
  if (bytes[comm.rank]) std::memcpy(out.output.data() + my_offset, e.input, bytes[comm.rank]);
  phase(timeline_, r.names, phase_name(r.op), [&] { allgather_ring(comm, out.output.data(), bytes); });
}

void Engine::run_broadcast(const Response& r, Entry& e, const Communicator& comm) {
  const size_t bytes = size_t(num_elements(e.request.shape)) * dtype_size(r.dtype);
  if (comm.rank == r.root && e.output != e.input) std::memcpy(e.output, e.input, bytes);
  phase(timeline_, r.names, phase_name(r.op), [&] { broadcast_tree(comm, e.output, bytes, r.root); });
}

void Engine::run_alltoall(const Response& r, Entry& e, const Communicator& comm) {
  const auto& shape = e.request.shape;
  const size_t row_bytes = size_t(num_elements(shape, 1)) * dtype_size(r.dtype);
  const int n = comm.size, me = comm.rank;
  std::vector<size_t> send_bytes(n), recv_bytes(n);
  HandleState& out = *e.state;
  out.ints.assign(n, 0);
  int64_t rows = 0;
  for (int i = 0; i < n; ++i) {
    send_bytes[i] = size_t(r.splits_matrix[size_t(me) * n + i]) * row_bytes;
    const int64_t got = r.splits_matrix[size_t(i) * n + me];
    recv_bytes[i] = size_t(got) * row_bytes;
    out.ints[i] = got;
    rows += got;
  }
  out.output.resize(size_t(rows) * row_bytes);
  out.output_shape = shape.empty() ? std::vector<int64_t>{rows} : shape;
  out.output_shape[0] = rows;
  phase(timeline_, r.names, phase_name(r.op), [&] {
    alltoall_pairwise(comm, e.input, send_bytes, out.output.data(), recv_bytes);
  });
}

void Engine::run_reducescatter(const Response& r, Entry& e, const Communicator& comm) {
  const auto& shape = e.request.shape;
  const size_t esize = dtype_size(r.dtype);
  const int64_t rows = shape.empty() ? 1 : shape[0];
  const size_t row_elems = size_t(num_elements(shape, 1));
  const int n = comm.size;
  // Like Horovod: rows are split evenly, the first (rows % n) members get one extra row.
  std::vector<size_t> counts(n);
  std::vector<int64_t> member_rows(n);
  for (int i = 0; i < n; ++i) {
    member_rows[i] = rows / n + (i < rows % n ? 1 : 0);
    counts[i] = size_t(member_rows[i]) * row_elems;
  }
  const size_t total = size_t(num_elements(shape));
  auto* buf = static_cast<uint8_t*>(fusion_.reserve(total * esize));
  std::memcpy(buf, e.input, total * esize);
  if (r.prescale != 1.0) scale_buffer(buf, total, r.dtype, r.prescale);
  phase(timeline_, r.names, phase_name(r.op), [&] {
    reducescatter_ring(comm, buf, counts, r.dtype, r.reduce_op, scratch_);
  });
  size_t offset = 0;
  for (int i = 0; i < comm.rank; ++i) offset += counts[i];
  HandleState& out = *e.state;
  out.output.assign(buf + offset * esize, buf + (offset + counts[comm.rank]) * esize);
  out.output_shape = shape.empty() ? std::vector<int64_t>{member_rows[comm.rank]} : shape;
  out.output_shape[0] = member_rows[comm.rank];
  const double post = final_scale(r, comm.size);
  if (post != 1.0) scale_buffer(out.output.data(), counts[comm.rank], r.dtype, post);
}

}  // namespace shvd
