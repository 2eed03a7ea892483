#include "handles.h"

#include "../gpu/gpu_path.h"

#include <thread>

namespace shvd {

HandleState::~HandleState() {
  if (device_output) gpu::free_device_output(output_device, device_output);
}

namespace {
std::atomic<int64_t> next_handle{1};  // process-wide: see HandleTable::create
}  // namespace

int64_t HandleTable::create(std::shared_ptr<HandleState>* state) {
  auto s = std::make_shared<HandleState>();
  const int64_t h = next_handle.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);
  handles_[h] = s;
  *state = s;
  return h;
}

std::shared_ptr<HandleState> HandleTable::get(int64_t handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handles_.find(handle);
  return it == handles_.end() ? nullptr : it->second;
}

void HandleTable::note_released(const HandleState& state) {
  if (state.notice > released_notice_.load(std::memory_order_relaxed))
    released_notice_.store(state.notice, std::memory_order_release);
}

void HandleTable::release(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handles_.find(handle);
  if (it == handles_.end()) return;
  if (it->second->done.load(std::memory_order_acquire)) note_released(*it->second);
  handles_.erase(it);
}

int HandleTable::release_completed(int64_t* handles, int n) {
  std::lock_guard<std::mutex> lock(mu_);
  int pending = 0;
  for (int i = 0; i < n; ++i) {
    auto it = handles_.find(handles[i]);
    if (it == handles_.end()) continue;
    if (it->second->done.load(std::memory_order_acquire)) {
      note_released(*it->second);
      handles_.erase(it);
    }
    else
      handles[pending++] = handles[i];
  }
  return pending;
}

void HandleTable::mark_done(const std::shared_ptr<HandleState>& state) {
  state->done.store(true, std::memory_order_release);
}

void HandleTable::wake_waiters() {
  // Nobody waits (the common case when the op ran on its caller's thread): no lock, no
  // notify. The fences pair with wait_until's: either this sees its waiters_ increment, or
  // its check of the done flag sees the flag set before this fence.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (waiters_.load(std::memory_order_relaxed) == 0) return;
  // Taking the mutex orders the done flags before any waiter's check-then-sleep, so no
  // wake-up is lost.
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
}

bool HandleTable::wait_until(const std::shared_ptr<HandleState>& state, Clock::time_point deadline) {
  auto done = [&] { return state->done.load(std::memory_order_acquire); };
  if (done()) return true;
  waiters_.fetch_add(1);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // see wake_waiters
  if (wait_hook_) wait_hook_();
  // Spin briefly (yielding, so the engine thread gets the core on a small machine) before
  // sleeping on the condition variable. (A pure spin on the word first cost 2 us per wait
  // whenever the engine thread had to run on the waiter's core: measured, 8.2 -> 10.5 us for
  // a single-rank 4-byte allreduce.)
  for (int i = 0; i < 200 && !done(); ++i) std::this_thread::yield();
  bool completed = done();
  if (!completed) {
    std::unique_lock<std::mutex> lock(mu_);
    if (deadline == Clock::time_point::max()) {
      cv_.wait(lock, done);
      completed = true;
    } else {
      completed = cv_.wait_until(lock, deadline, done);
    }
  }
  waiters_.fetch_sub(1);
  return completed;
}

void HandleTable::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  handles_.clear();
}

}  // namespace shvd
