// Memory that the other members of a shared-memory group can map: tensors allocated here
// (gradients, by the torch adapter's allocator) are reduced in place, each member reading its
// slice of every member's tensor and writing the sum into all of them, with no copy through the
// group's slots (per member S bytes read and S written instead of 2 S and 2 S).
//
// Arenas are memfd mappings of this process. A peer maps one by opening /proc/<tid>/fd/<fd>
// (the kernel checks that it may inspect this process: same user, no stricter policy) and
// learns the fd and size from the arena directory every member keeps in its group segment.
// Blocks are cached by exact size and never returned to the kernel: gradients have the same
// sizes every step, so the steady state allocates nothing.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shvd {

constexpr int kMaxArenas = 64;

struct ArenaInfo {
  int fd;
  size_t bytes;
  void* base;
};

// Thread-safe; nullptr when the block cannot be served (in a forked child, the arenas' 4 GiB
// spent, memfd unavailable): the caller then uses ordinary memory.
void* shared_arena_alloc(size_t bytes);
// True when `p` was a block of the arenas (now free), false when it is not arena memory.
bool shared_arena_free(void* p);
// Where `p` .. `p + bytes` lies: the arena's index and the offset of `p` in it. False when the
// range is not inside one arena.
bool shared_arena_locate(const void* p, size_t bytes, int* arena, uint64_t* offset);
ArenaInfo shared_arena_info(int arena);
// Bytes held by arenas (blocks in use and cached).
size_t shared_arena_bytes();
// Allreduces this process ran in place in the arenas (the group counts them).
void shared_arena_count_inplace();
uint64_t shared_arena_inplace_allreduces();

}  // namespace shvd
