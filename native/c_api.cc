// The extern "C" surface: argument checking, error translation, and the single process-wide
// engine instance (init -> shutdown -> init again creates a fresh one).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string_view>

#include "algorithms/shared_arenas.h"
#include "common/logging.h"
#include "engine/engine.h"
#include "include/spark_hvd.h"
#include "mpi/mpi_backend.h"
#include "transport/mesh.h"

using namespace shvd;


static_assert(kFixFusionThreshold == SHVD_AUTOTUNE_FIX_FUSION_THRESHOLD &&
                  kFixCycleTime == SHVD_AUTOTUNE_FIX_CYCLE_TIME &&
                  kFixCache == SHVD_AUTOTUNE_FIX_CACHE &&
                  kFixHierarchicalAllreduce == SHVD_AUTOTUNE_FIX_HIERARCHICAL_ALLREDUCE &&
                  kFixHierarchicalAllgather == SHVD_AUTOTUNE_FIX_HIERARCHICAL_ALLGATHER,
              "the kFix* bits must equal the SHVD_AUTOTUNE_FIX_* codes of spark_hvd.h");

namespace {

std::mutex g_mu;
std::unique_ptr<Endpoint> g_endpoint;
std::shared_ptr<Engine> g_engine;
thread_local std::string t_error;
thread_local int t_error_kind = SHVD_ERR_NONE;

int32_t fail(int kind, const std::string& message) {
  t_error_kind = kind;
  t_error = message;
  return -1;
}

std::shared_ptr<Engine> engine() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_engine;
}

// Runs `body`, translating exceptions into the C error convention.
template <typename F>
int32_t guarded(F body) {
  try {
    return body();
  } catch (const UnsupportedError& e) {
    return fail(SHVD_ERR_UNSUPPORTED, e.what());
  } catch (const OpMismatchError& e) {
    return fail(SHVD_ERR_INVALID, e.what());
  } catch (const ConnectTimeoutError& e) {
    return fail(SHVD_ERR_CONNECT, e.what());
  } catch (const PeerLostError& e) {
    return fail(SHVD_ERR_INTERNAL, e.what());
  } catch (const std::exception& e) {
    return fail(SHVD_ERR_STATE, e.what());
  }
}

#define REQUIRE_ENGINE(e)                                                                   \
  auto e = engine();                                                                        \
  if (!e) return fail(SHVD_ERR_STATE, "spark_hvd has not been initialized; call init() first")

// shvd_abi_codes' table. Codes are walked over the header's ranges and named by the core's own
// name functions (what its messages say), so a code the core cannot name reads "unknown".
std::string abi_codes_table() {
  std::string t;
  auto line = [&t](const char* kind, const char* name, int code, std::string more = "") {
    t += std::string(kind) + " " + name + " " + std::to_string(code) + more + "\n";
  };
  for (int d = 0; d < SHVD_NUM_DTYPES; ++d)
    line("dtype", dtype_name(DataType(d)), d, " " + std::to_string(dtype_size(DataType(d))));
  for (int r = 0; r < SHVD_NUM_REDUCE_OPS; ++r) line("reduce_op", reduce_op_name(ReduceOp(r)), r);
  for (int o = SHVD_OP_ALLREDUCE; o <= SHVD_OP_REMOVE_PROCESS_SET; ++o)
    line("op", op_type_name(OpType(o)), o);
  line("error", "none", SHVD_ERR_NONE);
  line("error", "invalid", SHVD_ERR_INVALID);
  line("error", "internal", SHVD_ERR_INTERNAL);
  line("error", "state", SHVD_ERR_STATE);
  line("error", "unsupported", SHVD_ERR_UNSUPPORTED);
  line("error", "connect", SHVD_ERR_CONNECT);
  return t;
}

// Copies `n` int64 values from memory that may be unaligned (a packed record's shape).
std::vector<int64_t> int64_array(const void* p, int32_t n) {
  std::vector<int64_t> out(size_t(std::max<int32_t>(n, 0)));
  if (!out.empty()) std::memcpy(out.data(), p, 8 * out.size());
  return out;
}

