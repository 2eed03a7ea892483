/* The C ABI of the spark_hvd collective core, loaded by spark_hvd.common with ctypes.
 * It sees only pointers, element counts, dtypes, shapes and names: no framework, no Python.
 * Every number a binding passes is defined here (the core's internal enums are checked against
 * these at compile time, and Python reads them from shvd_abi_codes at load). Codes are only
 * ever appended: a code, once given, keeps its value.
 *
 * Functions return 0 (or a non-negative value) on success and -1 on failure; the failure's
 * message is then available from shvd_last_error() on the same thread, and its category from
 * shvd_last_error_kind() (SHVD_ERR_*).
 */
#ifndef SPARK_HVD_H_
#define SPARK_HVD_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  SHVD_ERR_NONE = 0,
  SHVD_ERR_INVALID = 1,   /* bad input or ranks disagree: ValueError */
  SHVD_ERR_INTERNAL = 2,  /* peer lost / job torn down: HorovodInternalError */
  SHVD_ERR_STATE = 3,     /* not initialized, already initialized, ...: RuntimeError */
  SHVD_ERR_UNSUPPORTED = 4, /* valid but not implemented (as in Horovod): NotImplementedError */
  SHVD_ERR_CONNECT = 5,   /* shvd_init: ranks did not connect within the start timeout (an
                           * unreachable advertised address, mostly): HorovodInternalError */
};

/* Element types (shvd_op.dtype). UINT16 came later and was appended. */
enum {
  SHVD_DTYPE_UINT8 = 0,
  SHVD_DTYPE_INT8 = 1,
  SHVD_DTYPE_INT16 = 2,
  SHVD_DTYPE_INT32 = 3,
  SHVD_DTYPE_INT64 = 4,
  SHVD_DTYPE_FLOAT16 = 5,
  SHVD_DTYPE_BFLOAT16 = 6,
  SHVD_DTYPE_FLOAT32 = 7,
  SHVD_DTYPE_FLOAT64 = 8,
  SHVD_DTYPE_BOOL = 9,
  SHVD_DTYPE_UINT16 = 10,
  SHVD_NUM_DTYPES = 11,
};

/* Reductions (shvd_op.reduce_op) of allreduce and reducescatter. AVERAGE sums and divides by
 * the process set's size; ADASUM is allreduce only, of floating-point tensors. */
enum {
  SHVD_REDUCE_AVERAGE = 0,
  SHVD_REDUCE_SUM = 1,
  SHVD_REDUCE_ADASUM = 2,
  SHVD_REDUCE_MIN = 3,
  SHVD_REDUCE_MAX = 4,
  SHVD_REDUCE_PRODUCT = 5,
  SHVD_NUM_REDUCE_OPS = 6,
};

