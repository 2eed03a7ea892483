// Host-memory stand-ins for the CUDA runtime and NCCL, for tests only: the core's GPU path
// (native/gpu/gpu_path.cc, which loads both at run time) then runs on a machine without a GPU,
// through real processes, so its logic (events, the core's stream, fusion copies, the
// finalizer, communicator set-up, the hierarchical steps, aborting on a lost peer) is checked
// in every `make test`, and a GPU machine's scarce time goes to what only a GPU can show.
//
// "Device memory" is host memory. A stream is a worker thread running its work in order; an
// event completes when the work before it did. A communicator is a full mesh of TCP
// connections (127.0.0.1, or FAKE_NCCL_ADDR) made at ncclCommInitRank, its unique id carrying
// rank 0's listener and a nonce each connection must present. Every collective sends whole
// buffers to the peers and reduces in rank order, so every rank's result is the same bits.
// Like NCCL, work whose peer is gone does not fail: it hangs (its stream stops) until the
// communicator is aborted. Hooks for the tests: FAKE_NCCL_HANG_AT, FAKE_NCCL_STUCK (below).
//
// Built by tests/fake_cuda/__init__.py's build() (g++ -shared); one file serves as both
// libraries.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

// -- streams and events ---------------------------------------------------------------------

struct Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> work;
  bool busy = false, stop = false;
  std::thread worker;

  Stream() : worker([this] { run(); }) {}
  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    worker.join();
  }
  void run() {
    for (;;) {
      std::function<void()> f;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [this] { return stop || !work.empty(); });
        if (work.empty()) return;
        f = std::move(work.front());
        work.pop_front();
        busy = true;
      }
      f();
      {
        std::lock_guard<std::mutex> lock(mu);
        busy = false;
      }
      cv.notify_all();
    }
  }
  void push(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> lock(mu);
      work.push_back(std::move(f));
    }
    cv.notify_all();
  }
  void synchronize() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [this] { return work.empty() && !busy; });
  }
};

// Every stream, for what waits for the whole device (cudaFree).
std::mutex g_streams_mu;
std::vector<Stream*> g_streams;

Stream* stream_of(void* s) {
  static Stream* legacy = [] {  // the default stream (0); never destroyed
    auto* st = new Stream();
    std::lock_guard<std::mutex> lock(g_streams_mu);
    g_streams.push_back(st);
    return st;
  }();
  return s ? static_cast<Stream*>(s) : legacy;
}

struct Event {
  std::atomic<uint64_t> recorded{0}, done{0};
};

thread_local int t_device = 0;

int device_count() {
  const char* v = std::getenv("FAKE_CUDA_DEVICE_COUNT");
  return v && *v ? std::atoi(v) : 4;
}

// -- NCCL -----------------------------------------------------------------------------------

struct UniqueId {  // inside ncclUniqueId's 128 bytes
  char magic[8];
  char addr[48];
  int32_t port;
  uint64_t nonce;
};

struct Comm {
  int size = 1, rank = 0;
  uint64_t nonce = 0;
  std::vector<int> fds;  // by peer rank; -1 for me
  std::mutex mu;
  std::condition_variable cv;
  bool aborted = false;
  std::atomic<bool> failed{false};
};

std::mutex g_mu;
std::map<uint64_t, int> g_listeners;          // nonce -> rank 0's listener (this process)
std::map<int, double> g_ops;  // PreMulSum op -> its factor
int g_next_op = 5;

// FAKE_NCCL_ADDR: an IPv4 address, or "hostname" for this host's name's (a host of the
// network-namespace bed); 127.0.0.1 by default.
std::string bind_addr() {
  const char* v = std::getenv("FAKE_NCCL_ADDR");
  if (!v || !*v) return "127.0.0.1";
  if (std::strcmp(v, "hostname") != 0) return v;
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_INET;
  std::string addr = "127.0.0.1";
  if (getaddrinfo(host, nullptr, &hints, &found) == 0 && found) {
    char text[INET_ADDRSTRLEN] = {0};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr, text,
              sizeof text);
    addr = text;
    freeaddrinfo(found);
  }
  return addr;
}

