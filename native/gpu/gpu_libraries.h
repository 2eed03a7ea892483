// The CUDA runtime and NCCL, loaded at run time (dlopen) so that the core builds without a CUDA
// toolkit and loads on machines without GPUs. Only the few types and functions the core uses
// are declared here, with the values of the libraries' stable ABI (cudart 11-13, NCCL >= 2.7).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace shvd {
namespace gpu {

using cudaStream_t = void*;
using cudaEvent_t = void*;
using cudaError_t = int;
using ncclComm_t = void*;
using ncclResult_t = int;
using ncclDataType_t = int;
using ncclRedOp_t = int;
struct ncclUniqueId {
  char internal[128];
};

constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorNotReady = 600;
constexpr int cudaMemcpyHostToDevice = 1;
constexpr int cudaMemcpyDeviceToHost = 2;
constexpr int cudaMemcpyDeviceToDevice = 3;
constexpr unsigned cudaStreamNonBlocking = 1;
constexpr unsigned cudaEventDisableTiming = 2;

constexpr ncclResult_t ncclSuccess = 0;
constexpr ncclDataType_t ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3,
                         ncclInt64 = 4, ncclUint64 = 5, ncclFloat16 = 6, ncclFloat32 = 7,
                         ncclFloat64 = 8, ncclBfloat16 = 9;
constexpr ncclRedOp_t ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4;
constexpr int ncclScalarHostImmediate = 1;

struct CudaApi {
  cudaError_t (*GetDeviceCount)(int*);
  cudaError_t (*SetDevice)(int);
  cudaError_t (*GetDevice)(int*);
  cudaError_t (*DeviceGetPCIBusId)(char*, int, int);
  cudaError_t (*StreamCreateWithFlags)(cudaStream_t*, unsigned);
  cudaError_t (*StreamDestroy)(cudaStream_t);
  cudaError_t (*StreamSynchronize)(cudaStream_t);
  cudaError_t (*StreamWaitEvent)(cudaStream_t, cudaEvent_t, unsigned);
  cudaError_t (*EventCreateWithFlags)(cudaEvent_t*, unsigned);
  cudaError_t (*EventDestroy)(cudaEvent_t);
  cudaError_t (*EventRecord)(cudaEvent_t, cudaStream_t);
  cudaError_t (*EventQuery)(cudaEvent_t);
  cudaError_t (*EventSynchronize)(cudaEvent_t);
  cudaError_t (*Malloc)(void**, size_t);
  cudaError_t (*Free)(void*);
  cudaError_t (*MallocAsync)(void**, size_t, cudaStream_t);
  cudaError_t (*FreeAsync)(void*, cudaStream_t);
  cudaError_t (*MemcpyAsync)(void*, const void*, size_t, int, cudaStream_t);
  cudaError_t (*MemsetAsync)(void*, int, size_t, cudaStream_t);
  const char* (*GetErrorString)(cudaError_t);
  cudaError_t (*GetLastError)();
};

struct NcclApi {
  int version = 0;  // e.g. 22805 for 2.28.5
  ncclResult_t (*GetVersion)(int*);
  ncclResult_t (*GetUniqueId)(ncclUniqueId*);
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*);
  const char* (*GetErrorString)(ncclResult_t);
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*Reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int,
                         ncclComm_t, cudaStream_t);
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                ncclComm_t, cudaStream_t);
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();
  // Optional (NCCL >= 2.11): null when absent.
  ncclResult_t (*RedOpCreatePreMulSum)(ncclRedOp_t*, void*, ncclDataType_t, int, ncclComm_t);
  ncclResult_t (*RedOpDestroy)(ncclRedOp_t, ncclComm_t);
};

// Loads the CUDA runtime (and NCCL) once per process: the given paths first (from the Python
// side, which knows where the frameworks' wheels put them; NULL or "" to skip), then a library
// of that name already loaded in the process, then the loader's search path. Thread-safe;
// later calls return the first call's outcome unless that found nothing and a path is given.
// Returns 0 (nothing), 1 (CUDA runtime only) or 2 (CUDA runtime and NCCL).
int load(const char* cudart_path, const char* nccl_path);
int status();                  // what load() found so far (0 before any call)
const std::string& load_report();  // what was tried and found, for error messages
const CudaApi& cuda();         // only after status() >= 1
const NcclApi& nccl();         // only after status() == 2

// Throws std::runtime_error naming `what` when a CUDA call failed.
void check_cuda(cudaError_t err, const char* what);
void check_nccl(ncclResult_t err, const char* what);

}  // namespace gpu
}  // namespace shvd