// Builds and validates the entry for one op. The scalar fields come from `op`; the name, group,
// shape and splits are passed apart because a packed record holds them unterminated and
// unaligned (both entry points then build the entry without intermediate copies).
Entry make_entry(const shvd_op& op, std::string_view name, std::string_view group,
                 const void* shape, const void* splits_data, Engine& eng) {
  if (op.op < SHVD_OP_ALLREDUCE || op.op > SHVD_OP_REMOVE_PROCESS_SET)
    throw OpMismatchError("unknown collective operation " + std::to_string(op.op));
  if (op.dtype < 0 || op.dtype >= SHVD_NUM_DTYPES)
    throw OpMismatchError("unsupported data type code " + std::to_string(op.dtype));
  Entry e;
  Request& r = e.request;
  r.op = OpType(op.op);
  r.name = name;
  if (r.name.empty()) throw OpMismatchError("every collective needs a name");
  r.dtype = DataType(op.dtype);
  if (op.ndim < 0) throw OpMismatchError("negative number of dimensions");
  r.shape = int64_array(shape, op.ndim);
  for (int64_t d : r.shape)
    if (d < 0) throw OpMismatchError("negative dimension in the shape of '" + r.name + "'");
  r.reduce_op = ReduceOp(op.reduce_op);
  r.prescale = op.prescale;
  r.postscale = op.postscale;
  r.root = op.root_rank;
  r.process_set = op.process_set;
  if (!group.empty()) {
    r.group = group;
    r.group_size = op.group_size;
  }
  e.input = op.input;
  e.output = op.output;
  if (op.device_kind == SHVD_DEVICE_CUDA) {
    r.on_gpu = true;
    e.gpu.device = op.device;
    e.gpu.stream = op.stream;
    if (op.device < 0) throw OpMismatchError("'" + r.name + "': negative CUDA device index");
  } else if (op.device_kind != SHVD_DEVICE_HOST) {
    throw OpMismatchError("unknown device kind " + std::to_string(op.device_kind));
  }

  ProcessSets& sets = eng.process_sets();
  const int my_rank = eng.options().rank;
  if (r.op == OpType::kAddProcessSet || r.op == OpType::kRemoveProcessSet || r.op == OpType::kJoin) {
    if (r.process_set != 0) throw OpMismatchError(std::string(op_type_name(r.op)) + " runs on the global process set only");
    if (r.op == OpType::kAddProcessSet) {
      r.splits = int64_array(splits_data, op.nsplits);
      for (int64_t g : r.splits)
        if (g < 0 || g >= eng.options().size)
          throw OpMismatchError("add_process_set: rank " + std::to_string(g) + " is not in [0, " +
                                std::to_string(eng.options().size) + ")");
    }
    if (r.op == OpType::kRemoveProcessSet && (r.root == 0 || !sets.exists(r.root)))
      throw OpMismatchError("remove_process_set: process set " + std::to_string(r.root) +
                            " does not exist (or is the global set)");
    return e;
  }
  const ProcessSets::Membership membership = sets.membership(r.process_set, my_rank);
  if (membership.size < 0)
    throw OpMismatchError("process set " + std::to_string(r.process_set) +
                          " does not exist; add it with add_process_set() first");
  // Names are scoped by process set: disjoint sets may use the same tensor names (each
  // set's training loop names its gradients alike) without colliding in negotiation.
  if (r.process_set != 0) {
    const std::string scope = " (process set " + std::to_string(r.process_set) + ")";
    r.name += scope;
    if (!r.group.empty()) r.group += scope;
  }
  const int set_size = membership.size;
  if (membership.index < 0)
    throw OpMismatchError("rank " + std::to_string(my_rank) + " is not a member of process set " +
                          std::to_string(r.process_set) + " and cannot run '" + r.name + "' on it");
  if (r.op == OpType::kAllreduce || r.op == OpType::kReducescatter) {
    if (r.reduce_op < ReduceOp::kAverage || r.reduce_op > ReduceOp::kProduct)
      throw OpMismatchError("unknown reduce op " + std::to_string(int(r.reduce_op)));
    if (r.reduce_op == ReduceOp::kAdasum && r.op == OpType::kAllreduce) {
      if (!adasum_supports(r.dtype))
        throw OpMismatchError("op=Adasum reduces floating-point tensors only; '" + r.name +
                              "' is " + dtype_name(r.dtype) + " (use op=Sum or Average)");
      if ((set_size & (set_size - 1)) != 0)
        throw UnsupportedError("op=Adasum needs a power-of-two number of ranks; '" + r.name +
                              "' runs on " + std::to_string(set_size) +
                              " (use op=Average, or a process set of 2, 4, 8 ... ranks)");
    }
    if (r.op == OpType::kReducescatter &&
        r.reduce_op != ReduceOp::kSum && r.reduce_op != ReduceOp::kAverage)
      throw OpMismatchError("reducescatter supports op=Sum and op=Average only");
  }
  if (r.on_gpu && r.reduce_op == ReduceOp::kAdasum && r.op == OpType::kAllreduce)
    throw UnsupportedError("op=Adasum on CUDA tensors is not built into spark_hvd ('" + r.name +
                           "'); move the tensors to the CPU for Adasum, or use op=Average");
  if ((r.op == OpType::kAllreduce || r.op == OpType::kBroadcast) && !e.output)
    throw OpMismatchError("'" + r.name + "': no output buffer");
  if (r.op == OpType::kBroadcast) {
    // As in Horovod, root_rank is a global rank; the set's algorithms count within the set.
    const int root_in_set = r.process_set == 0 ? (r.root >= 0 && r.root < set_size ? r.root : -1)
                                               : sets.index_of(r.process_set, r.root);
    if (root_in_set < 0)
      throw OpMismatchError("broadcast of '" + r.name + "': root rank " + std::to_string(r.root) +
                            (r.process_set == 0
                                 ? " is not a rank of this job of " + std::to_string(set_size)
                                 : " is not a member of process set " +
                                       std::to_string(r.process_set)) +
                            " (root_rank is a global rank, as in Horovod)");
    r.root = root_in_set;
  }
  if ((r.op == OpType::kAllgather || r.op == OpType::kAlltoall || r.op == OpType::kReducescatter) &&
      r.shape.empty())
    throw OpMismatchError(std::string(op_type_name(r.op)) + " of '" + r.name +
                          "' needs a tensor with at least one dimension");
  if (r.op == OpType::kAlltoall) {
    const int64_t rows = r.shape[0];
    if (op.nsplits == 0) {
      if (rows % set_size != 0)
        throw OpMismatchError("alltoall of '" + r.name + "': the first dimension (" +
                              std::to_string(rows) + ") is not divisible by the number of ranks (" +
                              std::to_string(set_size) + "); pass splits explicitly");
      r.splits.assign(set_size, rows / set_size);
    } else {
      if (op.nsplits != set_size)
        throw OpMismatchError("alltoall of '" + r.name + "': got " + std::to_string(op.nsplits) +
                              " splits for " + std::to_string(set_size) + " ranks");
      r.splits = int64_array(splits_data, op.nsplits);
      int64_t sum = 0;
      for (int64_t s : r.splits) {
        if (s < 0) throw OpMismatchError("alltoall of '" + r.name + "': negative split");
        sum += s;
      }
      if (sum != rows)
        throw OpMismatchError("alltoall of '" + r.name + "': splits sum to " + std::to_string(sum) +
                              " but the first dimension is " + std::to_string(rows));
    }
  }
  return e;
}