int listen_on(const std::string& addr, int* port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  inet_pton(AF_INET, addr.c_str(), &sa.sin_addr);
  socklen_t len = sizeof sa;
  if (fd < 0 || bind(fd, (sockaddr*)&sa, sizeof sa) != 0 || listen(fd, 64) != 0 ||
      getsockname(fd, (sockaddr*)&sa, &len) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  *port = ntohs(sa.sin_port);
  return fd;
}

bool send_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n) {
    ssize_t k = send(fd, c, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    c += k;
    n -= size_t(k);
  }
  return true;
}

bool recv_all(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n) {
    ssize_t k = recv(fd, c, n, 0);
    if (k <= 0) return false;
    c += k;
    n -= size_t(k);
  }
  return true;
}

int connect_to(const char* addr, int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(uint16_t(port));
  inet_pton(AF_INET, addr, &sa.sin_addr);
  for (int tries = 0; fd >= 0 && tries < 600; ++tries) {
    if (connect(fd, (sockaddr*)&sa, sizeof sa) == 0) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return fd;
    }
    usleep(100000);
  }
  if (fd >= 0) close(fd);
  return -1;
}

// Accepts one connection that presents `nonce`, within 120 s.
int accept_one(int listener, uint64_t nonce) {
  for (;;) {
    pollfd p{listener, POLLIN, 0};
    if (poll(&p, 1, 120000) <= 0) return -1;
    int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return -1;
    uint64_t got = 0;
    if (recv_all(fd, &got, sizeof got) && got == nonce) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return fd;
    }
    close(fd);
  }
}

size_t type_size(int t) {
  switch (t) {
    case 0: case 1: return 1;
    case 2: case 3: return 4;
    case 4: case 5: return 8;
    case 6: case 9: return 2;
    case 7: return 4;
    default: return 8;
  }
}

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float f;
  if (exp == 0) f = std::ldexp(float(man), -24);
  else if (exp == 31) f = man ? NAN : INFINITY;
  else f = std::ldexp(float(man | 0x400), int(exp) - 25);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= sign;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  float a = std::fabs(f);
  if (std::isnan(f)) return uint16_t(sign | 0x7E00);
  if (a >= 65520.0f) return uint16_t(sign | 0x7C00);
  if (a < std::ldexp(1.0f, -14))  // subnormal
    return uint16_t(sign | uint16_t(std::nearbyint(a * std::ldexp(1.0f, 24))));
  int e;
  float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  uint32_t mant = uint32_t(std::nearbyint((m * 2 - 1) * 1024));
  int exp = e - 1 + 15;
  if (mant == 1024) { mant = 0; ++exp; }
  if (exp >= 31) return uint16_t(sign | 0x7C00);
  return uint16_t(sign | (uint32_t(exp) << 10) | mant);
}

float bf16_to_float(uint16_t b) {
  uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return uint16_t(bits >> 16);
}

