// Small allreduces through the slots of the shared-memory group's segment with one wait instead
// of the sliced path's two (allreduce_shm_slots.cc): every member copies its whole input into its
// slot, waits until every other member has done the same, and reduces all members' copies itself,
// in member order, into its own tensors. That is n times the arithmetic of one slice, which for
// a few KiB costs less than the hand-off it saves. Every member reduces the same inputs in the
// same order: results are bitwise equal.
//
//   1. copy-in  member r copies its input into its slot (bank seq % 2), bumps `in_seq`
//   2. reduce   after every `in_seq`: member r reduces every slot in member order into its own
//               output, bumps `done_seq` (its reads of bank seq % 2 are over)
//
// A bank is written again two collectives later, after every member's `done_seq` passed it.
#include <cstring>

#include "shared_memory_group_internal.h"

namespace shvd {

bool SharedMemoryGroup::small_suits(size_t bytes) const {
  return bytes > 0 && bytes <= kSmallAllreduceBytes && bytes <= chunk_bytes_;
}

void SharedMemoryGroup::allreduce_small(const Communicator& comm,
                                        const std::vector<TensorSpan>& tensors, DataType dtype,
                                        ReduceOp op, double scale) {
  const int n = members_, me = comm.rank;
  const size_t esize = dtype_size(dtype);
  const SegmentedBuffer data(tensors, esize);
  const size_t bytes = data.bytes();
  if (bytes == 0) return;
  const Chunk c = start(bytes / esize, esize, chunk_bytes_).chunk(0);  // one chunk: small_suits
  Counter* mine = control()[me].seq;

  if (c.seq > 2) wait_all(comm, kDone, c.seq - 2);  // my bank, last read two collectives ago
  uint8_t* mine_in = slot(me, c.b);
  data.for_range(0, bytes, [&](const uint8_t* in, uint8_t*, size_t len, size_t at) {
    std::memcpy(mine_in + at, in, len);
  });
  mine[kIn].value.store(c.seq, std::memory_order_release);

  wait_all(comm, kIn, c.seq);
  data.for_range(0, bytes, [&](const uint8_t*, uint8_t* out, size_t len, size_t at) {
    auto src = [&](int m) -> const uint8_t* { return slot(m, c.b) + at; };
    reduce_members(n, src, out, out, out, len / esize, dtype, op, scale);
  });
  mine[kReduced].value.store(c.seq, std::memory_order_release);
  mine[kDone].value.store(c.seq, std::memory_order_release);
}

}  // namespace shvd
