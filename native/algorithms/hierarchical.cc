// Hierarchical allreduce and allgather (see hierarchical.h): three steps, each an existing
// ring (or recursive doubling) on a sub-communicator of the set.
#include "hierarchical.h"

#include <sys/prctl.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "../kernels/reduce_kernels.h"
#include "shared_memory_group_internal.h"

namespace shvd {

namespace {

// Marks one step for the timeline while it runs.
class Step {
 public:
  Step(const StepMarker& marker, const char* name) : marker_(marker), name_(name) {
    if (marker_ && name_) marker_(name_, true);
  }
  ~Step() {
    if (marker_ && name_) marker_(name_, false);
  }

 private:
  const StepMarker& marker_;
  const char* name_;
};

// The sub-communicator of `comm` made of the members `members` (set indices, in order).
Communicator sub_communicator(const Communicator& comm, const std::vector<int>& members) {
  Communicator sub;
  sub.size = int(members.size());
  for (int i = 0; i < sub.size; ++i) {
    const int m = members[i];
    if (m == comm.rank) sub.rank = i;
    sub.links.push_back(comm.links[m]);
    sub.global_ranks.push_back(comm.global_ranks[m]);
  }
  return sub;
}

}  // namespace

namespace {

// Hosts in the order of their first member; each host's members in set order.
void group_by_host(const std::vector<std::string>& host_ids, std::vector<std::string>* hosts,
                   std::vector<std::vector<int>>* members) {
  for (int i = 0; i < int(host_ids.size()); ++i) {
    auto it = std::find(hosts->begin(), hosts->end(), host_ids[i]);
    if (it == hosts->end()) {
      hosts->push_back(host_ids[i]);
      members->emplace_back();
      it = hosts->end() - 1;
    }
    (*members)[it - hosts->begin()].push_back(i);
  }
}

// Several hosts, more than one member on some: something to do within hosts.
bool worth_a_hierarchy(const std::vector<std::vector<int>>& members) {
  size_t largest = 0;
  for (const auto& m : members) largest = std::max(largest, m.size());
  return members.size() >= 2 && largest >= 2;
}

bool consecutive(const std::vector<int>& members) {
  return members.back() - members.front() + 1 == int(members.size());
}

}  // namespace

Hierarchy::Use Hierarchy::usable(const std::vector<std::string>& host_ids) {
  std::vector<std::string> hosts;
  std::vector<std::vector<int>> members;
  group_by_host(host_ids, &hosts, &members);
  Use use;
  use.allreduce = worth_a_hierarchy(members);
  use.allgather = use.allreduce && std::all_of(members.begin(), members.end(), consecutive);
  return use;
}

std::unique_ptr<Hierarchy> Hierarchy::build(const Communicator& comm,
                                            const std::vector<std::string>& host_ids) {
  if (comm.rank < 0 || int(host_ids.size()) != comm.size) return nullptr;
  std::vector<std::string> hosts;
  std::vector<std::vector<int>> members;
  group_by_host(host_ids, &hosts, &members);
  if (!worth_a_hierarchy(members)) return nullptr;
  size_t lanes = members[0].size();
  for (const auto& m : members) lanes = std::min(lanes, m.size());

  auto h = std::make_unique<Hierarchy>();
  h->hosts = int(hosts.size());
  h->lanes = int(lanes);
  h->my_host = int(std::find(hosts.begin(), hosts.end(), host_ids[comm.rank]) - hosts.begin());
  h->local = sub_communicator(comm, members[h->my_host]);
  // My lane's ring: the members of my local index on every host; past the lanes, just me.
  std::vector<int> lane{comm.rank};
  if (h->local.rank < h->lanes) {
    lane.clear();
    for (const auto& m : members) lane.push_back(m[h->local.rank]);
  }
  h->cross = sub_communicator(comm, lane);
  h->hosts_contiguous = true;
  for (const auto& m : members) {
    h->host_first.push_back(m.front());
    h->host_size.push_back(int(m.size()));
    h->hosts_contiguous = h->hosts_contiguous && consecutive(m);
  }
  return h;
}

std::vector<size_t> Hierarchy::lane_blocks(size_t total) const {
  std::vector<size_t> blocks = even_blocks(total, lanes);
  blocks.resize(local.size, 0);
  return blocks;
}

namespace {

// One segment's three steps; `cross` runs the middle one (in place, my block; nothing past the
// lanes, whose blocks are empty). The block sizes depend only on the segment and the number of
// lanes, so every member of a lane's ring has the same block and chooses the same cross-host
// algorithm.
struct SegmentSteps {
  const Hierarchy& h;
  DataType dtype;
  ReduceOp op;
  size_t ring_threshold_bytes;

