// The MPI plugin (libspark_hvd_mpi.so): the collectives of mpi/plugin_api.h on the MPI library
// that the process already loaded and initialised (mpi4py's). Built by build.py with the MPI
// compiler wrapper's flags; the core dlopens it only when MPI operations are asked for.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "../../include/spark_hvd.h"
#include "../plugin_api.h"

#define SHVD_MPI_EXPORT __attribute__((visibility("default")))

namespace {

MPI_Comm g_world = MPI_COMM_NULL;  // the duplicate of the job's communicator
std::map<std::vector<int32_t>, MPI_Comm> g_comms;
shvd_reduce_fn g_reduce = nullptr;
std::atomic<int64_t> g_counts[5];
enum { kAllreduce, kAllgather, kBroadcast, kAlltoall, kReducescatter };

int fail(char* err, size_t len, const std::string& what) {
  if (len) std::snprintf(err, len, "%s", what.c_str());
  return -1;
}

// A failed MPI call: its error string. Our communicators return errors (MPI_ERRORS_RETURN)
// instead of aborting the job.
int mpi_fail(char* err, size_t len, const char* call, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int n = 0;
  if (MPI_Error_string(code, text, &n) != MPI_SUCCESS) n = 0;
  return fail(err, len, std::string(call) + " failed: " + std::string(text, size_t(n)));
}

#define MPI_CHECK(call, name)                                   \
  do {                                                          \
    int rc_ = (call);                                           \
    if (rc_ != MPI_SUCCESS) return mpi_fail(err, err_len, name, rc_); \
  } while (0)

// User-defined ops for the types MPI has no arithmetic for (float16, bfloat16) and for bool,
// whose core semantics (any non-zero byte is true, results 0/1) MPI's logical ops on bytes
// would not give: they call the core's own kernel. One op per (dtype, reduce op).
template <int32_t D, int32_t R>
void core_op(void* in, void* inout, int* len, MPI_Datatype*) {
  g_reduce(inout, in, size_t(*len), D, R);
}

constexpr int32_t kCoreOpDtypes[] = {SHVD_DTYPE_FLOAT16, SHVD_DTYPE_BFLOAT16, SHVD_DTYPE_BOOL};
constexpr int32_t kCoreOpReductions[] = {SHVD_REDUCE_SUM, SHVD_REDUCE_MIN, SHVD_REDUCE_MAX,
                                         SHVD_REDUCE_PRODUCT};
MPI_Op g_core_ops[3][4];
bool g_core_ops_made = false;

template <int32_t D>
void core_op_row(MPI_User_function** row) {
  row[0] = core_op<D, SHVD_REDUCE_SUM>;
  row[1] = core_op<D, SHVD_REDUCE_MIN>;
  row[2] = core_op<D, SHVD_REDUCE_MAX>;
  row[3] = core_op<D, SHVD_REDUCE_PRODUCT>;
}

int core_op_index(int32_t dtype) {
  for (int i = 0; i < 3; ++i)
    if (kCoreOpDtypes[i] == dtype) return i;
  return -1;
}

int reduction_index(int32_t op) {
  // Average reduces as Sum; the core divides afterwards.
  if (op == SHVD_REDUCE_AVERAGE) op = SHVD_REDUCE_SUM;
  for (int i = 0; i < 4; ++i)
    if (kCoreOpReductions[i] == op) return i;
  return -1;
}

bool datatype_of(int32_t dtype, MPI_Datatype* t) {
  switch (dtype) {
    case SHVD_DTYPE_UINT8: *t = MPI_UINT8_T; return true;
    case SHVD_DTYPE_INT8: *t = MPI_INT8_T; return true;
    case SHVD_DTYPE_INT16: *t = MPI_INT16_T; return true;
    case SHVD_DTYPE_UINT16: *t = MPI_UINT16_T; return true;
    case SHVD_DTYPE_INT32: *t = MPI_INT32_T; return true;
    case SHVD_DTYPE_INT64: *t = MPI_INT64_T; return true;
    case SHVD_DTYPE_FLOAT32: *t = MPI_FLOAT; return true;
    case SHVD_DTYPE_FLOAT64: *t = MPI_DOUBLE; return true;
    // Reduced by the core's kernels (core_op): two and one opaque bytes per element.
    case SHVD_DTYPE_FLOAT16:
    case SHVD_DTYPE_BFLOAT16: *t = MPI_UINT16_T; return true;
    case SHVD_DTYPE_BOOL: *t = MPI_UINT8_T; return true;
    default: return false;
  }
}

bool op_of(int32_t dtype, int32_t reduce_op, MPI_Op* op) {
  const int r = reduction_index(reduce_op);
  if (r < 0) return false;  // Adasum: never sent here
  const int c = core_op_index(dtype);
  if (c >= 0) {
    *op = g_core_ops[c][r];
    return true;
  }
  static const MPI_Op builtin[4] = {MPI_SUM, MPI_MIN, MPI_MAX, MPI_PROD};
  *op = builtin[r];
  return true;
}

size_t dtype_bytes(int32_t dtype) {
  switch (dtype) {
    case SHVD_DTYPE_INT16: case SHVD_DTYPE_UINT16: case SHVD_DTYPE_FLOAT16:
    case SHVD_DTYPE_BFLOAT16: return 2;
    case SHVD_DTYPE_INT32: case SHVD_DTYPE_FLOAT32: return 4;
    case SHVD_DTYPE_INT64: case SHVD_DTYPE_FLOAT64: return 8;
    default: return 1;
  }
}

int types(int32_t dtype, int32_t reduce_op, MPI_Datatype* t, MPI_Op* op, char* err,
          size_t err_len) {
  if (!datatype_of(dtype, t) || !op_of(dtype, reduce_op, op))
    return fail(err, err_len, "MPI backend: dtype " + std::to_string(dtype) + " with reduce op " +
                                  std::to_string(reduce_op) + " has no MPI form");
  return 0;
}

// ---------------------------------------------------------------------------------------------

int start(int64_t fortran_comm, shvd_reduce_fn reduce, int32_t* thread_level, char* err,
          size_t err_len) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized)
    return fail(err, err_len,
                finalized ? "MPI operations: MPI is already finalised in this process"
                          : "MPI operations: MPI is not initialised in this process (import "
                            "mpi4py.MPI, which initialises it, before spark_hvd.init)");
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  *thread_level = provided == MPI_THREAD_MULTIPLE     ? 3
                  : provided == MPI_THREAD_SERIALIZED ? 2
                  : provided == MPI_THREAD_FUNNELED   ? 1
                                                      : 0;
  // The core's engine thread makes every MPI call of the collectives: an MPI initialised for
  // the main thread only cannot take them.
  if (provided != MPI_THREAD_MULTIPLE && provided != MPI_THREAD_SERIALIZED)
    return fail(err, err_len,
                std::string("MPI operations need MPI initialised with MPI_THREAD_MULTIPLE (or "
                            "MPI_THREAD_SERIALIZED), but it provides ") +
                    (provided == MPI_THREAD_FUNNELED ? "MPI_THREAD_FUNNELED" : "MPI_THREAD_SINGLE") +
                    ": spark_hvd runs MPI's collectives on its own background thread. Leave "
                    "mpi4py.rc.thread_level at 'multiple' (its default) before importing "
                    "mpi4py.MPI, or unset HOROVOD_CPU_OPERATIONS");
  g_reduce = reduce;
  if (!g_core_ops_made) {
    MPI_User_function* fns[3][4];
    core_op_row<SHVD_DTYPE_FLOAT16>(fns[0]);
    core_op_row<SHVD_DTYPE_BFLOAT16>(fns[1]);
    core_op_row<SHVD_DTYPE_BOOL>(fns[2]);
    for (int d = 0; d < 3; ++d)
      for (int r = 0; r < 4; ++r)
        MPI_CHECK(MPI_Op_create(fns[d][r], /*commute=*/1, &g_core_ops[d][r]), "MPI_Op_create");
    g_core_ops_made = true;
  }
  MPI_Comm comm = MPI_Comm_f2c(MPI_Fint(fortran_comm));
  if (comm == MPI_COMM_NULL) return fail(err, err_len, "MPI operations: the communicator is null");
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_dup(comm, &dup), "MPI_Comm_dup");
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  g_world = dup;
  g_comms.clear();
  return 0;
}

