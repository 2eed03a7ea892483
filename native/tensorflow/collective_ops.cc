// TensorFlow graph op for the allreduce family: one asynchronous kernel that hands a list of
// tensors to the core (one negotiation, fused) and completes when their results are in. Built
// separately from
// the core, against the installed TensorFlow (build.py), and loaded by spark_hvd.tensorflow when
// present; without it graphs fall back to tf.numpy_function nodes.
//
// Why a kernel instead of tf.numpy_function: the kernel runs without Python (no GIL, no NumPy
// conversions, about 1 ms less per step here), and it may reduce a gradient in place when no
// other op reads it (forward_input_or_allocate_output), which saves a pass over the result.
// It talks to the core only through its public C ABI (spark_hvd.h), so the core stays framework
// free.
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "../include/spark_hvd.h"

namespace spark_hvd_tf {

using tensorflow::AsyncOpKernel;
using tensorflow::DataType;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

REGISTER_OP("SparkHvdAllreduce")
    .Attr("T: list({uint8, int8, uint16, int16, int32, int64, half, bfloat16, float, double, "
          "bool})")
    .Attr("tensor_names: list(string)")
    .Attr("group: string = ''")
    .Attr("reduce_op: int")
    // Scale factors as decimal strings (Python's repr round-trips a double exactly; a float
    // attr would round them to 32 bits).
    .Attr("prescale: string = '1.0'")
    .Attr("postscale: string = '1.0'")
    .Attr("process_set: int = 0")
    .Input("tensors: T")
    .Output("reduced: T")
    // Stateful: never pruned, folded or deduplicated, and tf.function's automatic control
    // dependencies keep collectives in program order, which every rank must share.
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return absl::OkStatus();
    });

namespace {

int32_t core_dtype(DataType t) {
  switch (t) {
    case tensorflow::DT_UINT8: return SHVD_DTYPE_UINT8;
    case tensorflow::DT_INT8: return SHVD_DTYPE_INT8;
    case tensorflow::DT_INT16: return SHVD_DTYPE_INT16;
    case tensorflow::DT_UINT16: return SHVD_DTYPE_UINT16;
    case tensorflow::DT_INT32: return SHVD_DTYPE_INT32;
    case tensorflow::DT_INT64: return SHVD_DTYPE_INT64;
    case tensorflow::DT_HALF: return SHVD_DTYPE_FLOAT16;
    case tensorflow::DT_BFLOAT16: return SHVD_DTYPE_BFLOAT16;
    case tensorflow::DT_FLOAT: return SHVD_DTYPE_FLOAT32;
    case tensorflow::DT_DOUBLE: return SHVD_DTYPE_FLOAT64;
    case tensorflow::DT_BOOL: return SHVD_DTYPE_BOOL;
    default: return -1;  // excluded by the op's type constraint
  }
}

// Horovod's status classes: a request the ranks disagree about (found while negotiating, so
// reported by the wait) is FailedPrecondition; one refused when it is enqueued (bad arguments
// on this rank) is InvalidArgument.
absl::Status core_error(bool negotiated) {
  const std::string msg = shvd_last_error();
  switch (shvd_last_error_kind()) {
    case SHVD_ERR_INVALID:
      return negotiated ? absl::FailedPreconditionError(msg) : absl::InvalidArgumentError(msg);
    case SHVD_ERR_STATE: return absl::InvalidArgumentError(msg);
    case SHVD_ERR_UNSUPPORTED: return absl::UnimplementedError(msg);
    default: return absl::UnknownError("HorovodInternalError: " + msg);
  }
}

char empty_tensor_data[8];  // the core wants a valid address even for zero bytes

void* data_of(const Tensor& t) {
  return t.NumElements() ? const_cast<char*>(t.tensor_data().data()) : empty_tensor_data;
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
  using Done = std::function<void(absl::Status)>;

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
        item.done(absl::OkStatus());
        continue;
      }
      const bool ok = shvd_wait_release(item.handles.data(), n) == 0;
      // The core's last error is per thread: read on this one, which waited.
      item.done(ok ? absl::OkStatus() : core_error(/*negotiated=*/true));
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
};

}  // namespace