  std::vector<size_t> blocks(size_t count) const { return h.lane_blocks(count); }
  void reduce_scatter(uint8_t* seg, size_t count, Scratch& scratch) const {
    reducescatter_ring(h.local, seg, blocks(count), dtype, op, scratch);
  }
  void cross(uint8_t* seg, size_t count, Scratch& scratch) const {
    const std::vector<size_t> counts = blocks(count);
    cross_block(seg + prefix_offsets(counts)[h.local.rank] * dtype_size(dtype),
                counts[h.local.rank], scratch);
  }
  // My block of a segment, `mine` elements wherever they are.
  void cross_block(void* block, size_t mine, Scratch& scratch) const {
    if (allreduce_latency_bound(mine * dtype_size(dtype), mine, h.cross.size,
                                ring_threshold_bytes)) {
      if (mine > 0) allreduce_recursive_doubling(h.cross, block, mine, dtype, op, scratch);
    } else {
      allreduce_ring(h.cross, block, mine, dtype, op, scratch);
    }
  }
  void allgather(uint8_t* seg, size_t count) const {
    std::vector<size_t> bytes = blocks(count);
    for (size_t& b : bytes) b *= dtype_size(dtype);
    allgather_ring(h.local, seg, bytes);
  }
};

}  // namespace

// Runs the cross-host steps of the segments posted to it, in order, on a thread of its own, so
// that the wire between hosts carries one segment while the engine thread moves the
// neighbouring ones within the host. Its links (the cross ring's) are not the engine thread's
// (the host's) in the meantime. One per hierarchy, for the set's life: each call begins a run,
// posts its segments, waits for them and ends the run; between runs the thread sleeps.
class CrossHostWorker {
 public:
  CrossHostWorker() : thread_([this] { loop(); }) {}
  ~CrossHostWorker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    thread_.join();
  }

  // A new run: segment k goes through `run(k)` once posted.
  void begin(std::function<void(size_t)> run) {
    std::lock_guard<std::mutex> lock(mu_);
    run_ = std::move(run);
    posted_ = done_ = 0;
    error_ = nullptr;
  }
  void post(size_t segment) {
    std::lock_guard<std::mutex> lock(mu_);
    posted_ = segment + 1;
    cv_.notify_all();
  }
  // Waits until `segment` has crossed; rethrows the thread's error.
  void wait(size_t segment) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ > segment || error_; });
    if (error_) std::rethrow_exception(error_);
  }
  // Ends the run: lets the segment in hand finish (or fail: after an error the caller raises
  // the abort flag, which every link wait checks), and posts nothing more.
  void end() {
    std::unique_lock<std::mutex> lock(mu_);
    posted_ = std::min(posted_, done_ + (busy_ ? 1 : 0));
    cv_.wait(lock, [&] { return !busy_; });
    run_ = nullptr;
  }

 private:
  void loop() {
    prctl(PR_SET_NAME, "shvd-cross", 0, 0, 0);  // visible in top -H, perf, gdb
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || (posted_ > done_ && !error_); });
      if (stop_) return;
      const size_t k = done_;
      busy_ = true;
      lock.unlock();
      std::exception_ptr error;
      try {
        run_(k);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      busy_ = false;
      if (error) error_ = error;
      else done_ = k + 1;
      cv_.notify_all();
    }
  }

  std::function<void(size_t)> run_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t posted_ = 0, done_ = 0;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: starts once the rest is constructed
};

