// Where the engine threads of a shared-memory group's members run, so that two members spinning
// on one CPU notice it. The scheduler sometimes wakes two members' engine threads on one CPU
// (wake-up placement follows the waker) while another CPU idles; the collective then runs
// serially at half speed until load balancing moves one, which takes milliseconds. So members
// publish their CPU, and the lower-numbered of two that share one moves itself once per
// collective to another CPU it may run on (the affinity mask is left as it was: a one-off
// migration, not pinning).
#pragma once

#include <sched.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace shvd {

// Moves the calling thread off `cpu` to another CPU of its affinity mask, preferring one that
// `taken` does not name, and restores the mask: a one-off migration, not pinning. False when
// the mask allows no other CPU.
bool move_to_other_cpu(int cpu, const cpu_set_t& taken);

class CpuPlacement {
 public:
  // `words[m]`: where member m publishes its CPU, in memory every member maps; I am member
  // `me`.
  CpuPlacement(std::vector<std::atomic<uint64_t>*> words, int me);

  // A new collective (counted alike on every member): CPUs published during earlier ones are
  // stale (the thread may have moved since), and I may move again.
  void begin_collective();
  // Publishes my CPU for this collective; returns it + 1 (0: unknown).
  uint64_t publish();
  // Member `member`'s CPU + 1 as published in this collective, else 0.
  uint64_t of(int member) const;
  // While I wait for `member`, which runs on my CPU (`*my_cpu`, as publish returned it): when
  // I am the lower-numbered of us and have not moved in this collective, moves me to another
  // CPU, preferably one no other member is on, and republishes into `*my_cpu`. True when it
  // moved me.
  bool move_off_shared_cpu(int member, uint64_t* my_cpu);

 private:
  std::vector<std::atomic<uint64_t>*> words_;
  int me_;
  uint64_t collective_ = 0;  // collectives so far, identical on every member
  bool moved_ = false;       // this collective already moved me off a CPU shared with a peer
};

}  // namespace shvd