typedef struct {
  int32_t rank, size, local_rank, local_size, cross_rank, cross_size;
  /* One line per rank, "host port host_id\n", rank order, from the rendezvous. */
  const char* peers;
  const char* secret;
  int32_t secret_len;
  const char* job_id;
  int32_t use_shared_memory;
  double start_timeout_seconds;
  int64_t fusion_threshold_bytes;
  double cycle_time_ms;
  int64_t cache_capacity;
  double stall_warning_seconds;   /* <= 0 disables the stall inspector */
  double stall_shutdown_seconds;  /* > 0 aborts the job after that long */
  int64_t ring_threshold_bytes;
  const char* timeline_path;      /* NULL or "" for none */
  int32_t timeline_mark_cycles;
  /* Static process sets: `process_set_ranks` holds every set's ranks back to back,
   * `process_set_sizes[i]` how many belong to set i+1. */
  const int32_t* process_set_ranks;
  const int32_t* process_set_sizes;
  int32_t num_process_sets;
  /* 1: run collectives while the user thread is still submitting; 0: collect a burst of ops
   * until a result is awaited (hosts without a spare core per rank); -1: decide from the host. */
  int32_t overlap;
  /* Shared-memory allreduce (rank 0's values apply to every member of a set): chunk size
   * (0: default), whether large allreduces may read peers' memory directly (0: never), and
   * from which size they do (-1: default). */
  int64_t shm_chunk_bytes;
  int32_t shm_single_copy;
  int64_t shm_single_copy_min_bytes;
  /* Whether tensors in shared arenas (shvd_shared_alloc) are reduced in place where every
   * member can map them (0: never; 0 on any member turns it off for the whole set). */
  int32_t shm_arenas;
  /* Capacity of each direction of a shared-memory pipe between two ranks of a host (0: the
   * default, 4 MiB; bounded to [64 KiB, 1 GiB], whole pages). */
  int64_t shm_pipe_bytes;
  /* 1: when every rank shares one host, agree on cached allreduces through shared memory
   * instead of the coordinator (rank 0's value applies to every rank); 0: never. */
  int32_t shm_negotiation;
  /* Hierarchical allreduce / allgather on process sets that span hosts with as many ranks on
   * each: 1 always, 0 never, -1 automatic (allreduce when bandwidth-bound, allgather always). */
  int32_t hierarchical_allreduce;
  int32_t hierarchical_allgather;
  /* Autotuning (HOROVOD_AUTOTUNE): rank 0 measures and decides, every rank applies the same
   * settings at the same response batch. 0: off. The core trusts the values: their bounds are
   * checked where they are set (AUTOTUNE_BOUNDS of spark_hvd/common/_config.py). */
  int32_t autotune;
  const char* autotune_log;             /* CSV of the samples, rank 0; NULL or "" for none */
  int32_t autotune_warmup_samples;      /* samples measured but not used */
  int32_t autotune_steps_per_sample;
  int32_t autotune_bayes_opt_max_samples;
  double autotune_gaussian_process_noise;
  int32_t autotune_fixed;               /* SHVD_AUTOTUNE_FIX_* bits: settings the user gave */
  /* TCP links: a peer whose host stays silent this long (no acknowledgement, no keepalive
   * answer: host down, link cut) is lost, and every rank's pending ops fail (<= 0: the kernel's
   * defaults, minutes to hours). */
  double peer_timeout_seconds;
  /* ---- MPI backend ----
   * CPU collectives' data path (HOROVOD_CPU_OPERATIONS): SHVD_CPU_OPERATIONS_DEFAULT, the core's
   * own transport; SHVD_CPU_OPERATIONS_MPI, through MPI, with the plugin library at
   * `mpi_plugin` on a duplicate of the communicator `mpi_comm` (MPI_Comm_c2f of the one the job
   * was bootstrapped on: its rank i is rank i here; MPI initialised by the caller). */
  int32_t cpu_operations;
  int64_t mpi_comm;
  const char* mpi_plugin;
  /* What ranks of a process set that share one GPU do with CUDA tensors (NCCL refuses them):
   * SHVD_SHARED_GPU_HOST (0) through host memory, SHVD_SHARED_GPU_NCCL (1) through NCCL with a
   * host identity per rank (SPARK_HVD_SHARED_GPU). */
  int32_t shared_gpu;
  /* Every rank blocked this long (a user thread waits, nothing new submitted or executed) in
   * collectives none of which can complete (each waits for one another rank never submitted)
   * ends the job with an error naming each rank's pending ops (<= 0: no deadlock check). */
  double deadlock_check_seconds;
} shvd_init_options;

enum {
  SHVD_SHARED_GPU_HOST = 0,
  SHVD_SHARED_GPU_NCCL = 1,
};

/* shvd_init_options.cpu_operations (MPI backend). */
enum {
  SHVD_CPU_OPERATIONS_DEFAULT = 0,
  SHVD_CPU_OPERATIONS_MPI = 1,
};

/* Settings autotuning leaves alone (shvd_init_options.autotune_fixed). */
enum {
  SHVD_AUTOTUNE_FIX_FUSION_THRESHOLD = 1,
  SHVD_AUTOTUNE_FIX_CYCLE_TIME = 2,
  SHVD_AUTOTUNE_FIX_CACHE = 4,
  SHVD_AUTOTUNE_FIX_HIERARCHICAL_ALLREDUCE = 8,
  SHVD_AUTOTUNE_FIX_HIERARCHICAL_ALLGATHER = 16,
};

