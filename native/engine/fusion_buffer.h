// The fusion buffer: many small tensors of one allreduce response are packed back to back so a
// single collective reduces them all (one negotiation, one ring, one latency cost).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace shvd {

class FusionBuffer {
 public:
  // A buffer of at least `bytes`, 64-byte aligned, reused across responses.
  void* reserve(size_t bytes);

 private:
  std::vector<uint8_t> storage_;
};

}  // namespace shvd