// Queues validated entries. CUDA tensors' streams get their "ready" events here, once nothing
// can refuse the batch any more but the queue itself (the events go back if it does).
void enqueue_entries(Engine& eng, std::vector<Entry>& entries, int64_t* handles, bool awaited) {
  size_t recorded = 0;
  try {
    for (; recorded < entries.size(); ++recorded)
      if (entries[recorded].gpu.device >= 0) gpu::record_ready(entries[recorded].gpu);
    eng.enqueue(entries, handles, awaited);
  } catch (...) {
    for (size_t i = 0; i < recorded && i < entries.size(); ++i)
      if (entries[i].gpu.ready) gpu::forget_ready(entries[i].gpu);
    throw;
  }
}

}  // namespace

extern "C" {

int32_t shvd_listen(const char* bind_host, int64_t tcp_buffer_bytes) {
  return guarded([&] {
    std::lock_guard<std::mutex> lock(g_mu);
    g_endpoint = std::make_unique<Endpoint>(bind_host && *bind_host ? bind_host : "0.0.0.0",
                                            tcp_buffer_bytes);
    return g_endpoint->port();
  });
}

int32_t shvd_init(const shvd_init_options* o) {
  return guarded([&]() -> int32_t {
    {
      std::lock_guard<std::mutex> lock(g_mu);
      if (g_engine) return fail(SHVD_ERR_STATE, "spark_hvd is already initialized");
    }
    // An abort of the previous engine (a lost peer) ends with it: connecting the new mesh
    // checks the flag (elastic re-forms the job in the same process).
    global_abort().reset();
    if (o->size < 1 || o->rank < 0 || o->rank >= o->size)
      return fail(SHVD_ERR_INVALID, "invalid rank " + std::to_string(o->rank) + " for size " +
                                        std::to_string(o->size));
    MeshOptions mo;
    mo.rank = o->rank;
    mo.size = o->size;
    mo.secret.assign(o->secret ? o->secret : "", o->secret ? o->secret_len : 0);
    mo.job_id = o->job_id ? o->job_id : "job";
    mo.use_shared_memory = o->use_shared_memory != 0;
    mo.timeout_seconds = o->start_timeout_seconds > 0 ? o->start_timeout_seconds : 30.0;
    mo.shm_pipe_bytes = o->shm_pipe_bytes;
    mo.peer_timeout_seconds = o->peer_timeout_seconds;
    std::istringstream lines(o->peers ? o->peers : "");
    std::string line;
    while (std::getline(lines, line)) {
      if (line.empty()) continue;
      std::istringstream f(line);
      PeerAddress p;
      f >> p.host >> p.port >> p.host_id >> p.hostname;  // hostname: optional
      mo.peers.push_back(p);
    }
    Mesh mesh;
    if (o->size == 1) {
      mesh.data.resize(1);
      mesh.control.resize(1);
    } else {
      if (int(mo.peers.size()) != o->size)
        return fail(SHVD_ERR_INVALID, "expected " + std::to_string(o->size) + " peer addresses, got " +
                                          std::to_string(mo.peers.size()));
      std::unique_ptr<Endpoint> endpoint;
      {
        std::lock_guard<std::mutex> lock(g_mu);
        endpoint = std::move(g_endpoint);
      }
      if (!endpoint) return fail(SHVD_ERR_STATE, "shvd_listen must be called before shvd_init");
      // Errors name a rank's host as the launcher or Spark calls it (host id), with the
      // machine's own hostname where that differs (an address in -H, say).
      std::vector<std::string> hosts;
      for (const PeerAddress& p : mo.peers)
        hosts.push_back(p.hostname.empty() || p.hostname == p.host_id
                            ? p.host_id : p.host_id + " (" + p.hostname + ")");
      set_rank_hosts(std::move(hosts));
      mesh = build_mesh(*endpoint, mo);
    }
    // A collective that moves no byte for as long as the stall inspector would let a stalled
    // negotiation last (it aborts at the later of its two times) ends the same way.
    set_no_progress_timeout(o->stall_warning_seconds > 0 && o->stall_shutdown_seconds > 0
                                ? std::max(o->stall_warning_seconds, o->stall_shutdown_seconds)
                                : 0);
    bool shm = false;
    for (auto& l : mesh.data)
      if (l && l->is_shared_memory()) shm = true;
    EngineOptions eo;
    eo.rank = o->rank;
    eo.size = o->size;
    eo.local_rank = o->local_rank;
    eo.local_size = o->local_size;
    eo.cross_rank = o->cross_rank;
    eo.cross_size = o->cross_size;
    eo.job_id = mo.job_id;
    eo.overlap = o->overlap;
    eo.coordinator.fusion_threshold_bytes = size_t(o->fusion_threshold_bytes);
    eo.cycle_time_ms = o->cycle_time_ms;
    eo.coordinator.cache_capacity = size_t(o->cache_capacity);
    eo.coordinator.stall_warning_seconds = o->stall_warning_seconds;
    eo.coordinator.stall_shutdown_seconds = o->stall_shutdown_seconds;
    eo.coordinator.deadlock_check_seconds = o->deadlock_check_seconds;
    if (o->ring_threshold_bytes > 0) eo.ring_threshold_bytes = size_t(o->ring_threshold_bytes);
    if (o->shm_chunk_bytes > 0) eo.shm_group.chunk_bytes = uint64_t(o->shm_chunk_bytes);
    eo.shm_group.single_copy = o->shm_single_copy != 0;
    if (o->shm_single_copy_min_bytes >= 0)
      eo.shm_group.single_copy_min_bytes = uint64_t(o->shm_single_copy_min_bytes);
    eo.shm_group.arenas = o->shm_arenas != 0;
    eo.shm_negotiation = o->shm_negotiation != 0;
    if (o->shared_gpu != SHVD_SHARED_GPU_HOST && o->shared_gpu != SHVD_SHARED_GPU_NCCL)
      return fail(SHVD_ERR_INVALID, "unknown shared_gpu " + std::to_string(o->shared_gpu));
    eo.shared_gpu = o->shared_gpu == SHVD_SHARED_GPU_NCCL ? gpu::SharedGpu::kNccl
                                                          : gpu::SharedGpu::kHost;
    eo.hierarchical_allreduce = o->hierarchical_allreduce;
    eo.hierarchical_allgather = o->hierarchical_allgather;
    for (const PeerAddress& p : mo.peers) eo.host_ids.push_back(p.host_id);
    eo.autotune.enabled = o->autotune != 0;
    eo.autotune.log_path = o->autotune_log ? o->autotune_log : "";
    eo.autotune.warmup_samples = o->autotune_warmup_samples;
    eo.autotune.steps_per_sample = o->autotune_steps_per_sample;
    eo.autotune.max_samples = o->autotune_bayes_opt_max_samples;
    eo.autotune.noise = o->autotune_gaussian_process_noise;
    eo.autotune.fixed = uint32_t(o->autotune_fixed);  // values validated by the caller
    const int32_t* ranks = o->process_set_ranks;
    for (int i = 0; i < o->num_process_sets; ++i) {
      eo.static_process_sets.emplace_back(ranks, ranks + o->process_set_sizes[i]);
      ranks += o->process_set_sizes[i];
    }
    // MPI backend: collective over the job's communicator when asked for (mpi/mpi_backend.h).
    mpi::stop();
    if (o->cpu_operations == SHVD_CPU_OPERATIONS_MPI)
      mpi::start(o->mpi_plugin ? o->mpi_plugin : "", o->mpi_comm);
    else if (o->cpu_operations != SHVD_CPU_OPERATIONS_DEFAULT)
      return fail(SHVD_ERR_INVALID, "unknown cpu_operations " + std::to_string(o->cpu_operations));
    auto eng = std::make_shared<Engine>(std::move(eo), std::move(mesh), shm);
    if (o->timeline_path && *o->timeline_path && o->rank == 0) {
      std::string err;
      if (!eng->timeline().start(o->timeline_path, o->timeline_mark_cycles != 0, &err))
        log_message(LogLevel::kWarning, "%s", err.c_str());
    }
    std::lock_guard<std::mutex> lock(g_mu);
    g_engine = eng;
    return 0;
  });
}

int32_t shvd_shutdown(void) {
  std::shared_ptr<Engine> eng;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    eng.swap(g_engine);
    g_endpoint.reset();
  }
  if (eng) eng->shutdown();
  mpi::stop();  // MPI backend
  return 0;
}

