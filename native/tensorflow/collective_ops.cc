// TensorFlow graph op for the allreduce family: one asynchronous kernel that hands a list of
// tensors to the core (one negotiation, fused) and completes when their results are in. Built
// separately from the core and loaded by spark_hvd.tensorflow when present; without it graphs
// fall back to tf.numpy_function nodes.
//
// Why a kernel instead of tf.numpy_function: the kernel runs without Python (no GIL, no NumPy
// conversions, about 1 ms less per step here), and it may reduce a gradient in place when no
// other op reads it (TF_ForwardInputOrAllocateOutput), which saves a pass over the result.
//
// It is written against TensorFlow's C API only (tf_c_api.h: kernels.h, ops.h), never its C++
// classes, so one binary serves every TensorFlow from 2.16 on, and talks to the core only
// through the core's C ABI (spark_hvd.h), so the core stays framework free. The ops and kernels
// register themselves when tf.load_op_library loads the library (static constructors below).
#include <dlfcn.h>
#include <link.h>
#include <strings.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../include/spark_hvd.h"
#include "tf_c_api.h"

namespace spark_hvd_tf {
namespace {

// A TF_Status that frees itself.
struct Status {
  TF_Status* s = TF_NewStatus();
  Status() = default;
  Status(TF_Code code, const std::string& msg) { TF_SetStatus(s, code, msg.c_str()); }
  Status(const Status&) = delete;
  Status& operator=(const Status&) = delete;
  ~Status() { TF_DeleteStatus(s); }
  bool ok() const { return TF_GetCode(s) == TF_OK; }
};

int32_t core_dtype(TF_DataType t) {
  switch (t) {
    case TF_UINT8: return SHVD_DTYPE_UINT8;
    case TF_INT8: return SHVD_DTYPE_INT8;
    case TF_INT16: return SHVD_DTYPE_INT16;
    case TF_UINT16: return SHVD_DTYPE_UINT16;
    case TF_INT32: return SHVD_DTYPE_INT32;
    case TF_INT64: return SHVD_DTYPE_INT64;
    case TF_HALF: return SHVD_DTYPE_FLOAT16;
    case TF_BFLOAT16: return SHVD_DTYPE_BFLOAT16;
    case TF_FLOAT: return SHVD_DTYPE_FLOAT32;
    case TF_DOUBLE: return SHVD_DTYPE_FLOAT64;
    case TF_BOOL: return SHVD_DTYPE_BOOL;
    default: return -1;  // excluded by the op's type constraint
  }
}

// Horovod's status classes: a request the ranks disagree about (found while negotiating, so
// reported by the wait) is FailedPrecondition; one refused when it is enqueued (bad arguments
// on this rank) is InvalidArgument.
std::pair<TF_Code, std::string> core_error(bool negotiated) {
  std::string msg = shvd_last_error();
  switch (shvd_last_error_kind()) {
    case SHVD_ERR_INVALID:
      return {negotiated ? TF_FAILED_PRECONDITION : TF_INVALID_ARGUMENT, msg};
    case SHVD_ERR_STATE: return {TF_INVALID_ARGUMENT, msg};
    case SHVD_ERR_UNSUPPORTED: return {TF_UNIMPLEMENTED, msg};
    default: return {TF_UNKNOWN, "HorovodInternalError: " + msg};
  }
}

char empty_tensor_data[8];  // the core wants a valid address even for zero bytes

void* data_of(const TF_Tensor* t) {
  void* p = TF_TensorElementCount(t) ? TF_TensorData(t) : nullptr;
  return p ? p : empty_tensor_data;
}

// -- completing a kernel after compute_async_func returned -----------------------------------
//
// TensorFlow's C API hands an asynchronous kernel `done` as a pointer to the by-value
// std::function<void()> parameter of CAsyncOpKernel::ComputeAsync (tensorflow/c/kernels.cc),
// which dies when compute_async_func returns, and offers no call to copy or move it: the C API
// only supports running it before returning. Run later through that pointer, it crashed (2
// ranks, every tf.function). A kernel that waits for the other ranks before it returns blocks
// one of the executor's threads per collective, which hangs a graph run by a Session that holds
// more independent collectives than the inter-op pool has threads (see Waiter).
//
// So the callback is moved out, as libstdc++'s move constructor does it: std::function<void()>
// is 32 bytes, the functor's storage (16 bytes, holding the functor in place only when it is
// trivially copyable, else a pointer to it), the manager (byte 16) and the invoker (byte 24);
// the move copies the 32 bytes and clears the source's manager and invoker, after which the
// source's destructor does nothing. That layout is libstdc++'s ABI (unchanged since GCC 4.x,
// and what every C++ op built against TensorFlow's headers relies on too), and
// TF_RunAsyncOpKernelDoneCallback in TensorFlow 2.16 and 2.21 is exactly "manager at 16 set?
// then jump to the invoker at 24". It is used only when checked:
//  - once: the library that defines TF_RunAsyncOpKernelDoneCallback needs libstdc++.so.6 and
//    no libc++ (so its std::function is libstdc++'s);
//  - per call: the manager and the invoker both point into one loaded library (dladdr).
// Otherwise, or with SPARK_HVD_TF_SYNC_KERNELS=1, the kernel waits for its ops before it
// returns and runs `done` then, as the C API supports, after one log line saying so.

// The names a loaded library needs (DT_NEEDED), read from its dynamic section in memory.
std::vector<std::string> needed_libraries(const void* address_in_library) {
  std::vector<std::string> names;
  Dl_info info{};
  void* handle = nullptr;
  if (dladdr(address_in_library, &info) == 0 || info.dli_fname == nullptr) return names;
  handle = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return names;
  struct link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_ld != nullptr) {
    const char* strtab = nullptr;
    for (const ElfW(Dyn)* d = map->l_ld; d->d_tag != DT_NULL; ++d) {
      if (d->d_tag == DT_STRTAB) {
        // glibc has relocated the entry in place; add the load address where it has not.
        ElfW(Addr) a = d->d_un.d_ptr;
        strtab = reinterpret_cast<const char*>(a < map->l_addr ? a + map->l_addr : a);
      }
    }
    for (const ElfW(Dyn)* d = map->l_ld; strtab != nullptr && d->d_tag != DT_NULL; ++d)
      if (d->d_tag == DT_NEEDED) names.emplace_back(strtab + d->d_un.d_val);
  }
  dlclose(handle);
  return names;
}

// A line in the core's format at `level` (2 INFO, 3 WARNING), shown as the core's are
// (SPARK_HVD_LOG_LEVEL, default WARNING).
void log_line(int level, const std::string& msg) {
  static const char* const names[] = {"TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"};
  int threshold = 3;
  const char* value = std::getenv("SPARK_HVD_LOG_LEVEL");
  if (value == nullptr || *value == '\0') value = std::getenv("HOROVOD_LOG_LEVEL");
  for (int i = 0; value != nullptr && i < 6; ++i)
    if (strcasecmp(value, names[i]) == 0) threshold = i;
  if (level >= threshold) std::fprintf(stderr, "spark_hvd %s: %s\n", names[level], msg.c_str());
}

// Whether `done` callbacks may be moved out (checked once: see above).
bool deferral_allowed() {
  static const bool allowed = [] {
    const char* sync = std::getenv("SPARK_HVD_TF_SYNC_KERNELS");
    if (sync != nullptr && *sync != '\0' && std::strcmp(sync, "0") != 0) {
      log_line(2, "SPARK_HVD_TF_SYNC_KERNELS is set: the TensorFlow op library completes its "
               "collectives before its kernels return");
      return false;
    }
    bool libstdcxx = false, libcxx = false;
    for (const std::string& n :
         needed_libraries(reinterpret_cast<const void*>(&TF_RunAsyncOpKernelDoneCallback))) {
      libstdcxx = libstdcxx || n.rfind("libstdc++.so", 0) == 0;
      libcxx = libcxx || n.rfind("libc++.so", 0) == 0;
    }
    if (libstdcxx && !libcxx) {
      log_line(1, "TensorFlow's C API library needs libstdc++: the TensorFlow op library's "
                  "kernels complete after they return");
      return true;
    }
    log_line(3, "TensorFlow's C API library is not built with libstdc++: the TensorFlow op library "
             "completes its collectives before its kernels return (a graph with more independent "
             "collectives than inter-op threads may then wait on itself)");
    return false;
  }();
  return allowed;
}

// The per-call check: a libstdc++ std::function's manager and invoker, both in one library.
bool looks_like_a_function(const TF_AsyncOpKernelDoneCallback* done) {
  void* code[2];
  std::memcpy(code, reinterpret_cast<const char*>(done) + 16, sizeof(code));
  Dl_info manager{}, invoker{};
  if (code[0] == nullptr || code[1] == nullptr || dladdr(code[0], &manager) == 0
      || dladdr(code[1], &invoker) == 0 || manager.dli_fbase == nullptr
      || manager.dli_fbase != invoker.dli_fbase)
    return false;
  return true;
}

// A `done` callback moved out of TensorFlow's parameter (see above); runs and destroys it.
class DeferredDone {
 public:
  // Null when `done` may not be moved: the caller then completes the kernel before returning.
  static std::shared_ptr<DeferredDone> take(TF_AsyncOpKernelDoneCallback* done) {
    if (!deferral_allowed()) return nullptr;
    if (!looks_like_a_function(done)) {
      static std::atomic<bool> logged{false};
      if (!logged.exchange(true))
        log_line(3, "a TensorFlow done callback is not laid out as libstdc++'s std::function: the "
                 "TensorFlow op library completes such kernels before they return");
      return nullptr;
    }
    return std::shared_ptr<DeferredDone>(new DeferredDone(done));
  }
  DeferredDone(const DeferredDone&) = delete;
  DeferredDone& operator=(const DeferredDone&) = delete;
  ~DeferredDone() {
    Manager manager;
    std::memcpy(&manager, bytes_ + kManagerOffset, sizeof(manager));
    if (manager != nullptr) manager(bytes_, bytes_, kDestroyFunctor);
  }
  void run() {
    TF_RunAsyncOpKernelDoneCallback(reinterpret_cast<TF_AsyncOpKernelDoneCallback*>(bytes_));
  }