void stop() {
  g_world = MPI_COMM_NULL;
  g_comms.clear();
}

int comm(const int32_t* ranks, int32_t n, int32_t tag, void** handle, char* err,
         size_t err_len) {
  if (g_world == MPI_COMM_NULL) return fail(err, err_len, "MPI operations are not started");
  std::vector<int32_t> key(ranks, ranks + n);
  auto it = g_comms.find(key);
  if (it == g_comms.end()) {
    int world_size = 0;
    MPI_Comm_size(g_world, &world_size);
    bool identity = n == world_size;
    for (int i = 0; identity && i < n; ++i) identity = ranks[i] == i;
    MPI_Comm c = g_world;
    if (!identity) {
      MPI_Group world_group, group;
      MPI_CHECK(MPI_Comm_group(g_world, &world_group), "MPI_Comm_group");
      std::vector<int> members(ranks, ranks + n);
      MPI_CHECK(MPI_Group_incl(world_group, n, members.data(), &group), "MPI_Group_incl");
      const int rc = MPI_Comm_create_group(g_world, group, tag, &c);
      MPI_Group_free(&group);
      MPI_Group_free(&world_group);
      if (rc != MPI_SUCCESS) return mpi_fail(err, err_len, "MPI_Comm_create_group", rc);
      MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    }
    it = g_comms.emplace(std::move(key), c).first;
  }
  *handle = &it->second;  // std::map keeps its nodes in place
  return 0;
}

MPI_Comm as_comm(void* handle) { return *static_cast<MPI_Comm*>(handle); }

