// The core's side of the MPI plugin: dlopen, version check, and the collectives' calls.
#include "mpi_backend.h"

#include <dlfcn.h>

#include <cstring>
#include <stdexcept>

#include "../kernels/reduce_kernels.h"
#include "../common/logging.h"
#include "plugin_api.h"

namespace shvd {
namespace mpi {

namespace {

const shvd_mpi_plugin* g_plugin = nullptr;  // loaded once, never unloaded
bool g_active = false;
// The tag of MPI_Comm_create_group: members create one communicator at a time, in the same
// order, so one tag serves them all.
constexpr int32_t kCommTag = 0x5348;

void core_reduce(void* dst, const void* src, size_t count, int32_t dtype, int32_t op) {
  reduce_into(dst, src, count, DataType(dtype), ReduceOp(op));
}

const shvd_mpi_plugin* load(const std::string& path) {
  if (g_plugin) return g_plugin;
  if (path.empty())
    throw std::runtime_error("MPI operations: spark_hvd's MPI plugin was not built (build.py "
                             "builds it where mpicxx and MPI's headers are installed)");
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle)
    throw std::runtime_error("MPI operations: cannot load spark_hvd's MPI plugin " + path + ": " +
                             dlerror());
  auto get = reinterpret_cast<const shvd_mpi_plugin* (*)()>(dlsym(handle, "shvd_mpi_plugin_api"));
  const shvd_mpi_plugin* api = get ? get() : nullptr;
  if (!api || api->version != SHVD_MPI_PLUGIN_VERSION)
    throw std::runtime_error("MPI operations: " + path + " is not an MPI plugin of this core's "
                             "version; rebuild with build.py");
  g_plugin = api;
  return api;
}

// Runs a plugin call; its failure becomes the op's error on this rank.
template <typename F>
void call(const char* what, F body) {
  char err[512] = {0};
  if (body(err, sizeof err) != 0)
    throw PeerLostError(std::string("MPI ") + what + ": " + err);
}

void* mpi_comm(const Communicator& comm) {
  void* handle = nullptr;
  std::vector<int32_t> ranks(comm.global_ranks.begin(), comm.global_ranks.end());
  call("communicator", [&](char* e, size_t n) {
    return g_plugin->comm(ranks.data(), int32_t(ranks.size()), kCommTag, &handle, e, n);
  });
  return handle;
}

}  // namespace

void start(const std::string& plugin_path, int64_t fortran_comm) {
  const shvd_mpi_plugin* api = load(plugin_path);
  char err[512] = {0};
  int32_t level = 0;
  if (api->start(fortran_comm, core_reduce, &level, err, sizeof err) != 0)
    throw std::runtime_error(err);
  if (level == 2)
    log_message(LogLevel::kWarning,
                "MPI operations with MPI_THREAD_SERIALIZED: spark_hvd's background thread "
                "calls MPI, so this process must make no MPI call of its own while "
                "collectives run");
  g_active = true;
}

void stop() {
  if (g_plugin && g_active) g_plugin->stop();
  g_active = false;
}

bool active() { return g_active; }

bool supports(DataType, ReduceOp op) { return op != ReduceOp::kAdasum; }

void allreduce(const Communicator& comm, void* buf, size_t count, DataType dtype, ReduceOp op) {
  void* c = mpi_comm(comm);
  call("allreduce", [&](char* e, size_t n) {
    return g_plugin->allreduce(c, buf, count, int32_t(dtype), int32_t(op), e, n);
  });
}

void allgather(const Communicator& comm, void* out, const std::vector<size_t>& bytes) {
  void* c = mpi_comm(comm);
  call("allgather", [&](char* e, size_t n) { return g_plugin->allgatherv(c, out, bytes.data(), e, n); });
}

void broadcast(const Communicator& comm, void* buf, size_t bytes, int root) {
  void* c = mpi_comm(comm);
  call("broadcast", [&](char* e, size_t n) { return g_plugin->broadcast(c, buf, bytes, root, e, n); });
}

void alltoall(const Communicator& comm, const void* in, const std::vector<size_t>& send_bytes,
              void* out, const std::vector<size_t>& recv_bytes) {
  void* c = mpi_comm(comm);
  call("alltoall", [&](char* e, size_t n) {
    return g_plugin->alltoallv(c, in, send_bytes.data(), out, recv_bytes.data(), e, n);
  });
}

void reducescatter(const Communicator& comm, void* buf, const std::vector<size_t>& counts,
                   DataType dtype, ReduceOp op, Scratch& scratch) {
  void* c = mpi_comm(comm);
  const size_t esize = dtype_size(dtype);
  size_t offset = 0;
  for (int i = 0; i < comm.rank; ++i) offset += counts[i];
  const size_t mine = counts[comm.rank] * esize;
  void* out = scratch.get(mine ? mine : 1);
  call("reducescatter", [&](char* e, size_t n) {
    return g_plugin->reduce_scatter(c, buf, out, counts.data(), int32_t(dtype), int32_t(op), e, n);
  });
  if (mine) std::memcpy(static_cast<uint8_t*>(buf) + offset * esize, out, mine);
}

}  // namespace mpi
}  // namespace shvd