enum {
  SHVD_OP_ALLREDUCE = 0,
  SHVD_OP_ALLGATHER = 1,
  SHVD_OP_BROADCAST = 2,
  SHVD_OP_ALLTOALL = 3,
  SHVD_OP_REDUCESCATTER = 4,
  SHVD_OP_BARRIER = 5,
  SHVD_OP_JOIN = 6,
  SHVD_OP_ADD_PROCESS_SET = 7,
  SHVD_OP_REMOVE_PROCESS_SET = 8,
};

typedef struct {
  int32_t op;
  const char* name;
  int32_t dtype;
  int32_t ndim;
  const int64_t* shape;
  /* Input data (contiguous). For allreduce and broadcast, `output` receives the result and may
   * equal `input` (in place); for allgather, alltoall and reducescatter the core allocates the
   * result (shvd_output). */
  const void* input;
  void* output;
  int32_t reduce_op;
  double prescale;
  double postscale;
  int32_t root_rank;     /* broadcast: rank within the process set; remove_process_set: set id */
  int32_t process_set;
  const int64_t* splits; /* alltoall rows per member; add_process_set: the ranks */
  int32_t nsplits;
  const char* group;     /* grouped ops: shared group name, NULL otherwise */
  int32_t group_size;
  /* SHVD_DEVICE_CUDA: `input`/`output` are device pointers on CUDA device `device`, valid for
   * work enqueued on `stream` (a cudaStream_t; 0 the legacy default stream) at the time of the
   * call. The core waits for the stream's work so far (an event, no host synchronisation);
   * the result is usable on any stream once the handle completes. */
  int32_t device_kind;
  int32_t device;
  void* stream;
} shvd_op;

/* Where an op's tensors live (shvd_op.device_kind). */
enum {
  SHVD_DEVICE_HOST = 0,
  SHVD_DEVICE_CUDA = 1,
};

/* Phase 1: bind the listening socket; returns the port or -1. `tcp_buffer_bytes` sizes the
 * send and receive buffers of every TCP data socket of the mesh (-1: the default, 4 MiB; 0: the
 * kernel's autotuning; at most 1 GiB). It is given here, not to shvd_init, because the listening
 * socket passes its buffers on to the connections it accepts, and peers may connect as soon as
 * the port is published. */
int32_t shvd_listen(const char* bind_host, int64_t tcp_buffer_bytes);
/* Phase 2: connect the mesh and start the engine thread. */
int32_t shvd_init(const shvd_init_options* options);
int32_t shvd_shutdown(void);
int32_t shvd_is_initialized(void);
/* Ends the job from any thread (elastic: the launcher saw a peer exit or its host fall silent):
 * this rank's pending and later ops fail with `why`, and the peers' ops fail as its links close.
 * No-op when not initialized. */
int32_t shvd_abort(const char* why);
/* Elastic host-change notices. Rank 0 posts the newest notice id (ignored on other ranks); the
 * coordinator sends it with its next response batch, and every op a rank completes from there on
 * carries it. shvd_released_notice: the newest id among the ops whose handles this rank has
 * released (0 before any), the same on every rank at the same point of an SPMD program. */
int32_t shvd_post_notice(int64_t id);
/* Synchronous ops this process ran on the calling thread since init (when every rank shares a
 * host, a cached small allreduce or barrier runs there instead of on the engine thread). */
int64_t shvd_calling_thread_ops(void);
int64_t shvd_released_notice(void);

int32_t shvd_rank(void);
int32_t shvd_size(void);
int32_t shvd_local_rank(void);
int32_t shvd_local_size(void);
int32_t shvd_cross_rank(void);
int32_t shvd_cross_size(void);
/* 1 if ranks to this rank's peers on its host go over shared memory. */
int32_t shvd_shared_memory_enabled(void);

