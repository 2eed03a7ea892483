#include "fusion_buffer.h"

#include <cstdint>

namespace shvd {

void* FusionBuffer::reserve(size_t bytes) {
  if (storage_.size() < bytes + 64) storage_.resize(bytes + 64);
  auto p = reinterpret_cast<uintptr_t>(storage_.data());
  return reinterpret_cast<void*>((p + 63) & ~uintptr_t(63));
}

}  // namespace shvd
