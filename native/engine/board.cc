// Shared-memory negotiation (controller/negotiation_board.h): when every rank shares this host,
// cached allreduces are agreed on the board instead of through rank 0, and every rank executes
// the board's log in order, the coordinator's batches at their markers.
#include <cstdio>

#include "../common/logging.h"
#include "engine.h"

namespace shvd {

std::string Engine::receive_frame(int peer) {
  const auto give_up = Clock::now() + std::chrono::seconds(60);
  Link* link = mesh_.control[peer].get();
  for (;;) {
    std::vector<std::string> frames = read_frames(peer);
    if (!frames.empty()) {
      // Frames that came with it (rank 0's first response batch can follow its last set-up
      // message at once) go back to the inbox, in order, for the loop to read.
      std::string rest;
      for (size_t i = 1; i < frames.size(); ++i) {
        const uint32_t n = uint32_t(frames[i].size());
        rest.append(reinterpret_cast<const char*>(&n), sizeof n);
        rest += frames[i];
      }
      control_inbox_[peer].insert(0, rest);
      return frames.front();
    }
    if (Clock::now() > give_up)
      throw PeerLostError("rank " + std::to_string(peer) +
                          " did not answer while setting up the shared-memory negotiation");
    pollfd fd{link->fd(), POLLIN, 0};
    if (fd.fd >= 0) poll(&fd, 1, 100);
    else std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void Engine::set_up_board() {
  // Every rank computes the same answer here (all ranks on one host or not); rank 0 then
  // decides whether there is a board, and tells the others.
  if (options_.size < 2 || options_.local_size != options_.size) return;
  if (options_.rank == 0) {
    if (options_.shm_negotiation && shared_memory_ && cache_.enabled() &&
        options_.size <= NegotiationBoard::kMaxRanks) {
      try {
        board_ = NegotiationBoard::create(options_.job_id, options_.size,
                                          uint32_t(options_.coordinator.cache_capacity));
      } catch (const std::exception& e) {
        log_message(LogLevel::kDebug, "shared-memory negotiation unavailable: %s", e.what());
      }
    }
    const std::string offer =
        board_ ? board_->name() + " " + std::to_string(board_->ids()) + " " +
                     std::to_string(options_.coordinator.fusion_threshold_bytes)
               : "";
    for (int r = 1; r < options_.size; ++r) send_frame(mesh_.control[r].get(), offer);
    if (!board_) return;
    bool everyone = true;
    for (int r = 1; r < options_.size; ++r) everyone = receive_frame(r) == "ok" && everyone;
    for (int r = 1; r < options_.size; ++r) send_frame(mesh_.control[r].get(), everyone ? "on" : "off");
    board_->unlink();  // everyone who will map it has
    if (!everyone) {
      board_.reset();
      return;
    }
    board_fusion_bytes_ = options_.coordinator.fusion_threshold_bytes;
    coordinator_->set_board(board_.get());
    log_message(LogLevel::kDebug, "cached allreduces are negotiated through shared memory (%s)",
                board_->name().c_str());
    return;
  }
  const std::string offer = receive_frame(0);
  if (offer.empty()) return;
  char name[256];
  unsigned long ids = 0, fusion = 0;
  std::string reply = "no";
  if (std::sscanf(offer.c_str(), "%255s %lu %lu", name, &ids, &fusion) == 3) {
    try {
      board_ = NegotiationBoard::open(name, options_.rank, options_.size, uint32_t(ids));
      reply = "ok";
    } catch (const std::exception& e) {
      log_message(LogLevel::kDebug, "shared-memory negotiation unavailable: %s", e.what());
    }
  }
  send_frame(mesh_.control[0].get(), reply);
  if (receive_frame(0) != "on") board_.reset();
  board_fusion_bytes_ = fusion;
}

bool Engine::arrive_on_board(uint32_t id, std::vector<uint64_t>* completed) {
  const ResponseCache::Answer* answer = cache_.answer(id);
  if (!answer || id >= board_->ids() || !(answer->members >> options_.rank & 1)) return false;
  switch (board_->arrive(id, options_.rank, answer->members)) {
    case NegotiationBoard::Arrival::kRefused: return false;
    case NegotiationBoard::Arrival::kWaiting: return true;
    case NegotiationBoard::Arrival::kCompleted: break;
  }
  completed->push_back(id);
  return true;
}

bool Engine::board_has_work() const {
  if (!board_) return false;
  const uint64_t read = board_read_.load(std::memory_order_relaxed);
  if (board_->tail() == read) return false;
  // A marker whose batch has not arrived yet waits for the control link, not for the board.
  return !(board_->entry(read) & NegotiationBoard::kMarker) ||
         tcp_batches_queued_.load(std::memory_order_relaxed) > 0;
}

void Engine::read_board() {
  if (!board_ || board_->tail() == board_read_.load(std::memory_order_relaxed)) return;
  const uint64_t end = board_->seal();
  uint64_t read = board_read_.load(std::memory_order_relaxed);
  while (read < end && !finished_) {
    const uint64_t entry = board_->entry(read);
    if (entry & NegotiationBoard::kMarker) {
      if (tcp_batches_.empty()) break;  // still on its way
      ResponseBatch batch = std::move(tcp_batches_.front());
      tcp_batches_.pop_front();
      tcp_batches_queued_.store(tcp_batches_.size(), std::memory_order_relaxed);
      board_read_.store(++read, std::memory_order_relaxed);
      run_batch(batch);
      continue;
    }
    const ResponseCache::Answer* answer = cache_.answer(uint32_t(entry));
    if (!answer)
      throw std::logic_error("negotiation board: no cached response for id " +
                             std::to_string(entry));
    ++read;
    if (!(read < end && board_->fuses(read))) {
      // Alone (the latency-bound case): the cached response as it is, no copy.
      board_read_.store(read, std::memory_order_relaxed);
      mark_negotiated(answer->response);
      execute(answer->response, true);
      continue;
    }
    Response fused = answer->response;
    size_t bytes = answer->bytes;
    // The entries appended while this one was unsealed, as far as they fit into one collective
    // (every rank holds the same answers, so every rank splits the same way).
    while (read < end && board_->fuses(read)) {
      const ResponseCache::Answer* next = cache_.answer(uint32_t(board_->entry(read)));
      if (!next || !fusable_allreduces(fused, next->response) ||
          bytes + next->bytes > board_fusion_bytes_)
        break;
      fused.names.push_back(next->response.names[0]);
      fused.shapes.push_back(next->response.shapes[0]);
      fused.cache_ids.push_back(next->response.cache_ids[0]);
      bytes += next->bytes;
      ++read;
    }
    board_read_.store(read, std::memory_order_relaxed);
    mark_negotiated(fused);
    execute(fused, true);
  }
  board_->consumed(read);
}

}  // namespace shvd
