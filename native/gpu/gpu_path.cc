#include "gpu_path.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>

#include "../algorithms/dispatch.h"
#include "../algorithms/hierarchical.h"
#include "../kernels/reduce_kernels.h"
#include "../common/logging.h"
#include "../engine/entry.h"
#include "../include/spark_hvd.h"

namespace shvd {
namespace gpu {

namespace {

// How long the finalizer waits, after an abort, for the GPU work of the collectives in flight
// to end (their communicators are aborted, so it ends unless the GPU itself is stuck).
constexpr int64_t kAbortedWorkWaitNs = 10'000'000'000;

// Keeps the calling thread's current device: the user's threads must find theirs unchanged.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cuda().GetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cuda().SetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int now = -1;
    if (cuda().GetDevice(&now) == cudaSuccess && now != previous_) cuda().SetDevice(previous_);
  }

 private:
  int previous_ = 0;
};

// Events are reused: creating one costs microseconds, and an op needs two.
std::mutex g_events_mu;
std::map<int, std::vector<cudaEvent_t>> g_free_events;

cudaEvent_t acquire_event(int device) {
  {
    std::lock_guard<std::mutex> lock(g_events_mu);
    auto& pool = g_free_events[device];
    if (!pool.empty()) {
      cudaEvent_t ev = pool.back();
      pool.pop_back();
      return ev;
    }
  }
  cudaEvent_t ev = nullptr;
  check_cuda(cuda().EventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
  return ev;
}

void release_event(int device, cudaEvent_t ev) {
  if (!ev) return;
  std::lock_guard<std::mutex> lock(g_events_mu);
  g_free_events[device].push_back(ev);
}

// NCCL's type for a reduction of `t`; -1 where NCCL has none (16-bit integers).
int nccl_type(DataType t) {
  switch (t) {
    case DataType::kUInt8: return ncclUint8;
    case DataType::kBool: return ncclUint8;
    case DataType::kInt8: return ncclInt8;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat64: return ncclFloat64;
    default: return -1;
  }
}

bool is_float(DataType t) {
  return t == DataType::kFloat16 || t == DataType::kBFloat16 || t == DataType::kFloat32 ||
         t == DataType::kFloat64;
}

// The one factor a Sum/Average reduction multiplies by: prescale, postscale and 1/n together
// (NCCL applies it to each input, which equals scaling the sum).
double combined_factor(const Response& r, int set_size) {
  double f = r.prescale * r.postscale;
  if (r.reduce_op == ReduceOp::kAverage) f /= set_size;
  return f;
}

uint16_t float_to_bfloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even
  return uint16_t(bits >> 16);
}

const char* nccl_phase(OpType op) {
  switch (op) {
    case OpType::kAllreduce: return "NCCL_ALLREDUCE";
    case OpType::kAllgather: return "NCCL_ALLGATHER";
    case OpType::kBroadcast: return "NCCL_BROADCAST";
    case OpType::kAlltoall: return "NCCL_ALLTOALL";
    case OpType::kReducescatter: return "NCCL_REDUCESCATTER";
    default: return "NCCL";
  }
}

// A result the core allocated on `device`: `rows` rows of `shape`'s trailing dimensions.
void set_device_result(HandleState& st, const std::vector<int64_t>& shape, int64_t rows,
                       void* out, size_t bytes, int device) {
  st.output_shape = shape;
  st.output_shape[0] = rows;
  st.device_output = out;
  st.device_output_bytes = bytes;
  st.output_device = device;
}

// The reduction of `r` with no scale factor (booleans: logical and/or on bytes); also what
// the hierarchical allreduce's later steps apply, once the first applied the scaling.
ncclRedOp_t unscaled(const Response& r) {
  const bool boolean = r.dtype == DataType::kBool;
  switch (r.reduce_op) {
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kProduct: return boolean ? ncclMin : ncclProd;
    default: return boolean ? ncclMax : ncclSum;
  }
}

// Whether allreduce `r` (one NCCL can run) splits into the hierarchical steps: a reduction
// applied within the host (scaled there, once) and then unscaled across hosts. NCCL's own
// average of integers (ncclAvg) divides at the end and does not split.
bool splits_into_steps(const Response& r) {
  return r.reduce_op != ReduceOp::kAverage || is_float(r.dtype);
}

// The reduction for response `r` on `comm`; `*created` when it was made for this call only
// (PreMulSum, destroyed once enqueued).
ncclRedOp_t reduction(const Response& r, int set_size, ncclComm_t comm, bool* created) {
  *created = false;
  if (r.reduce_op == ReduceOp::kMin || r.reduce_op == ReduceOp::kMax ||
      r.reduce_op == ReduceOp::kProduct)
    return unscaled(r);
  const double f = combined_factor(r, set_size);
  if (f == 1.0) return unscaled(r);
  if (r.reduce_op == ReduceOp::kAverage && r.prescale == 1.0 && r.postscale == 1.0 &&
      !is_float(r.dtype))
    return ncclAvg;
  // A float type with a factor (nccl_can_run checked PreMulSum exists).
  alignas(8) unsigned char scalar[8];
  switch (r.dtype) {
    case DataType::kFloat64: { double v = f; std::memcpy(scalar, &v, 8); break; }
    case DataType::kFloat32: { float v = float(f); std::memcpy(scalar, &v, 4); break; }
    case DataType::kFloat16: { uint16_t v = float_to_half(float(f)); std::memcpy(scalar, &v, 2); break; }
    default: { uint16_t v = float_to_bfloat16(float(f)); std::memcpy(scalar, &v, 2); break; }
  }
  ncclRedOp_t op = ncclSum;
  check_nccl(nccl().RedOpCreatePreMulSum(&op, scalar, nccl_type(r.dtype),
                                         ncclScalarHostImmediate, comm),
             "ncclRedOpCreatePreMulSum");
  *created = true;
  return op;
}

// The entries' inputs back to back in `buf` (zeros for the tensors a joined rank never
// submitted), stream-ordered on `s`; `counts`: elements of each.
void pack_fused(const std::vector<Entry*>& entries, const std::vector<size_t>& counts,
                size_t esize, uint8_t* buf, cudaStream_t s) {
  size_t off = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const size_t bytes = counts[i] * esize;
    if (entries[i])
      check_cuda(cuda().MemcpyAsync(buf + off, entries[i]->input, bytes,
                                    cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
    else
      check_cuda(cuda().MemsetAsync(buf + off, 0, bytes, s), "cudaMemsetAsync");
    off += bytes;
  }
}

// pack_fused's reverse: each entry's output from its place in `buf`.
void unpack_fused(const std::vector<Entry*>& entries, const std::vector<size_t>& counts,
                  size_t esize, const uint8_t* buf, cudaStream_t s) {
  size_t off = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const size_t bytes = counts[i] * esize;
    if (entries[i])
      check_cuda(cuda().MemcpyAsync(entries[i]->output, buf + off, bytes,
                                    cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
    off += bytes;
  }
}

// Identifies this process's GPU across the job: machine and PCI bus (what NCCL compares).
std::string device_identity(int device) {
  char bus[64] = {0};
  check_cuda(cuda().DeviceGetPCIBusId(bus, sizeof bus, device), "cudaDeviceGetPCIBusId");
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return std::string(host) + "/" + boot + "/" + bus;
}

}  // namespace

Counters& counters() {
  static Counters c;
  return c;
}

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void record_ready(TensorPlace& place) {
  if (status() < 1 && load(nullptr, nullptr) < 1)
    throw std::runtime_error("a CUDA tensor was given, but the core has no CUDA runtime: " +
                             load_report());
  try {
    DeviceGuard guard(place.device);
    place.enqueued_ns = steady_ns();
    place.ready = acquire_event(place.device);
    check_cuda(cuda().EventRecord(place.ready, place.stream), "cudaEventRecord");
  } catch (const std::runtime_error& e) {
    throw std::runtime_error("a tensor on CUDA device " + std::to_string(place.device) +
                             " cannot be used: " + e.what());
  }
}

void forget_ready(TensorPlace& place) {
  release_event(place.device, place.ready);
  place.ready = nullptr;
}

void copy_device_output(int device, void* src, size_t bytes, void* dst, cudaStream_t stream) {
  DeviceGuard guard(device);
  if (bytes)
    check_cuda(cuda().MemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream),
               "cudaMemcpyAsync");
  check_cuda(cuda().FreeAsync(src, stream), "cudaFreeAsync");
}

void free_device_output(int device, void* src) {
  DeviceGuard guard(device);
  cuda().Free(src);
}

GpuPath::GpuPath(Host& host, int global_rank, const std::string& job_id, SharedGpu shared)
    : host_(host), global_rank_(global_rank), job_id_(job_id), shared_(shared) {
  finalizer_ = std::thread([this] { finalizer_loop(); });
}

GpuPath::~GpuPath() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  finalizer_.join();
  auto release = [this](ncclComm_t comm) {
    if (comm) aborted_ ? nccl().CommAbort(comm) : nccl().CommDestroy(comm);
  };
  for (auto& [key, sc] : comms_) release(sc.comm);
  for (auto& [key, hc] : hierarchy_comms_) {
    release(hc.local);
    release(hc.cross);
  }
  for (auto& [index, d] : devices_) {
    cuda().SetDevice(index);
    if (d.fusion) cuda().Free(d.fusion);
    if (d.stream) cuda().StreamDestroy(d.stream);
  }
}

