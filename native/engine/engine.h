// The background engine: one thread per process that takes enqueued named tensors, negotiates
// with the coordinator (rank 0) which are ready on every member of their process set, fuses
// small allreduces, runs the collectives and completes the handles.
//
// User threads only touch the queue (enqueue) and handles; everything else, including every
// link, belongs to the engine thread.
#pragma once

#include <poll.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "../algorithms/collectives.h"
#include "../algorithms/hierarchical.h"
#include "../algorithms/shared_memory_group.h"
#include "../controller/autotune.h"
#include "../controller/coordinator.h"
#include "../controller/message.h"
#include "../controller/negotiation_board.h"
#include "../controller/process_sets.h"
#include "../controller/response_cache.h"
#include "../gpu/gpu_path.h"
#include "../timeline/timeline.h"
#include "../transport/mesh.h"
#include "entry.h"
#include "fusion_buffer.h"
#include "handles.h"

namespace shvd {

struct Algorithm;  // a row of the dispatcher's table (algorithms/dispatch.h)

using Clock = std::chrono::steady_clock;

struct EngineOptions {
  int rank = 0, size = 1, local_rank = 0, local_size = 1, cross_rank = 0, cross_size = 1;
  CoordinatorOptions coordinator;
  size_t ring_threshold_bytes = kDefaultRingThresholdBytes;
  SharedMemoryGroup::Settings shm_group;  // used as rank 0's
  // Host id of every rank (the rendezvous'): members with equal ids share a machine. Empty for a
  // job of one.
  std::vector<std::string> host_ids;
  // Hierarchical allreduce / allgather on sets that span hosts (algorithms/hierarchical.h): 1
  // always, 0 never, -1 automatic. The starting values of the engine's tuned settings, which
  // execute.cc reads for every response; autotuning may change those between cycles, every
  // rank at the same point.
  int hierarchical_allreduce = -1;
  int hierarchical_allgather = -1;
  std::vector<std::vector<int>> static_process_sets;
  std::string job_id = "job";
  // After activity the engine polls for this long before sleeping: back-to-back collectives
  // (a training step's gradients, latency-bound loops) then skip two thread wake-ups each.
  double spin_microseconds = 200;
  double cycle_time_ms = 0.5;  // a burst's window (see Engine::in_burst_)
  // See Engine::overlap_. -1: decide from the host (off when ranks * 2 threads > CPUs, unless
  // the job spans hosts).
  int overlap = -1;
  // Negotiate cached allreduces through shared memory when every rank shares this host
  // (negotiation_board.h). Rank 0's setting applies to every rank.
  bool shm_negotiation = true;
  // Autotuning of the run-time settings (TunedParams): rank 0's options apply.
  AutotuneOptions autotune;
  // What ranks of a set that share a GPU do with CUDA tensors (SPARK_HVD_SHARED_GPU).
  gpu::SharedGpu shared_gpu = gpu::SharedGpu::kHost;
};

class Engine : public gpu::GpuPath::Host {
 public:
  Engine(EngineOptions options, Mesh mesh, bool shared_memory);
  ~Engine();

  const EngineOptions& options() const { return options_; }
  ProcessSets& process_sets() { return sets_; }
  HandleTable& handles() { return handles_; }
  Timeline& timeline() { return timeline_; }
  bool shared_memory() const { return shared_memory_; }

  // Validates and queues ops (all or none), moving them out of `entries` and writing their
  // handles to `ids`. Throws OpMismatchError for bad input, PeerLostError if the job was
  // aborted, std::logic_error after shutdown. `awaited`: the caller waits for these ops right
  // away (a synchronous collective): the engine sends them when it takes them, without the
  // second hand-off (the wait) that would end a burst for them a few microseconds later.
  void enqueue(std::vector<Entry>& entries, int64_t* ids, bool awaited = false);

  // Coordinated shutdown: returns once every rank has shut down (or the job aborted).
  void shutdown();

  // A user thread wants a result (it waits for or polls a handle): ends the current burst.
  void request_flush();

