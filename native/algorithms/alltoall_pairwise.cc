// Pairwise-exchange alltoall: in step k member r sends its block for (r+k) and receives the
// block from (r-k), so every step is a deadlock-free full-duplex exchange between two members.
#include <cstring>

#include "collectives.h"

namespace shvd {

void alltoall_pairwise(const Communicator& comm, const void* in,
                       const std::vector<size_t>& send_bytes, void* out,
                       const std::vector<size_t>& recv_bytes) {
  const int n = comm.size, r = comm.rank;
  const std::vector<size_t> send_off = prefix_offsets(send_bytes);
  const std::vector<size_t> recv_off = prefix_offsets(recv_bytes);
  const auto* src = static_cast<const uint8_t*>(in);
  auto* dst = static_cast<uint8_t*>(out);
  if (recv_bytes[r] > 0) std::memcpy(dst + recv_off[r], src + send_off[r], recv_bytes[r]);
  for (int k = 1; k < n; ++k) {
    const int to = (r + k) % n, from = (r - k + n) % n;
    send_recv(comm.link(to), src + send_off[to], send_bytes[to], comm.link(from),
              dst + recv_off[from], recv_bytes[from]);
  }
}

}  // namespace shvd
