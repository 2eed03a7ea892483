#include "cpu_placement.h"

#include <sched.h>

#include <utility>

namespace shvd {

namespace {
// A published word is (collective << 16) | (CPU + 1).
constexpr uint64_t kCpuBits = 0xffff;
}  // namespace

bool move_to_other_cpu(int cpu, const cpu_set_t& taken) {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return false;
  int target = -1, fallback = -1;
  for (int i = 1; i < CPU_SETSIZE && target < 0; ++i) {
    const int c = (cpu + i) % CPU_SETSIZE;
    if (c == cpu || !CPU_ISSET(c, &allowed)) continue;
    if (!CPU_ISSET(c, &taken)) target = c;
    else if (fallback < 0) fallback = c;
  }
  if (target < 0) target = fallback;
  if (target < 0) return false;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(target, &one);
  if (sched_setaffinity(0, sizeof one, &one) != 0) return false;  // migrates before returning
  sched_setaffinity(0, sizeof allowed, &allowed);
  return true;
}

CpuPlacement::CpuPlacement(std::vector<std::atomic<uint64_t>*> words, int me)
    : words_(std::move(words)), me_(me) {}

void CpuPlacement::begin_collective() {
  moved_ = false;
  collective_ = (collective_ + 1) & 0xffffffffffffULL;  // the same count on every member
  publish();
}

uint64_t CpuPlacement::publish() {
  const int cpu = sched_getcpu();
  const uint64_t mine = cpu >= 0 ? uint64_t(cpu) + 1 : 0;  // 0: unknown
  words_[me_]->store((collective_ << 16) | mine, std::memory_order_relaxed);
  return mine;
}

uint64_t CpuPlacement::of(int member) const {
  const uint64_t v = words_[member]->load(std::memory_order_relaxed);
  return (v >> 16) == collective_ ? (v & kCpuBits) : 0;
}

bool CpuPlacement::move_off_shared_cpu(int member, uint64_t* my_cpu) {
  if (me_ >= member || moved_ || *my_cpu == 0) return false;
  cpu_set_t taken;  // CPUs the other members are on
  CPU_ZERO(&taken);
  for (int m = 0; m < int(words_.size()); ++m) {
    const uint64_t c = m == me_ ? 0 : of(m);
    if (c != 0 && c <= CPU_SETSIZE) CPU_SET(int(c - 1), &taken);
  }
  if (!move_to_other_cpu(int(*my_cpu) - 1, taken)) return false;
  moved_ = true;
  *my_cpu = publish();
  return true;
}

}  // namespace shvd
