// A scripted worker for frontend tests: a DEALER "rank-0" that speaks protocol.h, reports a ready status and emits
// each request's scripted tokens one per event, honouring max_tokens, stop ids, cancel and an optional rejection.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "server/protocol.h"

namespace bg::testing {

class FakeWorker {
 public:
  using Script = std::function<std::vector<int32_t>(const proto::GenerateRequest&)>;

  FakeWorker(zmq::context_t& ctx, const std::string& endpoint, Script script, int64_t max_len = 64,
             int64_t vocab = 261, const std::string& identity = "rank-0", int32_t rank = 0)
      : max_model_len(max_len), vocab_size(vocab), rank_(rank), sock_(ctx, zmq::socket_type::dealer),
        script_(std::move(script)) {
    sock_.set(zmq::sockopt::routing_id, identity);
    sock_.set(zmq::sockopt::linger, 0);
    sock_.connect(endpoint);
    thread_ = std::thread([this] { run(); });
  }
  ~FakeWorker() {
    stop_ = true;
    thread_.join();
  }

  std::atomic<int32_t> reject_code{0};          // non-zero: reject every generate with this code
  std::atomic<int64_t> fail_after{-1};          // >= 0: fail each request with fail_code after this many tokens
  std::atomic<int32_t> fail_code{500};
  std::atomic<bool> paused{false};              // true: sends nothing at all (a hung worker)
  std::atomic<int64_t> token_delay_ms{2};
  std::atomic<int64_t> max_model_len;
  const int64_t vocab_size;

  std::vector<std::string> cancelled() {
    std::lock_guard lock(mu_);
    return cancelled_;
  }
  size_t active() {
    std::lock_guard lock(mu_);
    return active_.size();
  }
  std::vector<proto::GenerateRequest> received() {
    std::lock_guard lock(mu_);
    return received_;
  }

 private:
  struct Active {
    proto::GenerateRequest req;
    std::vector<int32_t> script;
    size_t next = 0;
  };

  void send(const std::string& type, const nlohmann::json& body) {
    const std::string frame = proto::encode(type, body);
    sock_.send(zmq::buffer(frame), zmq::send_flags::none);
  }
  void send_status() {
    proto::WorkerStatus st;
    st.rank = rank_;
    st.phase = "ready";
    st.arch = "fake";
    st.vocab_size = vocab_size;
    st.max_model_len = max_model_len;
    st.kv_blocks_total = 100;
    st.state_slots_total = 8;
    std::lock_guard lock(mu_);
    st.running = static_cast<int64_t>(active_.size());
    st.kv_blocks_free = 100 - st.running;
    st.state_slots_free = 8 - st.running;
    send("status", st);
  }
  proto::TokenEvent event(const Active& a) {
    proto::TokenEvent ev;
    ev.id = a.req.id;
    ev.prompt_tokens = static_cast<int64_t>(a.req.prompt.size());
    ev.completion_tokens = static_cast<int64_t>(a.next);
    return ev;
  }

  void on_message(const proto::Message& m) {
    std::lock_guard lock(mu_);
    if (m.type == "generate") {
      auto req = proto::body_as<proto::GenerateRequest>(m);
      received_.push_back(req);
      if (reject_code != 0) {
        proto::TokenEvent ev;
        ev.id = req.id;
        ev.finish_reason = "error";
        ev.error = "the queue is full";
        ev.error_code = reject_code;
        send("tokens", ev);
        return;
      }
      active_[req.id] = Active{req, script_(req), 0};
    } else if (m.type == "cancel") {
      auto c = proto::body_as<proto::Cancel>(m);
      cancelled_.push_back(c.id);
      auto it = active_.find(c.id);
      if (it == active_.end()) return;
      proto::TokenEvent ev = event(it->second);
      ev.finish_reason = "abort";
      send("tokens", ev);
      active_.erase(it);
    }
  }

  void step() {
    std::lock_guard lock(mu_);
    for (auto it = active_.begin(); it != active_.end();) {
      Active& a = it->second;
      proto::TokenEvent ev;
      const int32_t tok = a.next < a.script.size() ? a.script[a.next] : -1;
      if (fail_after >= 0 && static_cast<int64_t>(a.next) >= fail_after) {
        ev = event(a);
        ev.finish_reason = "error";
        ev.error = "the step failed";
        ev.error_code = fail_code;
      } else if (tok >= 0) {
        ++a.next;
        ev = event(a);
        ev.tokens = {tok};
        if (a.req.params.top_logprobs >= 0) {
          proto::TokenLogprob lp{tok, -0.5f, {}};
          for (int32_t k = 0; k < a.req.params.top_logprobs; ++k) lp.top.emplace_back((tok + k) % 256, -0.5f - static_cast<float>(k));
          ev.logprobs.push_back(lp);
        }
        const auto& stops = a.req.params.stop_token_ids;
        if (std::find(stops.begin(), stops.end(), tok) != stops.end()) {
          ev.finish_reason = "stop";
        } else if (static_cast<int64_t>(a.next) >= a.req.params.max_tokens) {
          ev.finish_reason = "length";
        }
      } else {
        ev = event(a);
        ev.finish_reason = "stop";
      }
      send("tokens", ev);
      it = ev.finish_reason.empty() ? std::next(it) : active_.erase(it);
    }
  }

  void run() {
    send_status();
    auto last_status = std::chrono::steady_clock::now();
    auto last_step = last_status;
    while (!stop_) {
      if (paused) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      std::vector<zmq::pollitem_t> items = {{sock_.handle(), 0, ZMQ_POLLIN, 0}};
      zmq::poll(items, std::chrono::milliseconds(1));
      if (items[0].revents & ZMQ_POLLIN) {
        zmq::message_t msg;
        while (sock_.recv(msg, zmq::recv_flags::dontwait)) {
          proto::Message m = proto::decode(std::as_bytes(std::span(static_cast<const char*>(msg.data()), msg.size())));
          if (m.type == "status_request") {
            send_status();
          } else {
            on_message(m);
          }
        }
      }
      const auto now = std::chrono::steady_clock::now();
      if (now - last_step >= std::chrono::milliseconds(token_delay_ms.load())) {
        step();
        last_step = now;
      }
      if (now - last_status >= std::chrono::milliseconds(200)) {
        send_status();
        last_status = now;
      }
    }
  }

  const int32_t rank_;
  zmq::socket_t sock_;
  Script script_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::map<std::string, Active> active_;
  std::vector<std::string> cancelled_;
  std::vector<proto::GenerateRequest> received_;
};

}  // namespace bg::testing