 private:
  explicit DeferredDone(TF_AsyncOpKernelDoneCallback* done) {
    std::memcpy(bytes_, done, sizeof(bytes_));
    std::memset(reinterpret_cast<char*>(done) + kManagerOffset, 0, 2 * sizeof(void*));
  }

  // libstdc++: _Any_data (16 bytes), _M_manager, _M_invoker; __destroy_functor is 3.
  using Manager = bool (*)(void*, const void*, int);
  static constexpr size_t kManagerOffset = 16;
  static constexpr int kDestroyFunctor = 3;
  alignas(16) unsigned char bytes_[32];
};

// Fails the kernel's run with (code, msg) and completes it.
void fail(TF_OpKernelContext* ctx, TF_AsyncOpKernelDoneCallback* done, TF_Code code,
          const std::string& msg) {
  Status status(code, msg);
  TF_OpKernelContext_Failure(ctx, status.s);
  TF_RunAsyncOpKernelDoneCallback(done);
}

// Waits for the ops that kernels enqueued and completes those kernels, on one thread of its own
// (SparkHvdAllreduce's, and SparkHvdWait's for the collectives that run as tf.numpy_function).
// A kernel must not block its executor thread until the other ranks arrive: a graph run by a
// Session may hold more independent collectives than the inter-op pool has threads (2 on a
// 2-core host), each rank's executor starts them in its own order, and blocked threads then
// wait for ops the other rank cannot start (Horovod's test_horovod_allreduce_cpu_fused hung so).
// Waiting in enqueue order is enough: every op is already with the core, which completes them
// in the negotiated order whoever waits.
class Waiter {
 public:
  // ok, or the error's (code, message).
  using Done = std::function<void(bool ok, TF_Code code, const std::string& msg)>;

