#include "gpu_libraries.h"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>

namespace shvd {
namespace gpu {

namespace {

std::mutex g_mu;
int g_status = 0;
bool g_tried = false;
std::string g_report;
CudaApi g_cuda{};
NcclApi g_nccl{};

// `path` if given, else the first of `names` already loaded, else the first the loader finds.
void* open_library(const char* path, std::initializer_list<const char*> names,
                   std::string* tried) {
  if (path && *path) {
    if (void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL)) return h;
    *tried += std::string(" ") + path + " (" + dlerror() + ");";
  }
  for (const char* n : names)
    if (void* h = dlopen(n, RTLD_NOW | RTLD_NOLOAD)) return h;
  for (const char* n : names) {
    if (void* h = dlopen(n, RTLD_NOW | RTLD_LOCAL)) return h;
    *tried += std::string(" ") + n + ";";
  }
  return nullptr;
}

template <typename F>
bool bind(void* lib, const char* name, F* fn, std::string* missing) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (!*fn) *missing += std::string(" ") + name;
  return *fn != nullptr;
}

bool bind_cuda(void* lib, std::string* missing) {
  bool ok = true;
  CudaApi& c = g_cuda;
  ok &= bind(lib, "cudaGetDeviceCount", &c.GetDeviceCount, missing);
  ok &= bind(lib, "cudaSetDevice", &c.SetDevice, missing);
  ok &= bind(lib, "cudaGetDevice", &c.GetDevice, missing);
  ok &= bind(lib, "cudaDeviceGetPCIBusId", &c.DeviceGetPCIBusId, missing);
  ok &= bind(lib, "cudaStreamCreateWithFlags", &c.StreamCreateWithFlags, missing);
  ok &= bind(lib, "cudaStreamDestroy", &c.StreamDestroy, missing);
  ok &= bind(lib, "cudaStreamSynchronize", &c.StreamSynchronize, missing);
  ok &= bind(lib, "cudaStreamWaitEvent", &c.StreamWaitEvent, missing);
  ok &= bind(lib, "cudaEventCreateWithFlags", &c.EventCreateWithFlags, missing);
  ok &= bind(lib, "cudaEventDestroy", &c.EventDestroy, missing);
  ok &= bind(lib, "cudaEventRecord", &c.EventRecord, missing);
  ok &= bind(lib, "cudaEventQuery", &c.EventQuery, missing);
  ok &= bind(lib, "cudaEventSynchronize", &c.EventSynchronize, missing);
  ok &= bind(lib, "cudaMalloc", &c.Malloc, missing);
  ok &= bind(lib, "cudaFree", &c.Free, missing);
  ok &= bind(lib, "cudaMallocAsync", &c.MallocAsync, missing);
  ok &= bind(lib, "cudaFreeAsync", &c.FreeAsync, missing);
  ok &= bind(lib, "cudaMemcpyAsync", &c.MemcpyAsync, missing);
  ok &= bind(lib, "cudaMemsetAsync", &c.MemsetAsync, missing);
  ok &= bind(lib, "cudaGetErrorString", &c.GetErrorString, missing);
  ok &= bind(lib, "cudaGetLastError", &c.GetLastError, missing);
  return ok;
}

bool bind_nccl(void* lib, std::string* missing) {
  bool ok = true;
  NcclApi& n = g_nccl;
  ok &= bind(lib, "ncclGetVersion", &n.GetVersion, missing);
  ok &= bind(lib, "ncclGetUniqueId", &n.GetUniqueId, missing);
  ok &= bind(lib, "ncclCommInitRank", &n.CommInitRank, missing);
  ok &= bind(lib, "ncclCommDestroy", &n.CommDestroy, missing);
  ok &= bind(lib, "ncclCommAbort", &n.CommAbort, missing);
  ok &= bind(lib, "ncclCommGetAsyncError", &n.CommGetAsyncError, missing);
  ok &= bind(lib, "ncclGetErrorString", &n.GetErrorString, missing);
  ok &= bind(lib, "ncclAllReduce", &n.AllReduce, missing);
  ok &= bind(lib, "ncclBroadcast", &n.Broadcast, missing);
  ok &= bind(lib, "ncclReduce", &n.Reduce, missing);
  ok &= bind(lib, "ncclAllGather", &n.AllGather, missing);
  ok &= bind(lib, "ncclReduceScatter", &n.ReduceScatter, missing);
  ok &= bind(lib, "ncclSend", &n.Send, missing);
  ok &= bind(lib, "ncclRecv", &n.Recv, missing);
  ok &= bind(lib, "ncclGroupStart", &n.GroupStart, missing);
  ok &= bind(lib, "ncclGroupEnd", &n.GroupEnd, missing);
  std::string optional;
  bind(lib, "ncclRedOpCreatePreMulSum", &n.RedOpCreatePreMulSum, &optional);
  bind(lib, "ncclRedOpDestroy", &n.RedOpDestroy, &optional);
  if (!n.RedOpDestroy) n.RedOpCreatePreMulSum = nullptr;
  if (ok && n.GetVersion(&n.version) != ncclSuccess) n.version = 0;
  return ok;
}

}  // namespace

int load(const char* cudart_path, const char* nccl_path) {
  std::lock_guard<std::mutex> lock(g_mu);
  const bool new_paths = (cudart_path && *cudart_path) || (nccl_path && *nccl_path);
  if (g_status == 2 || (g_tried && !new_paths)) return g_status;
  g_tried = true;
  std::string tried;
  if (g_status == 0) {
    void* lib = open_library(cudart_path, {"libcudart.so.13", "libcudart.so.12",
                                           "libcudart.so.11.0", "libcudart.so"}, &tried);
    if (!lib) {
      g_report = "no CUDA runtime library found (tried:" + tried + ")";
      return g_status;
    }
    std::string missing;
    if (!bind_cuda(lib, &missing)) {
      g_report = "the CUDA runtime lacks" + missing + " (CUDA 11.2 or later is needed)";
      return g_status;
    }
    g_status = 1;
  }
  tried.clear();
  void* lib = open_library(nccl_path, {"libnccl.so.2", "libnccl.so"}, &tried);
  if (!lib) {
    g_report = "CUDA runtime loaded; no NCCL library found (tried:" + tried + ")";
    return g_status;
  }
  std::string missing;
  if (!bind_nccl(lib, &missing)) {
    g_report = "CUDA runtime loaded; the NCCL library lacks" + missing + " (NCCL 2.7 or later)";
    return g_status;
  }
  g_status = 2;
  g_report = "CUDA runtime and NCCL " + std::to_string(g_nccl.version) + " loaded";
  return g_status;
}

int status() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_status;
}

const std::string& load_report() { return g_report; }
const CudaApi& cuda() { return g_cuda; }
const NcclApi& nccl() { return g_nccl; }

void check_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  throw std::runtime_error(std::string(what) + " failed: CUDA error " + std::to_string(err) +
                           " (" + (g_cuda.GetErrorString ? g_cuda.GetErrorString(err) : "?") +
                           ")");
}

void check_nccl(ncclResult_t err, const char* what) {
  if (err == ncclSuccess) return;
  throw std::runtime_error(std::string(what) + " failed: NCCL error " + std::to_string(err) +
                           " (" + (g_nccl.GetErrorString ? g_nccl.GetErrorString(err) : "?") +
                           ")");
}

}  // namespace gpu
}  // namespace shvd
