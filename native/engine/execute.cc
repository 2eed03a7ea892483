// Executing one negotiated response: process-set bookkeeping and join; for a collective, the
// communicator of its process set (made at its first use), then the dispatcher
// (algorithms/dispatch.h) chooses the algorithm and the engine packs the tensors for it (into
// the fusion buffer, or not, as the chosen row's staging says), scales, calls it and unpacks. Every member of the process set
// runs the same code on the same response, so buffer sizes and algorithm choices agree without
// further messages.
#include <cstring>

#include "../algorithms/dispatch.h"
#include "../include/spark_hvd.h"
#include "../kernels/reduce_kernels.h"
#include "engine.h"

namespace shvd {

namespace {

// Runs `body` inside a timeline phase for every tensor of `r` (no-op when not recording).
template <typename F>
void phase(Timeline& tl, const Response& r, const char* what, F body) {
  const bool on = tl.active();
  if (on)
    for (const auto& n : r.names) tl.begin(r.op, n, what);
  body();
  if (on)
    for (const auto& n : r.names) tl.end(r.op, n, what);
}

double final_scale(const Response& r, int set_size) {
  double f = r.postscale;
  if (r.reduce_op == ReduceOp::kAverage) f /= set_size;
  return f;
}

// What the dispatcher's rules look at, for response `r` of `count` elements on `comm`, with the
// engine's options `o` and its run-time settings `t` as they are now (autotuning changes `t`).
CollectiveCase collective_case(const Response& r, const Communicator& comm, size_t count,
                               const EngineOptions& o, const TunedParams& t) {
  CollectiveCase c;
  c.ring_threshold_bytes = o.ring_threshold_bytes;
  c.hierarchical = r.op == OpType::kAllreduce   ? t.hierarchical_allreduce
                   : r.op == OpType::kAllgather ? t.hierarchical_allgather
                                                : 0;
  c.op = r.op;
  c.comm = &comm;
  c.dtype = r.dtype;
  c.reduce_op = r.reduce_op;
  c.tensors = r.names.size();
  c.count = count;
  c.complete = r.joined.empty();
  c.prescaled = r.prescale != 1.0;
  return c;
}

// Runs `first` (and the rows after it while they decline) and names the path that ran as an
// empty phase at the end of the op's phase: a row may decline only while running, so the name
// is known afterwards.
void run_and_name(Timeline& tl, const Response& r, const CollectiveCase& c,
                  const Algorithm& first, const CollectiveCall& call) {
  const Algorithm& ran = run_algorithm(c, first, call);
  phase(tl, r, ran.name, [] {});
}

// What `call` takes from `c`; an algorithm's steps become phases of the response's tensors
// while the timeline records.
void prepare_call(Timeline& tl, const Response& r, const CollectiveCase& c,
                  CollectiveCall& call) {
  call.ring_threshold_bytes = c.ring_threshold_bytes;
  if (tl.active())
    call.step = [&tl, &r](const char* step, bool begin) {
      for (const auto& n : r.names) begin ? tl.begin(r.op, n, step) : tl.end(r.op, n, step);
    };
}

// The collectives other than allreduce have one tensor each: the engine lays out the buffers,
// the chosen algorithm runs inside the op's phase.
void run_collective(Timeline& tl, const Response& r, const CollectiveCase& c,
                    CollectiveCall& call) {
  prepare_call(tl, r, c, call);
  call.dtype = r.dtype;
  call.reduce_op = r.reduce_op;
  call.root = r.root;
  phase(tl, r, Timeline::op_phase(r.op),
        [&] { run_and_name(tl, r, c, choose_algorithm(c), call); });
}

}  // namespace

// The dispatcher's row for `r` when it hands `r` to the GPU path (a kDevice row: CUDA tensors;
// for an allreduce over several hosts it may be the hierarchical one, which looks at the size
// and the settings as the CPU path's does), else nullptr: the CPU rows, whose runners choose
// their algorithm themselves.
const Algorithm* Engine::device_row(const Response& r, const Communicator& comm) const {
  if (r.op == OpType::kBarrier) return nullptr;  // no rows: the negotiation was the barrier
  size_t count = 0;
  for (const auto& shape : r.shapes) count += size_t(num_elements(shape));
  CollectiveCase c = collective_case(r, comm, count, options_, tuned_);
  c.on_gpu = r.on_gpu;
  const Algorithm& row = choose_algorithm(c);
  return row.staging == Staging::kDevice ? &row : nullptr;
}

const Communicator& Engine::communicator(int process_set) {
  auto it = communicators_.find(process_set);
  if (it != communicators_.end()) return it->second;
  Communicator c;
  c.global_ranks = sets_.members(process_set);
  c.size = int(c.global_ranks.size());
  c.rank = sets_.index_of(process_set, options_.rank);
  bool all_shared_memory = c.size > 1;
  for (int g : c.global_ranks) {
    Link* link = g == options_.rank ? nullptr : mesh_.data[g].get();
    c.links.push_back(link);
    if (link && !link->is_shared_memory()) all_shared_memory = false;
  }
  // Every member builds this communicator while executing the same response, so the
  // collective set-up of the shared segment lines up across members.
  if (all_shared_memory && c.rank >= 0) {
    auto group = SharedMemoryGroup::create(c, options_.job_id, options_.shm_group);
    c.shm_group = group.get();
    shm_groups_[process_set] = std::move(group);
  }
  if (c.rank >= 0 && options_.host_ids.size() == size_t(options_.size)) {
    std::vector<std::string> member_hosts;
    for (int g : c.global_ranks) member_hosts.push_back(options_.host_ids[g]);
    auto hierarchy = Hierarchy::build(c, member_hosts);
    // My host's members set up their own shared-memory group for the within-host steps.
    bool local_shared_memory = hierarchy && hierarchy->local.size > 1;
    for (Link* l : hierarchy ? hierarchy->local.links : std::vector<Link*>())
      if (l && !l->is_shared_memory()) local_shared_memory = false;
    if (local_shared_memory)
      hierarchy->host_group =
          SharedMemoryGroup::create(hierarchy->local, options_.job_id, options_.shm_group);
    c.hierarchy = hierarchy.get();
    if (hierarchy) hierarchies_[process_set] = std::move(hierarchy);
  }
  return communicators_.emplace(process_set, std::move(c)).first->second;
}

void Engine::execute(const Response& resp, bool from_board) {
  moved_at_ = Clock::now();
  // The engine thread's spin window follows its own work (a user thread running its op here
  // keeps it asleep).
  if (on_engine_thread()) last_activity_ = moved_at_;
  if (!from_board) cache_.remember_answers(resp, sets_);
  execute_response(resp);
  handles_.wake_waiters();
}

void Engine::execute_response(const Response& resp) {
  // Process-set bookkeeping happens on every rank, members or not, so ids stay in step.
  if (resp.op == OpType::kAddProcessSet || resp.op == OpType::kRemoveProcessSet) {
    int id = -1;
    if (resp.error.empty()) {
      if (resp.op == OpType::kAddProcessSet) {
        std::vector<int> ranks(resp.splits_matrix.begin(), resp.splits_matrix.end());
        id = sets_.add(ranks);
      } else {
        sets_.remove(resp.root);
        communicators_.erase(resp.root);
        shm_groups_.erase(resp.root);
        hierarchies_.erase(resp.root);
        if (gpu_) gpu_->forget_set(resp.root);
        id = resp.root;
      }
    }
    auto it = table_.find(resp.names[0]);
    if (it != table_.end()) {
      it->second.state->ints = {id};
      complete(it->second, resp.error.empty() ? 0 : SHVD_ERR_INVALID, resp.error);
      table_.erase(it);
    }
    return;
  }
  if (resp.op == OpType::kJoin) {
    auto it = table_.find("__join__");
    if (it != table_.end()) {
      it->second.state->ints = {resp.last_joined};
      complete(it->second);
      table_.erase(it);
    }
    return;
  }
  const int my_index = sets_.index_of(resp.process_set, options_.rank);
  std::vector<Entry*> entries;
  for (const auto& name : resp.names) {
    auto it = table_.find(name);
    entries.push_back(it == table_.end() ? nullptr : &it->second);
    if (it != table_.end() && timeline_.active()) timeline_.end(resp.op, name, "QUEUE");
  }
  // Keep the response cache in step with the coordinator's.
  for (size_t i = 0; i < resp.names.size() && i < resp.cache_ids.size(); ++i)
    if (entries[i]) cache_.remember(resp.names[i], resp.cache_ids[i], entries[i]->request);

  if (!resp.error.empty()) {
    for (Entry* e : entries)
      if (e) complete(*e, resp.error_is_mismatch ? SHVD_ERR_INVALID : SHVD_ERR_INTERNAL, resp.error);
  } else if (my_index >= 0) {
    note_collective(resp);
    const Communicator& comm = communicator(resp.process_set);
    if (const Algorithm* row = device_row(resp, comm)) {
      if (!gpu_)
        gpu_ = std::make_unique<gpu::GpuPath>(*this, options_.rank, options_.job_id,
                                              options_.shared_gpu);
      gpu_->execute(resp, entries, comm, resp.process_set, timeline_,
                    std::strcmp(row->name, kNcclHierarchicalAllreduce) == 0);  // completes them
    } else {
      run_on_host(resp, entries, comm);
      for (Entry* e : entries)
        if (e) complete(*e);
    }
  }
  for (const auto& name : resp.names) table_.erase(name);
}

void Engine::run_on_host(const Response& r, std::vector<Entry*>& entries,
                         const Communicator& comm) {
  switch (r.op) {
    case OpType::kAllreduce: run_allreduce(r, entries, comm); break;
    case OpType::kAllgather: run_allgather(r, *entries[0], comm); break;
    case OpType::kBroadcast: run_broadcast(r, *entries[0], comm); break;
    case OpType::kAlltoall: run_alltoall(r, *entries[0], comm); break;
    case OpType::kReducescatter: run_reducescatter(r, *entries[0], comm); break;
    default: break;  // barrier: the negotiation was the barrier
  }
}

void Engine::host_broadcast(const Communicator& comm, void* buf, size_t bytes, int root) {
  broadcast_tree(comm, buf, bytes, root);
}

void Engine::host_allgather(const Communicator& comm, const void* mine, size_t bytes,
                            void* all) {
  std::memcpy(static_cast<uint8_t*>(all) + bytes * size_t(comm.rank), mine, bytes);
  allgather_ring(comm, all, std::vector<size_t>(size_t(comm.size), bytes));
}

void Engine::run_allreduce(const Response& r, std::vector<Entry*>& entries,
                           const Communicator& comm) {
  const size_t esize = dtype_size(r.dtype);
  std::vector<size_t> counts;
  size_t total = 0;
  for (const auto& s : r.shapes) {
    counts.push_back(size_t(num_elements(s)));
    total += counts.back();
  }
  CollectiveCase c = collective_case(r, comm, total, options_, tuned_);
  for (Entry* e : entries) c.complete = c.complete && e;
  const Algorithm& algo = choose_algorithm(c);
  CollectiveCall call(comm, scratch_);
  prepare_call(timeline_, r, c, call);
  call.dtype = r.dtype;
  call.reduce_op = r.reduce_op;
  const double post = final_scale(r, comm.size);

  if (algo.staging == Staging::kTensors) {
    // Each tensor read and written where it lies; a joined rank's missing tensors are skipped
    // (only a set of one takes this path with tensors missing).
    for (size_t i = 0; i < entries.size(); ++i)
      if (entries[i]) call.tensors.push_back({entries[i]->input, entries[i]->output, counts[i]});
    call.prescale = r.prescale;
    call.postscale = post;
    phase(timeline_, r, "ALLREDUCE",
          [&] { run_and_name(timeline_, r, c, algo, call); });
    return;
  }
  // One buffer reduced in place, scaled before and after.
  call.blocks = counts;
  auto reduce = [&](void* buf) {
    if (r.prescale != 1.0) scale_buffer(buf, total, r.dtype, r.prescale);
    call.tensors = {{buf, buf, total}};
    run_and_name(timeline_, r, c, algo, call);
    if (post != 1.0) scale_buffer(buf, total, r.dtype, post);
  };
  // A lone tensor is reduced in its own output, without the fusion buffer's copies.
  if (entries.size() == 1 && entries[0]) {
    Entry* e = entries[0];
    phase(timeline_, r, "ALLREDUCE", [&] {
      if (e->output != e->input) std::memcpy(e->output, e->input, total * esize);
      reduce(e->output);
    });
    return;
  }
  auto* fused = static_cast<uint8_t*>(fusion_.reserve(total * esize));
  phase(timeline_, r, "MEMCPY_IN_FUSION_BUFFER", [&] {
    size_t off = 0;
    for (size_t i = 0; i < entries.size(); ++i) {
      const size_t bytes = counts[i] * esize;
      // A rank that has joined contributes zeros for tensors it never submitted.
      if (entries[i]) std::memcpy(fused + off, entries[i]->input, bytes);
      else std::memset(fused + off, 0, bytes);
      off += bytes;
    }
  });
  phase(timeline_, r, "ALLREDUCE", [&] { reduce(fused); });
  phase(timeline_, r, "MEMCPY_OUT_FUSION_BUFFER", [&] {
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
  CollectiveCall call(comm, scratch_);
  int64_t rows = 0;
  for (int64_t d : r.first_dims) {
    call.blocks.push_back(size_t(d) * row_bytes);
    rows += d;
  }
  HandleState& out = *e.state;
  out.output.resize(size_t(rows) * row_bytes);
  out.output_shape = shape.empty() ? std::vector<int64_t>{rows} : shape;
  out.output_shape[0] = rows;
  size_t my_offset = 0;
  for (int i = 0; i < comm.rank; ++i) my_offset += call.blocks[i];
  const size_t mine = call.blocks[comm.rank];
  if (mine) std::memcpy(out.output.data() + my_offset, e.input, mine);
  call.tensors = {{nullptr, out.output.data(), out.output.size() / dtype_size(r.dtype)}};
  run_collective(timeline_, r,
                 collective_case(r, comm, call.tensors[0].count, options_, tuned_), call);
}

void Engine::run_broadcast(const Response& r, Entry& e, const Communicator& comm) {
  const size_t count = size_t(num_elements(e.request.shape));
  if (comm.rank == r.root && e.output != e.input)
    std::memcpy(e.output, e.input, count * dtype_size(r.dtype));
  CollectiveCall call(comm, scratch_);
  call.tensors = {{e.output, e.output, count}};
  run_collective(timeline_, r, collective_case(r, comm, count, options_, tuned_), call);
}

void Engine::run_alltoall(const Response& r, Entry& e, const Communicator& comm) {
  const auto& shape = e.request.shape;
  const size_t row_bytes = size_t(num_elements(shape, 1)) * dtype_size(r.dtype);
  const int n = comm.size, me = comm.rank;
  CollectiveCall call(comm, scratch_);
  call.blocks.resize(n);
  call.recv_blocks.resize(n);
  HandleState& out = *e.state;
  out.ints.assign(n, 0);
  int64_t rows = 0;
  for (int i = 0; i < n; ++i) {
    call.blocks[i] = size_t(r.splits_matrix[size_t(me) * n + i]) * row_bytes;
    const int64_t got = r.splits_matrix[size_t(i) * n + me];
    call.recv_blocks[i] = size_t(got) * row_bytes;
    out.ints[i] = got;
    rows += got;
  }
  out.output.resize(size_t(rows) * row_bytes);
  out.output_shape = shape.empty() ? std::vector<int64_t>{rows} : shape;
  out.output_shape[0] = rows;
  const size_t count = size_t(num_elements(shape));
  call.tensors = {{e.input, out.output.data(), count}};
  run_collective(timeline_, r, collective_case(r, comm, count, options_, tuned_), call);
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
  CollectiveCall call(comm, scratch_);
  call.tensors = {{buf, buf, total}};
  call.blocks = counts;
  run_collective(timeline_, r, collective_case(r, comm, total, options_, tuned_), call);
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