  static Waiter& instance() {
    static Waiter* waiter = new Waiter();  // never destroyed: its thread may outlive main()
    return *waiter;
  }

  // `release`: release the handles once done and report the first op's error (the allreduce
  // kernel); else only wait, leaving results and errors to whoever collects the handles.
  void add(std::vector<int64_t> handles, bool release, Done done) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(Item{std::move(handles), release, std::move(done)});
    }
    cv_.notify_one();
  }

 private:
  Waiter() { std::thread([this] { run(); }).detach(); }

  struct Item {
    std::vector<int64_t> handles;
    bool release;
    Done done;
  };

  void run() {
    for (;;) {
      Item item;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !queue_.empty(); });
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      const int32_t n = int32_t(item.handles.size());
      if (!item.release) {
        while (shvd_wait_for(item.handles.data(), n, 1000) == 1) {
        }
        item.done(true, TF_OK, "");
        continue;
      }
      if (shvd_wait_release(item.handles.data(), n) == 0) {
        item.done(true, TF_OK, "");
      } else {
        // The core's last error is per thread: read on this one, which waited.
        auto [code, msg] = core_error(/*negotiated=*/true);
        item.done(false, code, msg);
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
};

// -- reading attrs --------------------------------------------------------------------------

bool get_string(TF_OpKernelConstruction* c, const char* name, std::string* out, Status& st) {
  int32_t list_size = 0, total = 0;
  TF_OpKernelConstruction_GetAttrSize(c, name, &list_size, &total, st.s);
  if (!st.ok()) return false;
  std::string value(size_t(total > 0 ? total : 0), '\0');
  if (total > 0) TF_OpKernelConstruction_GetAttrString(c, name, &value[0], value.size(), st.s);
  *out = std::move(value);
  return st.ok();
}