double load(int t, const void* p, size_t i) {
  switch (t) {
    case 0: return static_cast<const int8_t*>(p)[i];
    case 1: return static_cast<const uint8_t*>(p)[i];
    case 2: return static_cast<const int32_t*>(p)[i];
    case 3: return static_cast<const uint32_t*>(p)[i];
    case 4: return double(static_cast<const int64_t*>(p)[i]);
    case 5: return double(static_cast<const uint64_t*>(p)[i]);
    case 6: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case 7: return static_cast<const float*>(p)[i];
    case 8: return static_cast<const double*>(p)[i];
    default: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

void store(int t, void* p, size_t i, double v) {
  switch (t) {
    case 0: static_cast<int8_t*>(p)[i] = int8_t(v); break;
    case 1: static_cast<uint8_t*>(p)[i] = uint8_t(v); break;
    case 2: static_cast<int32_t*>(p)[i] = int32_t(v); break;
    case 3: static_cast<uint32_t*>(p)[i] = uint32_t(v); break;
    case 4: static_cast<int64_t*>(p)[i] = int64_t(v); break;
    case 5: static_cast<uint64_t*>(p)[i] = uint64_t(v); break;
    case 6: static_cast<uint16_t*>(p)[i] = float_to_half(float(v)); break;
    case 7: static_cast<float*>(p)[i] = float(v); break;
    case 8: static_cast<double*>(p)[i] = v; break;
    default: static_cast<uint16_t*>(p)[i] = float_to_bf16(float(v)); break;
  }
}

// out[i] = in_0[i] op in_1[i] op ... (rank order), in the type's precision after each step.
// `factor`: a PreMulSum's (op >= 5), read when the collective was enqueued (NCCL lets the
// caller destroy the op as soon as that call returned).
void reduce_into(void* out, const std::vector<const void*>& ins, size_t count, int type,
                 int op, double factor) {
  const int base = op >= 5 ? 0 : op;  // PreMulSum: each input scaled, then summed
  std::vector<uint8_t> acc(count * type_size(type));
  for (size_t i = 0; i < count; ++i) {
    double v = load(type, ins[0], i) * factor;
    store(type, acc.data(), i, v);
    for (size_t r = 1; r < ins.size(); ++r) {
      const double a = load(type, acc.data(), i), b = load(type, ins[r], i) * factor;
      double x = a + b;
      if (base == 1) x = a * b;
      if (base == 2) x = a > b ? a : b;
      if (base == 3) x = a < b ? a : b;
      store(type, acc.data(), i, x);
    }
    if (base == 4) {
      const double s = load(type, acc.data(), i) / double(ins.size());
      store(type, acc.data(), i, type <= 5 ? std::trunc(s) : s);
    }
  }
  std::memcpy(out, acc.data(), acc.size());
}

// What one collective (or a group of them) exchanges: messages to and from peers, in the
// order every rank lists them, then the local work on what arrived.
struct Plan {
  struct Message {
    int peer;
    void* data;
    size_t bytes;
  };
  std::vector<Message> sends, recvs;
  std::vector<std::function<void()>> after;
  std::vector<std::unique_ptr<uint8_t[]>> scratch;
  uint8_t* buffer(size_t bytes) {
    scratch.emplace_back(new uint8_t[bytes ? bytes : 1]);
    return scratch.back().get();
  }
};

// FAKE_NCCL_STUCK=1: work that lost its peer does not end even when its communicator is
// aborted, as on a GPU that is stuck for real; it holds its stream until the process exits.
void stay_stuck_if_asked() {
  const char* stuck = std::getenv("FAKE_NCCL_STUCK");
  if (!stuck || std::strcmp(stuck, "1") != 0) return;
  static std::mutex mu;
  static std::condition_variable never;
  std::unique_lock<std::mutex> lock(mu);
  never.wait(lock, [] { return false; });
}

void wait_for_abort(Comm* c) {
  c->failed = true;
  stay_stuck_if_asked();
  std::unique_lock<std::mutex> lock(c->mu);
  c->cv.wait(lock, [c] { return c->aborted; });
}

// FAKE_NCCL_HANG_AT=N (read at each collective): this process's N-th collective waits until
// its communicator is aborted, as a kernel waiting for a peer that never sends (its peers wait
// for its data too); with FAKE_NCCL_HANG_HOST, only on the host of that name.
void hang_if_asked(Comm* c) {
  static std::atomic<int> executed{0};
  const char* at = std::getenv("FAKE_NCCL_HANG_AT");
  if (!at || !*at) return;
  const char* only = std::getenv("FAKE_NCCL_HANG_HOST");
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  if (only && *only && std::strcmp(only, host) != 0) return;
  if (++executed == std::atoi(at)) {
    std::unique_lock<std::mutex> lock(c->mu);
    c->cv.wait(lock, [c] { return c->aborted; });
  }
}

void execute(Comm* c, Plan& plan) {
  {
    std::lock_guard<std::mutex> lock(c->mu);
    if (c->aborted) return;
  }
  hang_if_asked(c);
  {
    std::lock_guard<std::mutex> lock(c->mu);
    if (c->aborted) return;
  }
  std::atomic<bool> ok{true};
  std::map<int, std::vector<Plan::Message>> by_peer;
  for (const auto& m : plan.sends) by_peer[m.peer].push_back(m);
  std::vector<std::thread> senders;
  for (auto& [peer, msgs] : by_peer)
    senders.emplace_back([c, &ok, peer = peer, msgs = msgs] {
      for (const auto& m : msgs)
        if (!send_all(c->fds[size_t(peer)], m.data, m.bytes)) {
          ok = false;
          return;
        }
    });
  for (const auto& m : plan.recvs)
    if (!ok || !recv_all(c->fds[size_t(m.peer)], m.data, m.bytes)) {
      ok = false;
      break;
    }
  if (!ok) wait_for_abort(c);  // aborting shuts the sockets: the senders end
  for (auto& t : senders) t.join();
  if (!ok) return;
  for (auto& f : plan.after) f();
}

double premul_factor(int op) {
  if (op < 5) return 1.0;
  std::lock_guard<std::mutex> lock(g_mu);
  return g_ops.count(op) ? g_ops[op] : 1.0;
}

using Builder = std::function<void(Plan&)>;
thread_local int t_group_depth = 0;
thread_local std::vector<Builder> t_group;
thread_local Comm* t_group_comm = nullptr;
thread_local Stream* t_group_stream = nullptr;

int submit(Comm* c, void* stream, Builder b) {
  if (t_group_depth > 0) {
    t_group.push_back(std::move(b));
    t_group_comm = c;
    t_group_stream = stream_of(stream);
    return 0;
  }
  stream_of(stream)->push([c, b = std::move(b)] {
    Plan plan;
    b(plan);
    execute(c, plan);
  });
  return 0;
}

// Every member's `bytes` from `send` into scratch buffers (mine: `send` itself), then `reduce`
// gets them in rank order.
void exchange_all(Comm* c, Plan& p, const void* send, size_t bytes,
                  std::vector<const void*>* in_rank_order) {
  in_rank_order->assign(size_t(c->size), nullptr);
  for (int r = 0; r < c->size; ++r) {
    if (r == c->rank) {
      (*in_rank_order)[size_t(r)] = send;
      continue;
    }
    p.sends.push_back({r, const_cast<void*>(send), bytes});
    uint8_t* buf = p.buffer(bytes);
    p.recvs.push_back({r, buf, bytes});
    (*in_rank_order)[size_t(r)] = buf;
  }
}

}  // namespace

extern "C" {

// -- the CUDA runtime -------------------------------------------------------------------------

int cudaGetDeviceCount(int* n) { *n = device_count(); return 0; }
int cudaSetDevice(int d) {
  if (d < 0 || d >= device_count()) return 101;  // cudaErrorInvalidDevice
  t_device = d;
  return 0;
}
int cudaGetDevice(int* d) { *d = t_device; return 0; }
int cudaDeviceGetPCIBusId(char* buf, int len, int d) {
  std::snprintf(buf, size_t(len), "00000000:%02X:00.0", 0x10 + d);
  return 0;
}
int cudaStreamCreateWithFlags(void** s, unsigned) {
  stream_of(nullptr);  // the default stream exists first
  auto* st = new Stream();
  std::lock_guard<std::mutex> lock(g_streams_mu);
  g_streams.push_back(st);
  *s = st;
  return 0;
}
int cudaStreamDestroy(void* s) {
  {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    g_streams.erase(std::find(g_streams.begin(), g_streams.end(), static_cast<Stream*>(s)));
  }
  delete static_cast<Stream*>(s);  // after its work, as CUDA releases it
  return 0;
}
int cudaStreamSynchronize(void* s) { stream_of(s)->synchronize(); return 0; }
int cudaEventCreateWithFlags(void** e, unsigned) { *e = new Event(); return 0; }
int cudaEventDestroy(void* e) { delete static_cast<Event*>(e); return 0; }
int cudaEventRecord(void* e, void* s) {
  Event* ev = static_cast<Event*>(e);
  const uint64_t n = ++ev->recorded;
  stream_of(s)->push([ev, n] {
    uint64_t d = ev->done.load();
    while (d < n && !ev->done.compare_exchange_weak(d, n)) {}
  });
  return 0;
}
int cudaEventQuery(void* e) {
  Event* ev = static_cast<Event*>(e);
  return ev->done.load() >= ev->recorded.load() ? 0 : 600;
}
int cudaEventSynchronize(void* e) {
  Event* ev = static_cast<Event*>(e);
  const uint64_t n = ev->recorded.load();
  while (ev->done.load() < n) usleep(20);
  return 0;
}
int cudaStreamWaitEvent(void* s, void* e, unsigned) {
  Event* ev = static_cast<Event*>(e);
  const uint64_t n = ev->recorded.load();
  stream_of(s)->push([ev, n] {
    while (ev->done.load() < n) usleep(20);
  });
  return 0;
}
int cudaMalloc(void** p, size_t n) {
  *p = std::aligned_alloc(256, (n + 255) / 256 * 256 + 256);
  return *p ? 0 : 2;  // cudaErrorMemoryAllocation
}
// cudaFree waits for the whole device's work first, as CUDA's does.
int cudaFree(void* p) {
  std::vector<Stream*> all;
  {
    std::lock_guard<std::mutex> lock(g_streams_mu);
    all = g_streams;
  }
  for (Stream* st : all) st->synchronize();
  std::free(p);
  return 0;
}
int cudaMallocAsync(void** p, size_t n, void*) { return cudaMalloc(p, n); }
int cudaFreeAsync(void* p, void* s) {
  stream_of(s)->push([p] { std::free(p); });
  return 0;
}
int cudaMemcpyAsync(void* dst, const void* src, size_t n, int, void* s) {
  stream_of(s)->push([dst, src, n] { std::memmove(dst, src, n); });
  return 0;
}
int cudaMemsetAsync(void* dst, int v, size_t n, void* s) {
  stream_of(s)->push([dst, v, n] { std::memset(dst, v, n); });
  return 0;
}
const char* cudaGetErrorString(int) { return "fake CUDA runtime error"; }
int cudaGetLastError() { return 0; }

// -- NCCL -------------------------------------------------------------------------------------

int ncclGetVersion(int* v) { *v = 22805; return 0; }
const char* ncclGetErrorString(int) { return "fake NCCL error"; }

int ncclGetUniqueId(void* out) {
  UniqueId id{};
  std::memcpy(id.magic, "fakenccl", 8);
  const std::string addr = bind_addr();
  std::snprintf(id.addr, sizeof id.addr, "%s", addr.c_str());
  int fd = listen_on(addr, &id.port);
  if (fd < 0) return 2;  // ncclSystemError
  id.nonce = std::random_device()() * 0x100000001ull ^ std::random_device()();
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_listeners[id.nonce] = fd;
  }
  std::memset(out, 0, 128);
  std::memcpy(out, &id, sizeof id);
  return 0;
}

// ncclUniqueId is passed by value (128 bytes): as a struct here too.
struct FakeUniqueId {
  char internal[128];
};

int ncclCommInitRank(void** out, int n, FakeUniqueId raw, int rank) {
  UniqueId id;
  std::memcpy(&id, raw.internal, sizeof id);
  if (std::memcmp(id.magic, "fakenccl", 8) != 0) return 4;  // ncclInvalidArgument
  auto* c = new Comm();
  c->size = n;
  c->rank = rank;
  c->nonce = id.nonce;
  c->fds.assign(size_t(n), -1);
  struct Place {
    char addr[48];
    int32_t port;
  };
  std::vector<Place> places(static_cast<size_t>(n));
  int mine_port = 0;
  const std::string addr = bind_addr();
  int listener = rank == 0 ? -1 : listen_on(addr, &mine_port);
  if (rank == 0) {
    std::lock_guard<std::mutex> lock(g_mu);
    listener = g_listeners.count(id.nonce) ? g_listeners[id.nonce] : -1;
    g_listeners.erase(id.nonce);
    mine_port = id.port;
  }
  if (listener < 0) return 2;
  std::snprintf(places[size_t(rank)].addr, sizeof(Place::addr), "%s", addr.c_str());
  places[size_t(rank)].port = mine_port;
  if (rank == 0) {
    // Everyone reports to rank 0 (rank, place); rank 0 answers with every place.
    for (int k = 1; k < n; ++k) {
      int fd = accept_one(listener, id.nonce);
      int32_t r = -1;
      Place pl{};
      if (fd < 0 || !recv_all(fd, &r, sizeof r) || !recv_all(fd, &pl, sizeof pl) || r <= 0 ||
          r >= n)
        return 2;
      c->fds[size_t(r)] = fd;
      places[size_t(r)] = pl;
    }
    for (int r = 1; r < n; ++r)
      if (!send_all(c->fds[size_t(r)], places.data(), sizeof(Place) * size_t(n))) return 2;
  } else {
    int fd = connect_to(id.addr, id.port);
    int32_t r = rank;
    if (fd < 0 || !send_all(fd, &id.nonce, sizeof id.nonce) || !send_all(fd, &r, sizeof r) ||
        !send_all(fd, &places[size_t(rank)], sizeof(Place)) ||
        !recv_all(fd, places.data(), sizeof(Place) * size_t(n)))
      return 2;
    c->fds[0] = fd;
    // The mesh: connect to the ranks below me (but 0), accept the ones above.
    for (int peer = 1; peer < rank; ++peer) {
      int pfd = connect_to(places[size_t(peer)].addr, places[size_t(peer)].port);
      if (pfd < 0 || !send_all(pfd, &id.nonce, sizeof id.nonce) ||
          !send_all(pfd, &r, sizeof r))
        return 2;
      c->fds[size_t(peer)] = pfd;
    }
    for (int k = rank + 1; k < n; ++k) {
      int pfd = accept_one(listener, id.nonce);
      int32_t from = -1;
      if (pfd < 0 || !recv_all(pfd, &from, sizeof from) || from <= rank || from >= n) return 2;
      c->fds[size_t(from)] = pfd;
    }
  }
  close(listener);
  *out = c;
  return 0;
}

static void shut(Comm* c) {
  std::lock_guard<std::mutex> lock(c->mu);
  c->aborted = true;
  for (int fd : c->fds)
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
  c->cv.notify_all();
}

// The Comm stays allocated: work still queued on a stream may name it.
int ncclCommAbort(void* comm) { shut(static_cast<Comm*>(comm)); return 0; }
int ncclCommDestroy(void* comm) { shut(static_cast<Comm*>(comm)); return 0; }
int ncclCommGetAsyncError(void* comm, int* err) {
  *err = static_cast<Comm*>(comm)->failed ? 6 : 0;  // ncclRemoteError
  return 0;
}

int ncclGroupStart() { ++t_group_depth; return 0; }
int ncclGroupEnd() {
  if (t_group_depth <= 0) return 5;  // ncclInvalidUsage
  if (--t_group_depth > 0 || t_group.empty()) return 0;
  std::vector<Builder> ops;
  ops.swap(t_group);
  Comm* c = t_group_comm;
  t_group_stream->push([c, ops = std::move(ops)] {
    Plan plan;
    for (const auto& b : ops) b(plan);
    execute(c, plan);
  });
  return 0;
}

int ncclRedOpCreatePreMulSum(int* op, void* scalar, int type, int, void*) {
  std::lock_guard<std::mutex> lock(g_mu);
  *op = g_next_op++;
  g_ops[*op] = load(type, scalar, 0);
  return 0;
}
int ncclRedOpDestroy(int op, void*) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_ops.erase(op);
  return 0;
}

