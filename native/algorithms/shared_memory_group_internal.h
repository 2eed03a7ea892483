// The shared-memory group's segment layout and the pieces its three allreduce files share
// (allreduce_shm_slots.cc, allreduce_shm_single_copy.cc, allreduce_shm_arena.cc). Private to
// those files, shared_memory_group.cc and hierarchical.cc (which borrows SegmentedBuffer).
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <vector>

#include "../transport/peer_memory.h"
#include "../kernels/reduce_kernels.h"
#include "shared_memory_group.h"

namespace shvd {

constexpr size_t kLine = 64;
// Up to this many bytes every member reduces the whole allreduce itself (allreduce_shm_small.cc).
constexpr size_t kSmallAllreduceBytes = 8 * 1024;
// A fused response with more tensors than this keeps the slots (its tensors are small), and
// the arena path declines it: the table holds this many tensors.
constexpr size_t kMaxSingleCopySegments = 256;
constexpr size_t kTableBytes = kMaxSingleCopySegments * 2 * sizeof(uint64_t);
static_assert(kMaxSingleCopySegments <= IOV_MAX, "one process_vm_readv per slice");

// The progress counters of each member (Control::seq): three for the chunks of the copying
// paths, two for the arena path's agreement and end.
enum { kIn = 0, kReduced = 1, kDone = 2, kArenaCheck = 3, kArenaDone = 4 };

struct alignas(kLine) Counter {
  std::atomic<uint64_t> value;
  char pad[kLine - sizeof(std::atomic<uint64_t>)];
};

// Per member, each on its own cache line: the progress counters, where it runs (CpuPlacement's
// word), and its identity, written once at set-up: its engine thread (the address space to
// read) and its probe target (peer_memory.h), which the others probe to find out whether they
// may read this member's memory and map its arenas.
struct SharedMemoryGroup::Control {
  Counter seq[5];
  Counter cpu;
  alignas(kLine) PeerIdentity id;
};

// Chunk k of a collective: its sequence number, which slot buffer it uses, and its slices
// (slice i = elements [lo(i), lo(i + 1)) of the chunk). Boundaries fall on elements.
struct SharedMemoryGroup::Chunk {
  uint64_t seq;
  int b;
  size_t first, elems;
  int n;
  size_t esize;
  size_t lo(int i) const { return elems * size_t(i) / n; }
  size_t slice_pos(int i) const { return (first + lo(i)) * esize; }
  size_t slice_bytes(int i) const { return (lo(i + 1) - lo(i)) * esize; }
};

// The fused tensors seen as one logical array of bytes.
class SegmentedBuffer {
 public:
  SegmentedBuffer(const std::vector<TensorSpan>& segments, size_t esize)
      : segments_(segments) {
    size_t pos = 0;
    for (const auto& s : segments) {
      starts_.push_back(pos);
      pos += s.count * esize;
    }
    starts_.push_back(pos);
  }
  size_t bytes() const { return starts_.back(); }
  const std::vector<TensorSpan>& segments() const { return segments_; }

  // Calls fn(segment, offset_in_segment, length, offset_within_range) for each piece of
  // [pos, pos + len).
  template <typename F>
  void for_pieces(size_t pos, size_t len, F fn) const {
    size_t i = std::upper_bound(starts_.begin(), starts_.end(), pos) - starts_.begin() - 1;
    size_t done = 0;
    while (done < len) {
      const size_t off = pos + done - starts_[i];
      const size_t n = std::min(len - done, starts_[i + 1] - starts_[i] - off);
      if (n > 0) fn(i, off, n, done);
      done += n;
      ++i;
    }
  }

  // Calls fn(in, out, length, offset_within_range) for each piece of [pos, pos + len).
  template <typename F>
  void for_range(size_t pos, size_t len, F fn) const {
    for_pieces(pos, len, [&](size_t i, size_t off, size_t n, size_t at) {
      fn(static_cast<const uint8_t*>(segments_[i].in) + off,
         static_cast<uint8_t*>(segments_[i].out) + off, n, at);
    });
  }

 private:
  const std::vector<TensorSpan>& segments_;
  std::vector<size_t> starts_;
};

// Reduces one piece of my slice over every member in member order (src(m): member m's input),
// partial sums in `acc` (may alias src(0) or src(1)); the scaled result goes to `out` and
// `copy_to`. Every path reduces alike, so they give bitwise equal results.
template <typename Src>
void reduce_members(int n, Src src, uint8_t* acc, uint8_t* out, uint8_t* copy_to, size_t count,
                    DataType dtype, ReduceOp op, double scale) {
  if (n > 2) reduce_out(acc, src(0), src(1), count, dtype, op);
  for (int m = 2; m < n - 1; ++m) reduce_into(acc, src(m), count, dtype, op);
  reduce_out_scaled(out, copy_to, n > 2 ? acc : src(0), src(n - 1), count, dtype, op, scale);
}

}  // namespace shvd
