// Shared-memory link between two ranks on one host: a pair of single-producer/single-consumer
// byte rings in one POSIX shared-memory segment. Moves data with one memcpy on each side and no
// system call, which is what makes intra-host collectives fast.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "link.h"

namespace shvd {

struct ShmSegment;  // layout, private to shm.cc

class SharedMemoryPipe : public Link {
 public:
  // The lower rank of the pair creates the segment (random name, `capacity` bytes per
  // direction, from shm_pipe_capacity()) and sends name() to the peer; the opener reads the
  // capacity from the segment. Throws std::runtime_error when shared memory is unavailable
  // (the mesh then uses TCP).
  static std::unique_ptr<SharedMemoryPipe> create(const std::string& job_id, int my_rank,
                                                  int peer_rank, int peer_pid, size_t capacity);
  // The higher rank opens the segment by the name it received.
  static std::unique_ptr<SharedMemoryPipe> open(const std::string& name, int my_rank,
                                                int peer_rank, int peer_pid);
  ~SharedMemoryPipe() override;
  SharedMemoryPipe(const SharedMemoryPipe&) = delete;
  SharedMemoryPipe& operator=(const SharedMemoryPipe&) = delete;

  const std::string& name() const { return name_; }
  // Removes the name from /dev/shm (the mappings stay valid). The creator calls it as soon as
  // the peer has opened the segment, so a crash never leaves the segment behind.
  void unlink();

  size_t try_send(const void* data, size_t n) override;
  size_t try_recv(void* data, size_t n) override;
  int fd() const override { return -1; }
  bool is_shared_memory() const override { return true; }
  // True while the peer process exists and has not closed its end, and also while bytes it
  // wrote are still unread (so a peer that sent its last message and exited is read to the end).
  bool peer_alive() const override;
  int peer_rank() const override { return peer_rank_; }
  size_t capacity() const { return capacity_; }

 private:
  SharedMemoryPipe(ShmSegment* seg, size_t map_bytes, size_t capacity, std::string name,
                   int side, int peer_rank, int peer_pid);
  bool peer_gone() const;
  [[noreturn]] void lost() const;

  ShmSegment* seg_;
  size_t map_bytes_;
  size_t capacity_;
  std::string name_;
  bool unlinked_ = false;
  int side_;  // 0 = creator, 1 = opener; ring[side_] is the one this side writes
  int peer_rank_;
  int peer_pid_;
  uint8_t* send_data_;
  uint8_t* recv_data_;
  // Local copies of the shared counters: our own counter is only written by us, and the peer's
  // is re-read only when the cached value says we are stuck, which keeps the two cache lines
  // from bouncing between cores on every call.
  uint64_t send_head_ = 0, peer_tail_cache_ = 0;
  uint64_t recv_tail_ = 0, peer_head_cache_ = 0;
  mutable bool peer_closed_ = false;
  mutable bool peer_died_ = false;
};

// Capacity of each direction of a pipe (the init option shm_pipe_bytes, from
// SPARK_HVD_SHM_PIPE_BYTES): <= 0 asks for the default, others are bounded to [64 KiB, 1 GiB]
// and rounded up to whole pages.
constexpr size_t kDefaultShmPipeBytes = 4u << 20;
size_t shm_pipe_capacity(int64_t requested);

// Whether `pid` names a live (not zombie) process visible from here.
bool process_alive(int pid);

}  // namespace shvd