class AllreduceOp : public AsyncOpKernel {
 public:
  explicit AllreduceOp(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("tensor_names", &names_));
    OP_REQUIRES_OK(c, c->GetAttr("group", &group_));
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &reduce_op_));
    std::string prescale, postscale;
    OP_REQUIRES_OK(c, c->GetAttr("prescale", &prescale));
    OP_REQUIRES_OK(c, c->GetAttr("postscale", &postscale));
    prescale_ = std::strtod(prescale.c_str(), nullptr);
    postscale_ = std::strtod(postscale.c_str(), nullptr);
    OP_REQUIRES_OK(c, c->GetAttr("process_set", &process_set_));
    OP_REQUIRES(c, int(names_.size()) == c->num_inputs(),
                absl::InvalidArgumentError("SparkHvdAllreduce needs one name per tensor"));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const int n = ctx->num_inputs();
    std::vector<std::vector<int64_t>> shapes(n);
    std::vector<shvd_op> ops(n);
    for (int i = 0; i < n; ++i) {
      const Tensor& in = ctx->input(i);
      Tensor* out = nullptr;
      // In place when nothing else reads the input (typical for a gradient).
      OP_REQUIRES_OK_ASYNC(ctx, ctx->forward_input_or_allocate_output({i}, i, in.shape(), &out),
                           done);
      for (int d = 0; d < in.dims(); ++d) shapes[i].push_back(in.dim_size(d));
      shvd_op& op = ops[i];
      op = shvd_op{};
      op.op = SHVD_OP_ALLREDUCE;
      op.name = names_[i].c_str();
      op.dtype = core_dtype(in.dtype());
      op.ndim = int32_t(shapes[i].size());
      op.shape = shapes[i].data();
      op.input = data_of(in);
      op.output = data_of(*out);
      op.reduce_op = int32_t(reduce_op_);
      op.prescale = prescale_;
      op.postscale = postscale_;
      op.process_set = int32_t(process_set_);
      op.group = group_.empty() ? nullptr : group_.c_str();
      op.group_size = group_.empty() ? 0 : n;
    }
    if (n == 0) return done();
    std::vector<int64_t> handles(n);
    OP_REQUIRES_ASYNC(ctx, shvd_enqueue(ops.data(), n, handles.data()) == 0,
                      core_error(/*negotiated=*/false), done);
    // Inputs and outputs stay referenced by ctx until `done` runs, so the core's pointers
    // remain valid while the op is in flight.
    Waiter::instance().add(std::move(handles), /*release=*/true, [ctx, done](absl::Status status) {
      if (!status.ok()) ctx->SetStatus(status);
      done();
    });
  }

 private:
  std::vector<std::string> names_;
  std::string group_;
  int64_t reduce_op_ = 0;
  double prescale_ = 1.0, postscale_ = 1.0;
  int64_t process_set_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("SparkHvdAllreduce").Device(tensorflow::DEVICE_CPU), AllreduceOp);

// Completes when the core's ops `handles` have completed, without releasing them, and passes
// `key` on. The collectives that run as tf.numpy_function nodes (allgather, broadcast,
// alltoall, reducescatter) are split around it in a graph: one node enqueues, this one waits
// off the executor's threads, one node collects the results. A node that blocked until the
// other ranks arrive could hang a graph with more independent collectives than the inter-op
// pool has threads, as the allreduce kernel could (see Waiter).
REGISTER_OP("SparkHvdWait")
    .Input("handles: int64")
    .Input("key: int64")
    .Output("key_out: int64")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      return absl::OkStatus();
    });

class WaitOp : public AsyncOpKernel {
 public:
  explicit WaitOp(OpKernelConstruction* c) : AsyncOpKernel(c) {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    ctx->set_output(0, ctx->input(1));
    auto flat = ctx->input(0).flat<int64_t>();
    std::vector<int64_t> handles(flat.data(), flat.data() + flat.size());
    if (handles.empty()) return done();
    Waiter::instance().add(std::move(handles), /*release=*/false,
                           [done](absl::Status) { done(); });
  }
};

REGISTER_KERNEL_BUILDER(Name("SparkHvdWait").Device(tensorflow::DEVICE_CPU), WaitOp);

// Fails with FailedPrecondition(message) when `failed` is true. The collectives that run as
// tf.numpy_function nodes report a disagreement of the ranks through it: TensorFlow turns any
// Python exception of such a node into InvalidArgument or Unknown, while Horovod (and the
// allreduce kernel above) raise FailedPrecondition for it.
REGISTER_OP("SparkHvdCheck")
    .Input("failed: bool")
    .Input("message: string")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext*) { return absl::OkStatus(); });

class CheckOp : public OpKernel {
 public:
  explicit CheckOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* ctx) override {
    if (ctx->input(0).scalar<bool>()())
      ctx->SetStatus(absl::FailedPreconditionError(ctx->input(1).scalar<tensorflow::tstring>()()));
  }
};

REGISTER_KERNEL_BUILDER(Name("SparkHvdCheck").Device(tensorflow::DEVICE_CPU), CheckOp);

}  // namespace spark_hvd_tf
