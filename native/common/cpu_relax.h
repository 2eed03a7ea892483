// The pause instruction for spin-wait loops: tells the CPU the loop waits (a sibling
// hyperthread gets the core's resources, and leaving the loop costs no pipeline flush).
#pragma once

namespace shvd {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace shvd
