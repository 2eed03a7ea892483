// Ring allgather with per-member block sizes: in step s member r forwards block (r-s) to the right
// and receives block (r-s-1) from the left, straight into its final place.
#include "collectives.h"

namespace shvd {

void allgather_ring_at(const Communicator& comm, void* base, const std::vector<size_t>& offsets,
                       const std::vector<size_t>& bytes) {
  const int n = comm.size, r = comm.rank;
  if (n <= 1) return;
  auto* at = static_cast<uint8_t*>(base);
  Link* right = comm.link((r + 1) % n);
  Link* left = comm.link((r - 1 + n) % n);
  for (int s = 0; s < n - 1; ++s) {
    const int send_block = ((r - s) % n + n) % n;
    const int recv_block = ((r - s - 1) % n + n) % n;
    send_recv(right, at + offsets[send_block], bytes[send_block], left, at + offsets[recv_block],
              bytes[recv_block]);
  }
}

void allgather_ring(const Communicator& comm, void* out, const std::vector<size_t>& bytes) {
  allgather_ring_at(comm, out, prefix_offsets(bytes), bytes);
}

}  // namespace shvd