int32_t shvd_is_initialized(void) { return engine() ? 1 : 0; }

int32_t shvd_abort(const char* why) {
  return guarded([&]() -> int32_t {
    if (auto e = engine()) e->abort(why ? why : "");
    return 0;
  });
}

int32_t shvd_post_notice(int64_t id) {
  REQUIRE_ENGINE(e);
  if (e->options().rank == 0) e->post_notice(id);
  return 0;
}

int64_t shvd_calling_thread_ops(void) {
  auto e = engine();
  return e ? e->ran_here() : 0;
}

int64_t shvd_released_notice(void) {
  auto e = engine();
  return e ? e->handles().released_notice() : 0;
}

#define ENGINE_FIELD(fn, field)              \
  int32_t fn(void) {                         \
    REQUIRE_ENGINE(e);                       \
    return e->options().field;               \
  }
ENGINE_FIELD(shvd_rank, rank)
ENGINE_FIELD(shvd_size, size)
ENGINE_FIELD(shvd_local_rank, local_rank)
ENGINE_FIELD(shvd_local_size, local_size)
ENGINE_FIELD(shvd_cross_rank, cross_rank)
ENGINE_FIELD(shvd_cross_size, cross_size)

int32_t shvd_shared_memory_enabled(void) {
  REQUIRE_ENGINE(e);
  return e->shared_memory() ? 1 : 0;
}