GpuPath::Device& GpuPath::device(int index) {
  auto it = devices_.find(index);
  if (it != devices_.end()) return it->second;
  Device d;
  d.index = index;
  check_cuda(cuda().SetDevice(index), "cudaSetDevice");
  check_cuda(cuda().StreamCreateWithFlags(&d.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  return devices_.emplace(index, d).first->second;
}

void* GpuPath::fusion_buffer(Device& d, size_t bytes) {
  if (bytes > d.fusion_bytes) {
    if (d.fusion) {
      check_cuda(cuda().StreamSynchronize(d.stream), "cudaStreamSynchronize");
      cuda().Free(d.fusion);
      d.fusion = nullptr;
      d.fusion_bytes = 0;
    }
    const size_t want = std::max(bytes, size_t(1) << 20);
    check_cuda(cuda().Malloc(&d.fusion, want), "cudaMalloc (GPU fusion buffer)");
    d.fusion_bytes = want;
  }
  return d.fusion;
}

GpuPath::SetComm& GpuPath::set_comm(int set_id, const Communicator& comm, int device_index) {
  const auto key = std::make_pair(set_id, device_index);
  auto it = comms_.find(key);
  if (it != comms_.end()) return it->second;
  SetComm sc;
  sc.size = comm.size;
  sc.rank = comm.rank;
  // Every member learns every member's GPU, so all decide alike whether NCCL can have them.
  constexpr size_t kId = 256;
  std::vector<char> mine(kId, 0), all(kId * comm.size, 0);
  const std::string id = device_identity(device_index);
  std::memcpy(mine.data(), id.data(), std::min(id.size(), kId - 1));
  host_.host_allgather(comm, mine.data(), kId, all.data());
  int shared_a = -1, shared_b = -1;
  for (int a = 0; a < comm.size && shared_a < 0; ++a)
    for (int b = a + 1; b < comm.size; ++b)
      if (std::strncmp(&all[a * kId], &all[b * kId], kId) == 0) {
        shared_a = a;
        shared_b = b;
        break;
      }
  const bool usable = status() == 2;
  if (!usable || (shared_a >= 0 && shared_ == SharedGpu::kHost)) {
    sc.staged = true;
    if (comm.rank == 0 && shared_a >= 0 && usable)
      log_message(LogLevel::kWarning,
                  "ranks %d and %d (process set %d) share one GPU (%s), which NCCL refuses: "
                  "CUDA collectives of this set run through host memory, slower. Give each "
                  "rank its own GPU (torch.cuda.set_device(hvd.local_rank())), or set "
                  "SPARK_HVD_SHARED_GPU=nccl to run them through NCCL's network transport.",
                  comm.global_ranks[shared_a], comm.global_ranks[shared_b], set_id,
                  &all[shared_a * kId]);
    return comms_.emplace(key, sc).first->second;
  }
  if (shared_a >= 0) {
    // NCCL tells hosts apart by NCCL_HOSTID: one per rank makes ranks on one GPU look like
    // separate machines, which NCCL connects through its network transport (sockets): over
    // loopback when every member is on this machine, else over the interface NCCL picks (or
    // the user's NCCL_SOCKET_IFNAME), which reaches the other hosts.
    bool one_machine = true;
    const std::string me(&all[comm.rank * kId]);
    const std::string machine = me.substr(0, me.rfind('/'));
    for (int a = 0; a < comm.size; ++a)
      one_machine = one_machine && std::string(&all[a * kId]).rfind(machine + "/", 0) == 0;
    static std::once_flag once;
    std::call_once(once, [this, one_machine] {
      const std::string host_id = job_id_ + "-rank" + std::to_string(global_rank_);
      setenv("NCCL_HOSTID", host_id.c_str(), 1);
      if (one_machine) setenv("NCCL_SOCKET_IFNAME", "lo", 0);
    });
  }
  sc.comm = make_comm(comm, device_index);
  return comms_.emplace(key, sc).first->second;
}

// An NCCL communicator over `group`'s members (every one calls this at the same point): its
// first member's unique id travels over the group's own links.
ncclComm_t GpuPath::make_comm(const Communicator& group, int device_index) {
  ncclUniqueId uid{};
  if (group.rank == 0) check_nccl(nccl().GetUniqueId(&uid), "ncclGetUniqueId");
  host_.host_broadcast(group, &uid, sizeof uid, 0);
  check_cuda(cuda().SetDevice(device_index), "cudaSetDevice");
  ncclComm_t made = nullptr;
  check_nccl(nccl().CommInitRank(&made, group.size, uid, group.rank), "ncclCommInitRank");
  return made;
}

// Made at the set's first hierarchical allreduce, by every member at once (the dispatcher's
// choice is the same on every member): first within each host, then along each lane.
GpuPath::HierarchyComms& GpuPath::hierarchy_comms(int set_id, const Communicator& comm,
                                                  int device_index) {
  const auto key = std::make_pair(set_id, device_index);
  auto it = hierarchy_comms_.find(key);
  if (it != hierarchy_comms_.end()) return it->second;
  const Hierarchy& h = *comm.hierarchy;
  HierarchyComms hc;
  hc.local = make_comm(h.local, device_index);
  hc.cross = make_comm(h.cross, device_index);
  return hierarchy_comms_.emplace(key, hc).first->second;
}

void GpuPath::forget_set(int set_id) {
  // The set's communicators go once the work queued on the core's streams (which may use
  // them) is done: one synchronisation for all of them.
  bool synced = false;
  auto destroy = [&](ncclComm_t comm) {
    if (!comm) return;
    if (!synced)
      for (auto& [index, d] : devices_) cuda().StreamSynchronize(d.stream);
    synced = true;
    nccl().CommDestroy(comm);
  };
  for (auto it = comms_.begin(); it != comms_.end();) {
    if (it->first.first != set_id) {
      ++it;
      continue;
    }
    destroy(it->second.comm);
    it = comms_.erase(it);
  }
  for (auto it = hierarchy_comms_.begin(); it != hierarchy_comms_.end();) {
    if (it->first.first != set_id) {
      ++it;
      continue;
    }
    destroy(it->second.local);
    destroy(it->second.cross);
    it = hierarchy_comms_.erase(it);
  }
}

bool GpuPath::nccl_can_run(const Response& r, const Communicator& comm) const {
  if (r.op != OpType::kAllreduce && r.op != OpType::kReducescatter) return true;  // bytes
  if (nccl_type(r.dtype) < 0) return false;
  switch (r.reduce_op) {
    case ReduceOp::kSum:
    case ReduceOp::kAverage: {
      const double f = combined_factor(r, comm.size);
      if (f == 1.0) return true;
      if (r.reduce_op == ReduceOp::kAverage && r.prescale == 1.0 && r.postscale == 1.0)
        return is_float(r.dtype) ? nccl().RedOpCreatePreMulSum != nullptr
                                 : nccl().version >= 21000;
      return is_float(r.dtype) && nccl().RedOpCreatePreMulSum != nullptr;
    }
    case ReduceOp::kMin:
    case ReduceOp::kMax:
    case ReduceOp::kProduct:
      return r.prescale == 1.0 && r.postscale == 1.0;
    default:
      return false;
  }
}

void GpuPath::execute(const Response& r, std::vector<Entry*>& entries, const Communicator& comm,
                      int set_id, Timeline& timeline, bool hierarchical) {
  const int64_t executed_ns = steady_ns();
  int index = last_device_;
  for (Entry* e : entries)
    if (e) {
      index = e->gpu.device;
      break;
    }
  if (index < 0) check_cuda(cuda().GetDevice(&index), "cudaGetDevice");
  last_device_ = index;
  const char* path = nullptr;  // the timeline's name for the path, once chosen
  try {
    Device& d = device(index);
    for (Entry* e : entries)
      if (e) {
        check_cuda(cuda().StreamWaitEvent(d.stream, e->gpu.ready, 0), "cudaStreamWaitEvent");
        forget_ready(e->gpu);  // the wait took the event's state; it may be recorded again
      }
    SetComm& sc = set_comm(set_id, comm, index);
    const bool staged = sc.staged || !nccl_can_run(r, comm);
    hierarchical = hierarchical && !staged && comm.hierarchy && splits_into_steps(r);
    path = staged         ? "CUDA_HOST_STAGED"
           : hierarchical ? kNcclHierarchicalAllreduce
                          : nccl_phase(r.op);
    if (timeline.active())
      for (const auto& n : r.names) timeline.begin(r.op, n, path);
    if (staged) {
      run_staged(r, entries, comm, d);
    } else if (hierarchical) {
      run_nccl_hierarchical(r, entries, comm, hierarchy_comms(set_id, comm, index), d);
      finish_async(d, entries, executed_ns);
    } else {
      run_nccl(r, entries, sc, d);
      finish_async(d, entries, executed_ns);
    }
  } catch (const std::exception& ex) {
    for (Entry* e : entries)
      if (e) host_.complete_entry(*e, SHVD_ERR_INTERNAL,
                                  std::string(op_type_name(r.op)) + " of CUDA tensor '" +
                                      e->request.name + "': " + ex.what());
    host_.wake_waiters();
  }
  if (path && timeline.active())
    for (const auto& n : r.names) timeline.end(r.op, n, path);
}

void GpuPath::run_nccl(const Response& r, std::vector<Entry*>& entries, const SetComm& sc,
                       Device& d) {
  const NcclApi& n = nccl();
  const CudaApi& c = cuda();
  cudaStream_t s = d.stream;
  const size_t esize = dtype_size(r.dtype);
  const int me = sc.rank, size = sc.size;
  counters().nccl_collectives++;
  switch (r.op) {
    case OpType::kAllreduce: {
      std::vector<size_t> counts;
      size_t total = 0;
      for (const auto& shape : r.shapes)
        total += counts.emplace_back(size_t(num_elements(shape)));
      bool created = false;
      const ncclRedOp_t op = reduction(r, size, sc.comm, &created);
      if (entries.size() == 1 && entries[0]) {
        check_nccl(n.AllReduce(entries[0]->input, entries[0]->output, total, nccl_type(r.dtype),
                               op, sc.comm, s), "ncclAllReduce");
      } else {
        auto* buf = static_cast<uint8_t*>(fusion_buffer(d, total * esize));
        pack_fused(entries, counts, esize, buf, s);
        check_nccl(n.AllReduce(buf, buf, total, nccl_type(r.dtype), op, sc.comm, s),
                   "ncclAllReduce");
        unpack_fused(entries, counts, esize, buf, s);
      }
      if (created) n.RedOpDestroy(op, sc.comm);
      return;
    }
    case OpType::kBroadcast: {
      Entry& e = *entries[0];
      const size_t bytes = size_t(num_elements(e.request.shape)) * esize;
      check_nccl(n.Broadcast(e.input, e.output, bytes, ncclUint8, r.root, sc.comm, s),
                 "ncclBroadcast");
      return;
    }
    case OpType::kAllgather: {
      Entry& e = *entries[0];
      const size_t row_bytes = size_t(num_elements(e.request.shape, 1)) * esize;
      std::vector<size_t> bytes(size);
      size_t total = 0;
      bool even = true;
      for (int i = 0; i < size; ++i) {
        bytes[i] = size_t(r.first_dims[i]) * row_bytes;
        total += bytes[i];
        even = even && bytes[i] == bytes[0];
      }
      void* out = nullptr;
      check_cuda(c.MallocAsync(&out, std::max<size_t>(total, 1), s), "cudaMallocAsync");
      auto* o = static_cast<uint8_t*>(out);
      if (even) {
        check_nccl(n.AllGather(e.input, o, bytes[0], ncclUint8, sc.comm, s), "ncclAllGather");
      } else {  // ragged: every member broadcasts its block into place
        check_nccl(n.GroupStart(), "ncclGroupStart");
        size_t off = 0;
        for (int i = 0; i < size; ++i) {
          if (bytes[i])
            n.Broadcast(e.input, o + off, bytes[i], ncclUint8, i, sc.comm, s);
          off += bytes[i];
        }
        check_nccl(n.GroupEnd(), "ncclGroupEnd (allgather)");
      }
      int64_t rows = 0;
      for (int64_t v : r.first_dims) rows += v;
      set_device_result(*e.state, e.request.shape, rows, out, total, d.index);
      return;
    }
    case OpType::kAlltoall: {
      Entry& e = *entries[0];
      const size_t row_bytes = size_t(num_elements(e.request.shape, 1)) * esize;
      std::vector<size_t> send(size), recv(size);
      size_t total = 0;
      HandleState& st = *e.state;
      st.ints.assign(size, 0);
      for (int i = 0; i < size; ++i) {
        send[i] = size_t(r.splits_matrix[size_t(me) * size + i]) * row_bytes;
        const int64_t got = r.splits_matrix[size_t(i) * size + me];
        recv[i] = size_t(got) * row_bytes;
        st.ints[i] = got;
        total += recv[i];
      }
      void* out = nullptr;
      check_cuda(c.MallocAsync(&out, std::max<size_t>(total, 1), s), "cudaMallocAsync");
      const auto* in = static_cast<const uint8_t*>(e.input);
      auto* o = static_cast<uint8_t*>(out);
      check_nccl(n.GroupStart(), "ncclGroupStart");
      size_t soff = 0, roff = 0;
      for (int i = 0; i < size; ++i) {
        if (i == me) {
          if (send[i]) c.MemcpyAsync(o + roff, in + soff, send[i], cudaMemcpyDeviceToDevice, s);
        } else {
          if (send[i]) n.Send(in + soff, send[i], ncclUint8, i, sc.comm, s);
          if (recv[i]) n.Recv(o + roff, recv[i], ncclUint8, i, sc.comm, s);
        }
        soff += send[i];
        roff += recv[i];
      }
      check_nccl(n.GroupEnd(), "ncclGroupEnd (alltoall)");
      int64_t rows = 0;
      for (int i = 0; i < size; ++i) rows += r.splits_matrix[size_t(i) * size + me];
      set_device_result(st, e.request.shape, rows, out, total, d.index);
      return;
    }
    case OpType::kReducescatter: {
      Entry& e = *entries[0];
      const auto& shape = e.request.shape;
      const int64_t rows = shape[0];
      const size_t row_elems = size_t(num_elements(shape, 1));
      std::vector<size_t> counts(size);
      bool even = true;
      for (int i = 0; i < size; ++i) {
        counts[i] = size_t(rows / size + (i < rows % size ? 1 : 0)) * row_elems;
        even = even && counts[i] == counts[0];
      }
      void* out = nullptr;
      check_cuda(c.MallocAsync(&out, std::max<size_t>(counts[me] * esize, 1), s),
                 "cudaMallocAsync");
      bool created = false;
      const ncclRedOp_t op = reduction(r, size, sc.comm, &created);
      const int type = nccl_type(r.dtype);
      if (even) {
        check_nccl(n.ReduceScatter(e.input, out, counts[0], type, op, sc.comm, s),
                   "ncclReduceScatter");
      } else {  // uneven blocks: one reduce to each member
        const auto* in = static_cast<const uint8_t*>(e.input);
        check_nccl(n.GroupStart(), "ncclGroupStart");
        size_t off = 0;
        for (int i = 0; i < size; ++i) {
          if (counts[i]) n.Reduce(in + off * esize, out, counts[i], type, op, i, sc.comm, s);
          off += counts[i];
        }
        check_nccl(n.GroupEnd(), "ncclGroupEnd (reducescatter)");
      }
      if (created) n.RedOpDestroy(op, sc.comm);
      set_device_result(*e.state, shape, rows / size + (me < rows % size ? 1 : 0), out,
                        counts[me] * esize, d.index);
      return;
    }
    default:
      return;
  }
}

void GpuPath::run_nccl_hierarchical(const Response& r, std::vector<Entry*>& entries,
                                    const Communicator& comm, const HierarchyComms& hc,
                                    Device& d) {
  const NcclApi& n = nccl();
  const CudaApi& c = cuda();
  cudaStream_t s = d.stream;
  const size_t esize = dtype_size(r.dtype);
  const Hierarchy& h = *comm.hierarchy;
  std::vector<size_t> counts;
  size_t total = 0;
  for (const auto& shape : r.shapes) total += counts.emplace_back(size_t(num_elements(shape)));
  // One equal block per member of my host (every host has as many members as lanes).
  const size_t members = size_t(h.local.size);
  const size_t block = (total + members - 1) / members;
  auto* buf = static_cast<uint8_t*>(fusion_buffer(d, std::max<size_t>(block * members, 1) * esize));
  pack_fused(entries, counts, esize, buf, s);
  if (block * members > total)  // the padding: reduced, never read back
    check_cuda(c.MemsetAsync(buf + total * esize, 0, (block * members - total) * esize, s),
               "cudaMemsetAsync");
  const int type = nccl_type(r.dtype);
  uint8_t* mine = buf + size_t(h.local.rank) * block * esize;
  counters().nccl_collectives++;
  counters().nccl_hierarchical_allreduces++;
  // Scaling (prescale, postscale, 1/n of the whole set) is applied once, in the first step.
  bool created = false;
  const ncclRedOp_t first = reduction(r, comm.size, hc.local, &created);
  check_nccl(n.ReduceScatter(buf, mine, block, type, first, hc.local, s),
             "ncclReduceScatter (within the host)");
  if (created) n.RedOpDestroy(first, hc.local);
  check_nccl(n.AllReduce(mine, mine, block, type, unscaled(r), hc.cross, s),
             "ncclAllReduce (across hosts)");
  check_nccl(n.AllGather(mine, buf, block, type, hc.local, s), "ncclAllGather (within the host)");
  unpack_fused(entries, counts, esize, buf, s);
}

void GpuPath::run_staged(const Response& r, std::vector<Entry*>& entries,
                         const Communicator& comm, Device& d) {
  const CudaApi& c = cuda();
  const size_t esize = dtype_size(r.dtype);
  // Host twins of the entries: the same requests and handles, host buffers.
  std::vector<Entry> twins(entries.size());
  std::vector<Entry*> twin_ptrs(entries.size(), nullptr);
  std::vector<std::vector<uint8_t>> in(entries.size()), out(entries.size());
  int64_t staged = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    Entry* e = entries[i];
    if (!e) continue;
    const size_t bytes = size_t(num_elements(e->request.shape)) * esize;
    in[i].resize(std::max<size_t>(bytes, 1));
    out[i].resize(std::max<size_t>(bytes, 1));
    if (bytes)
      check_cuda(c.MemcpyAsync(in[i].data(), e->input, bytes, cudaMemcpyDeviceToHost, d.stream),
                 "cudaMemcpyAsync (to host)");
    staged += int64_t(bytes);
    twins[i].request = e->request;
    twins[i].input = in[i].data();
    twins[i].output = out[i].data();
    twins[i].state = e->state;
    twin_ptrs[i] = &twins[i];
  }
  check_cuda(c.StreamSynchronize(d.stream), "cudaStreamSynchronize");
  host_.run_on_host(r, twin_ptrs, comm);
  for (size_t i = 0; i < entries.size(); ++i) {
    Entry* e = entries[i];
    if (!e) continue;
    HandleState& st = *e->state;
    if (r.op == OpType::kAllreduce || r.op == OpType::kBroadcast) {
      const size_t bytes = size_t(num_elements(e->request.shape)) * esize;
      if (bytes)
        check_cuda(c.MemcpyAsync(e->output, out[i].data(), bytes, cudaMemcpyHostToDevice,
                                 d.stream), "cudaMemcpyAsync (to device)");
      staged += int64_t(bytes);
    } else if (!st.error_kind) {
      void* dev = nullptr;
      const size_t bytes = st.output.size();
      check_cuda(c.MallocAsync(&dev, std::max<size_t>(bytes, 1), d.stream), "cudaMallocAsync");
      if (bytes)
        check_cuda(c.MemcpyAsync(dev, st.output.data(), bytes, cudaMemcpyHostToDevice,
                                 d.stream), "cudaMemcpyAsync (to device)");
      staged += int64_t(bytes);
      set_device_result(st, st.output_shape, st.output_shape.empty() ? 0 : st.output_shape[0],
                        dev, bytes, d.index);
    }
  }
  check_cuda(c.StreamSynchronize(d.stream), "cudaStreamSynchronize");
  for (Entry* e : entries)
    if (e) e->state->output = std::vector<uint8_t>();
  counters().host_staged_bytes += staged;
  for (Entry* e : entries)
    if (e) host_.complete_entry(*e, e->state->error_kind, e->state->error);
  host_.wake_waiters();
}

void GpuPath::finish_async(Device& d, std::vector<Entry*>& entries, int64_t executed_ns) {
  Job job;
  job.device = d.index;
  job.executed_ns = executed_ns;
  for (Entry* e : entries)
    if (e && e->gpu.enqueued_ns && (!job.enqueued_ns || e->gpu.enqueued_ns < job.enqueued_ns))
      job.enqueued_ns = e->gpu.enqueued_ns;
  job.done = acquire_event(d.index);
  check_cuda(cuda().EventRecord(job.done, d.stream), "cudaEventRecord");
  job.launched_ns = steady_ns();
  for (Entry* e : entries)
    if (e) job.entries.push_back(std::move(*e));
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void GpuPath::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    abort_reason_ = why;
  }
  aborted_at_ns_ = steady_ns();
  aborted_ = true;
  // Abort the communicators now (the engine thread owns them): their kernels, which may wait
  // for a peer that is gone, end, and so does the work queued after them on the core's
  // streams, which the finalizer waits for before it hands the buffers back (see there).
  for (auto& [key, sc] : comms_)
    if (sc.comm) {
      nccl().CommAbort(sc.comm);
      sc.comm = nullptr;
    }
  for (auto& [key, hc] : hierarchy_comms_)
    for (ncclComm_t* comm : {&hc.local, &hc.cross})
      if (*comm) {
        nccl().CommAbort(*comm);
        *comm = nullptr;
      }
  cv_.notify_all();
}

