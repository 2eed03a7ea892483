// Binomial-tree broadcast: in round k every member that already has the data sends it to the
// member 2^k positions further (counted from the root), so n members are reached in log2(n)
// rounds and the root sends only log2(n) copies.
#include "collectives.h"

namespace shvd {

void broadcast_tree(const Communicator& comm, void* buf, size_t bytes, int root) {
  const int n = comm.size;
  if (n <= 1 || bytes == 0) return;
  const int vrank = (comm.rank - root + n) % n;  // my position relative to the root
  // Receive from the parent: the member that differs in my lowest set bit.
  int mask = 1;
  while (mask < n) {
    if (vrank & mask) {
      const int parent = ((vrank - mask) + root) % n;
      comm.link(parent)->recv(buf, bytes);
      break;
    }
    mask <<= 1;
  }
  // Forward to children below that bit.
  mask >>= 1;
  while (mask > 0) {
    if (vrank + mask < n) {
      const int child = (vrank + mask + root) % n;
      comm.link(child)->send(buf, bytes);
    }
    mask >>= 1;
  }
}

}  // namespace shvd
