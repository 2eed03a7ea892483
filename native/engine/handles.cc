#include "handles.h"

#include <thread>

namespace shvd {

int64_t HandleTable::create(std::shared_ptr<HandleState>* state) {
  auto s = std::make_shared<HandleState>();
  std::lock_guard<std::mutex> lock(mu_);
  int64_t h = next_++;
  handles_[h] = s;
  *state = s;
  return h;
}

std::shared_ptr<HandleState> HandleTable::get(int64_t handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handles_.find(handle);
  return it == handles_.end() ? nullptr : it->second;
}

void HandleTable::release(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  handles_.erase(handle);
}

void HandleTable::mark_done(const std::shared_ptr<HandleState>& state) {
  state->done.store(true, std::memory_order_release);
}

void HandleTable::wake_waiters() {
  // Taking the mutex orders the done flags before any waiter's check-then-sleep, so no
  // wake-up is lost.
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
}

void HandleTable::wait(const std::shared_ptr<HandleState>& state) {
  if (state->done.load(std::memory_order_acquire)) return;
  waiters_.fetch_add(1);
  if (wait_hook_) wait_hook_();
  // Spin briefly (yielding, so the engine thread gets the core on a small machine) before
  // sleeping on the condition variable.
  for (int i = 0; i < 200 && !state->done.load(std::memory_order_acquire); ++i)
    std::this_thread::yield();
  if (!state->done.load(std::memory_order_acquire)) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return state->done.load(std::memory_order_acquire); });
  }
  waiters_.fetch_sub(1);
}

void HandleTable::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  handles_.clear();
}

}  // namespace shvd
