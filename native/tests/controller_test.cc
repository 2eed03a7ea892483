// Unit tests of the negotiation layer (native/controller/): the response cache, the mismatch
// diagnosis, the stall inspector and the coordinator that uses them, driven with request batches
// as the ranks' engines send them. Built and run by tests/test_native_units.py; not part of the
// library.
#include <poll.h>
#include <unistd.h>

#include <thread>

#include "../controller/coordinator.h"
#include "../controller/deadlock.h"
#include "../controller/mismatch.h"
#include "../controller/negotiation_board.h"
#include "../controller/response_cache.h"
#include "../controller/stall_inspector.h"
#include "harness.h"

using namespace shvd;
using namespace shvd_test;

namespace {

Request allreduce(const std::string& name, std::vector<int64_t> shape, int process_set = 0) {
  Request r;
  r.op = OpType::kAllreduce;
  r.name = name;
  r.shape = std::move(shape);
  r.process_set = process_set;
  return r;
}

Request join_request() {
  Request r;
  r.op = OpType::kJoin;
  r.name = "__join__";
  return r;
}

RequestBatch full(int rank, std::vector<Request> requests) {
  RequestBatch b;
  b.rank = rank;
  b.requests = std::move(requests);
  return b;
}

RequestBatch cached(int rank, std::vector<uint32_t> ids) {
  RequestBatch b;
  b.rank = rank;
  b.cached = std::move(ids);
  return b;
}

// A coordinator over `size` ranks with its own process sets and cache.
struct Setup {
  explicit Setup(int size, size_t capacity = 16, double stall_warning_s = 60) {
    sets.reset(size);
    CoordinatorOptions o;
    o.cache_capacity = capacity;
    o.stall_warning_seconds = stall_warning_s;
    cache = std::make_unique<ResponseCache>(capacity, size);
    coordinator = std::make_unique<Coordinator>(size, &sets, cache.get(), o);
  }
  ProcessSets sets;
  std::unique_ptr<ResponseCache> cache;
  std::unique_ptr<Coordinator> coordinator;
};

// Both ranks of `s` ask for allreduce `name` of shape [4] and get it answered: the name has a
// cache id from now on.
void answer_once(Setup& s, const std::string& name) {
  s.coordinator->add_batch(full(0, {allreduce(name, {4})}));
  s.coordinator->add_batch(full(1, {allreduce(name, {4})}));
  CHECK(s.coordinator->take_ready().size() == 1);
}

// Runs the stall inspector until it warns (at most 5 s); its warnings.
std::vector<std::string> stall_warnings(Setup& s) {
  std::vector<std::string> warnings;
  auto warn = [&](const std::string& m) { warnings.push_back(m); };
  const auto deadline = Coordinator::Clock::now() + std::chrono::seconds(5);
  while (warnings.empty() && Coordinator::Clock::now() < deadline) {
    CHECK(s.coordinator->inspect_stalls(Coordinator::Clock::now(), warn).empty());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return warnings;
}

// ---- ResponseCache ----------------------------------------------------------------------------

void test_cache_rank_view() {
  ResponseCache c(4, 2);
  const Request a = allreduce("a", {4});
  CHECK(c.lookup(a) == -1);
  c.remember("a", 3, a);
  CHECK(c.lookup(a) == 3);
  Request other_shape = allreduce("a", {5});
  CHECK(c.lookup(other_shape) == -1);  // same name, other parameters: a full request
  c.remember("a", -1, other_shape);    // not cached: the old entry stays
  CHECK(c.lookup(a) == 3);
  c.remember("a", 3, other_shape);     // the coordinator re-recorded id 3 with the new shape
  CHECK(c.lookup(other_shape) == 3 && c.lookup(a) == -1);
}

void test_cache_numbering_and_capacity() {
  ResponseCache c(2, 2);
  std::vector<Request> by_rank = {allreduce("a", {1}), allreduce("a", {1})};
  CHECK(c.record("a", {0, 1}, by_rank) == 0);
  by_rank = {allreduce("b", {1}), allreduce("b", {1})};
  CHECK(c.record("b", {0, 1}, by_rank) == 1);
  CHECK(c.record("a", {0, 1}, {allreduce("a", {2}), allreduce("a", {2})}) == 0);  // same id
  CHECK(c.entry(0).by_rank[1].shape == std::vector<int64_t>{2});
  CHECK(c.record("c", {0, 1}, {allreduce("c", {1}), allreduce("c", {1})}) == -1);  // full
  CHECK(c.id_of("b") == 1 && c.id_of("c") == -1);
  Request grouped = allreduce("g", {1});
  grouped.group = "grp";
  CHECK(c.record("g", {0}, {grouped, Request()}) == -1);  // grouped ops are never cached
  ResponseCache off(0, 2);
  CHECK(!off.enabled() && off.record("a", {0, 1}, by_rank) == -1);
}

// ---- mismatch diagnosis -----------------------------------------------------------------------

void test_mismatch_messages() {
  ProcessSets sets;
  sets.reset(3);
  std::vector<Request> by_rank = {allreduce("x", {4, 3}), allreduce("x", {5, 3}),
                                  allreduce("x", {4, 3})};
  Response r = agreed_response("x", by_rank, {0, 1, 2}, {}, sets);
  CHECK(r.error == "Mismatched shapes for tensor 'x' in allreduce: ranks [0, 2] sent [4, 3]; "
                   "ranks [1] sent [5, 3]");
  by_rank[1] = allreduce("x", {4, 3});
  by_rank[1].dtype = DataType::kFloat64;
  r = agreed_response("x", by_rank, {0, 1, 2}, {}, sets);
  CHECK(r.error.rfind("Mismatched data types for tensor 'x': ranks [0, 2] sent float32", 0) == 0);
  by_rank[1].dtype = DataType::kFloat32;
  r = agreed_response("x", by_rank, {0, 1, 2}, {}, sets);
  CHECK(r.error.empty() && r.shapes.size() == 1 && r.shapes[0] == by_rank[0].shape);
  // Allgather: only the first dimension may differ; the response lists it per member.
  for (int i = 0; i < 3; ++i) {
    by_rank[i].op = OpType::kAllgather;
    by_rank[i].shape = {i + 1, 3};
  }
  r = agreed_response("x", by_rank, {0, 1, 2}, {}, sets);
  CHECK(r.error.empty() && (r.first_dims == std::vector<int64_t>{1, 2, 3}));
  r = agreed_response("x", by_rank, {0, 1, 2}, {2}, sets);  // rank 2 joined: refused
  CHECK(r.error == joined_refusal(OpType::kAllgather, "x", {2}));
  CHECK(r.error == "allgather of tensor 'x' is not supported while ranks [2] have joined; only "
                   "allreduce continues after join()");
}

// ---- stall inspector --------------------------------------------------------------------------

void test_stall_inspector() {
  using Clock = StallInspector::Clock;
  StallInspector off(0, 0);
  CHECK(!off.enabled() && !off.due(Clock::now()));
  StallInspector s(10, 30);
  const auto t0 = Clock::now();
  CHECK(s.due(t0) && !s.due(t0 + std::chrono::milliseconds(100)));
  // A wake-up a few ms short of the interval still inspects.
  CHECK(s.due(t0 + StallInspector::kInterval - std::chrono::milliseconds(5)));
  std::vector<std::string> warnings;
  auto warn = [&](const std::string& m) { warnings.push_back(m); };
  Clock::time_point last = t0;
  CHECK(s.inspect("t", {0}, {1}, t0, &last, t0 + std::chrono::seconds(5), warn).empty());
  CHECK(warnings.empty());  // younger than the warning time
  CHECK(s.inspect("t", {0}, {1}, t0, &last, t0 + std::chrono::seconds(11), warn).empty());
  CHECK(warnings.size() == 1 && warnings[0].find("tensor 't' was submitted by ranks [0] but "
                                                 "rank 1 has not submitted it for 11 s") !=
                                    std::string::npos);
  s.inspect("t", {0}, {1}, t0, &last, t0 + std::chrono::seconds(12), warn);
  CHECK(warnings.size() == 1);  // once per warning period
  s.inspect("t", {0}, {1}, t0, &last, t0 + std::chrono::seconds(22), warn);
  CHECK(warnings.size() == 2);
  const std::string abort = s.inspect("t", {0}, {1}, t0, &last, t0 + std::chrono::seconds(31), warn);
  CHECK(abort.rfind("stall inspector: tensor 't'", 0) == 0);
  // With the hosts known (from the mesh's peer list), the missing ranks are named by host.
  set_rank_hosts({"node-a", "node-a", "node-b", "node-b"});
  const std::string named =
      s.inspect("t", {0, 1}, {2, 3}, t0, &last, t0 + std::chrono::seconds(31), warn);
  set_rank_hosts({});
  CHECK(named.find("by ranks [0, 1] but ranks 2, 3 on node-b have not submitted it") !=
        std::string::npos);
}

// ---- coordinator ------------------------------------------------------------------------------

void test_coordinator_caches_and_answers_ids() {
  Setup s(2);
  s.coordinator->add_batch(full(0, {allreduce("a", {4}), allreduce("b", {2})}));
  CHECK(s.coordinator->take_ready().empty());
  s.coordinator->add_batch(full(1, {allreduce("b", {2}), allreduce("a", {4})}));
  std::vector<Response> out = s.coordinator->take_ready();
  // Fused into one allreduce, in the order the tensors became ready (rank 1's order).
  CHECK(out.size() == 1 && (out[0].names == std::vector<std::string>{"b", "a"}));
  CHECK((out[0].cache_ids == std::vector<int64_t>{0, 1}));
  CHECK(s.cache->entry(0).fast && s.cache->entry(0).members == 2);
  // The next step: ids only. Answered from the cache once both ranks sent them.
  s.coordinator->add_batch(cached(1, {1}));
  CHECK(s.coordinator->take_ready().empty());
  s.coordinator->add_batch(cached(0, {1}));
  out = s.coordinator->take_ready();
  CHECK(out.size() == 1 && (out[0].names == std::vector<std::string>{"a"}) && out[0].error.empty());
  CHECK(out[0].shapes[0] == std::vector<int64_t>{4});
}

void test_coordinator_mixed_cached_and_full_request() {
  Setup s(2);
  answer_once(s, "a");
  // Rank 0 repeats the request (its id); rank 1 changed the shape (a full request): the waiting
  // id is demoted to the general path, which names the mismatch.
  s.coordinator->add_batch(cached(0, {0}));
  s.coordinator->add_batch(full(1, {allreduce("a", {5})}));
  std::vector<Response> out = s.coordinator->take_ready();
  CHECK(out.size() == 1 && out[0].error ==
        "Mismatched shapes for tensor 'a' in allreduce: ranks [0] sent [4]; ranks [1] sent [5]");
}

void test_coordinator_join_demotes_cached() {
  Setup s(2);
  answer_once(s, "a");
  s.coordinator->add_batch(cached(0, {0}));
  const Request join = join_request();
  s.coordinator->add_batch(full(1, {join}));
  // Rank 0's allreduce goes on without the joined rank (which contributes zeros).
  std::vector<Response> out = s.coordinator->take_ready();
  CHECK(out.size() == 1 && out[0].names[0] == "a" && (out[0].joined == std::vector<int>{1}));
  CHECK(!s.cache->entry(0).fast);  // answered with a rank joined: not the steady state
  s.coordinator->add_batch(full(0, {join}));
  out = s.coordinator->take_ready();
  CHECK(out.size() == 1 && out[0].op == OpType::kJoin && out[0].last_joined == 0);
}

void test_coordinator_stall_on_cached_id() {
  Setup s(2, 16, 0.2);
  answer_once(s, "a");
  s.coordinator->add_batch(cached(0, {0}));  // rank 1 never sends it
  const std::vector<std::string> warnings = stall_warnings(s);
  CHECK(warnings.size() == 1 &&
        warnings[0].find("tensor 'a' was submitted by ranks [0] but rank 1 has not") != std::string::npos);
}

void test_coordinator_shutdown_fails_waiting_ops() {
  Setup s(2);
  answer_once(s, "a");
  s.coordinator->add_batch(cached(0, {0}));
  RequestBatch bye;
  bye.rank = 1;
  bye.shutdown = true;
  s.coordinator->add_batch(bye);
  std::vector<Response> out = s.coordinator->take_ready();
  CHECK(out.size() == 1 && !out[0].error_is_mismatch &&
        out[0].error == "ranks [1] have shut down spark_hvd and cannot complete allreduce of "
                        "tensor 'a'");
}

// ---- negotiation board ------------------------------------------------------------------------

// A board for ranks 0 and 1, both mapped in this process (the protocol only needs the two views).
struct Board2 {
  explicit Board2(uint32_t ids = 16) {
    r0 = NegotiationBoard::create("unittest" + std::to_string(getpid()), 2, ids);
    r1 = NegotiationBoard::open(r0->name(), 1, 2, ids);
    r0->unlink();
  }
  std::unique_ptr<NegotiationBoard> r0, r1;
};

using Arrival = NegotiationBoard::Arrival;

void test_board_arrivals() {
  Board2 b;
  CHECK(b.r0->arrive(3, 0, 0b11) == Arrival::kWaiting);
  CHECK(b.r1->waiting(3) == 0b01);  // the other rank's view of the same word
  CHECK(b.r1->arrive(3, 1, 0b11) == Arrival::kCompleted);
  CHECK(b.r0->waiting(3) == 0 && b.r0->completions(3) == 1);
  // A one-member process set completes at once; other ids are independent.
  CHECK(b.r1->arrive(4, 1, 0b10) == Arrival::kCompleted);
  CHECK(b.r0->arrive(5, 0, 0b11) == Arrival::kWaiting);
  // Taken over: the waiting bits go to the coordinator, later arrivals are refused until the
  // id is given back.
  CHECK(b.r0->steal(5) == 0b01);
  CHECK(b.r1->arrive(5, 1, 0b11) == Arrival::kRefused);
  CHECK(b.r0->waiting(5) == 0);
  b.r0->enable(5);
  CHECK(b.r1->arrive(5, 1, 0b11) == Arrival::kWaiting);
}

void test_board_log_groups_and_wakeups() {
  Board2 b;
  b.r0->append(5);
  b.r1->append(6);  // appended while 5 is unsealed: may fuse with it
  CHECK(b.r0->tail() == 2 && b.r0->entry(0) == 5 && b.r1->entry(1) == 6);
  CHECK(!b.r0->fuses(0) && b.r0->fuses(1));
  CHECK(b.r1->seal() == 2);  // a reader starts executing 5 and 6
  b.r0->append(7);           // too late to join them
  b.r0->append(NegotiationBoard::kMarker | 0);
  b.r0->append(8);
  CHECK(!b.r1->fuses(2) && !b.r1->fuses(3) && !b.r1->fuses(4));  // markers never fuse
  CHECK(b.r1->entry(3) == (NegotiationBoard::kMarker | 0));
  // A sleeping rank is woken by an append, an awake one is not (no system call).
  pollfd fd{b.r1->wake_fd(), POLLIN, 0};
  b.r0->append(9);
  CHECK(poll(&fd, 1, 0) == 0);
  b.r1->set_sleeping(true);
  b.r0->append(10);
  CHECK(poll(&fd, 1, 2000) == 1);
  b.r1->drain_wake_fd();
  b.r1->set_sleeping(false);
  CHECK(poll(&fd, 1, 0) == 0);
  // The ring reuses space the ranks consumed.
  b.r0->consumed(b.r0->tail());
  b.r1->consumed(b.r1->tail());
  for (int i = 0; i < 10000; ++i) {
    b.r0->append(uint64_t(i % 16));
    b.r0->consumed(b.r0->tail());
    b.r1->consumed(b.r1->tail());
  }
  CHECK(b.r0->tail() == 10007 && b.r1->entry(10006) == 9999 % 16);
}

void test_coordinator_takes_board_ids_over() {
  Setup s(2);
  Board2 b;
  s.coordinator->set_board(b.r0.get());
  answer_once(s, "a");  // id 0
  CHECK(b.r0->arrive(0, 0, 0b11) == Arrival::kWaiting);
  // Rank 1 changed the shape: its full request makes the coordinator take id 0 over, with
  // rank 0's arrival, and name the mismatch.
  s.coordinator->add_batch(full(1, {allreduce("a", {5})}));
  CHECK(b.r1->arrive(0, 1, 0b11) == Arrival::kRefused);
  std::vector<Response> out = s.coordinator->take_ready();
  CHECK(out.size() == 1 && out[0].error ==
        "Mismatched shapes for tensor 'a' in allreduce: ranks [0] sent [4]; ranks [1] sent [5]");
  // Answered: the id is back on the board.
  CHECK(b.r1->arrive(0, 1, 0b11) == Arrival::kWaiting);
  CHECK(b.r0->arrive(0, 0, 0b11) == Arrival::kCompleted);
}

void test_coordinator_join_takes_board_over() {
  Setup s(2);
  Board2 b;
  s.coordinator->set_board(b.r0.get());
  answer_once(s, "a");
  CHECK(b.r0->arrive(0, 0, 0b11) == Arrival::kWaiting);
  const Request join = join_request();
  s.coordinator->add_batch(full(1, {join}));
  std::vector<Response> out = s.coordinator->take_ready();
  CHECK(out.size() == 1 && out[0].names[0] == "a" && (out[0].joined == std::vector<int>{1}));
  CHECK(b.r0->arrive(0, 0, 0b11) == Arrival::kRefused);  // still joined: over TCP
  s.coordinator->add_batch(full(0, {join}));
  out = s.coordinator->take_ready();
  CHECK(out.size() == 1 && out[0].op == OpType::kJoin);
  CHECK(b.r0->arrive(0, 0, 0b11) == Arrival::kWaiting);  // everyone is back
}

void test_coordinator_stall_on_board() {
  Setup s(2, 16, 0.2);
  Board2 b;
  s.coordinator->set_board(b.r0.get());
  answer_once(s, "a");
  CHECK(b.r0->arrive(0, 0, 0b11) == Arrival::kWaiting);  // rank 1 never arrives
  const std::vector<std::string> warnings = stall_warnings(s);
  CHECK(warnings.size() == 1 &&
        warnings[0].find("tensor 'a' was submitted by ranks [0] but rank 1 has not") != std::string::npos);
  // Rank 1 finally sends it: over TCP now (the id was taken over), answered by the coordinator.
  CHECK(b.r1->arrive(0, 1, 0b11) == Arrival::kRefused);
  s.coordinator->add_batch(cached(1, {0}));
  std::vector<Response> out = s.coordinator->take_ready();
  CHECK(out.size() == 1 && out[0].error.empty() && out[0].names[0] == "a");
}

// Rank 0's engine wakes every StallInspector::kInterval to inspect, a little early or late: an
// inspection a few ms short of the interval still runs, and ranks first seen waiting on the
// board one warning time ago (give or take those ms) are reported then, not an interval later.
void test_board_stall_reported_at_the_wake_up_due() {
  using std::chrono::milliseconds;
  Setup s(2, 16, 1.0);
  Board2 b;
  s.coordinator->set_board(b.r0.get());
  answer_once(s, "a");
  CHECK(b.r0->arrive(0, 0, 0b11) == Arrival::kWaiting);  // rank 1 is late
  std::vector<std::string> warnings;
  auto warn = [&](const std::string& m) { warnings.push_back(m); };
  const auto t0 = Coordinator::Clock::now();
  CHECK(s.coordinator->inspect_stalls(t0, warn).empty());  // first seen waiting
  CHECK(s.coordinator->inspect_stalls(t0 + milliseconds(495), warn).empty());
  CHECK(warnings.empty());
  CHECK(s.coordinator->inspect_stalls(t0 + milliseconds(990), warn).empty());
  CHECK(warnings.size() == 1 &&
        warnings[0].find("rank 1 has not submitted it for 1 s") != std::string::npos);
}

}  // namespace

void test_deadlock_detector() {
  ProcessSets sets;
  sets.reset(3);
  const int pair = sets.add({0, 1});
  using C = DeadlockDetector::Clock;
  const C::time_point t0 = C::now();
  auto at = [&](int ms) { return t0 + std::chrono::milliseconds(ms); };
  auto op = [](const std::string& n, OpType o = OpType::kAllreduce, int set = 0) {
    return PendingOp{n, o, set};
  };
  DeadlockDetector d(3, std::chrono::milliseconds(200));
  // Not every rank reported: nothing to decide.
  d.blocked(0, {op("a")});
  d.blocked(1, {op("b")});
  CHECK(d.diagnose(sets, {}).empty() && d.check(at(0), sets, {}).empty());
  // Every rank blocked, each op missing a rank: suspected, then confirmed 200 ms later.
  d.blocked(2, {op("b")});
  CHECK(!d.diagnose(sets, {}).empty());
  CHECK(d.check(at(0), sets, {}).empty());
  CHECK(d.check(at(100), sets, {}).empty());
  const std::string msg = d.check(at(250), sets, {});
  CHECK(msg.find("deadlock") == 0);
  CHECK(msg.find("rank 0 waits for allreduce 'a' (not submitted by ranks 1, 2)") !=
        std::string::npos);
  CHECK(msg.find("rank 2 waits for allreduce 'b' (not submitted by rank 0)") != std::string::npos);
  // A report that changes restarts the confirmation; one that completes an op clears it.
  d.blocked(0, {op("a"), op("c")});
  CHECK(d.check(at(300), sets, {}).empty());
  d.blocked(0, {op("b")});  // rank 0 now waits for 'b' too: every member has it
  CHECK(d.diagnose(sets, {}).empty());
  d.moving(0);
  CHECK(d.diagnose(sets, {}).empty());
  // A joined rank is no member an allreduce waits for, but other ops still need it.
  d.blocked(0, {op("__join__", OpType::kJoin)});
  d.blocked(1, {op("x")});
  d.blocked(2, {op("x")});
  CHECK(d.diagnose(sets, {0}).empty());
  d.blocked(1, {op("g", OpType::kAllgather)});
  d.blocked(2, {op("g", OpType::kAllgather)});
  CHECK(!d.diagnose(sets, {0}).empty());
  // Process sets: an op of {0, 1} needs only those two.
  d.blocked(0, {op("p", OpType::kAllreduce, pair)});
  d.blocked(1, {op("p", OpType::kAllreduce, pair)});
  d.blocked(2, {op("q")});
  CHECK(d.diagnose(sets, {}).empty());
  d.blocked(1, {op("q")});
  const std::string sets_msg = d.diagnose(sets, {});
  CHECK(sets_msg.find("allreduce 'p' (not submitted by rank 1)") != std::string::npos);
  CHECK(sets_msg.find("allreduce 'q' (not submitted by rank 0)") != std::string::npos);
}

int main(int argc, char** argv) {
  if (argc > 1) g_filter = argv[1];
  run_test("response cache: the rank's view", test_cache_rank_view);
  run_test("response cache: numbering and capacity", test_cache_numbering_and_capacity);
  run_test("mismatch diagnosis messages", test_mismatch_messages);
  run_test("stall inspector: warn, repeat, abort", test_stall_inspector);
  run_test("coordinator: caches and answers ids", test_coordinator_caches_and_answers_ids);
  run_test("coordinator: cached id meets a full request", test_coordinator_mixed_cached_and_full_request);
  run_test("coordinator: join demotes cached ids", test_coordinator_join_demotes_cached);
  run_test("coordinator: stall on a cached id", test_coordinator_stall_on_cached_id);
  run_test("coordinator: shutdown fails waiting ops", test_coordinator_shutdown_fails_waiting_ops);
  run_test("board: arrivals, take-over", test_board_arrivals);
  run_test("board: log groups, wake-ups, ring", test_board_log_groups_and_wakeups);
  run_test("coordinator: takes board ids over", test_coordinator_takes_board_ids_over);
  run_test("coordinator: join takes the board over", test_coordinator_join_takes_board_over);
  run_test("coordinator: stall on the board", test_coordinator_stall_on_board);
  run_test("coordinator: board stall reported at the wake-up due",
           test_board_stall_reported_at_the_wake_up_due);
  run_test("deadlock detector", test_deadlock_detector);
  return summary();
}