/* Memory that the other members of a shared-memory group can map: allreduces of tensors that
 * lie there on every member are reduced in place, without copies through the shared segment.
 * Blocks are cached by size and never returned to the kernel. Returns NULL when no block can
 * be had (no memfd, or the arenas' 4 GiB spent): use ordinary memory then.
 * Needs no initialized engine; thread-safe. */
void* shvd_shared_alloc(int64_t bytes);
int32_t shvd_shared_free(void* p); /* 1 if `p` was a block of the arenas, else 0 (untouched) */
int64_t shvd_shared_bytes(void); /* bytes the arenas hold */
int64_t shvd_shared_inplace_allreduces(void); /* allreduces this process reduced in place there */

/* Process sets. */
int32_t shvd_process_set_size(int32_t id);        /* -1 if unknown */
int32_t shvd_process_set_rank(int32_t id);        /* -1 if not a member or unknown */
int32_t shvd_process_set_ranks(int32_t id, int32_t* out, int32_t cap); /* count or -1 */
int32_t shvd_process_set_ids(int32_t* out, int32_t cap);
int32_t shvd_process_set_find(const int32_t* ranks, int32_t n); /* id or -1 */

/* Enqueue `n` ops atomically (one negotiation round for a group). Writes n handles (> 0).
 * On failure no op is enqueued. */
int32_t shvd_enqueue(const shvd_op* ops, int32_t n, int64_t* handles);
/* The same as shvd_enqueue, with the ops serialised back to back in one buffer (what Python
 * uses: one struct.pack instead of a ctypes structure per op). Each record, little-endian, an 88-byte header:
 *   int32 op, dtype, reduce_op, root_rank, process_set, ndim, nsplits, group_size,
 *   int64 input, output, float64 prescale, postscale, int32 name_len, group_len,
 *   int32 device_kind, device, int64 stream (88 bytes in all),
 *   then name bytes, group bytes, int64 shape[ndim], int64 splits[nsplits]. */
int32_t shvd_enqueue_packed(const char* records, int64_t len, int32_t n, int64_t* handles);
/* One packed record (the per-tensor hot path): returns its handle (> 0), or -1 on failure. */
int64_t shvd_enqueue_record(const char* record, int64_t len);
/* A synchronous collective's hot path in one call: enqueues one packed record as awaited (the
 * engine sends it at once instead of waiting for the wait to end its burst), then waits as
 * shvd_wait_release_one_for. Returns 0 (completed and released), the handle (> 0: still
 * running after about `timeout_ms`, wait for it again), -1 (nothing enqueued: the error says
 * why) or -2 (the op failed and is released: its error). */
int64_t shvd_enqueue_record_wait(const char* record, int64_t len, int32_t timeout_ms);
/* 1 if done, 0 if pending, -1 unknown handle. */
int32_t shvd_poll(int64_t handle);
/* Waits until done. Returns 0 on success, -1 on failure (the op's error). */
int32_t shvd_wait(int64_t handle);
/* Waits for every handle, then releases them all. Returns 0, or -1 with the first failed op's
 * error (the others are released too). One call per group instead of two per op. */
int32_t shvd_wait_release(const int64_t* handles, int32_t n);
/* shvd_wait_release of one handle, without building an array. */
int32_t shvd_wait_release_one(int64_t handle);
/* The same waits, bounded: each returns after at most about `timeout_ms` so that a caller can
 * react to signals in between (Python runs its signal handlers only when the call returns).
 * Both return 1 when the time ran out before every op completed (nothing is released then).
 * shvd_wait_for: 0 when every op completed (successfully or not; nothing is released), -1 for
 * an unknown handle. shvd_wait_release_for: when every op completed, releases them all and
 * returns as shvd_wait_release. */