int ncclAllReduce(const void* send, void* recv, size_t count, int type, int op, void* comm,
                  void* stream) {
  Comm* c = static_cast<Comm*>(comm);
  const double factor = premul_factor(op);
  return submit(c, stream, [=](Plan& p) {
    auto ins = std::make_shared<std::vector<const void*>>();
    exchange_all(c, p, send, count * type_size(type), ins.get());
    p.after.push_back([=] { reduce_into(recv, *ins, count, type, op, factor); });
  });
}

int ncclReduce(const void* send, void* recv, size_t count, int type, int op, int root,
               void* comm, void* stream) {
  Comm* c = static_cast<Comm*>(comm);
  const double factor = premul_factor(op);
  return submit(c, stream, [=](Plan& p) {
    const size_t bytes = count * type_size(type);
    if (c->rank != root) {
      p.sends.push_back({root, const_cast<void*>(send), bytes});
      return;
    }
    auto ins = std::make_shared<std::vector<const void*>>(size_t(c->size), nullptr);
    for (int r = 0; r < c->size; ++r) {
      if (r == root) {
        (*ins)[size_t(r)] = send;
        continue;
      }
      uint8_t* buf = p.buffer(bytes);
      p.recvs.push_back({r, buf, bytes});
      (*ins)[size_t(r)] = buf;
    }
    p.after.push_back([=] { reduce_into(recv, *ins, count, type, op, factor); });
  });
}

