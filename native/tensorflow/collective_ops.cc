// TensorFlow graph op for the allreduce family: one kernel that hands a list of tensors to the
// core (one negotiation, fused) and blocks until their results are in. Built separately from
// the core, against the installed TensorFlow (build.py), and loaded by spark_hvd.tensorflow when
// present; without it graphs fall back to tf.numpy_function nodes.
//
// Why a kernel instead of tf.numpy_function: the kernel runs without Python (no GIL, no NumPy
// conversions, about 1 ms less per step here), and it may reduce a gradient in place when no
// other op reads it (forward_input_or_allocate_output), which saves a pass over the result.
// It talks to the core only through its public C ABI (spark_hvd.h), so the core stays framework
// free.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "../common/types.h"
#include "../include/spark_hvd.h"

namespace spark_hvd_tf {

using tensorflow::DataType;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

REGISTER_OP("SparkHvdAllreduce")
    .Attr("T: list({uint8, int8, int16, int32, int64, half, bfloat16, float, double, bool})")
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
  using shvd::DataType;
  DataType d = DataType::kFloat32;
  switch (t) {
    case tensorflow::DT_UINT8: d = DataType::kUInt8; break;
    case tensorflow::DT_INT8: d = DataType::kInt8; break;
    case tensorflow::DT_INT16: d = DataType::kInt16; break;
    case tensorflow::DT_INT32: d = DataType::kInt32; break;
    case tensorflow::DT_INT64: d = DataType::kInt64; break;
    case tensorflow::DT_HALF: d = DataType::kFloat16; break;
    case tensorflow::DT_BFLOAT16: d = DataType::kBFloat16; break;
    case tensorflow::DT_FLOAT: d = DataType::kFloat32; break;
    case tensorflow::DT_DOUBLE: d = DataType::kFloat64; break;
    case tensorflow::DT_BOOL: d = DataType::kBool; break;
    default: return -1;  // excluded by the op's type constraint
  }
  return int32_t(d);
}

// The same exception classes the tf.numpy_function path gives (TensorFlow maps a Python
// ValueError to InvalidArgument and other exceptions to Unknown), so both paths raise alike.
absl::Status core_error() {
  const std::string msg = shvd_last_error();
  switch (shvd_last_error_kind()) {
    case SHVD_ERR_INVALID: return absl::InvalidArgumentError(msg);
    case SHVD_ERR_STATE: return absl::InvalidArgumentError(msg);
    case SHVD_ERR_UNSUPPORTED: return absl::UnimplementedError(msg);
    default: return absl::UnknownError("HorovodInternalError: " + msg);
  }
}

char empty_tensor_data[8];  // the core wants a valid address even for zero bytes

void* data_of(const Tensor& t) {
  return t.NumElements() ? const_cast<char*>(t.tensor_data().data()) : empty_tensor_data;
}

}  // namespace

class AllreduceOp : public OpKernel {
 public:
  explicit AllreduceOp(OpKernelConstruction* c) : OpKernel(c) {
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

  void Compute(OpKernelContext* ctx) override {
    const int n = ctx->num_inputs();
    std::vector<std::vector<int64_t>> shapes(n);
    std::vector<shvd_op> ops(n);
    for (int i = 0; i < n; ++i) {
      const Tensor& in = ctx->input(i);
      Tensor* out = nullptr;
      // In place when nothing else reads the input (typical for a gradient).
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({i}, i, in.shape(), &out));
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
    if (n == 0) return;
    std::vector<int64_t> handles(n);
    OP_REQUIRES(ctx, shvd_enqueue(ops.data(), n, handles.data()) == 0, core_error());
    // Blocks this executor thread, like the op it replaces; inputs and outputs stay referenced
    // by ctx until Compute returns, so the core's pointers remain valid.
    OP_REQUIRES(ctx, shvd_wait_release(handles.data(), n) == 0, core_error());
  }

 private:
  std::vector<std::string> names_;
  std::string group_;
  int64_t reduce_op_ = 0;
  double prescale_ = 1.0, postscale_ = 1.0;
  int64_t process_set_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("SparkHvdAllreduce").Device(tensorflow::DEVICE_CPU), AllreduceOp);

}  // namespace spark_hvd_tf
