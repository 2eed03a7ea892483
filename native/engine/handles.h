// Handles: the future each enqueued op returns. Completed by the engine thread, waited on by
// user threads (a short spin first: small collectives finish in microseconds).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace shvd {

struct HandleState {
  ~HandleState();  // frees a GPU result nobody copied
  std::atomic<bool> done{false};
  int error_kind = 0;  // SHVD_ERR_*
  std::string error;
  std::vector<uint8_t> output;        // core-allocated result
  // A result on a GPU instead (CUDA tensors): freed by shvd_output_copy or the release.
  void* device_output = nullptr;
  size_t device_output_bytes = 0;
  int output_device = -1;
  std::vector<int64_t> output_shape;
  std::vector<int64_t> ints;          // received splits / last joined rank / new set id
  // The newest host-change notice (elastic) the engine had executed when it completed the op.
  int64_t notice = 0;
};

class HandleTable {
 public:
  using Clock = std::chrono::steady_clock;

  // Ids are unique in the process, not only in this table: a handle kept across shutdown and
  // init can never name an op of the next engine.
  int64_t create(std::shared_ptr<HandleState>* state);
  std::shared_ptr<HandleState> get(int64_t handle) const;
  void release(int64_t handle);
  // Releases those of `handles[0..n)` whose op completed (or that are unknown: released
  // already) and moves the others to the front; returns how many are still pending. Sweeps
  // the handles user code dropped before completion (one lock for the whole batch).
  int release_completed(int64_t* handles, int n);
  // Marks done without waking anyone: the engine completes a whole fused response, then calls
  // wake_waiters() once (one futex wake instead of one per tensor).
  void mark_done(const std::shared_ptr<HandleState>& state);
  void wake_waiters();
  // Threads currently blocked in wait(): the engine sends batched requests at once when
  // somebody is waiting for a result.
  int waiters() const { return waiters_.load(); }
  // Runs in every thread that starts waiting (the engine ends its burst for it).
  void set_wait_hook(std::function<void()> hook) { wait_hook_ = std::move(hook); }
  void wait(const std::shared_ptr<HandleState>& state) { wait_until(state, Clock::time_point::max()); }
  // Waits until the op completed or `deadline` passed; true if it completed. Waits in slices
  // let the caller run Python's signal handlers in between (see spark_hvd.common._ops).
  bool wait_until(const std::shared_ptr<HandleState>& state, Clock::time_point deadline);
  void clear();

  // The newest notice (HandleState::notice) among the ops whose handles the user released: every
  // rank releases the same ops at the same points of its program, so every rank sees a notice
  // at the same point (elastic's check_host_updates), whenever it arrived. Any thread.
  int64_t released_notice() const { return released_notice_.load(std::memory_order_acquire); }

 private:
  void note_released(const HandleState& state);  // requires mu_
  std::atomic<int64_t> released_notice_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<int64_t, std::shared_ptr<HandleState>> handles_;
  std::atomic<int> waiters_{0};
  std::function<void()> wait_hook_;
};

}  // namespace shvd
