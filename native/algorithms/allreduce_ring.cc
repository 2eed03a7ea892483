// Ring allreduce = ring reduce-scatter followed by ring allgather. Each of the 2(n-1) steps moves
// 1/n of the buffer to the right neighbour while receiving 1/n from the left one, so every link
// carries 2(n-1)/n of the data: bandwidth-optimal for large messages.
//
// Walk-through for member r of n, blocks numbered 0..n-1:
//   reduce-scatter (reducescatter_ring.cc): after n-1 steps block r is complete here.
//   allgather step s: send block (r-s), receive block (r-s-1) straight into place.
#include <algorithm>

#include "collectives.h"

namespace shvd {

void allreduce_ring(const Communicator& comm, void* buf, size_t count, DataType dtype,
                    ReduceOp op, Scratch& scratch) {
  const int n = comm.size;
  if (n <= 1) return;
  const std::vector<size_t> counts = even_blocks(count, n);
  reducescatter_ring(comm, buf, counts, dtype, op, scratch);

  // Allgather the completed blocks around the ring, in place.
  const size_t esize = dtype_size(dtype);
  const std::vector<size_t> offsets = prefix_offsets(counts);
  auto* base = static_cast<uint8_t*>(buf);
  const int r = comm.rank;
  Link* right = comm.link((r + 1) % n);
  Link* left = comm.link((r - 1 + n) % n);
  for (int s = 0; s < n - 1; ++s) {
    const int send_block = ((r - s) % n + n) % n;
    const int recv_block = ((r - s - 1) % n + n) % n;
    send_recv(right, base + offsets[send_block] * esize, counts[send_block] * esize, left,
              base + offsets[recv_block] * esize, counts[recv_block] * esize);
  }
}

}  // namespace shvd
