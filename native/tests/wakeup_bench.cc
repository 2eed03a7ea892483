// What one cross-process hand-off costs on this host: the floor under a small collective that
// two ranks' engine threads negotiate and run. Two processes pass a token back and forth
// through shared memory, waiting for it by (a) spinning on the word, (b) spinning with
// sched_yield, (c) sleeping in futex(2) (woken by FUTEX_WAKE), (d) sleeping in poll(2) on a
// datagram socket (how the negotiation board wakes a sleeping engine). Prints the median
// one-way hand-off of each. Built and run by tests/test_native_units.py (printed with -s).
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "harness.h"

using namespace shvd_test;
using Clock = std::chrono::steady_clock;

namespace {

struct Shared {
  alignas(64) std::atomic<uint32_t> turn;  // whose move: 0 or 1
  alignas(64) double one_way_us[4];
};

enum Mode { kSpin, kYield, kFutex, kSocket };
const char* kNames[] = {"spin", "spin + sched_yield", "futex wait/wake", "poll on a datagram socket"};

void futex_wait(std::atomic<uint32_t>* w, uint32_t value) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), FUTEX_WAIT, value, nullptr, nullptr, 0);
}
void futex_wake(std::atomic<uint32_t>* w) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

// argv[2]: hand-offs per mode. The test suite runs a few hundred: two pure spinners that share
// a CPU pay a scheduler time slice per hand-off, so the full count can take minutes there.
int g_rounds = 0;

// Plays `me`'s side of `rounds` hand-offs; returns the median one-way time (player 0 only).
double play(Shared* s, int me, Mode mode, int rounds, int sock) {
  std::vector<double> round_trips;
  for (int i = 0; i < rounds; ++i) {
    const auto t0 = Clock::now();
    for (int leg = 0; leg < 2; ++leg) {
      const uint32_t mover = uint32_t(leg);
      if (mover == uint32_t(me)) {
        s->turn.store(1 - mover, std::memory_order_seq_cst);
        if (mode == kFutex) futex_wake(&s->turn);
        if (mode == kSocket) {
          char b = 1;
          (void)!write(sock, &b, 1);
        }
      } else {
        // Wait until it is my move (the other side hands the turn to me).
        while (s->turn.load(std::memory_order_seq_cst) != uint32_t(me)) {
          if (mode == kYield) sched_yield();
          if (mode == kFutex) futex_wait(&s->turn, 1 - me);
          if (mode == kSocket) {
            pollfd fd{sock, POLLIN, 0};
            poll(&fd, 1, 100);
            char b[16];
            (void)!recv(sock, b, sizeof b, MSG_DONTWAIT);
          }
        }
      }
    }
    round_trips.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  std::sort(round_trips.begin(), round_trips.end());
  return round_trips[round_trips.size() / 2] / 2;
}

void measure(Shared* s, Mode mode) {
  int socks[2];
  CHECK(socketpair(AF_UNIX, SOCK_DGRAM, 0, socks) == 0);
  s->turn.store(0);
  const int rounds = g_rounds > 0 ? g_rounds : mode == kSpin || mode == kYield ? 20000 : 5000;
  pid_t child = fork();
  if (child == 0) {
    play(s, 1, mode, rounds, socks[1]);
    _exit(0);
  }
  s->one_way_us[mode] = play(s, 0, mode, rounds, socks[0]);
  int status = 0;
  waitpid(child, &status, 0);
  close(socks[0]);
  close(socks[1]);
  std::printf("     one-way hand-off, %-28s median %8.2f us\n", kNames[mode], s->one_way_us[mode]);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && argv[1][0] != '\0') g_filter = argv[1];
  if (argc > 2) g_rounds = std::atoi(argv[2]);
  auto* s = static_cast<Shared*>(mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE,
                                      MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  std::printf("CPUs: %ld online\n", sysconf(_SC_NPROCESSORS_ONLN));
  for (Mode m : {kSpin, kYield, kFutex, kSocket})
    run_test(kNames[m], [&] {
      measure(s, m);
      CHECK(s->one_way_us[m] > 0);
    });
  return summary();
}
