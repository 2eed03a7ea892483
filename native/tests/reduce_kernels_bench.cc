// What the reduce kernels cost per call, for benchmarks/wheel.py: the same source built with
// the g++ build's flags and with the wheel's (zig's clang for glibc 2.28) runs these cases, and
// the benchmark compares their medians. One JSON line per case on stdout:
//   {"case": "float32 sum", "bytes": 16384, "ns": [median, min]}
// Arguments: [repetitions per case] (default 31; each repetition times enough calls to take
// about 2 ms, so small sizes are not lost in the clock's resolution).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "../kernels/reduce_kernels.h"

using shvd::DataType;
using shvd::ReduceOp;
using Clock = std::chrono::steady_clock;

namespace {

struct Case {
  const char* name;
  DataType dtype;
  size_t elem;
  // One call on (dst, a, b) of `count` elements.
  std::function<void(void*, void*, const void*, size_t)> call;
};

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 31;
  auto into = [](DataType t, ReduceOp op) {
    return [t, op](void* d, void*, const void* s, size_t n) { shvd::reduce_into(d, s, n, t, op); };
  };
  const std::vector<Case> cases = {
      {"float32 sum", DataType::kFloat32, 4, into(DataType::kFloat32, ReduceOp::kSum)},
      {"float32 max", DataType::kFloat32, 4, into(DataType::kFloat32, ReduceOp::kMax)},
      {"float64 sum", DataType::kFloat64, 8, into(DataType::kFloat64, ReduceOp::kSum)},
      {"int32 sum", DataType::kInt32, 4, into(DataType::kInt32, ReduceOp::kSum)},
      {"float16 sum", DataType::kFloat16, 2, into(DataType::kFloat16, ReduceOp::kSum)},
      {"bfloat16 sum", DataType::kBFloat16, 2, into(DataType::kBFloat16, ReduceOp::kSum)},
      {"float32 average out (a+b)/2 twice", DataType::kFloat32, 4,
       [](void* d, void* d2, const void* s, size_t n) {
         shvd::reduce_out_scaled(d, d2, d, s, n, DataType::kFloat32, ReduceOp::kAverage, 0.5);
       }},
      {"float32 scale", DataType::kFloat32, 4,
       [](void* d, void*, const void*, size_t n) {
         shvd::scale_buffer(d, n, DataType::kFloat32, 1.0000001);
       }},
  };
  const size_t sizes[] = {16 << 10, 1 << 20, 64 << 20};
  for (const Case& c : cases) {
    for (size_t bytes : sizes) {
      const size_t n = bytes / c.elem;
      // Values between 1 and 2 (small integers for int32): sums, averages, maxima and a scale
      // by a factor close to 1 keep them finite and normal over thousands of calls.
      // One 64-byte aligned block for both builds alike (their C++ runtimes allocate apart
      // otherwise), the arrays apart by a distance that is no multiple of 4 KiB (loads then
      // never falsely wait for stores to another array's same page offset).
      constexpr size_t kApart = 64 * 17;
      std::vector<uint8_t> block(3 * (bytes + kApart) + 64);
      uint8_t* base = block.data() + (64 - reinterpret_cast<uintptr_t>(block.data()) % 64) % 64;
      uint8_t* dst = base;
      uint8_t* src = dst + bytes + kApart;
      uint8_t* dst2 = src + bytes + 2 * kApart;
      for (size_t i = 0; i < n; ++i) {
        const float v = 1.0f + float(i % 97) / 97.0f;
        switch (c.dtype) {
          case DataType::kFloat32: reinterpret_cast<float*>(src)[i] = v; break;
          case DataType::kFloat64: reinterpret_cast<double*>(src)[i] = v; break;
          case DataType::kFloat16:
            reinterpret_cast<uint16_t*>(src)[i] = shvd::float_to_half(v);
            break;
          case DataType::kBFloat16:
            reinterpret_cast<uint16_t*>(src)[i] = shvd::float_to_bfloat16(v);
            break;
          default: reinterpret_cast<int32_t*>(src)[i] = int32_t(i % 5);
        }
      }
      // Calls per repetition: about 2 ms.
      size_t calls = 1;
      for (;;) {
        const auto t0 = Clock::now();
        for (size_t k = 0; k < calls; ++k) c.call(dst, dst2, src, n);
        if (seconds(Clock::now() - t0) > 2e-3 || calls >= (1u << 20)) break;
        calls *= 2;
      }
      std::vector<double> per_call;
      for (int r = 0; r < reps; ++r) {
        // Sums of 1..2 grow: start each repetition from the same values.
        std::memcpy(dst, src, bytes);
        const auto t0 = Clock::now();
        for (size_t k = 0; k < calls; ++k) c.call(dst, dst2, src, n);
        per_call.push_back(seconds(Clock::now() - t0) / double(calls) * 1e9);
      }
      std::sort(per_call.begin(), per_call.end());
      std::printf("{\"case\": \"%s\", \"bytes\": %zu, \"ns\": [%.1f, %.1f]}\n", c.name, bytes,
                  per_call[per_call.size() / 2], per_call.front());
      std::fflush(stdout);
    }
  }
  return 0;
}