bool get_string_list(TF_OpKernelConstruction* c, const char* name,
                     std::vector<std::string>* out, Status& st) {
  int32_t list_size = 0, total = 0;
  TF_OpKernelConstruction_GetAttrSize(c, name, &list_size, &total, st.s);
  if (!st.ok()) return false;
  std::vector<char*> values(static_cast<size_t>(list_size));
  std::vector<size_t> lengths(static_cast<size_t>(list_size));
  std::vector<char> storage(size_t(total > 0 ? total : 1));
  TF_OpKernelConstruction_GetAttrStringList(c, name, values.data(), lengths.data(), list_size,
                                            storage.data(), storage.size(), st.s);
  if (!st.ok()) return false;
  out->clear();
  for (int32_t i = 0; i < list_size; ++i) out->emplace_back(values[i], lengths[i]);
  return true;
}

// -- SparkHvdAllreduce ----------------------------------------------------------------------

struct Allreduce {
  std::vector<std::string> names;
  std::string group;
  int64_t reduce_op = 0;
  double prescale = 1.0, postscale = 1.0;
  int64_t process_set = 0;
};

void* allreduce_create(TF_OpKernelConstruction* c) {
  auto* k = new Allreduce();
  Status st;
  std::string prescale, postscale;
  if (get_string_list(c, "tensor_names", &k->names, st) && get_string(c, "group", &k->group, st)
      && get_string(c, "prescale", &prescale, st) && get_string(c, "postscale", &postscale, st)) {
    TF_OpKernelConstruction_GetAttrInt64(c, "reduce_op", &k->reduce_op, st.s);
    if (st.ok()) TF_OpKernelConstruction_GetAttrInt64(c, "process_set", &k->process_set, st.s);
  }
  if (!st.ok()) {
    TF_OpKernelConstruction_Failure(c, st.s);
    return k;
  }
  k->prescale = std::strtod(prescale.c_str(), nullptr);
  k->postscale = std::strtod(postscale.c_str(), nullptr);
  return k;
}