int32_t shvd_tuned_parameters(double* out, int32_t n) {
  REQUIRE_ENGINE(e);
  uint64_t generation = 0;
  const TunedParams p = e->executed_params(&generation);
  const double values[] = {double(generation), double(p.fusion_threshold_bytes), p.cycle_time_ms,
                           p.cache_enabled ? 1.0 : 0.0, double(p.hierarchical_allreduce),
                           double(p.hierarchical_allgather), p.tuning ? 1.0 : 0.0};
  const int32_t count = int32_t(std::size(values));
  for (int32_t i = 0; i < std::min(n, count); ++i) out[i] = values[i];
  return count;
}

void* shvd_shared_alloc(int64_t bytes) {
  return bytes > 0 ? shared_arena_alloc(size_t(bytes)) : nullptr;
}
int32_t shvd_shared_free(void* p) { return shared_arena_free(p) ? 1 : 0; }
int64_t shvd_shared_bytes(void) { return int64_t(shared_arena_bytes()); }
int64_t shvd_shared_inplace_allreduces(void) { return int64_t(shared_arena_inplace_allreduces()); }

int32_t shvd_process_set_size(int32_t id) {
  REQUIRE_ENGINE(e);
  if (!e->process_sets().exists(id)) return fail(SHVD_ERR_INVALID, "process set " + std::to_string(id) + " does not exist");
  return int32_t(e->process_sets().members(id).size());
}