  // Ends the job from any thread (elastic: the launcher saw a rank exit or a host fall silent):
  // every pending and later op fails with `why` on this rank, and its closed links fail the
  // peers' ops at once. Waits for nothing.
  void abort(const std::string& why);

  // Elastic host-change notices (rank 0, any thread): the newest `id` goes to every rank with
  // the next response batch; ops completed from there on carry it (HandleState::notice).
  void post_notice(int64_t id);

  // The run-time settings the latest collective this rank executed ran with, and how many
  // settings had been applied by then (0: the initial ones). Every rank executes the same
  // sequence with the same settings, so after a step's results are in, every rank reads the
  // same values here. Any thread.
  TunedParams executed_params(uint64_t* generation) const;

 private:
  void loop();
  // Waits for local work, a peer's message or a deadline. True when it ended a burst (its
  // requests are to be sent now).
  bool wait_for_work();
  void drain_wake_fd(const pollfd& fd);
  // `awaited`: an op taken was enqueued awaited (see enqueue).
  std::vector<Entry> take_queue(bool* awaited);
  // Blocks in poll() on the wake eventfd and the control links until `deadline`.
  void sleep_until(std::vector<pollfd>& fds, Clock::time_point deadline);
  void abort_job(const std::string& why);
  void complete(Entry& entry, int error_kind = 0, const std::string& error = "");

  // Negotiation over TCP (negotiation.cc).
  void submit_queued(bool burst_over);
  void flush_requests();
  void run_coordinator(bool burst_over);
  void run_worker(bool burst_over);
  // A cycle's work after submitting: rank 0 reads the requests and answers (coordinator),
  // the others read the answers; both execute what the board's log holds.
  void progress();
  void send_frame(Link* link, const std::string& payload);
  // Reads whatever the control link has (never blocks) and returns the complete frames.
  std::vector<std::string> read_frames(int peer);
  void run_batch(const ResponseBatch& batch);
  // Timeline: `resp`'s tensors of this rank end negotiating and wait for their turn.
  void mark_negotiated(const Response& resp);
  // Rank 0: sends a response batch to every rank (with the tuner's new setting when one is
  // due) and runs it here, or, with a board, marks its place in the log.
  void send_batch(ResponseBatch batch);
  // The deadlock check (controller/deadlock.h): reports to the coordinator that this rank's
  // user threads have waited for results, with nothing submitted or executed, for the check's
  // delay, or that it moves again after such a report.
  void report_blocked();
  void send_blocked_state(RequestBatch::Blocked state);
  // Every rank, where it executes a batch that carries settings: they apply from here on.
  void apply_params(const TunedParams& params);
  // Before executing a collective: the tuner's measurement (rank 0) and executed_params().
  void note_collective(const Response& resp);

  // Shared-memory negotiation (board.cc; see negotiation_board.h). Set up collectively before
  // the loop starts, when every rank shares this host; board_ stays null otherwise (or on any
  // failure, on every rank alike).
  void set_up_board();
  std::string receive_frame(int peer);  // blocks (set-up only)
  // Puts a cached id on the board; false when the board refused it (send it over TCP). An id
  // this arrival completed is added to `completed` (the caller appends them to the log).
  bool arrive_on_board(uint32_t id, std::vector<uint64_t>* completed);
  // Executes the log's entries up to its tail: cached responses (fused where they fit) and, at
  // each marker, the coordinator's next response batch (stops at one not yet received).
  void read_board();
  bool board_has_work() const;  // entries this rank can execute now
  // ... and no user thread executes them (run_here): the engine thread must.
  bool board_needs_engine() const { return running_here_.load() == 0 && board_has_work(); }

  // A synchronous op on the calling thread (fast_path.cc): true when the op went into the
  // engine's tables here (completed, or left for the engine thread to finish); false when it
  // must be queued as usual.
  bool run_here(Entry& entry);
  bool on_engine_thread() const { return std::this_thread::get_id() == thread_.get_id(); }
  bool control_readable();  // a control link has bytes to read (never blocks)
  // run_here, waiting for the peers' arrivals on cache id `id`: moves off a CPU that a missing
  // peer was last seen on.
  void spread_from_missing_peers(uint32_t id, uint64_t members);

