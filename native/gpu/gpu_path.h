// Collectives on CUDA tensors: NCCL on a stream of the core's own per device, or, where NCCL
// cannot run a response (ranks of the set share a GPU, a dtype NCCL lacks, a scaling NCCL cannot
// apply), through host memory and the CPU algorithms.
//
// The caller's stream is never synchronised: at enqueue a "ready" event is recorded on it (the
// user thread), the core's stream waits for that event, NCCL runs there, and a "done" event
// recorded after the last kernel is waited for by a finalizer thread, which completes the
// handles. The engine thread only enqueues GPU work and moves on.
//
// Over several hosts with the same number of ranks each, an allreduce the dispatcher makes
// hierarchical runs as three NCCL calls on the fusion buffer (padded to a multiple of the
// host's ranks): reduce-scatter within the host, allreduce of my block with my lane (the
// members of my local index on the other hosts), allgather within the host. Only a host's
// share crosses between hosts, and the last step copies bytes, so every rank ends bitwise
// equal.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../controller/message.h"
#include "../timeline/timeline.h"
#include "../transport/communicator.h"
#include "gpu_libraries.h"
#include "tensor_place.h"

namespace shvd {

struct Entry;

namespace gpu {

// What ranks sharing a GPU do (SPARK_HVD_SHARED_GPU): NCCL refuses two ranks on one device.
enum class SharedGpu { kHost, kNccl };

struct Counters {
  std::atomic<int64_t> nccl_collectives{0};
  std::atomic<int64_t> host_staged_bytes{0};
  std::atomic<int64_t> nccl_hierarchical_allreduces{0};  // of nccl_collectives
  // Where an NCCL op's latency goes (steady clock, summed over `timed_ops`): from the enqueue
  // to the engine executing it (queue and negotiation), from there to its GPU work being
  // enqueued on the core's stream (events, fusion copies, NCCL's launch), and from there to
  // the finalizer seeing it done (the GPU's time and the finalizer's polling). What is left of
  // a caller's time is waking it and the framework's layers.
  std::atomic<int64_t> timed_ops{0};
  std::atomic<int64_t> negotiation_ns{0}, launch_ns{0}, gpu_ns{0};
};
int64_t steady_ns();
Counters& counters();

// Copies a result the core allocated on a device into `dst` on `stream` and frees it there,
// stream-ordered (user thread).
void copy_device_output(int device, void* src, size_t bytes, void* dst, cudaStream_t stream);
void free_device_output(int device, void* src);

class GpuPath {
 public:
  // What the engine lends the GPU path.
  struct Host {
    virtual ~Host() = default;
    // Host-memory collectives over the set's own links (communicator set-up, staged responses).
    virtual void host_broadcast(const Communicator& comm, void* buf, size_t bytes, int root) = 0;
    virtual void host_allgather(const Communicator& comm, const void* mine, size_t bytes,
                                void* all) = 0;
    // Runs a response on the CPU path with entries whose buffers are host memory.
    virtual void run_on_host(const Response& r, std::vector<Entry*>& entries,
                             const Communicator& comm) = 0;
    // Completes an op (any thread) and wakes its waiters.
    virtual void complete_entry(Entry& e, int error_kind, const std::string& error) = 0;
    virtual void wake_waiters() = 0;
  };

  GpuPath(Host& host, int global_rank, const std::string& job_id, SharedGpu shared);
  ~GpuPath();  // waits for the GPU work in flight, then frees streams and communicators

  // Runs response `r` (r.on_gpu) of set `set_id`, this rank's entries (null: joined rank).
  // The entries are completed now (errors, staged path) or by the finalizer. `hierarchical`:
  // the dispatcher chose the hierarchical allreduce (comm.hierarchy, hosts of equal size); it
  // runs where NCCL can take the set and the reduction splits into the three steps.
  void execute(const Response& r, std::vector<Entry*>& entries, const Communicator& comm,
               int set_id, Timeline& timeline, bool hierarchical = false);
  void forget_set(int set_id);  // a removed process set: its communicators go
  // The job is torn down: pending GPU ops fail with `why` and NCCL communicators are aborted
  // (their kernels may wait for a peer that is gone).
  void abort(const std::string& why);

 private:
  struct Device {
    int index = 0;
    cudaStream_t stream = nullptr;
    void* fusion = nullptr;
    size_t fusion_bytes = 0;
  };
  struct SetComm {
    ncclComm_t comm = nullptr;
    int size = 1, rank = 0;
    bool staged = false;  // members share a GPU: host memory
  };
  // A set's hierarchical communicators on one device: my host's members, my lane's ring.
  struct HierarchyComms {
    ncclComm_t local = nullptr, cross = nullptr;
  };
  struct Job {
    cudaEvent_t done = nullptr;
    int device = 0;
    int64_t enqueued_ns = 0, executed_ns = 0, launched_ns = 0;  // Counters' latency
    std::vector<Entry> entries;
  };

  Device& device(int index);
  void* fusion_buffer(Device& d, size_t bytes);
  SetComm& set_comm(int set_id, const Communicator& comm, int device);
  ncclComm_t make_comm(const Communicator& group, int device);
  HierarchyComms& hierarchy_comms(int set_id, const Communicator& comm, int device);
  bool nccl_can_run(const Response& r, const Communicator& comm) const;
  void run_nccl(const Response& r, std::vector<Entry*>& entries, const SetComm& sc,
                Device& d);
  void run_nccl_hierarchical(const Response& r, std::vector<Entry*>& entries,
                             const Communicator& comm, const HierarchyComms& hc, Device& d);
  void run_staged(const Response& r, std::vector<Entry*>& entries, const Communicator& comm,
                  Device& d);
  void finish_async(Device& d, std::vector<Entry*>& entries, int64_t executed_ns);
  void finalizer_loop();

  Host& host_;
  const int global_rank_;
  const std::string job_id_;
  const SharedGpu shared_;
  int last_device_ = -1;
  std::map<int, Device> devices_;
  std::map<std::pair<int, int>, SetComm> comms_;  // (set id, device)
  std::map<std::pair<int, int>, HierarchyComms> hierarchy_comms_;  // (set id, device)

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stopping_ = false;
  std::string abort_reason_;
  std::atomic<bool> aborted_{false};
  std::atomic<int64_t> aborted_at_ns_{0};  // steady_ns() of the abort
  std::thread finalizer_;
};

}  // namespace gpu
}  // namespace shvd