int32_t shvd_process_set_rank(int32_t id) {
  REQUIRE_ENGINE(e);
  if (!e->process_sets().exists(id)) return fail(SHVD_ERR_INVALID, "process set " + std::to_string(id) + " does not exist");
  return e->process_sets().index_of(id, e->options().rank);
}

int32_t shvd_process_set_ranks(int32_t id, int32_t* out, int32_t cap) {
  REQUIRE_ENGINE(e);
  if (!e->process_sets().exists(id)) return fail(SHVD_ERR_INVALID, "process set " + std::to_string(id) + " does not exist");
  auto m = e->process_sets().members(id);
  for (int i = 0; i < int(m.size()) && i < cap; ++i) out[i] = m[i];
  return int32_t(m.size());
}

int32_t shvd_process_set_ids(int32_t* out, int32_t cap) {
  REQUIRE_ENGINE(e);
  auto ids = e->process_sets().ids();
  for (int i = 0; i < int(ids.size()) && i < cap; ++i) out[i] = ids[i];
  return int32_t(ids.size());
}

int32_t shvd_process_set_find(const int32_t* ranks, int32_t n) {
  REQUIRE_ENGINE(e);
  return e->process_sets().find(std::vector<int>(ranks, ranks + n));
}

int32_t shvd_enqueue(const shvd_op* ops, int32_t n, int64_t* handles) {
  REQUIRE_ENGINE(eng);
  return guarded([&] {
    std::vector<Entry> entries;
    entries.reserve(n);
    for (int i = 0; i < n; ++i) {
      const shvd_op& op = ops[i];
      entries.push_back(make_entry(op, op.name ? op.name : "", op.group ? op.group : "",
                                   op.shape, op.splits, *eng));
    }
    enqueue_entries(*eng, entries, handles, false);
    return 0;
  });
}

namespace {
// shvd_enqueue_packed; `awaited` as in Engine::enqueue.
int32_t enqueue_packed(const char* records, int64_t len, int32_t n, int64_t* handles,
                       bool awaited) {
  struct Header {
    int32_t op, dtype, reduce_op, root_rank, process_set, ndim, nsplits, group_size;
    int64_t input, output;
    double prescale, postscale;
    int32_t name_len, group_len;
    int32_t device_kind, device;
    int64_t stream;
  };
  static_assert(sizeof(Header) == 88, "record header layout must match Python's struct format");
  REQUIRE_ENGINE(eng);
  return guarded([&]() -> int32_t {
    std::vector<Entry> entries;
    entries.reserve(n);
    const char* p = records;
    const char* end = records + len;
    for (int i = 0; i < n; ++i) {
      Header h;
      if (size_t(end - p) < sizeof h) return fail(SHVD_ERR_INVALID, "truncated op record");
      std::memcpy(&h, p, sizeof h);
      p += sizeof h;
      const size_t tail = size_t(h.name_len) + h.group_len + 8 * (size_t(h.ndim) + h.nsplits);
      if (h.name_len < 0 || h.group_len < 0 || h.ndim < 0 || h.nsplits < 0 ||
          tail > size_t(end - p))
        return fail(SHVD_ERR_INVALID, "malformed op record");
      shvd_op op{};
      op.op = h.op;
      op.dtype = h.dtype;
      op.reduce_op = h.reduce_op;
      op.root_rank = h.root_rank;
      op.process_set = h.process_set;
      op.ndim = h.ndim;
      op.nsplits = h.nsplits;
      op.group_size = h.group_size;
      op.input = reinterpret_cast<const void*>(h.input);
      op.output = reinterpret_cast<void*>(h.output);
      op.prescale = h.prescale;
      op.postscale = h.postscale;
      op.device_kind = h.device_kind;
      op.device = h.device;
      op.stream = reinterpret_cast<void*>(h.stream);
      const std::string_view name(p, size_t(h.name_len));
      const std::string_view group(p + h.name_len, size_t(h.group_len));
      const char* shape = p + h.name_len + h.group_len;
      entries.push_back(make_entry(op, name, group, shape, shape + 8 * size_t(h.ndim), *eng));
      p += tail;
    }
    enqueue_entries(*eng, entries, handles, awaited);
    return 0;
  });
}
}  // namespace

