// Adasum ("adaptive summation", Maleki et al. 2020, Horovod's op=Adasum): combines two
// gradients a and b of one tensor as
//
//   (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b
//
// (a coefficient stays 1 when its vector's squared norm is below 1e-8), which adds orthogonal
// gradients and averages parallel ones. Over n = 2^k members the pairs combine level by level
// as a binary tree: members that differ in bit l exchange their partial results and both
// compute the same combination, the lower member's vector as `a`. Each tensor of a fused
// buffer gets its own coefficients. Both members of a pair compute on identical inputs in the
// same order, so every member ends bitwise equal.
//
// Whole vectors are exchanged at every level (n log n traffic rather than the 2n of vector
// halving): simple and exact, and Adasum jobs are rarely bound by this step.
#include <cmath>
#include <cstring>

#include "collectives.h"
#include "../kernels/reduce_kernels.h"

namespace shvd {

namespace {

struct Float16 {
  using Raw = uint16_t;
  static double load(Raw v) { return half_to_float(v); }
  static Raw store(double v) { return float_to_half(float(v)); }
};
struct BFloat16 {
  using Raw = uint16_t;
  static double load(Raw v) { return bfloat16_to_float(v); }
  static Raw store(double v) { return float_to_bfloat16(float(v)); }
};
template <typename T>
struct Plain {
  using Raw = T;
  static double load(Raw v) { return v; }
  static Raw store(double v) { return Raw(v); }
};

// mine = combine(a, b) for one tensor of `count` elements, where `mine` is a or b.
template <typename Type>
void combine(typename Type::Raw* mine, const typename Type::Raw* theirs, size_t count,
             bool mine_is_a) {
  using Raw = typename Type::Raw;
  const Raw* a = mine_is_a ? mine : theirs;
  const Raw* b = mine_is_a ? theirs : mine;
  double dot = 0, a_norm = 0, b_norm = 0;
  for (size_t i = 0; i < count; ++i) {
    const double x = Type::load(a[i]), y = Type::load(b[i]);
    dot += x * y;
    a_norm += x * x;
    b_norm += y * y;
  }
  const double a_coeff = a_norm >= 1e-8 ? 1.0 - dot / a_norm * 0.5 : 1.0;
  const double b_coeff = b_norm >= 1e-8 ? 1.0 - dot / b_norm * 0.5 : 1.0;
  for (size_t i = 0; i < count; ++i)
    mine[i] = Type::store(a_coeff * Type::load(a[i]) + b_coeff * Type::load(b[i]));
}

template <typename Type>
void combine_tensors(void* mine, const void* theirs, const std::vector<size_t>& tensor_counts,
                     bool mine_is_a) {
  using Raw = typename Type::Raw;
  auto* m = static_cast<Raw*>(mine);
  const auto* t = static_cast<const Raw*>(theirs);
  for (size_t count : tensor_counts) {
    combine<Type>(m, t, count, mine_is_a);
    m += count;
    t += count;
  }
}

}  // namespace

bool adasum_supports(DataType dtype) {
  return dtype == DataType::kFloat16 || dtype == DataType::kBFloat16 ||
         dtype == DataType::kFloat32 || dtype == DataType::kFloat64;
}

void allreduce_adasum(const Communicator& comm, void* buf,
                      const std::vector<size_t>& tensor_counts, DataType dtype,
                      Scratch& scratch) {
  if (comm.size <= 1) return;
  if ((comm.size & (comm.size - 1)) != 0 || !adasum_supports(dtype))
    throw OpMismatchError("Adasum needs a power-of-two number of ranks and floating-point "
                          "tensors");  // checked at enqueue; a guard for direct callers
  size_t count = 0;
  for (size_t c : tensor_counts) count += c;
  const size_t bytes = count * dtype_size(dtype);
  void* theirs = scratch.get(bytes);
  for (int level = 1; level < comm.size; level <<= 1) {
    Link* peer = comm.link(comm.rank ^ level);
    send_recv(peer, buf, bytes, peer, theirs, bytes);
    const bool mine_is_a = (comm.rank & level) == 0;
    if (dtype == DataType::kFloat16)
      combine_tensors<Float16>(buf, theirs, tensor_counts, mine_is_a);
    else if (dtype == DataType::kBFloat16)
      combine_tensors<BFloat16>(buf, theirs, tensor_counts, mine_is_a);
    else if (dtype == DataType::kFloat32)
      combine_tensors<Plain<float>>(buf, theirs, tensor_counts, mine_is_a);
    else
      combine_tensors<Plain<double>>(buf, theirs, tensor_counts, mine_is_a);
  }
}

}  // namespace shvd