 public:
  // Ops that ran on their caller's thread (run_here) since init.
  int64_t ran_here() const { return ran_here_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> ran_here_{0};

  // Running a response (execute.cc).
  // `from_board`: a cached response off the board (its answers are already remembered).
  void execute(const Response& response, bool from_board = false);
  void execute_response(const Response& response);
  const Communicator& communicator(int process_set);
  const Algorithm* device_row(const Response& r, const Communicator& comm) const;
  void run_on_host(const Response& r, std::vector<Entry*>& entries,
                   const Communicator& comm) override;
  // What the GPU path borrows (gpu/gpu_path.h).
  void host_broadcast(const Communicator& comm, void* buf, size_t bytes, int root) override;
  void host_allgather(const Communicator& comm, const void* mine, size_t bytes,
                      void* all) override;
  void complete_entry(Entry& e, int error_kind, const std::string& error) override {
    complete(e, error_kind, error);
  }
  void wake_waiters() override { handles_.wake_waiters(); }
  void run_allreduce(const Response& r, std::vector<Entry*>& entries, const Communicator& comm);
  void run_allgather(const Response& r, Entry& e, const Communicator& comm);
  void run_broadcast(const Response& r, Entry& e, const Communicator& comm);
  void run_alltoall(const Response& r, Entry& e, const Communicator& comm);
  void run_reducescatter(const Response& r, Entry& e, const Communicator& comm);

  EngineOptions options_;
  Mesh mesh_;
  bool shared_memory_;
  ProcessSets sets_;
  HandleTable handles_;
  Timeline timeline_;
  Scratch scratch_;
  FusionBuffer fusion_;
  ResponseCache cache_;  // engine thread only; rank 0's coordinator numbers its entries
  std::unique_ptr<Coordinator> coordinator_;  // rank 0 only
  std::map<int, Communicator> communicators_;
  std::vector<std::string> control_inbox_;  // per peer: bytes of a partially received frame
  std::map<int, std::unique_ptr<SharedMemoryGroup>> shm_groups_;
  std::map<int, std::unique_ptr<Hierarchy>> hierarchies_;  // sets spanning hosts
  std::unique_ptr<NegotiationBoard> board_;
  std::unique_ptr<gpu::GpuPath> gpu_;  // made at the first response on CUDA tensors
  std::atomic<uint64_t> board_read_{0};    // log entries this rank executed
  size_t board_fusion_bytes_ = 0;          // rank 0's fusion threshold (every rank alike)
  std::deque<ResponseBatch> tcp_batches_;  // received, waiting for their marker in the log
  std::atomic<size_t> tcp_batches_queued_{0};  // its size, for board_has_work() unlocked
  uint64_t batches_sent_ = 0;              // rank 0: markers appended

  // Shared with user threads.
  std::mutex queue_mu_;
  std::vector<Entry> queue_;
  bool awaited_queued_ = false;  // queue_ holds an op enqueued awaited
  std::unordered_set<std::string> in_flight_;  // names enqueued and not yet completed
  bool shutdown_requested_ = false;
  std::string abort_requested_;  // abort(): the engine thread ends the job with this reason
  bool stopped_ = false;
  std::string abort_reason_;
  int wake_fd_ = -1;  // eventfd: enqueue/shutdown wake a sleeping engine thread
  // Set by enqueue; lets a spinning engine notice new work without a syscall.
  std::atomic<bool> work_pending_{false};
  // Time of the latest enqueue (steady clock ticks): tells a burst that is still being filled.
  std::atomic<Clock::rep> last_enqueue_{0};
  // True while the engine thread blocks in poll(): only then does enqueue pay for a wake-up.
  std::atomic<bool> sleeping_{false};
  // True while the engine sleeps through a burst: only a waiting user thread wakes it then.
  std::atomic<bool> batching_{false};
  // Set when a user thread waits for or polls a result: ends the current burst.
  std::atomic<bool> flush_requested_{false};

  // Whoever runs the engine's work holds this: the engine thread for each cycle (after it
  // woke up), or a user thread running its synchronous op here (run_here). Everything below
  // "Engine thread only" belongs to its holder; wait_for_work and sleep_until run without it
  // and read only atomics.
  std::mutex executor_mu_;
  std::atomic<int> running_here_{0};  // user threads in run_here: the engine need not watch
  std::atomic<bool> board_ready_{false};  // board_ is set up (run_here may be worth trying)

  // Engine thread only (or the executor lock's holder, see above).
  std::unordered_map<std::string, Entry> table_;  // negotiating or waiting to execute
  Clock::time_point last_activity_{};
  // Requests taken from the queue and not yet sent to the coordinator.
  RequestBatch unsent_;
  // The deadlock check: when this rank last took new ops or executed a response, and whether
  // (since when) it has reported itself blocked.
  Clock::time_point moved_at_ = Clock::now();
  bool blocked_reported_ = false;
  Clock::time_point blocked_reported_at_{};
  // Bursts. Ops enqueued in quick succession (a step's gradients) are collected into one
  // batch: while a burst is open the engine sleeps and further enqueues do not wake it. The
  // burst ends, and its requests go to the coordinator, when a user thread waits for (or
  // polls) a result, or when a cycle time passes without the user submitting (overlap_ on),
  // at the latest after kMaxBurstCycles (deferring: kMaxDeferredCycles) cycle times. Fewer,
  // larger batches mean fewer negotiations and fused collectives, and no engine wake-up per
  // tensor.
  bool in_burst_ = false;
  Clock::time_point burst_started_{};
  Clock::time_point burst_until_{};
  static constexpr std::chrono::microseconds kSubmissionPause{50};
  static constexpr std::chrono::microseconds kBurstSpin{50};
  static constexpr int kMaxBurstCycles = 10;
  static constexpr int kMaxDeferredCycles = 100;
  // How long the engine spins for a response while a user thread waits for it (a wake-up
  // from poll costs about 0.1 ms on a VM; the waits it saves follow the ranks' imbalance).
  static constexpr std::chrono::microseconds kWaiterSpin{2000};
  Clock::duration waiter_spin_{};  // kWaiterSpin, or zero with more local ranks than CPUs
  // True: run collectives while the user thread is still submitting (spare cores overlap them
  // with its work). False: keep collecting until a result is awaited (or the cap): on a host
  // with no spare core the engine would only preempt the threads it waits for.
  bool overlap_ = true;
  Clock::duration cycle_time() const {
    return std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double, std::milli>(cycle_time_ms_.load(std::memory_order_relaxed)));
  }
  std::atomic<double> cycle_time_ms_{0.5};  // tuned_.cycle_time_ms, read without the lock
  // Run-time settings (engine thread): the options' values until rank 0 sends others.
  TunedParams tuned_;
  uint64_t tuned_generation_ = 0;        // settings applied so far
  // Rank 0's own settings arrived (its first batch: generation 0); and since then no
  // collective has reported them yet.
  bool rank0_params_applied_ = false, executed_stale_ = false;
  std::unique_ptr<Autotuner> autotuner_;  // rank 0 with autotuning on
  bool params_due_ = false;               // the tuner's proposal waits to be sent
  mutable std::mutex executed_mu_;        // executed_params(): read by user threads
  TunedParams executed_params_;
  uint64_t executed_generation_ = 0;
  // Elastic notices: posted on rank 0 (any thread), the newest sent (rank 0's engine thread),
  // and the newest executed (set by the engine thread, read where ops complete).
  std::atomic<int64_t> posted_notice_{0};
  int64_t sent_notice_ = 0;
  std::atomic<int64_t> notice_{0};
  bool shutdown_sent_ = false;
  std::atomic<bool> finished_{false};
  std::thread thread_;
};

}  // namespace shvd