int allreduce(void* c, void* buf, size_t count, int32_t dtype, int32_t reduce_op, char* err,
              size_t err_len) {
  MPI_Datatype t;
  MPI_Op op;
  if (types(dtype, reduce_op, &t, &op, err, err_len)) return -1;
  auto* p = static_cast<uint8_t*>(buf);
  const size_t esize = dtype_bytes(dtype);
  for (size_t done = 0; done < count;) {
    const size_t n = std::min(count - done, size_t(INT_MAX));
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, p + done * esize, int(n), t, op, as_comm(c)),
              "MPI_Allreduce");
    done += n;
  }
  g_counts[kAllreduce]++;
  return 0;
}

// Counts and displacements of `bytes` in units of a contiguous type of `unit` bytes, the
// largest that divides all of them (MPI's counts are ints; a type of several bytes keeps
// blocks of over 2 GiB expressible). Members may choose different units: MPI matches the
// type signatures of what each pair sends and receives, which are bytes on both sides.
struct Layout {
  MPI_Datatype type = MPI_BYTE;
  std::vector<int> counts, displs;
  ~Layout() {
    if (type != MPI_BYTE) MPI_Type_free(&type);
  }
};

int layout(const size_t* bytes, int n, Layout& l, const char* what, char* err, size_t err_len) {
  size_t unit = 0, total = 0;
  for (int i = 0; i < n; ++i) {
    unit = std::gcd(unit, bytes[i]);
    unit = std::gcd(unit, total);
    total += bytes[i];
  }
  if (unit == 0) unit = 1;
  if (total / unit > size_t(INT_MAX) || unit > size_t(INT_MAX))
    return fail(err, err_len, std::string("MPI backend: ") + what +
                                  " blocks too large for MPI's int counts");
  l.counts.resize(n);
  l.displs.resize(n);
  size_t off = 0;
  for (int i = 0; i < n; ++i) {
    l.counts[i] = int(bytes[i] / unit);
    l.displs[i] = int(off / unit);
    off += bytes[i];
  }
  if (unit > 1) {
    MPI_CHECK(MPI_Type_contiguous(int(unit), MPI_BYTE, &l.type), "MPI_Type_contiguous");
    MPI_CHECK(MPI_Type_commit(&l.type), "MPI_Type_commit");
  }
  return 0;
}

int comm_size(void* c) {
  int n = 0;
  MPI_Comm_size(as_comm(c), &n);
  return n;
}

int allgatherv(void* c, void* out, const size_t* bytes, char* err, size_t err_len) {
  Layout l;
  if (layout(bytes, comm_size(c), l, "allgather", err, err_len)) return -1;
  MPI_CHECK(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out, l.counts.data(),
                           l.displs.data(), l.type, as_comm(c)),
            "MPI_Allgatherv");
  g_counts[kAllgather]++;
  return 0;
}

int broadcast(void* c, void* buf, size_t bytes, int32_t root, char* err, size_t err_len) {
  auto* p = static_cast<uint8_t*>(buf);
  for (size_t done = 0; done < bytes;) {
    const size_t n = std::min(bytes - done, size_t(INT_MAX));
    MPI_CHECK(MPI_Bcast(p + done, int(n), MPI_BYTE, root, as_comm(c)), "MPI_Bcast");
    done += n;
  }
  g_counts[kBroadcast]++;
  return 0;
}

int alltoallv(void* c, const void* in, const size_t* send_bytes, void* out,
              const size_t* recv_bytes, char* err, size_t err_len) {
  const int n = comm_size(c);
  Layout s, r;
  if (layout(send_bytes, n, s, "alltoall", err, err_len) ||
      layout(recv_bytes, n, r, "alltoall", err, err_len))
    return -1;
  MPI_CHECK(MPI_Alltoallv(in, s.counts.data(), s.displs.data(), s.type, out, r.counts.data(),
                          r.displs.data(), r.type, as_comm(c)),
            "MPI_Alltoallv");
  g_counts[kAlltoall]++;
  return 0;
}

int reduce_scatter(void* c, const void* in, void* out, const size_t* counts, int32_t dtype,
                   int32_t reduce_op, char* err, size_t err_len) {
  MPI_Datatype t;
  MPI_Op op;
  if (types(dtype, reduce_op, &t, &op, err, err_len)) return -1;
  const int n = comm_size(c);
  std::vector<int> recv(n);
  for (int i = 0; i < n; ++i) {
    if (counts[i] > size_t(INT_MAX))
      return fail(err, err_len, "MPI backend: reducescatter block too large for MPI's int counts");
    recv[i] = int(counts[i]);
  }
  MPI_CHECK(MPI_Reduce_scatter(in, out, recv.data(), t, op, as_comm(c)), "MPI_Reduce_scatter");
  g_counts[kReducescatter]++;
  return 0;
}

const shvd_mpi_plugin kApi = {SHVD_MPI_PLUGIN_VERSION, start,     stop,      comm,
                              allreduce,               allgatherv, broadcast, alltoallv,
                              reduce_scatter};

}  // namespace

extern "C" {

SHVD_MPI_EXPORT const shvd_mpi_plugin* shvd_mpi_plugin_api(void) { return &kApi; }

SHVD_MPI_EXPORT int32_t shvd_mpi_plugin_counts(int64_t* out, int32_t n) {
  for (int i = 0; i < std::min<int32_t>(n, 5); ++i) out[i] = g_counts[i].load();
  return 5;
}

}  // extern "C"