void allreduce_delete(void* kernel) { delete static_cast<Allreduce*>(kernel); }

void allreduce_compute(void* kernel, TF_OpKernelContext* ctx,
                       TF_AsyncOpKernelDoneCallback* done) {
  const Allreduce& k = *static_cast<Allreduce*>(kernel);
  const int n = TF_NumInputs(ctx);
  if (n != int(k.names.size()))
    return fail(ctx, done, TF_INVALID_ARGUMENT, "SparkHvdAllreduce needs one name per tensor");
  if (n == 0) return TF_RunAsyncOpKernelDoneCallback(done);
  std::vector<std::vector<int64_t>> shapes(static_cast<size_t>(n));
  std::vector<shvd_op> ops(static_cast<size_t>(n));
  Status st;
  for (int i = 0; i < n; ++i) {
    // The input's shape and type, then its handle dropped before the output is made: a handle
    // holds a reference to the buffer, and only a buffer nobody else references is forwarded.
    TF_Tensor* in = nullptr;
    TF_GetInput(ctx, i, &in, st.s);
    if (!st.ok()) return fail(ctx, done, TF_GetCode(st.s), "SparkHvdAllreduce: no input");
    const TF_DataType dtype = TF_TensorType(in);
    for (int d = 0; d < TF_NumDims(in); ++d) shapes[i].push_back(TF_Dim(in, d));
    TF_DeleteTensor(in);
    // In place when nothing else reads the input (typical for a gradient).
    int forwarded = -1;
    TF_Tensor* out = TF_ForwardInputOrAllocateOutput(ctx, &i, 1, i, shapes[i].data(),
                                                     int(shapes[i].size()), &forwarded, st.s);
    if (!st.ok()) {
      TF_DeleteTensor(out);
      TF_OpKernelContext_Failure(ctx, st.s);
      return TF_RunAsyncOpKernelDoneCallback(done);
    }
    void* output = data_of(out);
    void* input = output;
    if (forwarded != i) {
      TF_GetInput(ctx, i, &in, st.s);
      input = data_of(in);
      TF_DeleteTensor(in);
    }
    // The context keeps its inputs and outputs until `done` runs, so the core's pointers stay
    // valid while the op is in flight; the handles taken here are not needed for that.
    TF_DeleteTensor(out);
    shvd_op& op = ops[i];
    op = shvd_op{};
    op.op = SHVD_OP_ALLREDUCE;
    op.name = k.names[i].c_str();
    op.dtype = core_dtype(dtype);
    op.ndim = int32_t(shapes[i].size());
    op.shape = shapes[i].data();
    op.input = input;
    op.output = output;
    op.reduce_op = int32_t(k.reduce_op);
    op.prescale = k.prescale;
    op.postscale = k.postscale;
    op.process_set = int32_t(k.process_set);
    op.group = k.group.empty() ? nullptr : k.group.c_str();
    op.group_size = k.group.empty() ? 0 : n;
  }
  std::vector<int64_t> handles(static_cast<size_t>(n));
  if (shvd_enqueue(ops.data(), n, handles.data()) != 0) {
    auto [code, msg] = core_error(/*negotiated=*/false);
    return fail(ctx, done, code, msg);
  }
  auto later = DeferredDone::take(done);
  if (later == nullptr) {  // completed before returning (see DeferredDone)
    if (shvd_wait_release(handles.data(), n) != 0) {
      auto [code, msg] = core_error(/*negotiated=*/true);
      Status status(code, msg);
      TF_OpKernelContext_Failure(ctx, status.s);
    }
    return TF_RunAsyncOpKernelDoneCallback(done);
  }
  Waiter::instance().add(std::move(handles), /*release=*/true,
                         [ctx, later](bool ok, TF_Code code, const std::string& msg) {
                           if (!ok) {
                             Status status(code, msg);
                             TF_OpKernelContext_Failure(ctx, status.s);
                           }
                           later->run();
                         });
}

