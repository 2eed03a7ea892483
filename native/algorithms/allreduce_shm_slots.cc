// Allreduce through the slots of the shared-memory group's segment (see
// shared_memory_group.h), the path every group can take. Each member publishes its chunk once,
// reduces its own slice of every chunk directly out of the others' slots, and copies the
// finished slices back:
//
//   for each chunk (double-buffered so the next chunk's copy-in overlaps the stragglers):
//     1. copy-in   member r copies the slices owned by others into its slot, bumps `in_seq`
//     2. reduce    member r reduces slice r over all members (its own from private memory,
//                  the others' from their slots), in member order, into the shared result;
//                  bumps `reduced_seq`
//     3. copy-out  member r copies the other slices from the shared result, bumps `done_seq`
//
// Chunks are sized to stay in cache, so DRAM sees the input read once and the output written
// once. Each slice is reduced by exactly one member in a fixed order: results are bitwise equal.
#include <cstring>

#include "shared_memory_group_internal.h"

namespace shvd {

void SharedMemoryGroup::allreduce_through_slots(const Communicator& comm,
                                                const std::vector<TensorSpan>& tensors,
                                                DataType dtype, ReduceOp op, double scale) {
  const int n = members_, me = comm.rank;
  const size_t esize = dtype_size(dtype);
  const SegmentedBuffer data(tensors, esize);
  if (data.bytes() == 0) return;
  const Plan plan = start(data.bytes() / esize, esize, chunk_bytes_);
  Counter* mine = control()[me].seq;

  // 1. copy-in: the slices other members reduce go into my slot.
  auto copy_in = [&](const Chunk& c) {
    if (c.seq > 2) wait_all(comm, kDone, c.seq - 2);  // slot last read two chunks ago
    for (int i = 0; i < n; ++i) {
      if (i == me) continue;
      uint8_t* dst = slot(me, c.b) + c.lo(i) * esize;
      data.for_range(c.slice_pos(i), c.slice_bytes(i),
                     [&](const uint8_t* in, uint8_t*, size_t len, size_t at) {
                       std::memcpy(dst + at, in, len);
                     });
    }
    mine[kIn].value.store(c.seq, std::memory_order_release);
  };

  copy_in(plan.chunk(0));
  for (size_t k = 0; k < plan.chunks; ++k) {
    const Chunk c = plan.chunk(k);
    // 2. reduce my slice in member order (mine straight from my tensors) into the result:
    // partial sums in the shared result, the last member added, scaled and written to both
    // the result and my own tensor in one pass.
    wait_all(comm, kIn, c.seq);
    uint8_t* out = result(c.b) + c.lo(me) * esize;
    data.for_range(c.slice_pos(me), c.slice_bytes(me),
                   [&](const uint8_t* in, uint8_t* dst, size_t len, size_t at) {
                     auto src = [&](int m) -> const uint8_t* {
                       return m == me ? in : slot(m, c.b) + c.lo(me) * esize + at;
                     };
                     reduce_members(n, src, out + at, out + at, dst, len / esize, dtype, op,
                                    scale);
                   });
    mine[kReduced].value.store(c.seq, std::memory_order_release);
    // Software pipelining: publish the next chunk before waiting for the others' reductions,
    // so a member that runs late finds its inputs ready instead of stalling everyone.
    if (k + 1 < plan.chunks) copy_in(plan.chunk(k + 1));

    // 3. copy-out everybody else's slices.
    wait_all(comm, kReduced, c.seq);
    for (int i = 0; i < n; ++i) {
      if (i == me) continue;
      const uint8_t* src = result(c.b) + c.lo(i) * esize;
      data.for_range(c.slice_pos(i), c.slice_bytes(i),
                     [&](const uint8_t*, uint8_t* dst, size_t len, size_t at) {
                       std::memcpy(dst, src + at, len);
                     });
    }
    mine[kDone].value.store(c.seq, std::memory_order_release);
  }
}

}  // namespace shvd
