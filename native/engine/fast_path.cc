// A synchronous small allreduce on the calling thread. When every rank shares this host, a
// cached allreduce is agreed on the negotiation board (board.cc) and executed from the board's
// log, which needs nothing that only the engine thread has: the user thread that waits for the
// result can arrive on the board itself and execute the log up to its op, holding the executor
// lock the engine thread takes for each of its cycles. That saves the two thread hand-offs
// (user -> engine -> user) that were half of a 4-byte allreduce's time, and on a host with no
// spare core, the engine thread's wake-ups. The log's order is every rank's order whichever
// thread reads it, so results and fusion stay the same.
//
// Left to the engine thread: ops that are not cached (negotiated over TCP), ids the coordinator
// decides for now (refused by the board), the timeline, CUDA tensors and MPI operations, an op
// whose peers are late (after a short spin the user thread waits for its handle as usual), and
// anything after a coordinator batch marker that has not arrived yet.
#include <poll.h>
#include <sched.h>
#include <unistd.h>

#include "../common/cpu_relax.h"
#include "../algorithms/cpu_placement.h"
#include "../mpi/mpi_backend.h"
#include "engine.h"

namespace shvd {

namespace {
// How the calling thread waits for its peers' arrivals: it spins briefly, then yields, and
// after kRunHereWait leaves the op to the engine thread and sleeps. Given up after 0.2 ms, the
// two wake-ups of the engine's path (the engine's, then this thread's) made the next op late
// too, so each rank gave up in turn, every op ~0.2-0.5 ms for whole runs on a loaded 2-core
// host; sleeping on the board instead (woken by the appender) was slower still there (wake-ups
// took ~1 ms). Open MPI polls forever.
constexpr int kRunHereSpinTurns = 256;
constexpr std::chrono::microseconds kRunHereSpread{20};
constexpr std::chrono::milliseconds kRunHereWait{2};

}  // namespace

bool Engine::control_readable() {
  pollfd fds[64];
  nfds_t n = 0;
  for (auto& link : mesh_.control)
    if (link && link->fd() >= 0 && n < 64) fds[n++] = {link->fd(), POLLIN, 0};
  return n > 0 && poll(fds, n, 0) > 0;
}

void Engine::spread_from_missing_peers(uint32_t id, uint64_t members) {
  // A wake-up puts the woken thread on its waker's CPU, so two ranks' threads can end up
  // sharing one CPU while the other runs something else; spinning, this one would then keep
  // the peer it waits for off the CPU. Move away from a missing peer's last CPU (once per op,
  // like the shared-memory group's placement, algorithms/cpu_placement.h).
  const uint64_t missing = members & ~board_->waiting(id) & ~(1ull << options_.rank);
  if (!missing || board_->waiting(id) == 0) return;  // completed meanwhile: nothing to wait for
  const int mine = sched_getcpu();
  bool shared = false;
  cpu_set_t taken;
  CPU_ZERO(&taken);
  for (int r = 0; r < options_.size; ++r) {
    if (r == options_.rank) continue;
    const int c = board_->cpu_of(r);
    if (c < 0 || c >= CPU_SETSIZE) continue;
    CPU_SET(c, &taken);
    shared = shared || (c == mine && (missing >> r & 1));
  }
  if (shared && move_to_other_cpu(mine, taken)) board_->publish_cpu();
}

bool Engine::run_here(Entry& entry) {
  // The engine thread holds it for a cycle at a time, which never waits for a user thread;
  // whatever it is executing comes before this op in the log anyway.
  std::unique_lock<std::mutex> executor(executor_mu_);
  if (finished_ || !board_ || timeline_.active() || gpu_ || entry.gpu.device >= 0 ||
      mpi::active() || !tuned_.cache_enabled)
    return false;
  const Request& req = entry.request;
  const int64_t cached = cache_.lookup(req);
  if (cached < 0) return false;
  const ResponseCache::Answer* answer = cache_.answer(uint32_t(cached));
  if (!answer || answer->response.process_set != req.process_set) return false;

  // From here on the op is in the engine's tables: whoever holds the executor lock runs it.
  running_here_.fetch_add(1);
  board_->publish_cpu();
  // A sleeping engine thread need not be woken by the peers' appends while this thread reads
  // the log (a system call on their side each time).
  if (sleeping_.load()) board_->set_sleeping(false);
  std::shared_ptr<HandleState> state = entry.state;
  table_.emplace(req.name, std::move(entry));
  bool engine_needed = false;  // work for the engine thread that the board does not show
  try {
    moved_at_ = Clock::now();
    if (blocked_reported_) send_blocked_state(RequestBatch::Blocked::kMoving);
    std::vector<uint64_t> completed;
    if (!arrive_on_board(uint32_t(cached), &completed)) {
      // The coordinator decides this id for now: as the engine would, over TCP (rank 0: into
      // its own coordinator, whose answer the engine thread sends).
      unsent_.rank = options_.rank;
      unsent_.cached.push_back(uint32_t(cached));
      flush_requests();
      engine_needed = options_.rank == 0;
    } else {
      if (!completed.empty()) board_->append(completed.data(), completed.size());
      const auto start = Clock::now();
      bool spread = false;
      for (int turn = 0; !state->done.load(std::memory_order_acquire); ++turn) {
        const uint64_t before = board_read_.load(std::memory_order_relaxed);
        read_board();
        if (state->done.load(std::memory_order_acquire) || finished_) break;
        // Stopped at a coordinator batch still on its way, or (now and then) a peer's message
        // for rank 0's coordinator: read the control links, as the engine thread would.
        if ((board_read_.load(std::memory_order_relaxed) == before && board_->tail() != before &&
             !board_has_work()) ||
            ((turn & 255) == 255 && options_.rank == 0 && control_readable()))
          progress();
        if (turn < kRunHereSpinTurns) {
          cpu_relax();
          continue;
        }
        // Other threads queued ops for the engine thread: let it run (this op's turn comes
        // in the log's order either way).
        if (work_pending_.load(std::memory_order_relaxed)) break;
        const auto waited = Clock::now() - start;
        if (waited > kRunHereWait) break;
        if (!spread && waited > kRunHereSpread) {
          spread = true;
          spread_from_missing_peers(uint32_t(cached), answer->members);
        }
        sched_yield();  // the peer we wait for may need this core
      }
    }
  } catch (const std::exception& e) {
    // The engine thread ends the job (abort_job), which completes this op with the error.
    running_here_.fetch_sub(1);
    executor.unlock();
    abort(e.what());
    return true;
  }
  running_here_.fetch_sub(1);
  if (state->done.load(std::memory_order_acquire)) ran_here_.fetch_add(1, std::memory_order_relaxed);
  // The engine thread watches the board again: raise its sleeping flag (peers' appends wake it)
  // and wake it now if there is work already.
  if (engine_needed) work_pending_.store(true);
  if (sleeping_.load()) {
    board_->set_sleeping(true);
    if (engine_needed || board_has_work()) {
      uint64_t one = 1;
      ssize_t ignored = write(wake_fd_, &one, sizeof one);
      (void)ignored;
    }
  }
  return true;
}

}  // namespace shvd
