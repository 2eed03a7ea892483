#include "shared_arenas.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace shvd {

namespace {
constexpr size_t kAlign = 64;               // what torch and NumPy expect of CPU buffers
constexpr size_t kArenaBytes = 64 << 20;    // a larger block gets an arena of its own size

struct Arenas {
  std::mutex mu;
  std::vector<ArenaInfo> arenas;
  size_t used_in_last = 0;  // bump pointer of the newest arena
  std::unordered_map<size_t, std::vector<void*>> free_blocks;  // by rounded size
  std::unordered_map<void*, size_t> sizes;                     // live blocks
  size_t budget = size_t(4) << 30;  // beyond it tensors stay in ordinary memory
  size_t total = 0;
  std::atomic<bool> forked_child{false};
};

Arenas& state() {
  static Arenas* a = [] {
    auto* s = new Arenas;  // never destroyed: tensors may outlive static destruction
    // A forked child shares the arenas' pages with its parent but has a copy of the free
    // lists: serving blocks there would hand the same memory to both processes.
    pthread_atfork(nullptr, nullptr, [] { state().forked_child = true; });
    return s;
  }();
  return *a;
}

bool new_arena(Arenas& a, size_t bytes) {
  if (a.arenas.size() >= size_t(kMaxArenas) || a.total + bytes > a.budget) return false;
  const int fd = memfd_create("spark_hvd_arena", MFD_CLOEXEC);
  if (fd < 0) return false;
  void* base = MAP_FAILED;
  if (ftruncate(fd, off_t(bytes)) == 0)
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    close(fd);
    return false;
  }
  a.arenas.push_back({fd, bytes, base});
  a.used_in_last = 0;
  a.total += bytes;
  return true;
}
// The arena holding [p, p + bytes), or -1.
int find_arena(const Arenas& a, const void* p, size_t bytes) {
  const auto* q = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < a.arenas.size(); ++i) {
    const auto* base = static_cast<const uint8_t*>(a.arenas[i].base);
    if (q >= base && q + bytes <= base + a.arenas[i].bytes) return int(i);
  }
  return -1;
}

std::atomic<uint64_t> g_inplace{0};
}  // namespace

void* shared_arena_alloc(size_t bytes) {
  Arenas& a = state();
  const size_t size = std::max(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  if (a.forked_child) return nullptr;  // before the lock: it may have been held at the fork
  std::lock_guard<std::mutex> lock(a.mu);
  auto cached = a.free_blocks.find(size);
  void* p = nullptr;
  if (cached != a.free_blocks.end() && !cached->second.empty()) {
    p = cached->second.back();
    cached->second.pop_back();
  } else {
    if (a.arenas.empty() || a.arenas.back().bytes - a.used_in_last < size) {
      if (!new_arena(a, std::max(size, kArenaBytes))) return nullptr;
    }
    p = static_cast<uint8_t*>(a.arenas.back().base) + a.used_in_last;
    a.used_in_last += size;
  }
  a.sizes[p] = size;
  return p;
}

bool shared_arena_free(void* p) {
  Arenas& a = state();
  if (!p) return false;
  // Inherited blocks stay where they are; the lock may have been held at the fork.
  if (a.forked_child) return find_arena(a, p, 1) >= 0;
  std::lock_guard<std::mutex> lock(a.mu);
  auto it = a.sizes.find(p);
  if (it == a.sizes.end()) return false;
  a.free_blocks[it->second].push_back(p);
  a.sizes.erase(it);
  return true;
}

bool shared_arena_locate(const void* p, size_t bytes, int* arena, uint64_t* offset) {
  Arenas& a = state();
  std::lock_guard<std::mutex> lock(a.mu);
  const int i = find_arena(a, p, bytes);
  if (i < 0) return false;
  *arena = i;
  *offset = uint64_t(static_cast<const uint8_t*>(p) -
                     static_cast<const uint8_t*>(a.arenas[size_t(i)].base));
  return true;
}

ArenaInfo shared_arena_info(int arena) {
  Arenas& a = state();
  std::lock_guard<std::mutex> lock(a.mu);
  return a.arenas.at(size_t(arena));
}

size_t shared_arena_bytes() {
  Arenas& a = state();
  std::lock_guard<std::mutex> lock(a.mu);
  return a.total;
}

void shared_arena_count_inplace() { g_inplace.fetch_add(1, std::memory_order_relaxed); }
uint64_t shared_arena_inplace_allreduces() { return g_inplace.load(std::memory_order_relaxed); }

}  // namespace shvd
