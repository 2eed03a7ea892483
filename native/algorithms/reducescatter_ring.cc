// Ring reduce-scatter with per-member block sizes, the first half of ring allreduce
// (allreduce_ring.cc) and reducescatter's algorithm. In step s member r sends block (r-s-1) to
// the right and receives block (r-s-2) from the left, reducing it into place as it arrives
// (pipelined per segment, see send_recv_reduce). After n-1 steps block r holds the reduction of
// every member's block r.
#include <algorithm>

#include "collectives.h"

namespace shvd {

void reducescatter_ring(const Communicator& comm, void* buf, const std::vector<size_t>& counts,
                        DataType dtype, ReduceOp op, Scratch& scratch) {
  const int n = comm.size, r = comm.rank;
  if (n <= 1) return;
  const size_t esize = dtype_size(dtype);
  const std::vector<size_t> offsets = prefix_offsets(counts);
  size_t max_block = 0;
  for (size_t c : counts) max_block = std::max(max_block, c);
  void* tmp = scratch.get(max_block * esize);
  auto* base = static_cast<uint8_t*>(buf);
  Link* right = comm.link((r + 1) % n);
  Link* left = comm.link((r - 1 + n) % n);
  for (int s = 0; s < n - 1; ++s) {
    const int send_block = ((r - s - 1) % n + n) % n;
    const int recv_block = ((r - s - 2) % n + n) % n;
    send_recv_reduce(right, base + offsets[send_block] * esize, counts[send_block] * esize, left,
                     base + offsets[recv_block] * esize, tmp, counts[recv_block] * esize, dtype,
                     op);
  }
}

}  // namespace shvd