int32_t shvd_enqueue_packed(const char* records, int64_t len, int32_t n, int64_t* handles) {
  return enqueue_packed(records, len, n, handles, false);
}

int64_t shvd_enqueue_record(const char* record, int64_t len) {
  int64_t handle = 0;
  return enqueue_packed(record, len, 1, &handle, false) == 0 ? handle : -1;
}

int64_t shvd_enqueue_record_wait(const char* record, int64_t len, int32_t timeout_ms) {
  int64_t handle = 0;
  if (enqueue_packed(record, len, 1, &handle, true) != 0) return -1;
  switch (shvd_wait_release_one_for(handle, timeout_ms)) {
    case 0: return 0;
    case 1: return handle;
    default: return -2;
  }
}

#define REQUIRE_HANDLE(e, s, h)                                                \
  REQUIRE_ENGINE(e);                                                           \
  auto s = e->handles().get(h);                                                \
  if (!s) return fail(SHVD_ERR_STATE, "unknown or released handle " + std::to_string(h))

int32_t shvd_poll(int64_t handle) {
  REQUIRE_HANDLE(e, s, handle);
  if (s->done.load(std::memory_order_acquire)) return 1;
  e->request_flush();  // somebody wants this result: do not hold it back in a burst
  return 0;
}

int32_t shvd_wait(int64_t handle) {
  REQUIRE_HANDLE(e, s, handle);
  e->handles().wait(s);
  if (s->error_kind) return fail(s->error_kind, s->error);
  return 0;
}

int32_t shvd_wait_release(const int64_t* handles, int32_t n) {
  REQUIRE_ENGINE(e);
  int kind = 0;
  std::string error;
  for (int i = 0; i < n; ++i) {
    auto s = e->handles().get(handles[i]);
    if (!s) {
      if (!kind) kind = SHVD_ERR_STATE, error = "unknown or released handle " + std::to_string(handles[i]);
      continue;
    }
    e->handles().wait(s);
    if (s->error_kind && !kind) kind = s->error_kind, error = s->error;
    e->handles().release(handles[i]);
  }
  return kind ? fail(kind, error) : 0;
}

int32_t shvd_wait_release_one(int64_t handle) { return shvd_wait_release(&handle, 1); }

namespace {
// Waits up to `timeout_ms` for every op of `handles` that is still running (unknown handles are
// skipped); false when the time ran out. The clock is read only once one has to be waited for.
bool wait_all_for(Engine& e, const int64_t* handles, int32_t n, int32_t timeout_ms) {
  using Clock = HandleTable::Clock;
  Clock::time_point deadline{};
  for (int i = 0; i < n; ++i) {
    auto s = e.handles().get(handles[i]);
    if (!s || s->done.load(std::memory_order_acquire)) continue;
    if (deadline == Clock::time_point{})
      deadline = Clock::now() + std::chrono::milliseconds(std::max<int32_t>(timeout_ms, 0));
    if (!e.handles().wait_until(s, deadline)) return false;
  }
  return true;
}
}  // namespace

int32_t shvd_wait_for(const int64_t* handles, int32_t n, int32_t timeout_ms) {
  REQUIRE_ENGINE(e);
  for (int i = 0; i < n; ++i)
    if (!e->handles().get(handles[i]))
      return fail(SHVD_ERR_STATE, "unknown or released handle " + std::to_string(handles[i]));
  return wait_all_for(*e, handles, n, timeout_ms) ? 0 : 1;
}