Hierarchy::Hierarchy() = default;
Hierarchy::~Hierarchy() = default;

namespace {

// What the timeline calls a pipeline's steps (run_segments); no name: not marked.
struct StepNames {
  const char *reduce, *cross, *share;
};
constexpr StepNames kAllreduceSteps{"INTRA_HOST_REDUCESCATTER", "CROSS_HOST_ALLREDUCE",
                                    "INTRA_HOST_ALLGATHER"};
constexpr StepNames kAllgatherSteps{nullptr, "CROSS_HOST_ALLGATHER", "INTRA_HOST_SHARE"};

// Runs `segments` segments through three steps: reduce(k) and share(k) on this thread,
// cross(k, scratch) on the hierarchy's helper thread when there are several, pipelined: while
// segment k crosses, this thread shares segment k - 1 and reduces segment k + 1 within the
// host. The timeline shows the first segment's reduce, the overlapped middle as the cross
// step, and the last segment's share.
template <typename Reduce, typename Cross, typename Share>
void run_segments(const Hierarchy& h, size_t segments, Reduce reduce, Cross cross, Share share,
                  Scratch& scratch, const StepMarker& step, const StepNames& names) {
  if (segments < 2) {
    {
      Step s(step, names.reduce);
      reduce(0);
    }
    {
      Step s(step, names.cross);
      cross(0, scratch);
    }
    Step s(step, names.share);
    share(0);
    return;
  }
  if (!h.cross_worker) h.cross_worker = std::make_unique<CrossHostWorker>();
  CrossHostWorker& crossing = *h.cross_worker;
  crossing.begin([&](size_t k) { cross(k, h.cross_scratch); });
  try {
    {
      Step s(step, names.reduce);
      reduce(0);
    }
    crossing.post(0);
    {
      Step s(step, names.cross);
      for (size_t k = 1; k < segments; ++k) {
        reduce(k);
        crossing.post(k);
        crossing.wait(k - 1);
        share(k - 1);
      }
      crossing.wait(segments - 1);
    }
    Step s(step, names.share);
    share(segments - 1);
  } catch (const std::exception& e) {
    // The crossing thread may wait on a peer that waits for us: make its waits fail too.
    global_abort().raise(e.what());
    crossing.end();
    throw;
  }
  crossing.end();
}

}  // namespace

void allreduce_hierarchical(const Communicator& comm, void* buf, size_t count, DataType dtype,
                            ReduceOp op, size_t ring_threshold_bytes, Scratch& scratch,
                            const StepMarker& step) {
  const Hierarchy& h = *comm.hierarchy;
  const SegmentSteps steps{h, dtype, op, ring_threshold_bytes};
  auto* base = static_cast<uint8_t*>(buf);
  const size_t esize = dtype_size(dtype);
  const size_t segment = std::max<size_t>(1, kHierarchicalSegmentBytes / esize);
  auto at = [&](size_t k) { return base + k * segment * esize; };
  auto len = [&](size_t k) { return std::min(segment, count - k * segment); };
  run_segments(
      h, (count + segment - 1) / segment,
      [&](size_t k) { steps.reduce_scatter(at(k), len(k), scratch); },
      [&](size_t k, Scratch& s) { steps.cross(at(k), len(k), s); },
      [&](size_t k) { steps.allgather(at(k), len(k)); }, scratch, step, kAllreduceSteps);
}