int32_t shvd_wait_for(const int64_t* handles, int32_t n, int32_t timeout_ms);
int32_t shvd_wait_release_for(const int64_t* handles, int32_t n, int32_t timeout_ms);
int32_t shvd_wait_release_one_for(int64_t handle, int32_t timeout_ms);
/* Releases those of `handles` whose op completed (unknown ones are dropped) and moves the rest
 * to the front of the array; returns how many are still pending. Buffers of a pending op must
 * stay valid: the core reads and writes them until the op completes, even after shutdown
 * began, whether or not its handle was released. */
int32_t shvd_release_completed(int64_t* handles, int32_t n);
/* Result allocated by the core (allgather, alltoall, reducescatter, add_process_set): data
 * pointer and byte count, valid until shvd_release. ndim/shape of the result via shvd_shape. */
int32_t shvd_output(int64_t handle, void** data, int64_t* nbytes);
int32_t shvd_output_shape(int64_t handle, int64_t* shape, int32_t cap); /* ndim or -1 */
/* alltoall: rows received from each member; join: [last joined rank]; add: [new set id]. */
int32_t shvd_output_ints(int64_t handle, int64_t* out, int32_t cap);   /* count or -1 */
int32_t shvd_release(int64_t handle);

/* Results on a GPU (allgather, alltoall, reducescatter of CUDA tensors): the device holding
 * the result, or -1 for host memory (shvd_output's pointer is then a device pointer). */
int32_t shvd_output_device(int64_t handle);
/* Copies a GPU result into `dst` (device memory of `nbytes` as shvd_output says) on `stream`
 * and frees the core's copy there, stream-ordered: the result is in `dst` for work enqueued on
 * `stream` afterwards. At most once per handle. */
int32_t shvd_output_copy(int64_t handle, void* dst, void* stream);

/* The GPU path. Loads the CUDA runtime and NCCL once per process (paths may be NULL; see
 * gpu_libraries.h for the search) and returns 0 (no CUDA runtime), 1 (CUDA runtime, no NCCL:
 * CUDA tensors are reduced through host memory) or 2 (NCCL). Needs no initialized engine. */
int32_t shvd_gpu_load(const char* cudart_path, const char* nccl_path);
const char* shvd_gpu_report(void); /* what shvd_gpu_load found, in words */
/* out[0] collectives run through NCCL, out[1] bytes of CUDA tensors staged through host memory
 * by the core, out[2] the NCCL version (0 if none), out[3] allreduces (of out[0]) run
 * hierarchically (NCCL within hosts and across them); where NCCL ops' latency went, summed
 * over out[4] ops: out[5] ns from enqueue to execution (queue, negotiation), out[6] ns from
 * there to the GPU work being enqueued, out[7] ns from there to the op seen done. Writes
 * min(n, 8); returns 8. */
int32_t shvd_gpu_counters(int64_t* out, int32_t n);

/* The run-time settings the latest collective of this rank ran with (autotuning changes them,
 * on every rank at the same collective): out[0] settings applied before it (0: the initial
 * ones), [1] fusion threshold bytes, [2] cycle time ms, [3] response cache on, [4]
 * hierarchical allreduce, [5] hierarchical allgather (-1 chosen by the dispatcher, 0 off,
 * 1 on), [6] 1 while autotuning still samples. Writes min(n, 7) values; returns 7. */
int32_t shvd_tuned_parameters(double* out, int32_t n);

int32_t shvd_start_timeline(const char* path, int32_t mark_cycles);
int32_t shvd_stop_timeline(void);

const char* shvd_last_error(void);
int32_t shvd_last_error_kind(void);

/* Every code of this header that a binding passes or reads, by name, one per line:
 * "<kind> <name> <code>", kind dtype (then also " <bytes per element>"), reduce_op, op or
 * error; names as the core spells them in messages ("float32", "Average", "allreduce",
 * "invalid"). A binding that keeps the numbers itself compares them with this table when it
 * loads the library, so a stale build fails at once instead of reducing the wrong type.
 * Static storage; needs no initialized engine. */
const char* shvd_abi_codes(void);

#ifdef __cplusplus
}
#endif

#endif /* SPARK_HVD_H_ */