int ncclBroadcast(const void* send, void* recv, size_t count, int type, int root, void* comm,
                  void* stream) {
  Comm* c = static_cast<Comm*>(comm);
  return submit(c, stream, [=](Plan& p) {
    const size_t bytes = count * type_size(type);
    if (c->rank == root) {
      for (int r = 0; r < c->size; ++r)
        if (r != root) p.sends.push_back({r, const_cast<void*>(send), bytes});
      if (recv != send) p.after.push_back([=] { std::memmove(recv, send, bytes); });
    } else {
      p.recvs.push_back({root, recv, bytes});
    }
  });
}

int ncclAllGather(const void* send, void* recv, size_t count, int type, void* comm,
                  void* stream) {
  Comm* c = static_cast<Comm*>(comm);
  return submit(c, stream, [=](Plan& p) {
    const size_t bytes = count * type_size(type);
    auto* out = static_cast<uint8_t*>(recv);
    for (int r = 0; r < c->size; ++r) {
      if (r == c->rank) continue;
      p.sends.push_back({r, const_cast<void*>(send), bytes});
      p.recvs.push_back({r, out + size_t(r) * bytes, bytes});
    }
    p.after.push_back([=] { std::memmove(out + size_t(c->rank) * bytes, send, bytes); });
  });
}