namespace {

// The segments' steps in place in the arenas of my host's members (`views[m]`: member m's
// tensors as I map them): as reduce-scatter, I reduce my block of every member's tensors into my
// lane buffer; it crosses; as allgather, I write it, scaled, into every member's tensors. Nobody
// else touches my block of anyone's tensors, so the agreement before and the release after
// are the only waits within the host.
void hierarchical_in_arenas(const Hierarchy& h, const SegmentSteps& steps,
                            const std::vector<std::vector<TensorSpan>>& views, size_t count,
                            double scale, Scratch& scratch, const StepMarker& step) {
  const int me = h.local.rank, n = h.local.size;
  if (me >= h.lanes) return;  // no block of my own: the lanes' members do my share
  const size_t esize = dtype_size(steps.dtype);
  const size_t segment = std::max<size_t>(1, kHierarchicalSegmentBytes / esize);
  const size_t segments = (count + segment - 1) / segment;
  std::vector<SegmentedBuffer> data;
  for (int m = 0; m < n; ++m) data.emplace_back(views[m], esize);
  // Segment k: my block is [pos[k], pos[k] + len[k]) of the tensors' bytes, at lane_at[k] in my
  // lane buffer.
  std::vector<size_t> pos(segments), len(segments), lane_at(segments + 1, 0);
  for (size_t k = 0; k < segments; ++k) {
    const size_t first = k * segment, elems = std::min(segment, count - first);
    const std::vector<size_t> blocks = h.lane_blocks(elems);
    pos[k] = (first + prefix_offsets(blocks)[me]) * esize;
    len[k] = blocks[me] * esize;
    lane_at[k + 1] = lane_at[k] + len[k];
  }
  if (h.lane_buffer.size() < lane_at[segments]) h.lane_buffer.resize(lane_at[segments]);
  uint8_t* lane = h.lane_buffer.data();
  auto reduce = [&](size_t k) {  // members in order: the same bits on every path
    data[0].for_pieces(pos[k], len[k], [&](size_t i, size_t off, size_t bytes, size_t at) {
      auto src = [&](int m) { return static_cast<const uint8_t*>(views[m][i].in) + off; };
      uint8_t* dst = lane + lane_at[k] + at;
      reduce_out(dst, src(0), src(1), bytes / esize, steps.dtype, steps.op);
      for (int m = 2; m < n; ++m) reduce_into(dst, src(m), bytes / esize, steps.dtype, steps.op);
    });
  };
  auto cross = [&](size_t k, Scratch& s) {
    steps.cross_block(lane + lane_at[k], len[k] / esize, s);
  };
  auto share = [&](size_t k) {
    if (scale != 1.0) scale_buffer(lane + lane_at[k], len[k] / esize, steps.dtype, scale);
    for (int m = 0; m < n; ++m)
      data[m].for_range(pos[k], len[k], [&](const uint8_t*, uint8_t* out, size_t bytes,
                                            size_t at) {
        std::memcpy(out, lane + lane_at[k] + at, bytes);
      });
  };
  run_segments(h, segments, reduce, cross, share, scratch, step, kAllreduceSteps);
}

}  // namespace

void allreduce_hierarchical_tensors(const Communicator& comm,
                                    const std::vector<TensorSpan>& tensors, DataType dtype,
                                    ReduceOp op, double scale, size_t ring_threshold_bytes,
                                    Scratch& scratch, const StepMarker& step) {
  const Hierarchy& h = *comm.hierarchy;
  const size_t esize = dtype_size(dtype);
  size_t count = 0;
  for (const TensorSpan& t : tensors) count += t.count;
  if (count == 0) return;
  SharedMemoryGroup* group = h.host_group.get();
  std::vector<std::vector<TensorSpan>> views;
  if (group && group->arenas_worth_checking(count * esize) &&
      group->map_members_arenas(h.local, tensors, esize, &views)) {
    try {
      hierarchical_in_arenas(h, SegmentSteps{h, dtype, op, ring_threshold_bytes}, views, count,
                             scale, scratch, step);
    } catch (const std::exception& e) {
      // My host's other members wait for my release: make their waits fail too.
      global_abort().raise(e.what());
      throw;
    }
    group->release_members_arenas(h.local);
    return;
  }
  // Packed as the engine packs a fusion buffer (a lone tensor in its own output).
  uint8_t* buf = static_cast<uint8_t*>(tensors[0].out);
  if (tensors.size() == 1) {
    if (tensors[0].in != buf) std::memcpy(buf, tensors[0].in, count * esize);
  } else {
    if (h.packed.size() < count * esize) h.packed.resize(count * esize);
    buf = h.packed.data();
    size_t at = 0;
    for (const TensorSpan& t : tensors) {
      std::memcpy(buf + at, t.in, t.count * esize);
      at += t.count * esize;
    }
  }
  allreduce_hierarchical(comm, buf, count, dtype, op, ring_threshold_bytes, scratch, step);
  if (scale != 1.0) scale_buffer(buf, count, dtype, scale);
  if (tensors.size() > 1) {
    size_t at = 0;
    for (const TensorSpan& t : tensors) {
      std::memcpy(t.out, buf + at, t.count * esize);
      at += t.count * esize;
    }
  }
}

