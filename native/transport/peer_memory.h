// Reaching the memory of another process on this host, for the shared-memory group
// (algorithms/shared_memory_group.h): reading it with process_vm_readv ("cross-memory attach",
// which Open MPI's shared-memory transport also uses) and mapping its file descriptors through
// /proc. Whether the kernel allows either (same user, ptrace policy, seccomp) depends on the
// host, so each process publishes a probe target, a private word and a memfd holding one random
// token, and the others try to read it both ways before relying on it.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace shvd {

// What a process publishes so that others can reach its memory, as plain words (it lives in
// memory the processes share).
struct PeerIdentity {
  uint64_t thread;         // a thread of the process: names its address space and its /proc
  uint64_t probe_address;  // the probe word's address in the process
  uint64_t probe_value;    // the token the probe word and the probe memfd hold
  uint64_t probe_fd;       // the probe memfd (as int64_t: -1 when there is none)
};

// This process's probe target: the word (and, when asked for and available, the memfd) holding
// a random token. Peers probe it while it lives; it does not move (its address is published).
class ProbeTarget {
 public:
  explicit ProbeTarget(bool with_memfd);
  ~ProbeTarget();
  ProbeTarget(const ProbeTarget&) = delete;
  ProbeTarget& operator=(const ProbeTarget&) = delete;

  // The identity to publish: the calling thread, the word and the memfd. The thread must live
  // as long as peers read this process (the shared-memory group is set up and used on the
  // engine thread; the main thread may exit while the engine runs).
  PeerIdentity identity() const;
  bool has_memfd() const { return fd_ >= 0; }

 private:
  volatile uint64_t word_ = 0;
  uint64_t token_ = 0;
  int fd_ = -1;
};

// Whether this process may read `peer`'s memory: reads its probe word through the kernel.
bool may_read(const PeerIdentity& peer);
// Whether this process may map `peer`'s file descriptors: maps its probe memfd.
bool may_map(const PeerIdentity& peer);

// Copies the `remote` ranges of process `pid` into the `local` ranges (equal total length),
// resuming after partial transfers. Returns 0, or the errno of the failure (ESRCH: the process
// is gone). Consumes the vectors.
int read_process(pid_t pid, std::vector<iovec>& local, std::vector<iovec>& remote);

// Maps `bytes` of file descriptor `fd` of the process that thread `thread` belongs to, through
// /proc (allowed when this process may inspect that one). nullptr on failure (errno set).
uint8_t* map_peer_fd(uint64_t thread, uint64_t fd, size_t bytes);

}  // namespace shvd