void GpuPath::finalizer_loop() {
  bool gave_up = false;  // on GPU work that outlived the abort by kAbortedWorkWaitNs
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    // Poll rather than block in cudaEventSynchronize, so that an abort is seen. An aborted
    // job is still waited for, a bounded time: its communicators are aborted, so its NCCL
    // kernels end, and the work queued after them (the copies out of the fusion buffer into
    // the caller's tensors) runs to its end before the caller gets the tensors back; handed
    // back earlier, a tensor freed and reused (an elastic job goes on after the error) would
    // be written by that stale work.
    cudaError_t err = cudaErrorNotReady;
    for (int spins = 0;; ++spins) {
      err = cuda().EventQuery(job.done);
      if (err != cudaErrorNotReady || gave_up) break;
      if (aborted_ && steady_ns() > aborted_at_ns_ + kAbortedWorkWaitNs) {
        log_message(LogLevel::kWarning,
                    "GPU work of aborted collectives did not end within %d s of the abort; "
                    "their tensors are handed back while it may still write them",
                    int(kAbortedWorkWaitNs / 1000000000));
        gave_up = true;
        break;
      }
      if (spins > 2000) usleep(20);
    }
    std::string error;
    int kind = 0;
    if (aborted_) {  // what an aborted communicator produced is not a result
      std::lock_guard<std::mutex> lock(mu_);
      kind = SHVD_ERR_INTERNAL;
      error = abort_reason_;
    } else if (err != cudaSuccess) {
      kind = SHVD_ERR_INTERNAL;
      error = std::string("CUDA error ") + std::to_string(err) + " (" +
              cuda().GetErrorString(err) + ") in a collective on CUDA tensors";
    }
    if (err == cudaSuccess && job.enqueued_ns) {
      Counters& c = counters();
      c.timed_ops++;
      c.negotiation_ns += job.executed_ns - job.enqueued_ns;
      c.launch_ns += job.launched_ns - job.executed_ns;
      c.gpu_ns += steady_ns() - job.launched_ns;
    }
    if (err != cudaErrorNotReady) release_event(job.device, job.done);
    for (Entry& e : job.entries) host_.complete_entry(e, kind, error);
    host_.wake_waiters();
  }
}

}  // namespace gpu
}  // namespace shvd
