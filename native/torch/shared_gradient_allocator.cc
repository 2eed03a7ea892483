// torch's CPU allocator, wrapped so that blocks of the sizes spark_hvd.torch asks for (the
// sizes of the gradients a DistributedOptimizer averages) come from the core's shared arenas.
// Autograd then writes each gradient straight into memory the other local ranks can map, and
// the core reduces it in place there instead of copying it through the shared segment (see
// native/algorithms/shared_arenas.h). Everything else goes to torch's allocator untouched.
//
// Built against torch's c10 headers, once per torch minor (c10::Allocator is torch's C++ class:
// its layout may change between minors), into libspark_hvd_torch_<major>_<minor>.so;
// spark_hvd.torch loads the one that matches the torch it runs with, or none. It knows nothing
// of the core but the two functions Python hands it (shvd_shared_alloc and shvd_shared_free).
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>

namespace {

using AllocFn = void* (*)(int64_t);
using FreeFn = int32_t (*)(void*);  // 1: the block was an arena block and is freed

AllocFn g_alloc = nullptr;
FreeFn g_free = nullptr;
c10::DeleterFnPtr g_inner_raw_deleter = nullptr;

// Sizes to serve from the arenas: appended under the mutex, read without it.
constexpr int kMaxSizes = 4096;
std::mutex g_sizes_mu;
int64_t g_sizes[kMaxSizes];
std::atomic<int> g_num_sizes{0};

bool wanted(size_t n) {
  const int k = g_num_sizes.load(std::memory_order_acquire);
  for (int i = 0; i < k; ++i)
    if (g_sizes[i] == int64_t(n)) return true;
  return false;
}

void delete_arena_block(void* p) { g_free(p); }

// For raw_allocate()d blocks, which may be either kind.
void delete_any(void* p) {
  if (!g_free(p)) g_inner_raw_deleter(p);
}

struct SharedGradientAllocator final : c10::Allocator {
  c10::Allocator* inner;
  explicit SharedGradientAllocator(c10::Allocator* a) : inner(a) {}

  c10::DataPtr allocate(size_t n) override {
    if (n > 0 && wanted(n)) {
      if (void* p = g_alloc(int64_t(n)))
        return {p, p, &delete_arena_block, c10::Device(c10::DeviceType::CPU)};
    }
    return inner->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return g_inner_raw_deleter ? &delete_any : nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

}  // namespace

extern "C" {

// Installs the wrapper around torch's current CPU allocator (once; later calls only check).
// Returns 0, or -1 when torch kept another allocator (one installed with a higher priority).
// A function-local static, not std::call_once: that needs pthread_once of glibc 2.34, and the
// wheel's libraries keep to manylinux_2_28.
int32_t shvd_torch_install_allocator(void* alloc_fn, void* free_fn) {
  static SharedGradientAllocator* const wrapper = [&] {
    g_alloc = reinterpret_cast<AllocFn>(alloc_fn);
    g_free = reinterpret_cast<FreeFn>(free_fn);
    c10::Allocator* inner = c10::GetCPUAllocator();
    g_inner_raw_deleter = inner->raw_deleter();
    auto* w = new SharedGradientAllocator(inner);  // lives as long as the process
    c10::SetCPUAllocator(w, /*priority=*/1);
    return w;
  }();
  return c10::GetCPUAllocator() == wrapper ? 0 : -1;
}

// Blocks of exactly `bytes` come from the shared arenas from now on.
int32_t shvd_torch_serve_size(int64_t bytes) {
  std::lock_guard<std::mutex> lock(g_sizes_mu);
  const int k = g_num_sizes.load(std::memory_order_relaxed);
  if (std::find(g_sizes, g_sizes + k, bytes) != g_sizes + k) return 0;
  if (k >= kMaxSizes) return -1;
  g_sizes[k] = bytes;
  g_num_sizes.store(k + 1, std::memory_order_release);
  return 0;
}

}  // extern "C"