// -- SparkHvdWait ---------------------------------------------------------------------------
// Completes when the core's ops `handles` have completed, without releasing them, and passes
// `key` on. The collectives that run as tf.numpy_function nodes (allgather, broadcast,
// alltoall, reducescatter) are split around it in a graph: one node enqueues, this one waits
// off the executor's threads, one node collects the results. A node that blocked until the
// other ranks arrive could hang a graph with more independent collectives than the inter-op
// pool has threads, as the allreduce kernel could (see Waiter).

void* no_state_create(TF_OpKernelConstruction*) { return nullptr; }
void no_state_delete(void*) {}

void wait_compute(void*, TF_OpKernelContext* ctx, TF_AsyncOpKernelDoneCallback* done) {
  Status st;
  TF_Tensor* key = nullptr;
  TF_GetInput(ctx, 1, &key, st.s);
  if (st.ok()) TF_SetOutput(ctx, 0, key, st.s);
  TF_DeleteTensor(key);
  TF_Tensor* ids = nullptr;
  if (st.ok()) TF_GetInput(ctx, 0, &ids, st.s);
  if (!st.ok()) {
    TF_DeleteTensor(ids);
    TF_OpKernelContext_Failure(ctx, st.s);
    return TF_RunAsyncOpKernelDoneCallback(done);
  }
  std::vector<int64_t> handles(static_cast<size_t>(TF_TensorElementCount(ids)));
  if (!handles.empty())
    std::memcpy(handles.data(), TF_TensorData(ids), handles.size() * sizeof(int64_t));
  TF_DeleteTensor(ids);
  if (handles.empty()) return TF_RunAsyncOpKernelDoneCallback(done);
  auto later = DeferredDone::take(done);
  if (later == nullptr) {  // completed before returning (see DeferredDone)
    while (shvd_wait_for(handles.data(), int32_t(handles.size()), 1000) == 1) {
    }
    return TF_RunAsyncOpKernelDoneCallback(done);
  }
  Waiter::instance().add(std::move(handles), /*release=*/false,
                         [later](bool, TF_Code, const std::string&) { later->run(); });
}

// -- SparkHvdCheck --------------------------------------------------------------------------
// Fails with FailedPrecondition(message) when `failed` is true. The collectives that run as
// tf.numpy_function nodes report a disagreement of the ranks through it: TensorFlow turns any
// Python exception of such a node into InvalidArgument or Unknown, while Horovod (and the
// allreduce kernel above) raise FailedPrecondition for it. The message comes as UTF-8 bytes
// (uint8): a string tensor's layout is not part of the C API.

void check_compute(void*, TF_OpKernelContext* ctx) {
  Status st;
  TF_Tensor* failed = nullptr;
  TF_GetInput(ctx, 0, &failed, st.s);
  const bool is_failed = st.ok() && TF_TensorElementCount(failed) > 0
                         && *static_cast<const bool*>(TF_TensorData(failed));
  TF_DeleteTensor(failed);
  if (!is_failed) return;
  TF_Tensor* message = nullptr;
  TF_GetInput(ctx, 1, &message, st.s);
  std::string msg;
  if (st.ok() && TF_TensorByteSize(message) > 0)
    msg.assign(static_cast<const char*>(TF_TensorData(message)), TF_TensorByteSize(message));
  TF_DeleteTensor(message);
  Status failure(TF_FAILED_PRECONDITION, msg);
  TF_OpKernelContext_Failure(ctx, failure.s);
}

