// Negotiation through shared memory, for a job whose ranks all share one host: the fast path
// for the steady state of a training loop, where every rank asks again for allreduces that the
// response cache already answered.
//
// Instead of sending a cache id to the coordinator over TCP and waiting for its answer, a rank
// sets its bit in the id's arrival word (Horovod's cached-response bit vectors, agreed here
// with one compare-and-swap instead of a bitwise-AND allreduce). The rank whose bit completes
// the id's member mask clears the word and appends the id to the log, a ring every rank reads
// in the same order and executes the cached responses from. The coordinator keeps deciding
// everything else (new or changed requests, errors, join, shutdown, stalls) over TCP, and its
// decisions enter the same log as markers ("the next response batch from rank 0"), so every rank
// executes cached and negotiated responses in one order.
//
// The coordinator takes an id over whenever the general path must decide it (a full request for
// the name, a join or shutdown, a stall): steal() clears the waiting ranks' bits, hands them to
// the coordinator and disables the word; a rank that finds its id disabled sends it over TCP as
// before. enable() gives the id back once the coordinator answered it.
//
// Consecutive log entries may fuse into one collective while nobody has started executing the
// earlier one: an entry appended while the previous one is unsealed is flagged as joining its
// group, and a reader seals everything up to the tail before it executes, so every rank sees the
// same groups however far each had read. (Readers then split a group where the responses do not
// fit together, deterministically: they all hold the same cached responses.)
//
// Wake-ups: an engine that goes to sleep raises its flag; whoever appends wakes the ranks whose
// flag is up through their datagram socket (an abstract unix socket, polled with the engine's
// other descriptors). Nobody pays a system call while everyone is awake.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <cstddef>
#include <string>

namespace shvd {

struct BoardLayout;  // in shared memory, private to negotiation_board.cc

class NegotiationBoard {
 public:
  static constexpr int kMaxRanks = 63;  // one arrival bit per rank, one for "disabled"
  // A log entry: a cache id, or a marker for the coordinator's next response batch.
  static constexpr uint64_t kMarker = 1ull << 62;
  static constexpr uint64_t kFuseWithPrevious = 1ull << 61;
  static constexpr uint64_t kValueMask = (1ull << 32) - 1;

  // Rank 0 creates the segment (a random name under `job_id`); it sends name() to the others,
  // which open() it. `ids`: the response cache's capacity. Throws std::runtime_error when shared
  // memory is unavailable.
  static std::unique_ptr<NegotiationBoard> create(const std::string& job_id, int size,
                                                  uint32_t ids);
  static std::unique_ptr<NegotiationBoard> open(const std::string& name, int rank, int size,
                                                uint32_t ids);
  ~NegotiationBoard();
  NegotiationBoard(const NegotiationBoard&) = delete;
  NegotiationBoard& operator=(const NegotiationBoard&) = delete;

  const std::string& name() const { return name_; }
  // Removes the name (the mappings stay valid); rank 0 does so once every rank opened it.
  void unlink();
  int rank() const { return rank_; }
  uint32_t ids() const { return ids_; }

  // --- Arrivals --------------------------------------------------------------------------------
  enum class Arrival {
    kWaiting,    // my bit is set; the last member to arrive appends the id
    kCompleted,  // my bit completed `members`: the caller appends the id now
    kRefused,    // the coordinator decides this id for now: send it over TCP
  };
  // `members`: the bits of the id's process set (global ranks).
  Arrival arrive(uint32_t id, int rank, uint64_t members);
  // Coordinator: disables the id and returns the bits of the ranks that had arrived.
  uint64_t steal(uint32_t id);
  void enable(uint32_t id);
  // The waiting ranks' bits and how many times the id completed (stall inspection).
  uint64_t waiting(uint32_t id) const;
  uint64_t completions(uint32_t id) const;

  // --- The log ---------------------------------------------------------------------------------
  // Appends `entries` (ids, or kMarker | batch number), in one step (no reader can seal between
  // them, so ids completed together can run as one collective), and wakes sleeping ranks.
  // Waits while the ring is full (throws after a minute).
  void append(const uint64_t* entries, size_t n);
  void append(uint64_t entry) { append(&entry, 1); }
  // Entries appended so far (acquire: entries below it can be read).
  uint64_t tail() const;
  // Seals the log up to its tail (groups below can no longer grow) and returns that tail.
  uint64_t seal();
  uint64_t entry(uint64_t position) const;  // without kFuseWithPrevious: see fuses()
  bool fuses(uint64_t position) const;      // joins the group of the entry before it
  // This rank read everything below `position` (frees ring space).
  void consumed(uint64_t position);

  // --- Sleeping --------------------------------------------------------------------------------
  // The socket to poll for wake-ups (readable after wake()), and reading it empty.
  int wake_fd() const { return wake_fd_; }
  void drain_wake_fd();
  // Announce sleep (then re-check for work before blocking) and end it.
  void set_sleeping(bool sleeping);

  // --- Where the ranks' threads run ---------------------------------------------------------
  // The CPU the calling thread is on, for the others to read (cpu_of: -1 when unknown). A
  // thread that waits for peers on the board (engine/fast_path.cc) moves off a CPU that a
  // missing peer was last seen on.
  void publish_cpu();
  int cpu_of(int rank) const;

 private:
  NegotiationBoard(BoardLayout* layout, size_t bytes, std::string name, int rank, int size,
                   uint32_t ids);
  void lock();
  void unlock();
  void wake_sleepers();
  std::string socket_name(int rank) const;

  BoardLayout* layout_;
  size_t bytes_;
  std::string name_;
  bool unlinked_ = false;
  int rank_;
  int size_;
  uint32_t ids_;
  uint64_t capacity_;  // log entries
  std::atomic<uint64_t>* arrivals_;
  std::atomic<uint64_t>* completions_;
  uint64_t* log_;
  int wake_fd_ = -1;
};

}  // namespace shvd
