// The interface between the core and its MPI plugin (libspark_hvd_mpi.so, built from
// mpi/plugin/ by build.py only where an MPI implementation with headers is installed).
//
// The core never links MPI: with HOROVOD_CPU_OPERATIONS=MPI it dlopens the plugin at init
// (mpi_backend.h), and the plugin uses the MPI library that mpi4py already loaded and
// initialised in the process. Nothing here names an MPI type: communicators are opaque
// handles, dtypes and reduce ops are the C ABI's codes (SHVD_DTYPE_*, SHVD_REDUCE_*).
//
// Every function returns 0 on success, or -1 with a message in `err` (at most `err_len` bytes,
// NUL-terminated). The collective functions run on the core's engine thread only.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

// Bumped whenever a field below changes: the core refuses a plugin of another version.
#define SHVD_MPI_PLUGIN_VERSION 1

// dst = op(dst, src) for `count` elements (the core's reduce_into): the plugin's user-defined
// MPI ops for float16, bfloat16 and bool call it, so they reduce exactly as the core does.
typedef void (*shvd_reduce_fn)(void* dst, const void* src, size_t count, int32_t dtype,
                               int32_t reduce_op);

typedef struct {
  int32_t version;  // SHVD_MPI_PLUGIN_VERSION
  // Checks that MPI is initialised (and not finalised) at a thread level the engine thread
  // may call it at, then duplicates `fortran_comm` (MPI_Comm_c2f of the communicator the job
  // was bootstrapped on; its rank i is the job's rank i). Collective over that communicator.
  // `thread_level` receives MPI_Query_thread's answer as 0 single, 1 funneled, 2 serialized,
  // 3 multiple.
  int (*start)(int64_t fortran_comm, shvd_reduce_fn reduce, int32_t* thread_level, char* err,
               size_t err_len);
  // Forgets the communicators (not freed: freeing is collective and the job is over) and the
  // user-defined ops.
  void (*stop)(void);
  // The communicator of the job's ranks `ranks` (n of them, in the set's order: member i is
  // rank i of the result), made with MPI_Comm_create_group on the started communicator the
  // first time and kept. Collective over those ranks. `tag` distinguishes concurrent creations.
  int (*comm)(const int32_t* ranks, int32_t n, int32_t tag, void** handle, char* err,
              size_t err_len);
  // In place: MPI_Allreduce(MPI_IN_PLACE, ...), in pieces of at most INT_MAX elements.
  int (*allreduce)(void* comm, void* buf, size_t count, int32_t dtype, int32_t reduce_op,
                   char* err, size_t err_len);
  // MPI_Allgatherv in place: `out` holds member i's bytes[i] bytes back to back, mine in place.
  int (*allgatherv)(void* comm, void* out, const size_t* bytes, char* err, size_t err_len);
  // MPI_Bcast of `bytes` from member `root`, in pieces of at most INT_MAX bytes.
  int (*broadcast)(void* comm, void* buf, size_t bytes, int32_t root, char* err,
                   size_t err_len);
  // MPI_Alltoallv: send_bytes[i] bytes of `in` (back to back) to member i, recv_bytes[i] from
  // member i into `out` (back to back).
  int (*alltoallv)(void* comm, const void* in, const size_t* send_bytes, void* out,
                   const size_t* recv_bytes, char* err, size_t err_len);
  // MPI_Reduce_scatter of `in` (every member's full input, counts[i] elements for member i)
  // into `out` (counts[my index] elements).
  int (*reduce_scatter)(void* comm, const void* in, void* out, const size_t* counts,
                        int32_t dtype, int32_t reduce_op, char* err, size_t err_len);
} shvd_mpi_plugin;

// The plugin's one entry point (dlsym'd by the core).
const shvd_mpi_plugin* shvd_mpi_plugin_api(void);

// Collectives the plugin ran in this process, by kind: out[0] allreduce, [1] allgather,
// [2] broadcast, [3] alltoall, [4] reducescatter. Writes min(n, 5); returns 5. Tests read it
// (with ctypes) as the proof that data went through MPI.
int32_t shvd_mpi_plugin_counts(int64_t* out, int32_t n);

}  // extern "C"
