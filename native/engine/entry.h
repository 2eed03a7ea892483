// One enqueued op as the engine keeps it until completion: what was asked, the caller's
// buffers, the handle it completes and, for a CUDA tensor, where it stands in its stream. Its
// own header so that the data paths the engine hands entries to (gpu/gpu_path.h) need not know
// the engine.
#pragma once

#include <memory>

#include "../controller/message.h"
#include "../gpu/tensor_place.h"
#include "handles.h"

namespace shvd {

struct Entry {
  Request request;
  const void* input = nullptr;
  void* output = nullptr;
  std::shared_ptr<HandleState> state;
  gpu::TensorPlace gpu;  // a CUDA tensor's device, stream and ready event (device -1: host)
};

}  // namespace shvd