// -- registration ---------------------------------------------------------------------------

void same_shapes(TF_ShapeInferenceContext* c, TF_Status* status) {
  TF_ShapeHandle* shape = TF_NewShapeHandle();
  for (int i = 0; i < int(TF_ShapeInferenceContextNumInputs(c)); ++i) {
    TF_ShapeInferenceContextGetInput(c, i, shape, status);
    if (TF_GetCode(status) != TF_OK) break;
    TF_ShapeInferenceContextSetOutput(c, i, shape, status);
    if (TF_GetCode(status) != TF_OK) break;
  }
  TF_DeleteShapeHandle(shape);
}

void key_shape(TF_ShapeInferenceContext* c, TF_Status* status) {
  TF_ShapeHandle* shape = TF_NewShapeHandle();
  TF_ShapeInferenceContextGetInput(c, 1, shape, status);
  if (TF_GetCode(status) == TF_OK) TF_ShapeInferenceContextSetOutput(c, 0, shape, status);
  TF_DeleteShapeHandle(shape);
}

void no_outputs(TF_ShapeInferenceContext*, TF_Status*) {}

struct OpSpec {
  const char* name;
  std::vector<const char*> attrs, inputs, outputs;
  void (*shape_fn)(TF_ShapeInferenceContext*, TF_Status*);
};

// Registers the op and its CPU kernel. Every op is stateful: never pruned, folded or
// deduplicated, and tf.function's automatic control dependencies keep collectives in program
// order, which every rank must share. A failure is printed: a missing op then makes
// spark_hvd.tensorflow fall back (and say so).
void register_op(const OpSpec& spec, TF_KernelBuilder* kernel) {
  TF_OpDefinitionBuilder* b = TF_NewOpDefinitionBuilder(spec.name);
  for (const char* a : spec.attrs) TF_OpDefinitionBuilderAddAttr(b, a);
  for (const char* i : spec.inputs) TF_OpDefinitionBuilderAddInput(b, i);
  for (const char* o : spec.outputs) TF_OpDefinitionBuilderAddOutput(b, o);
  TF_OpDefinitionBuilderSetIsStateful(b, true);
  TF_OpDefinitionBuilderSetShapeInferenceFunction(b, spec.shape_fn);
  Status st;
  TF_RegisterOpDefinition(b, st.s);
  if (st.ok()) TF_RegisterKernelBuilder(spec.name, kernel, st.s);
  if (!st.ok()) std::fprintf(stderr, "spark_hvd: registering %s failed\n", spec.name);
}

struct Registration {
  Registration() {
    register_op(
        {"SparkHvdAllreduce",
         {"T: list({uint8, int8, uint16, int16, int32, int64, half, bfloat16, float, double, "
          "bool})",
          "tensor_names: list(string)", "group: string = ''", "reduce_op: int",
          // Scale factors as decimal strings (Python's repr round-trips a double exactly; a
          // float attr would round them to 32 bits).
          "prescale: string = '1.0'", "postscale: string = '1.0'", "process_set: int = 0"},
         {"tensors: T"},
         {"reduced: T"},
         same_shapes},
        TF_NewAsyncKernelBuilder("SparkHvdAllreduce", "CPU", allreduce_create, allreduce_compute,
                                 allreduce_delete));
    register_op({"SparkHvdWait", {}, {"handles: int64", "key: int64"}, {"key_out: int64"},
                 key_shape},
                TF_NewAsyncKernelBuilder("SparkHvdWait", "CPU", no_state_create, wait_compute,
                                         no_state_delete));
    register_op({"SparkHvdCheck", {}, {"failed: bool", "message: uint8"}, {}, no_outputs},
                TF_NewKernelBuilder("SparkHvdCheck", "CPU", no_state_create, check_compute,
                                    no_state_delete));
  }
};

const Registration registration;

}  // namespace
}  // namespace spark_hvd_tf
