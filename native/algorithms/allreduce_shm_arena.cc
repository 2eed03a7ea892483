// Allreduce in place in shared arenas (shared_arenas.h: the torch adapter puts gradients
// there), in the shared-memory group (see shared_memory_group.h). Tensors that every member can
// map need no copy at all: member r reads slice r of every member's tensor where it lies, and
// writes the sum into every member's tensor. Per member that is S bytes read and S written
// instead of 2 S and 2 S, and two barriers instead of three per chunk. Whether every member's
// tensors of a response are in arenas is agreed at the start of each allreduce; if one member's
// are not, the allreduce declines and the dispatcher's next row runs on every member.
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "shared_arenas.h"
#include "shared_memory_group_internal.h"

namespace shvd {

uint8_t* SharedMemoryGroup::peer_arena(const Communicator& comm, int member, int arena) {
  auto& mapped = peer_arenas_[member];
  if (mapped.size() <= size_t(arena)) mapped.resize(size_t(arena) + 1, PeerArena{nullptr, 0});
  PeerArena& a = mapped[arena];
  if (!a.base) {
    const uint64_t* dir = arena_directory(member);
    const PeerIdentity& id = control()[member].id;
    a.bytes = size_t(dir[2 * arena + 1]);
    a.base = map_peer_fd(id.thread, dir[2 * arena], a.bytes);
    if (!a.base)
      throw std::runtime_error("shared-memory allreduce: mapping the gradient arena of rank " +
                               std::to_string(comm.global_ranks[member]) + " failed (" +
                               strerror(errno) + "); SPARK_HVD_SHARED_GRADIENTS=0 keeps "
                               "gradients in private memory");
  }
  return a.base;
}

bool SharedMemoryGroup::map_members_arenas(const Communicator& comm,
                                           const std::vector<TensorSpan>& segments,
                                           size_t esize,
                                           std::vector<std::vector<TensorSpan>>* views) {
  const int n = members_, me = comm.rank;
  Control* ctl = control();
  Counter* mine = ctl[me].seq;
  uint64_t* my_table = table(me);
  uint64_t* my_directory = arena_directory(me);

  // Am I all in arenas? My table and directory are written before I say so.
  bool in_arenas = segments.size() <= kMaxSingleCopySegments;
  for (size_t i = 0; in_arenas && i < segments.size(); ++i) {
    const size_t bytes = segments[i].count * esize;
    int arena_in, arena_out;
    uint64_t offset_in, offset_out;
    in_arenas = shared_arena_locate(segments[i].in, bytes, &arena_in, &offset_in) &&
                shared_arena_locate(segments[i].out, bytes, &arena_out, &offset_out);
    if (!in_arenas) break;
    for (int a : {arena_in, arena_out}) {
      if (my_directory[2 * a + 1] != 0) continue;
      const ArenaInfo info = shared_arena_info(a);
      my_directory[2 * a] = uint64_t(info.fd);
      my_directory[2 * a + 1] = uint64_t(info.bytes);
    }
    my_table[2 * i] = (uint64_t(arena_in) << 48) | offset_in;
    my_table[2 * i + 1] = (uint64_t(arena_out) << 48) | offset_out;
  }
  placement_.begin_collective();
  const uint64_t check = ++arena_checks_;
  // The low bit carries the answer. No member gets past this collective before every member
  // has read it, so the counter still holds this check's value when the others look.
  mine[kArenaCheck].value.store(2 * check + (in_arenas ? 1 : 0), std::memory_order_release);
  wait_all(comm, kArenaCheck, 2 * check);
  bool all = in_arenas;
  for (int m = 0; m < n && all; ++m)
    all = (ctl[m].seq[kArenaCheck].value.load(std::memory_order_acquire) & 1) != 0;
  if (!all) return false;

  // Every member's tensors, as this process sees them.
  constexpr uint64_t kOffsetBits = (uint64_t(1) << 48) - 1;
  views->assign(size_t(n), segments);
  for (int m = 0; m < n; ++m) {
    if (m == me) continue;
    const uint64_t* t = table(m);
    for (size_t i = 0; i < segments.size(); ++i) {
      (*views)[m][i].in = peer_arena(comm, m, int(t[2 * i] >> 48)) + (t[2 * i] & kOffsetBits);
      (*views)[m][i].out =
          peer_arena(comm, m, int(t[2 * i + 1] >> 48)) + (t[2 * i + 1] & kOffsetBits);
    }
  }
  return true;
}

void SharedMemoryGroup::release_members_arenas(const Communicator& comm) {
  // Nobody hands its tensors back while another member may still write into them.
  control()[comm.rank].seq[kArenaDone].value.store(arena_checks_, std::memory_order_release);
  wait_all(comm, kArenaDone, arena_checks_);
  shared_arena_count_inplace();
}

// Member r reduces elements [count * r / n, count * (r + 1) / n) of the response, reading every
// member's inputs where they lie and writing the result into every member's outputs. Nobody else
// reads or writes those elements of any member's tensors, so the only waits are the agreement
// (every member's inputs are complete and its table is published) and the end (every member's
// outputs are complete before anyone returns them to the framework).
bool SharedMemoryGroup::allreduce_in_arenas(const Communicator& comm,
                                            const std::vector<TensorSpan>& segments,
                                            DataType dtype, ReduceOp op, double scale) {
  const int n = members_, me = comm.rank;
  const size_t esize = dtype_size(dtype);
  const SegmentedBuffer data(segments, esize);
  if (data.bytes() == 0) return false;
  std::vector<std::vector<TensorSpan>> views;
  if (!map_members_arenas(comm, segments, esize, &views)) return false;

  // My share, in cache-sized pieces, members in order as on the other paths (bitwise equal
  // results). With more than two members partial sums go to a private buffer.
  const size_t count = data.bytes() / esize;
  const size_t lo = count * size_t(me) / n, hi = count * size_t(me + 1) / n;
  const size_t piece_elems = std::max<size_t>(1, chunk_bytes_ / esize);
  if (n > 2 && peer_slices_.size() < piece_elems * esize) peer_slices_.resize(piece_elems * esize);
  for (size_t first = lo; first < hi; first += piece_elems) {
    const size_t len = std::min(piece_elems, hi - first) * esize;
    data.for_pieces(first * esize, len, [&](size_t i, size_t off, size_t bytes, size_t at) {
      auto src = [&](int m) {
        return static_cast<const uint8_t*>(views[m][i].in) + off;
      };
      auto out = [&](int m) { return static_cast<uint8_t*>(views[m][i].out) + off; };
      if (n == 2) {
        reduce_out_scaled(out(me), out(1 - me), src(0), src(1), bytes / esize, dtype, op, scale);
        return;
      }
      reduce_members(n, src, peer_slices_.data() + at, out(me), out(me), bytes / esize, dtype,
                     op, scale);
      for (int m = 0; m < n; ++m)
        if (m != me) std::memcpy(out(m), out(me), bytes);
    });
  }
  release_members_arenas(comm);
  return true;
}

}  // namespace shvd