int32_t shvd_wait_release_for(const int64_t* handles, int32_t n, int32_t timeout_ms) {
  REQUIRE_ENGINE(e);
  if (!wait_all_for(*e, handles, n, timeout_ms)) return 1;
  return shvd_wait_release(handles, n);  // every op completed: this no longer blocks
}

int32_t shvd_wait_release_one_for(int64_t handle, int32_t timeout_ms) {
  // The per-tensor hot path (ResultHandle.wait): one lookup, no clock read when already done.
  REQUIRE_HANDLE(e, s, handle);
  if (!s->done.load(std::memory_order_acquire) &&
      !e->handles().wait_until(s, HandleTable::Clock::now() +
                                      std::chrono::milliseconds(std::max<int32_t>(timeout_ms, 0))))
    return 1;
  e->handles().release(handle);
  return s->error_kind ? fail(s->error_kind, s->error) : 0;
}

int32_t shvd_release_completed(int64_t* handles, int32_t n) {
  REQUIRE_ENGINE(e);
  return e->handles().release_completed(handles, n);
}

int32_t shvd_output(int64_t handle, void** data, int64_t* nbytes) {
  REQUIRE_HANDLE(e, s, handle);
  if (s->output_device >= 0) {
    *data = s->device_output;
    *nbytes = int64_t(s->device_output_bytes);
    return 0;
  }
  *data = s->output.data();
  *nbytes = int64_t(s->output.size());
  return 0;
}

int32_t shvd_output_device(int64_t handle) {
  REQUIRE_HANDLE(e, s, handle);
  return s->output_device;
}

int32_t shvd_output_copy(int64_t handle, void* dst, void* stream) {
  REQUIRE_HANDLE(e, s, handle);
  if (s->output_device < 0 || !s->device_output)
    return fail(SHVD_ERR_STATE, "handle " + std::to_string(handle) +
                                    " has no GPU result to copy (not a CUDA op, or copied)");
  return guarded([&]() -> int32_t {
    void* src = s->device_output;
    s->device_output = nullptr;
    gpu::copy_device_output(s->output_device, src, s->device_output_bytes, dst, stream);
    return 0;
  });
}

int32_t shvd_gpu_load(const char* cudart_path, const char* nccl_path) {
  return gpu::load(cudart_path, nccl_path);
}

const char* shvd_gpu_report(void) { return gpu::load_report().c_str(); }

int32_t shvd_gpu_counters(int64_t* out, int32_t n) {
  const gpu::Counters& c = gpu::counters();
  const int64_t values[8] = {c.nccl_collectives.load(),
                             c.host_staged_bytes.load(),
                             gpu::status() == 2 ? int64_t(gpu::nccl().version) : 0,
                             c.nccl_hierarchical_allreduces.load(),
                             c.timed_ops.load(),
                             c.negotiation_ns.load(),
                             c.launch_ns.load(),
                             c.gpu_ns.load()};
  for (int i = 0; i < n && i < 8; ++i) out[i] = values[i];
  return 8;
}

int32_t shvd_output_shape(int64_t handle, int64_t* shape, int32_t cap) {
  REQUIRE_HANDLE(e, s, handle);
  for (int i = 0; i < int(s->output_shape.size()) && i < cap; ++i) shape[i] = s->output_shape[i];
  return int32_t(s->output_shape.size());
}

int32_t shvd_output_ints(int64_t handle, int64_t* out, int32_t cap) {
  REQUIRE_HANDLE(e, s, handle);
  for (int i = 0; i < int(s->ints.size()) && i < cap; ++i) out[i] = s->ints[i];
  return int32_t(s->ints.size());
}

int32_t shvd_release(int64_t handle) {
  REQUIRE_ENGINE(e);
  e->handles().release(handle);
  return 0;
}

int32_t shvd_start_timeline(const char* path, int32_t mark_cycles) {
  REQUIRE_ENGINE(e);
  if (e->options().rank != 0) return 0;  // rank 0 records negotiation for every rank
  std::string err;
  if (!e->timeline().start(path, mark_cycles != 0, &err)) return fail(SHVD_ERR_INVALID, err);
  return 0;
}

int32_t shvd_stop_timeline(void) {
  REQUIRE_ENGINE(e);
  e->timeline().stop();
  return 0;
}

const char* shvd_abi_codes(void) {
  static const std::string table = abi_codes_table();
  return table.c_str();
}

const char* shvd_last_error(void) { return t_error.c_str(); }
int32_t shvd_last_error_kind(void) { return t_error_kind; }

}  // extern "C"