void allgather_hierarchical(const Communicator& comm, void* out, const std::vector<size_t>& bytes,
                            Scratch& scratch, const StepMarker& step) {
  const Hierarchy& h = *comm.hierarchy;
  const int my_index = h.local.rank;
  const std::vector<size_t> offsets = prefix_offsets(bytes);
  auto* base = static_cast<uint8_t*>(out);
  // Host g's region: the blocks of its members, back to back; and its pieces, one per lane,
  // back to back (none for the local indices past the lanes), piece j at piece_at[g][j].
  std::vector<size_t> region_at(h.hosts);
  std::vector<std::vector<size_t>> pieces(h.hosts), piece_at(h.hosts);
  size_t segments = 1;
  for (int g = 0; g < h.hosts; ++g) {
    const int first = h.host_first[g];
    region_at[g] = offsets[first];
    pieces[g] = h.lane_blocks(offsets[first + h.host_size[g]] - offsets[first]);
    for (size_t& at : piece_at[g] = prefix_offsets(pieces[g])) at += region_at[g];
    for (size_t p : pieces[g]) {
      const size_t k = (p + kHierarchicalSegmentBytes - 1) / kHierarchicalSegmentBytes;
      segments = std::max(segments, k);
    }
  }
  {
    Step s(step, "INTRA_HOST_ALLGATHER");
    const auto mine = bytes.begin() + h.host_first[h.my_host];
    allgather_ring(h.local, base + region_at[h.my_host],
                   std::vector<size_t>(mine, mine + h.local.size));
  }
  // Segment k of every piece: its bytes [k, k + 1) * kHierarchicalSegmentBytes (empty past
  // the piece's end). While segment k of my lane's pieces crosses between hosts, my host
  // shares segment k - 1 of the other hosts' pieces (the same numbers on every member).
  auto segment_of = [&](int g, int j, size_t k, size_t* at, size_t* len) {
    const size_t lo = std::min(pieces[g][j], k * kHierarchicalSegmentBytes);
    *at = piece_at[g][j] + lo;
    *len = std::min(pieces[g][j] - lo, kHierarchicalSegmentBytes);
  };
  auto cross = [&](size_t k, Scratch&) {
    if (my_index >= h.lanes) return;
    std::vector<size_t> at(h.hosts), len(h.hosts);
    for (int g = 0; g < h.hosts; ++g) segment_of(g, my_index, k, &at[g], &len[g]);
    allgather_ring_at(h.cross, base, at, len);
  };
  auto share = [&](size_t k) {
    std::vector<size_t> at(h.local.size, 0), len(h.local.size, 0);
    for (int g = 0; g < h.hosts; ++g) {
      if (g == h.my_host) continue;
      for (int j = 0; j < h.lanes; ++j) segment_of(g, j, k, &at[j], &len[j]);
      allgather_ring_at(h.local, base, at, len);
    }
  };
  run_segments(h, segments, [](size_t) {}, cross, share, scratch, step, kAllgatherSteps);
}

}  // namespace shvd
