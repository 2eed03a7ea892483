// Recursive doubling allreduce: log2(n) rounds, each an exchange of the whole buffer with the
// partner whose rank differs in one bit. Latency-optimal for small messages.
//
// Non-power-of-two sizes: the `extra` ranks above the largest power of two first hand their
// data to a partner below it, sit out the doubling, and get the result back at the end.
// Every step combines two operands with a commutative op, so all ranks end bitwise equal.
#include "collectives.h"
#include "../kernels/reduce_kernels.h"

namespace shvd {

void allreduce_recursive_doubling(const Communicator& comm, void* buf, size_t count,
                                  DataType dtype, ReduceOp op, Scratch& scratch) {
  const int n = comm.size, r = comm.rank;
  const size_t bytes = count * dtype_size(dtype);
  void* tmp = scratch.get(bytes);
  int pow2 = 1;
  while (pow2 * 2 <= n) pow2 *= 2;
  const int extra = n - pow2;

  if (r >= pow2) {  // Fold into partner r - pow2, then wait for the answer.
    Link* partner = comm.link(r - pow2);
    partner->send(buf, bytes);
    partner->recv(buf, bytes);
    return;
  }
  if (r < extra) {
    Link* partner = comm.link(r + pow2);
    partner->recv(tmp, bytes);
    reduce_into(buf, tmp, count, dtype, op);
  }
  for (int mask = 1; mask < pow2; mask <<= 1) {
    // Receive the partner's whole buffer before reducing: `buf` is still being sent.
    Link* peer = comm.link(r ^ mask);
    send_recv(peer, buf, bytes, peer, tmp, bytes);
    reduce_into(buf, tmp, count, dtype, op);
  }
  if (r < extra) comm.link(r + pow2)->send(buf, bytes);
}

}  // namespace shvd
