// Pieces every algorithm file uses: offsets and the pipelined
// receive-and-reduce step at the heart of ring and recursive-doubling allreduce.
#include <algorithm>
#include <cstring>

#include "../kernels/reduce_kernels.h"
#include "collectives.h"

namespace shvd {

std::vector<size_t> prefix_offsets(const std::vector<size_t>& sizes) {
  std::vector<size_t> offsets(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) offsets[i + 1] = offsets[i] + sizes[i];
  return offsets;
}

std::vector<size_t> even_blocks(size_t count, int n) {
  std::vector<size_t> counts(n, count / n);
  for (size_t i = 0; i < count % n; ++i) counts[i] += 1;
  return counts;
}

// Segment size for overlapping reduction with transfer: small enough to stay in L2 while the
// next segment arrives, large enough to amortise the loop.
static constexpr size_t kReduceSegmentBytes = 128 * 1024;

void send_recv_reduce(Link* to, const void* sbuf, size_t sn, Link* from, void* dst,
                      void* scratch_in, size_t rn, DataType dtype, ReduceOp op) {
  const size_t esize = dtype_size(dtype);
  const size_t segment = std::max(esize, kReduceSegmentBytes / esize * esize);
  auto* in = static_cast<uint8_t*>(scratch_in);
  auto* out = static_cast<uint8_t*>(dst);
  const auto* src = static_cast<const uint8_t*>(sbuf);
  size_t sent = 0, received = 0, reduced = 0;
  int idle_rounds = 0;
  while (sent < sn || reduced < rn) {
    bool progress = false;
    if (sent < sn) {
      size_t k = to->try_send(src + sent, sn - sent);
      sent += k;
      progress |= k > 0;
    }
    if (received < rn) {
      size_t k = from->try_recv(in + received, rn - received);
      received += k;
      progress |= k > 0;
    }
    // Reduce every complete segment that has arrived (the tail once everything arrived).
    while (reduced < received && (received - reduced >= segment || received == rn)) {
      size_t len = std::min(segment, received - reduced);
      len -= len % esize;
      if (len == 0) break;
      reduce_into(out + reduced, in + reduced, len / esize, dtype, op);
      reduced += len;
      progress = true;
    }
    if (progress) {
      idle_rounds = 0;
    } else {
      // Ask each socket only for what is still pending: a receive socket is always writable,
      // so asking it for POLLOUT would turn the wait into a busy spin.
      const LinkWait waits[2] = {{to, sent < sn, false}, {from, false, received < rn}};
      wait_for_progress(waits, 2, idle_rounds++);
    }
  }
}

}  // namespace shvd
