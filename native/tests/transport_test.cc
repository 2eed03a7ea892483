// Standalone test of the transport layer, the reduction kernels and the crypto helpers.
// Multi-rank tests fork one process per rank on 127.0.0.1 (the listening endpoints are opened in
// the parent first, so every rank knows every port, as after a real rendezvous). Built and run
// by tests/test_native_transport.py; not part of the library.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "../kernels/reduce_kernels.h"
#include "../common/hmac.h"
#include "../transport/mesh.h"
#include "../transport/shm.h"
#include "../transport/tcp.h"
#include "harness.h"

using namespace shvd;
using namespace shvd_test;
using Clock = std::chrono::steady_clock;

namespace {

std::string g_job;  // unique per run: names shm segments, checked for leaks at the end

std::string hex(const Digest& d) {
  std::string s;
  char b[3];
  for (uint8_t x : d) std::snprintf(b, 3, "%02x", x), s += b;
  return s;
}

// ---- crypto -----------------------------------------------------------------------------------

void test_sha256() {
  CHECK(hex(sha256("abc", 3)) ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(hex(sha256("", 0)) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  const char* two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";  // 2 blocks
  CHECK(hex(sha256(two, strlen(two))) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  std::string million(1000000, 'a');
  CHECK(hex(sha256(million.data(), million.size())) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

void test_hmac() {
  // RFC 4231 test cases 1, 2 and 6 (key longer than the block size).
  CHECK(hex(hmac_sha256(std::string(20, '\x0b'), "Hi There", 8)) ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  const char* m2 = "what do ya want for nothing?";
  CHECK(hex(hmac_sha256("Jefe", m2, strlen(m2))) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  const char* m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
  CHECK(hex(hmac_sha256(std::string(131, '\xaa'), m6, strlen(m6))) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  Digest a = sha256("x", 1), b = a;
  CHECK(digest_equal(a, b));
  b[31] ^= 1;
  CHECK(!digest_equal(a, b));
  uint8_t r1[32], r2[32];
  random_bytes(r1, 32);
  random_bytes(r2, 32);
  CHECK(memcmp(r1, r2, 32) != 0);
}

// ---- half precision -----------------------------------------------------------------------------

// Independent definitions of the formats, straight from the spec, in double.
double ref_half_value(uint16_t h) {
  int e = (h >> 10) & 31, m = h & 1023;
  double v = e == 0    ? std::ldexp(m, -24)
             : e == 31 ? (m ? NAN : INFINITY)
                       : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -v : v;
}
double ref_bf16_value(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Nearest representable code (ties to even) by binary search over the positive codes.
uint16_t ref_narrow(float f, double (*value)(uint16_t), uint16_t max_finite, uint16_t inf) {
  if (std::isnan(f)) return 0xffff;  // caller checks NaN-ness only
  uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double a = std::fabs(static_cast<double>(f));
  double top = value(max_finite), half_ulp = (top - value(max_finite - 1)) / 2;
  if (a >= top + half_ulp) return sign | inf;
  uint16_t lo = 0, hi = max_finite;  // largest code with value <= a
  while (lo < hi) {
    uint16_t mid = static_cast<uint16_t>((lo + hi + 1) / 2);
    if (value(mid) <= a) lo = mid; else hi = mid - 1;
  }
  if (lo == max_finite) return sign | lo;
  double dl = a - value(lo), dh = value(lo + 1) - a;
  uint16_t r = dl < dh ? lo : dh < dl ? lo + 1 : ((lo & 1) ? lo + 1 : lo);
  return sign | r;
}

void test_half_conversions() {
  for (uint32_t h = 0; h < 65536; ++h) {  // widening: every code, exactly
    double want = ref_half_value(static_cast<uint16_t>(h));
    float got = half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      CHECK(std::isnan(got) && std::isnan(half_to_float(float_to_half(got))));
    } else {
      CHECK(static_cast<double>(got) == want && std::signbit(got) == std::signbit(want));
      CHECK(float_to_half(got) == h);  // round trip
    }
    double bw = ref_bf16_value(static_cast<uint16_t>(h));
    if (!std::isnan(bw)) CHECK(float_to_bfloat16(bfloat16_to_float(h)) == h);
  }
  struct Known { float f; uint16_t h; };
  const Known known[] = {
      {1.0f, 0x3c00}, {-2.0f, 0xc000}, {65504.0f, 0x7bff}, {65519.0f, 0x7bff}, {65520.0f, 0x7c00},
      {1e6f, 0x7c00}, {-INFINITY, 0xfc00}, {0x1p-24f, 0x0001}, {0x1p-25f, 0x0000},
      {0x1.8p-25f, 0x0001}, {0x1.8p-24f, 0x0002}, {0x1p-14f, 0x0400}, {0x1.ffcp-15f, 0x0400},
      {1.0f + 0x1p-11f, 0x3c00}, {1.0f + 0x3p-11f, 0x3c02}, {-0.0f, 0x8000}, {0.1f, 0x2e66}};
  for (const Known& k : known) CHECK(float_to_half(k.f) == k.h);
  CHECK(std::isnan(half_to_float(float_to_half(NAN))));
  CHECK(float_to_bfloat16(1.0f) == 0x3f80 && float_to_bfloat16(1.0f + 0x1p-8f) == 0x3f80);
  CHECK(float_to_bfloat16(1.0f + 0x3p-8f) == 0x3f82 && float_to_bfloat16(-INFINITY) == 0xff80);
  CHECK(float_to_bfloat16(3.4e38f) == 0x7f80);  // above max bf16 + half ulp: inf
  CHECK(float_to_bfloat16(3.3895314e38f) == 0x7f7f);  // max finite bf16
  CHECK(std::isnan(bfloat16_to_float(float_to_bfloat16(NAN))));
  CHECK(float_to_bfloat16(0x1p-130f) == 0x0008);  // subnormal float -> subnormal bf16

  std::mt19937 rng(1234);
  for (int i = 0; i < 300000; ++i) {
    float f;
    if (i % 3 == 0) {
      uint32_t u = rng();
      memcpy(&f, &u, 4);
    } else if (i % 3 == 1) {
      f = std::ldexp(static_cast<float>(rng() % (1 << 24)), static_cast<int>(rng() % 45) - 50);
    } else {  // exact ties between two half codes
      uint16_t c = static_cast<uint16_t>(rng() % 0x7bff);
      f = static_cast<float>((ref_half_value(c) + ref_half_value(c + 1)) / 2);
    }
    uint16_t h = float_to_half(f), rh = ref_narrow(f, ref_half_value, 0x7bff, 0x7c00);
    uint16_t b = float_to_bfloat16(f), rb = ref_narrow(f, ref_bf16_value, 0x7f7f, 0x7f80);
    if (std::isnan(f)) {
      CHECK(std::isnan(half_to_float(h)) && std::isnan(bfloat16_to_float(b)));
    } else {
      if (h != rh) {
        throw Failure("float_to_half(" + std::to_string(f) + ") = " + std::to_string(h) +
                      ", want " + std::to_string(rh));
      }
      CHECK(b == rb);
    }
  }
}

// ---- reduction kernels --------------------------------------------------------------------------

const DataType kAllTypes[] = {DataType::kUInt8,   DataType::kInt8,     DataType::kInt16,
                              DataType::kInt32,   DataType::kInt64,    DataType::kFloat16,
                              DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64,
                              DataType::kBool,    DataType::kUInt16};
const ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAverage, ReduceOp::kMin, ReduceOp::kMax,
                            ReduceOp::kProduct};

template <class T>
T ref_op(ReduceOp op, T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    if (op == ReduceOp::kSum || op == ReduceOp::kAverage) return T(uint64_t(a) + uint64_t(b));
    if (op == ReduceOp::kProduct) return T(uint64_t(a) * uint64_t(b));
  } else {
    if (op == ReduceOp::kSum || op == ReduceOp::kAverage) return a + b;
    if (op == ReduceOp::kProduct) return a * b;
  }
  return op == ReduceOp::kMin ? std::min(a, b) : std::max(a, b);
}

template <class T>
void typed_ref(ReduceOp op, const uint8_t* a, const uint8_t* b, uint8_t* out) {
  T x, y;
  memcpy(&x, a, sizeof(T));
  memcpy(&y, b, sizeof(T));
  T r = ref_op(op, x, y);
  memcpy(out, &r, sizeof(T));
}

void ref_elem(DataType t, ReduceOp op, const uint8_t* a, const uint8_t* b, uint8_t* out) {
  uint16_t ha, hb, hr;
  switch (t) {
    case DataType::kUInt8: return typed_ref<uint8_t>(op, a, b, out);
    case DataType::kInt8: return typed_ref<int8_t>(op, a, b, out);
    case DataType::kInt16: return typed_ref<int16_t>(op, a, b, out);
    case DataType::kUInt16: return typed_ref<uint16_t>(op, a, b, out);
    case DataType::kInt32: return typed_ref<int32_t>(op, a, b, out);
    case DataType::kInt64: return typed_ref<int64_t>(op, a, b, out);
    case DataType::kFloat32: return typed_ref<float>(op, a, b, out);
    case DataType::kFloat64: return typed_ref<double>(op, a, b, out);
    case DataType::kFloat16:
    case DataType::kBFloat16: {
      bool h = t == DataType::kFloat16;
      memcpy(&ha, a, 2);
      memcpy(&hb, b, 2);
      float x = h ? half_to_float(ha) : bfloat16_to_float(ha);
      float y = h ? half_to_float(hb) : bfloat16_to_float(hb);
      float r = ref_op(op, x, y);
      hr = h ? float_to_half(r) : float_to_bfloat16(r);
      memcpy(out, &hr, 2);
      return;
    }
    case DataType::kBool: {
      bool x = *a != 0, y = *b != 0;
      bool any = op == ReduceOp::kSum || op == ReduceOp::kAverage || op == ReduceOp::kMax;
      *out = any ? (x || y) : (x && y);
      return;
    }
  }
}

void random_elem(DataType t, std::mt19937& rng, uint8_t* out) {
  auto put = [&](auto v) { memcpy(out, &v, sizeof(v)); };
  float f = std::ldexp(static_cast<float>(static_cast<int>(rng() % 20001) - 10000), -6);
  switch (t) {
    case DataType::kFloat16: put(float_to_half(rng() % 50 == 0 ? f * 0x1p-20f : f)); break;
    case DataType::kBFloat16: put(float_to_bfloat16(f)); break;
    case DataType::kFloat32: put(f * 1.37f); break;
    case DataType::kFloat64: put(static_cast<double>(f) * 1.37); break;
    case DataType::kBool: put(static_cast<uint8_t>(rng() % 3)); break;  // 2: non-canonical true
    default: {
      uint64_t v = (uint64_t(rng()) << 32) | rng();
      if (rng() % 2) v = static_cast<uint64_t>(static_cast<int64_t>(rng() % 200) - 100);
      memcpy(out, &v, dtype_size(t));  // little endian: low bytes
    }
  }
}

template <class T>
void typed_scale(uint8_t* p, double k) {
  T v;
  memcpy(&v, p, sizeof(T));
  v = static_cast<T>(static_cast<double>(v) * k);
  memcpy(p, &v, sizeof(T));
}

template <class T>
void float_scale(uint8_t* p, double k) {
  T v;
  memcpy(&v, p, sizeof(T));
  v = v * static_cast<T>(k);
  memcpy(p, &v, sizeof(T));
}

// scale_buffer's contract (Horovod's): ints in double, truncated toward zero; float32 in float
// by the factor rounded to float; float64 in double; halves in float.
void ref_scale(DataType t, uint8_t* p, double k) {
  uint16_t h;
  switch (t) {
    case DataType::kUInt8: return typed_scale<uint8_t>(p, k);
    case DataType::kInt8: return typed_scale<int8_t>(p, k);
    case DataType::kInt16: return typed_scale<int16_t>(p, k);
    case DataType::kUInt16: return typed_scale<uint16_t>(p, k);
    case DataType::kInt32: return typed_scale<int32_t>(p, k);
    case DataType::kInt64: return typed_scale<int64_t>(p, k);
    case DataType::kFloat32: return float_scale<float>(p, k);
    case DataType::kFloat64: return float_scale<double>(p, k);
    case DataType::kFloat16:
      memcpy(&h, p, 2);
      h = float_to_half(half_to_float(h) * static_cast<float>(k));
      memcpy(p, &h, 2);
      return;
    case DataType::kBFloat16:
      memcpy(&h, p, 2);
      h = float_to_bfloat16(bfloat16_to_float(h) * static_cast<float>(k));
      memcpy(p, &h, 2);
      return;
    case DataType::kBool: return;
  }
}

void test_kernels() {
  std::mt19937 rng(99);
  for (DataType t : kAllTypes) {
    const size_t es = dtype_size(t);
    for (size_t n : {1, 3, 17, 255, 256, 257, 1000, 4099}) {
      std::vector<uint8_t> a(n * es), b(n * es), want(n * es);
      for (size_t i = 0; i < n; ++i) {
        random_elem(t, rng, &a[i * es]);
        random_elem(t, rng, &b[i * es]);
      }
      for (ReduceOp op : kAllOps) {
        for (size_t i = 0; i < n; ++i) ref_elem(t, op, &a[i * es], &b[i * es], &want[i * es]);
        std::string what = std::string(dtype_name(t)) + " " + reduce_op_name(op) +
                           " n=" + std::to_string(n);
        std::vector<uint8_t> d = a;
        reduce_into(d.data(), b.data(), n, t, op);
        if (d != want) throw Failure("reduce_into " + what);
        std::vector<uint8_t> o(n * es);
        reduce_out(o.data(), a.data(), b.data(), n, t, op);
        if (o != want) throw Failure("reduce_out " + what);
        std::vector<uint8_t> aa = a, bb = b;
        reduce_out(aa.data(), aa.data(), b.data(), n, t, op);  // dst aliases a
        reduce_out(bb.data(), a.data(), bb.data(), n, t, op);  // dst aliases b
        if (aa != want || bb != want) throw Failure("reduce_out aliased " + what);
      }
      const bool is_float = t == DataType::kFloat16 || t == DataType::kBFloat16 ||
                            t == DataType::kFloat32 || t == DataType::kFloat64;
      for (double k : {0.5, 1.0 / 3.0, -2.0}) {
        if (k < 0 && !is_float) continue;  // keep integer results in range (no UB to compare)
        std::vector<uint8_t> s = a, w = a;
        scale_buffer(s.data(), n, t, k);
        for (size_t i = 0; i < n; ++i) ref_scale(t, &w[i * es], k);
        if (s != w) throw Failure(std::string("scale_buffer ") + dtype_name(t));
      }
      // reduce_out_scaled == reduce_out, then scale_buffer, then a copy, bit for bit; the copy
      // may alias either input (in-place allreduce).
      for (ReduceOp op : kAllOps) {
        for (double k : {1.0, 0.5, 1.0 / 3.0}) {
          std::vector<uint8_t> want_scaled(n * es);
          reduce_out(want_scaled.data(), a.data(), b.data(), n, t, op);
          scale_buffer(want_scaled.data(), n, t, k);
          const std::string what = std::string(dtype_name(t)) + " " + reduce_op_name(op) +
                                   " k=" + std::to_string(k) + " n=" + std::to_string(n);
          std::vector<uint8_t> dst(n * es), copy(n * es), dst2(n * es), dst3(n * es);
          std::vector<uint8_t> aa = a, bb = b;
          reduce_out_scaled(dst.data(), copy.data(), a.data(), b.data(), n, t, op, k);
          if (dst != want_scaled || copy != want_scaled)
            throw Failure("reduce_out_scaled " + what);
          reduce_out_scaled(dst2.data(), aa.data(), aa.data(), b.data(), n, t, op, k);
          reduce_out_scaled(dst3.data(), bb.data(), a.data(), bb.data(), n, t, op, k);
          std::vector<uint8_t> partial = a, copy2(n * es);  // dst aliases a (3+ members)
          reduce_out_scaled(partial.data(), copy2.data(), partial.data(), b.data(), n, t, op, k);
          if (aa != want_scaled || bb != want_scaled || dst2 != want_scaled ||
              dst3 != want_scaled || partial != want_scaled || copy2 != want_scaled)
            throw Failure("reduce_out_scaled aliased " + what);
        }
      }
    }
  }
  // Float32 scales in float by the factor rounded to float, fused with the sum or not: the bits
  // must equal that product's for any input, subnormal, huge, inf and NaN included.
  {
    const size_t n = 1 << 16;
    std::vector<float> a(n), b(n), out(n), copy(n), scaled(n);
    for (size_t i = 0; i < n; ++i) {
      uint32_t ua = rng(), ub = i % 3 ? uint32_t(rng()) : ua ^ (rng() & 0xff);  // cancellation
      if (i % 5 == 0) ua &= 0x80ffffffu;  // tiny exponents: subnormal sums and products
      memcpy(&a[i], &ua, 4);
      memcpy(&b[i], &ub, 4);
    }
    auto same = [](float x, float y) {
      return (std::isnan(x) && std::isnan(y)) || !memcmp(&x, &y, 4);
    };
    for (double k : {0.5, 0.25, 0x1p-10, 0x1p-126, 0x1p-127, 0x1p127, 2.0, 0.75, 1.0 / 3,
                     0.1234567891234}) {
      reduce_out_scaled(out.data(), copy.data(), a.data(), b.data(), n, DataType::kFloat32,
                        ReduceOp::kAverage, k);
      scaled = a;
      scale_buffer(scaled.data(), n, DataType::kFloat32, k);
      for (size_t i = 0; i < n; ++i) {
        const float sum = (a[i] + b[i]) * static_cast<float>(k);
        const float one = a[i] * static_cast<float>(k);
        if (!same(out[i], sum) || !same(copy[i], sum) || !same(scaled[i], one))
          throw Failure("float32 scaling by " + std::to_string(k) + " differs from the float "
                        "product at " + std::to_string(i));
      }
    }
  }
  bool threw = false;
  try {
    float x = 0;
    reduce_into(&x, &x, 1, DataType::kFloat32, ReduceOp::kAdasum);
  } catch (const OpMismatchError&) {
    threw = true;
  }
  CHECK(threw);
}

void bench_kernels() {
  const size_t n = 8 << 20;
  std::vector<float> a(n, 1.0f), b(n, 2.0f);
  std::vector<uint16_t> ha(n, 0x3c00), hb(n, 0x4000);
  auto rate = [&](void* d, const void* s, DataType t) {  // Gelem/s, best of 5
    double best = 1e9;
    for (int i = 0; i < 6; ++i) {
      auto t0 = Clock::now();
      reduce_into(d, s, n, t, ReduceOp::kSum);
      if (i > 0) best = std::min(best, seconds_since(t0));
    }
    return n / best / 1e9;
  };
  double f32 = rate(a.data(), b.data(), DataType::kFloat32);
  double f16 = rate(ha.data(), hb.data(), DataType::kFloat16);
  double b16 = rate(ha.data(), hb.data(), DataType::kBFloat16);
  std::printf("kernel: sum of 8M elements: float32 %.2f, float16 %.2f, bfloat16 %.2f Gelem/s\n",
              f32, f16, b16);
}

}  // namespace

// ---- multi-process harness ----------------------------------------------------------------------
namespace {

const char* kSecret = "correct horse battery staple";

struct World {
  int n;
  std::vector<std::string> host_ids;
  bool shm = true;
  std::string secret = kSecret;
  double timeout = 20.0;
  double peer_timeout = 30.0;
  int64_t shm_pipe_bytes = 0;
  std::vector<std::unique_ptr<Endpoint>> eps;
  std::vector<int> ports;  // kept: a child closes the other ranks' endpoints

  World(int n_, std::vector<std::string> hosts, bool use_shm, int64_t tcp_buffer_bytes = -1)
      : n(n_), host_ids(std::move(hosts)), shm(use_shm) {
    for (int r = 0; r < n; ++r) {
      eps.emplace_back(new Endpoint("127.0.0.1", tcp_buffer_bytes));
      ports.push_back(eps.back()->port());
    }
  }
  MeshOptions options(int rank) const {
    MeshOptions o;
    o.rank = rank;
    o.size = n;
    for (int r = 0; r < n; ++r) o.peers.push_back({"127.0.0.1", ports[r], host_ids[r]});
    o.secret = secret;
    o.job_id = g_job;
    o.use_shared_memory = shm;
    o.timeout_seconds = timeout;
    o.shm_pipe_bytes = shm_pipe_bytes;
    o.peer_timeout_seconds = peer_timeout;
    return o;
  }
  Mesh build(int rank) { return build_mesh(*eps[rank], options(rank)); }
};

// Forks one child per rank running body(rank); a child passes by returning. `parent` runs in
// the parent meanwhile; it may kill children, then set pids[r] = 0 once it reaped one itself,
// or pids[r] = -pid to have it reaped only after every other rank finished (a zombie until
// then). Returns each child's wait status.
std::vector<int> fork_ranks(World& w, const std::function<void(int)>& body,
                            const std::function<void(std::vector<pid_t>&)>& parent = nullptr,
                            double limit_s = 60) {
  std::vector<pid_t> pids;
  std::fflush(stdout);
  std::fflush(stderr);
  for (int r = 0; r < w.n; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // a killed test run leaves no ranks behind
      for (int q = 0; q < w.n; ++q) if (q != r) w.eps[q].reset();  // only my listening socket
      int code = 0;
      try {
        body(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        code = 1;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  if (parent) parent(pids);
  std::vector<int> status(w.n, -1);
  auto t0 = Clock::now();
  for (int left = w.n; left > 0;) {
    int others = 0;
    for (int r = 0; r < w.n; ++r) others += status[r] == -1 && pids[r] > 0;
    for (int r = 0; r < w.n; ++r) {
      if (status[r] != -1) continue;
      if (pids[r] == 0) {
        status[r] = 0, --left;
        continue;
      }
      if (pids[r] < 0 && others > 0) continue;
      int st;
      if (waitpid(std::abs(pids[r]), &st, WNOHANG) == std::abs(pids[r])) status[r] = st, --left;
    }
    if (left > 0 && seconds_since(t0) > limit_s) {
      for (int r = 0; r < w.n; ++r) {
        if (status[r] != -1 || pids[r] == 0) continue;
        kill(std::abs(pids[r]), SIGKILL);
        waitpid(std::abs(pids[r]), &status[r], 0);
      }
      throw Failure("ranks did not finish within " + std::to_string(limit_s) + " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return status;
}

void expect_all_ok(const std::vector<int>& status) {
  for (size_t r = 0; r < status.size(); ++r) {
    if (!(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0)) {
      throw Failure("rank " + std::to_string(r) + " failed (wait status " +
                    std::to_string(status[r]) + ")");
    }
  }
}

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
void fill(uint8_t* p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i += 8) {
    uint64_t v = mix(seed * 1000003 + i);
    memcpy(p + i, &v, std::min<size_t>(8, n - i));
  }
}
bool verify(const uint8_t* p, size_t n, uint64_t seed) {
  uint8_t chunk[4096];
  for (size_t off = 0; off < n; off += sizeof(chunk)) {
    size_t m = std::min(sizeof(chunk), n - off);
    for (size_t i = 0; i < m; i += 8) {
      uint64_t v = mix(seed * 1000003 + off + i);
      memcpy(chunk + i, &v, std::min<size_t>(8, m - i));
    }
    if (memcmp(p + off, chunk, m) != 0) return false;
  }
  return true;
}

// Each rank sends to its right neighbour while receiving from its left, for many sizes.
void ring_exchange(World& w, bool expect_shm_all, bool print_rate, const char* label) {
  auto body = [&](int r) {
    Mesh m = w.build(r);
    int right = (r + 1) % w.n, left = (r + w.n - 1) % w.n;
    for (int q = 0; q < w.n; ++q) {
      if (q == r) { CHECK(!m.data[q]); continue; }
      CHECK(m.data[q]);
      bool same = w.shm && w.host_ids[q] == w.host_ids[r];
      CHECK(m.data[q]->is_shared_memory() == same);
      CHECK(m.data[q]->peer_rank() == q);
    }
    if (expect_shm_all) CHECK(m.data[right]->is_shared_memory());
    // Control links: every worker to rank 0, over TCP.
    if (r == 0) {
      for (int q = 1; q < w.n; ++q) {
        uint32_t v = 0;
        m.control[q]->recv(&v, 4);
        CHECK(v == 1000u + q && !m.control[q]->is_shared_memory());
      }
    } else {
      uint32_t v = 1000u + r;
      CHECK(m.control[0] && !m.control[0]->is_shared_memory());
      m.control[0]->send(&v, 4);
    }
    const size_t max = 64u << 20;
    std::vector<uint8_t> sbuf(max), rbuf(max);
    for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(4096), size_t(65537), size_t(1) << 20,
                     (size_t(4) << 20) + 1, size_t(16) << 20, max}) {
      fill(sbuf.data(), n, r * 7919 + n);
      send_recv(m.data[right].get(), sbuf.data(), n, m.data[left].get(), rbuf.data(), n);
      if (!verify(rbuf.data(), n, left * 7919 + n)) {
        throw Failure("corrupt data, size " + std::to_string(n));
      }
    }
    // Blocking send/recv in a chain 0 -> 1 -> ... (exercises Link::send/recv).
    uint64_t token = 0;
    if (r > 0) m.data[left]->recv(&token, 8);
    token += r;
    if (r < w.n - 1) m.data[right]->send(&token, 8);
    if (r == w.n - 1) CHECK(token == uint64_t(w.n) * (w.n - 1) / 2);
    if (print_rate) {
      const size_t n = 16u << 20;
      // Best and median of several rounds: the median shows what a loaded machine gives.
      std::vector<double> secs;
      send_recv(m.data[right].get(), sbuf.data(), n, m.data[left].get(), rbuf.data(), n);
      for (int i = 0; i < 9; ++i) {
        auto t0 = Clock::now();
        send_recv(m.data[right].get(), sbuf.data(), n, m.data[left].get(), rbuf.data(), n);
        secs.push_back(seconds_since(t0));
      }
      std::sort(secs.begin(), secs.end());
      if (r == 0) {
        std::printf("throughput: %s, 16 MiB send_recv: best %.2f GB/s, median %.2f GB/s "
                    "per rank per direction\n", label, n / secs.front() / 1e9, n / secs[4] / 1e9);
      }
      if (w.n == 2) {  // small-message latency: 8-byte ping-pong
        const int rounds = 2000;
        uint64_t v = 0;
        Link* peer = m.data[1 - r].get();
        auto t1 = Clock::now();
        for (int i = 0; i < rounds; ++i) {
          if (r == 0) peer->send(&v, 8), peer->recv(&v, 8);
          else peer->recv(&v, 8), ++v, peer->send(&v, 8);
        }
        if (r == 0) {
          CHECK(v == rounds);
          std::printf("latency: %s, 8-byte round trip: %.1f us\n", label,
                      seconds_since(t1) / rounds * 1e6);
        }
      }
    }
  };
  expect_all_ok(fork_ranks(w, body));
}

void test_rogue_clients() {
  World w(3, {"h", "h", "h"}, true);
  const int target_port = w.eps[0]->port();
  auto connect_to = [&] {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(target_port);
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) _exit(4);
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
  };
  pid_t rogue = -1;
  auto body = [&](int r) {
    // Rank 2 comes late so rank 0 is still accepting when the strangers knock.
    if (r == 2) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto t0 = Clock::now();
    Mesh m = w.build(r);
    if (r == 0) CHECK(seconds_since(t0) < 1.5);  // a stalled stranger did not hold us up
    uint8_t x = static_cast<uint8_t>(r), y = 0;
    int right = (r + 1) % 3, left = (r + 2) % 3;
    send_recv(m.data[right].get(), &x, 1, m.data[left].get(), &y, 1);
    CHECK(y == left);
  };
  auto parent = [&](std::vector<pid_t>&) {
    rogue = fork();
    if (rogue != 0) return;
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    // A client that knows the protocol but not the secret, one that stalls, one that babbles.
    int good_format = connect_to(), stalled = connect_to(), garbage = connect_to();
    uint8_t nonce[32], hello[73] = {};
    bool ok = recv(good_format, nonce, 32, MSG_WAITALL) == 32;
    hello[0] = 1;  // claims to be rank 1, data purpose, with an HMAC under the wrong secret
    hello[8] = 1;
    Digest mac = hmac_sha256("wrong secret", hello, 41);
    memcpy(hello + 41, mac.data(), 32);
    ok = ok && send(good_format, hello, 73, MSG_NOSIGNAL) == 73;
    uint8_t reply[32];
    ok = ok && recv(good_format, reply, 32, MSG_WAITALL) <= 0;  // closed, no reply
    std::vector<uint8_t> junk(1000, 0x5a);
    send(garbage, junk.data(), junk.size(), MSG_NOSIGNAL);
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    close(stalled);
    close(garbage);
    close(good_format);
    _exit(ok ? 0 : 3);
  };
  expect_all_ok(fork_ranks(w, body, parent));
  int st = 0;
  waitpid(rogue, &st, 0);
  if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
    throw Failure("the wrong-secret client was not rejected (status " + std::to_string(st) + ")");
  }
}

void test_wrong_secret_rank() {
  World w(2, {"a", "b"}, false);
  w.timeout = 2.0;
  auto body = [&](int r) {
    MeshOptions o = w.options(r);
    if (r == 1) o.secret = "not the job secret";
    try {
      build_mesh(*w.eps[r], o);
    } catch (const PeerLostError& e) {
      std::string msg = e.what();
      CHECK(msg.find("timed out after 2 s waiting for ranks [") != std::string::npos);
      CHECK(msg.find(r == 0 ? "[1]" : "[0]") != std::string::npos);
      return;
    }
    throw Failure("mesh built with a wrong secret");
  };
  expect_all_ok(fork_ranks(w, body, nullptr, 20));
}

// Rank 2 is SIGKILLed once every mesh is up; ranks 0 and 1, blocked receiving from it, must get
// PeerLostError quickly. With `reap` false the victim stays a zombie (its parent has not waited
// yet), which the shared-memory liveness check must still see as dead.
void test_peer_killed(bool shm, bool reap) {
  using Hosts = std::vector<std::string>;
  World w(3, shm ? Hosts{"h", "h", "h"} : Hosts{"a", "b", "c"}, shm);
  int ready[2];
  CHECK(pipe(ready) == 0);
  auto body = [&](int r) {
    Mesh m = w.build(r);
    CHECK(m.data[(r + 1) % 3]->is_shared_memory() == shm);
    char c = 'r';
    CHECK(write(ready[1], &c, 1) == 1);
    if (r == 2) {
      for (;;) pause();
    }
    std::vector<uint8_t> buf(1 << 20);
    auto t0 = Clock::now();
    try {
      m.data[2]->recv(buf.data(), buf.size());
    } catch (const PeerLostError& e) {
      CHECK(seconds_since(t0) < 5.0);
      CHECK(std::string(e.what()).find("rank 2") != std::string::npos);
      return;
    }
    throw Failure("recv from a killed rank returned");
  };
  auto parent = [&](std::vector<pid_t>& pids) {
    char c;
    for (int i = 0; i < 3; ++i) {
      pollfd p{ready[0], POLLIN, 0};
      if (poll(&p, 1, 30000) != 1 || read(ready[0], &c, 1) != 1) return;  // ranks failed
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let them block in recv
    kill(pids[2], SIGKILL);
    if (reap) {
      int st;
      waitpid(pids[2], &st, 0);
      pids[2] = 0;
    } else {
      pids[2] = -pids[2];  // stays a zombie while ranks 0 and 1 wait on it
    }
  };
  std::vector<int> st = fork_ranks(w, body, parent, 30);
  close(ready[0]);
  close(ready[1]);
  st.resize(2);
  expect_all_ok(st);
}

// A peer that sends its last bytes and exits normally is read to the end, then reported.
void test_peer_closed_shm() {
  World w(2, {"h", "h"}, true);
  auto body = [&](int r) {
    Mesh m = w.build(r);
    CHECK(m.data[1 - r]->is_shared_memory());
    std::vector<uint8_t> buf(100000);
    if (r == 1) {
      fill(buf.data(), buf.size(), 5);
      m.data[0]->send(buf.data(), buf.size());
      return;  // mesh destroyed: the pipe is marked closed
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    m.data[1]->recv(buf.data(), buf.size());
    CHECK(verify(buf.data(), buf.size(), 5));
    try {
      m.data[1]->recv(buf.data(), 1);
    } catch (const PeerLostError& e) {
      CHECK(std::string(e.what()).find("rank 1") != std::string::npos);
      return;
    }
    throw Failure("recv after the peer closed returned");
  };
  expect_all_ok(fork_ranks(w, body));
}

// When the creator cannot allocate the segment (here: a file size limit; in practice a full
// /dev/shm), the pair falls back to TCP instead of failing the job.
void test_shm_fallback() {
  World w(2, {"h", "h"}, true);
  auto body = [&](int r) {
    if (r == 0) {
      signal(SIGXFSZ, SIG_IGN);
      rlimit lim{1 << 20, 1 << 20};
      CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0);
    }
    Mesh m = w.build(r);
    CHECK(!m.data[1 - r]->is_shared_memory());
    uint64_t mine = 40 + r, theirs = 0;
    send_recv(m.data[1 - r].get(), &mine, 8, m.data[1 - r].get(), &theirs, 8);
    CHECK(theirs == uint64_t(41 - r));
  };
  expect_all_ok(fork_ranks(w, body));
}

void test_mesh_timeout() {
  World w(2, {"a", "b"}, false);  // rank 1's endpoint listens but nobody runs it
  w.timeout = 1.0;
  auto t0 = Clock::now();
  try {
    w.build(0);
  } catch (const PeerLostError& e) {
    double s = seconds_since(t0);
    CHECK(s >= 0.9 && s < 3.0);
    const char* want = "timed out after 1 s waiting for ranks [1] to connect";
    CHECK(std::string(e.what()).find(want) != std::string::npos);
    return;
  }
  throw Failure("build_mesh did not time out");
}

// Raising the global abort flag releases a rank blocked on a healthy link (threads, one process).
void test_abort(bool shm) {
  World w(2, {"h", "h"}, shm);
  Mesh meshes[2];
  std::thread t1([&] { meshes[1] = w.build(1); });
  meshes[0] = w.build(0);
  t1.join();
  CHECK(meshes[0].data[1]->is_shared_memory() == shm);
  std::string error;
  auto t0 = Clock::now();
  std::thread blocked([&] {
    uint8_t b[16];
    try {
      meshes[0].data[1]->recv(b, sizeof(b));
    } catch (const PeerLostError& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  global_abort().raise("job aborted by test");
  blocked.join();
  global_abort().reset();
  CHECK(error == "job aborted by test");
  CHECK(seconds_since(t0) < 1.0);
}

int socket_option(int fd, int level, int which) {
  int value = 0;
  socklen_t len = sizeof(value);
  CHECK(::getsockopt(fd, level, which, &value, &len) == 0);
  return value;
}

int socket_buffer(int fd, int which) { return socket_option(fd, SOL_SOCKET, which); }

// Lost hosts: the peer timeout reaches every TCP link, data and control, connected and
// accepted, as TCP_USER_TIMEOUT and keepalive probes after half of it (a shared-memory pipe has
// no socket; its peer is watched through its pid and closed flag).
void test_peer_timeout_settings() {
  World w(3, {"a", "b", "b"}, true);
  w.peer_timeout = 7;
  expect_all_ok(fork_ranks(w, [&](int r) {
    Mesh m = w.build(r);
    std::vector<Link*> tcp;
    for (int q = 0; q < w.n; ++q) {
      if (m.data[q] && !m.data[q]->is_shared_memory()) tcp.push_back(m.data[q].get());
      if (m.control[q]) tcp.push_back(m.control[q].get());
    }
    CHECK(tcp.size() == (r == 0 ? 4u : 2u));
    for (Link* l : tcp) {
      CHECK(socket_option(l->fd(), IPPROTO_TCP, TCP_USER_TIMEOUT) == 7000);
      CHECK(socket_option(l->fd(), SOL_SOCKET, SO_KEEPALIVE) == 1);
      CHECK(socket_option(l->fd(), IPPROTO_TCP, TCP_KEEPIDLE) == 3);
      CHECK(socket_option(l->fd(), IPPROTO_TCP, TCP_KEEPINTVL) == 1);
    }
  }));
  World off(2, {"a", "b"}, true);
  off.peer_timeout = 0;  // the kernel's defaults
  expect_all_ok(fork_ranks(off, [&](int r) {
    Mesh m = off.build(r);
    CHECK(socket_option(m.data[1 - r]->fd(), IPPROTO_TCP, TCP_USER_TIMEOUT) == 0);
    CHECK(socket_option(m.data[1 - r]->fd(), SOL_SOCKET, SO_KEEPALIVE) == 0);
  }));
}

// Errors name ranks with their hosts; a wait in which no byte moves for the no-progress bound
// fails naming the peer, on a TCP link, a shared-memory pipe and in a NoProgressWatch.
void test_no_progress_bound() {
  set_rank_hosts({"a", "b", "b"});
  CHECK(describe_rank(0) == "rank 0 on a");
  CHECK(describe_ranks({1, 2}) == "ranks 1, 2 on b");
  CHECK(describe_ranks({0, 2}) == "ranks 0 on a; 2 on b");
  CHECK(describe_rank(5) == "rank 5");
  set_no_progress_timeout(0.2);
  for (bool shm : {false, true}) {
    World w(2, {"a", shm ? "a" : "b"}, shm);
    expect_all_ok(fork_ranks(w, [&](int r) {
      Mesh m = w.build(r);
      if (r == 1) {  // alive, connected, and silent for longer than the bound
        std::this_thread::sleep_for(std::chrono::milliseconds(1500));
        return;
      }
      uint8_t b[16];
      auto t0 = Clock::now();
      std::string error;
      try {
        m.data[1]->recv(b, sizeof(b));
      } catch (const PeerLostError& e) {
        error = e.what();
      }
      CHECK(error.find("no data moved to or from rank 1 on b for 0.2 s") == 0);
      CHECK(seconds_since(t0) >= 0.2 && seconds_since(t0) < 1.2);
    }));
  }
  NoProgressWatch watch;
  watch.check({2});  // within the bound: nothing
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  std::string error;
  try {
    watch.check({2});
  } catch (const PeerLostError& e) {
    error = e.what();
  }
  CHECK(error.find("no data moved to or from rank 2 on b") == 0);
  set_no_progress_timeout(0);
  set_rank_hosts({});
}

// The transport settings given through the API reach the links: shm_pipe_bytes sizes the pipes
// (both sides), tcp_buffer_bytes the listening socket, the sockets it accepts and the ones a
// rank connects. Linux reports twice the requested buffer size (its bookkeeping share);
// 40000 bytes is below the default net.core.{r,w}mem_max, so the kernel does not cap it.
void test_transport_settings() {
  CHECK(shm_pipe_capacity(0) == kDefaultShmPipeBytes);
  CHECK(shm_pipe_capacity(-5) == kDefaultShmPipeBytes);
  CHECK(shm_pipe_capacity(100) == 64u << 10);
  CHECK(shm_pipe_capacity(100000) == 25 * 4096);
  CHECK(shm_pipe_capacity(int64_t(1) << 40) == size_t(1) << 30);
  CHECK(tcp_buffer_bytes(-1) == kDefaultTcpBufferBytes);
  CHECK(tcp_buffer_bytes(0) == 0);
  CHECK(tcp_buffer_bytes(int64_t(1) << 40) == kMaxTcpBufferBytes);

  World pipes(2, {"h", "h"}, true);
  pipes.shm_pipe_bytes = 100000;
  expect_all_ok(fork_ranks(pipes, [&](int r) {
    Mesh m = pipes.build(r);
    auto* pipe = dynamic_cast<SharedMemoryPipe*>(m.data[1 - r].get());
    CHECK(pipe && pipe->capacity() == 25 * 4096);
  }));

  const int requested = 40000;
  World tcp(3, {"a", "b", "c"}, true, requested);
  for (auto& ep : tcp.eps) {
    CHECK(ep->tcp_buffer_bytes() == requested);
    CHECK(socket_buffer(ep->fd(), SO_RCVBUF) == 2 * requested);
  }
  expect_all_ok(fork_ranks(tcp, [&](int r) {
    Mesh m = tcp.build(r);
    for (int q = 0; q < tcp.n; ++q) {
      if (q == r) continue;
      // Lower ranks were connected to, higher ranks connected: both kinds of socket.
      CHECK(socket_buffer(m.data[q]->fd(), SO_RCVBUF) == 2 * requested);
      CHECK(socket_buffer(m.data[q]->fd(), SO_SNDBUF) == 2 * requested);
    }
  }));
  Endpoint autotuned("127.0.0.1", 0);
  CHECK(autotuned.tcp_buffer_bytes() == 0);
  CHECK(socket_buffer(autotuned.fd(), SO_RCVBUF) != 2 * requested);
}

void test_no_leftover_segments() {
  DIR* d = opendir("/dev/shm");
  if (!d) return;
  std::string prefix = "shvd-" + g_job + "-";
  int found = 0;
  while (dirent* e = readdir(d)) found += strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0;
  closedir(d);
  CHECK(found == 0);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) g_filter = argv[1];
  signal(SIGPIPE, SIG_IGN);
  g_job = "test" + std::to_string(getpid());
  run_test("sha256 vectors", test_sha256);
  run_test("hmac-sha256 RFC 4231 vectors", test_hmac);
  run_test("float16/bfloat16 conversions", test_half_conversions);
  run_test("reduce kernels: every dtype x op", test_kernels);
  run_test("kernel throughput", bench_kernels);
  run_test("transport settings reach the links", test_transport_settings);
  run_test("peer timeout reaches every tcp link", test_peer_timeout_settings);
  run_test("no-progress bound names the silent peer", test_no_progress_bound);
  run_test("ring exchange, 2 ranks, shared memory", [] {
    World w(2, {"h", "h"}, true);
    ring_exchange(w, true, true, "shm pipe, 2 ranks");
  });
  run_test("ring exchange, 3 ranks, shared memory", [] {
    World w(3, {"h", "h", "h"}, true);
    ring_exchange(w, true, true, "shm pipe ring, 3 ranks");
  });
  run_test("ring exchange, 2 ranks, tcp", [] {
    World w(2, {"a", "b"}, true);
    ring_exchange(w, false, true, "tcp, 2 ranks");
  });
  run_test("ring exchange, 3 ranks, tcp", [] {
    World w(3, {"a", "b", "c"}, true);
    ring_exchange(w, false, true, "tcp ring, 3 ranks");
  });
  run_test("ring exchange, 3 ranks, shm disabled", [] {
    World w(3, {"h", "h", "h"}, false);
    ring_exchange(w, false, false, "");
  });
  run_test("ring exchange, 3 ranks, mixed shm + tcp", [] {
    World w(3, {"h", "h", "other"}, true);
    ring_exchange(w, false, false, "");
  });
  run_test("ring exchange, 4 ranks on 2 hosts", [] {
    World w(4, {"A", "A", "B", "B"}, true);
    ring_exchange(w, false, false, "");
  });
  run_test("strangers rejected, mesh completes", test_rogue_clients);
  run_test("rank with a wrong secret fails the mesh", test_wrong_secret_rank);
  run_test("mesh timeout names missing ranks", test_mesh_timeout);
  run_test("shared memory unavailable: falls back to tcp", test_shm_fallback);
  run_test("killed peer detected (shm, zombie)", [] { test_peer_killed(true, false); });
  run_test("killed peer detected (shm, reaped)", [] { test_peer_killed(true, true); });
  run_test("killed peer detected (tcp)", [] { test_peer_killed(false, true); });
  run_test("closed shm peer read to the end", test_peer_closed_shm);
  run_test("abort releases a blocked recv (shm)", [] { test_abort(true); });
  run_test("abort releases a blocked recv (tcp)", [] { test_abort(false); });
  run_test("no shared-memory segments left behind", test_no_leftover_segments);
  return summary();
}
