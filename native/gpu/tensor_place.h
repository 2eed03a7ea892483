// A CUDA tensor's place in its stream, as an enqueued op carries it (Entry::gpu): recorded on
// the user's thread at enqueue, waited for by the core's stream when the op runs.
#pragma once

#include <cstdint>

#include "gpu_libraries.h"

namespace shvd {
namespace gpu {

// Where a CUDA tensor's op stands (Entry::gpu): device -1 for a host tensor.
struct TensorPlace {
  int device = -1;
  cudaStream_t stream = nullptr;  // the caller's stream at enqueue
  cudaEvent_t ready = nullptr;    // recorded on `stream` at enqueue
  int64_t enqueued_ns = 0;        // steady clock at enqueue (the path's latency counters)
};

// Records where `place.stream` stands (user thread; `place.device` set). Throws
// std::runtime_error when the CUDA runtime is not loaded or the call fails.
void record_ready(TensorPlace& place);
// Returns an event recorded by record_ready that no op will use (an enqueue that failed).
void forget_ready(TensorPlace& place);

}  // namespace gpu
}  // namespace shvd