int ncclReduceScatter(const void* send, void* recv, size_t count, int type, int op, void* comm,
                      void* stream) {
  Comm* c = static_cast<Comm*>(comm);
  const double factor = premul_factor(op);
  return submit(c, stream, [=](Plan& p) {
    const size_t block = count * type_size(type);
    auto ins = std::make_shared<std::vector<const void*>>();
    exchange_all(c, p, send, block * size_t(c->size), ins.get());
    p.after.push_back([=] {
      std::vector<const void*> mine;
      for (const void* in : *ins)
        mine.push_back(static_cast<const uint8_t*>(in) + size_t(c->rank) * block);
      reduce_into(recv, mine, count, type, op, factor);
    });
  });
}

int ncclSend(const void* send, size_t count, int type, int peer, void* comm, void* stream) {
  Comm* c = static_cast<Comm*>(comm);
  return submit(c, stream, [=](Plan& p) {
    p.sends.push_back({peer, const_cast<void*>(send), count * type_size(type)});
  });
}

int ncclRecv(void* recv, size_t count, int type, int peer, void* comm, void* stream) {
  Comm* c = static_cast<Comm*>(comm);
  return submit(c, stream, [=](Plan& p) {
    p.recvs.push_back({peer, recv, count * type_size(type)});
  });
}

}  // extern "C"
