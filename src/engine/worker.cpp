// Worker loop: the DEALER socket, the loading phase on a helper thread, message handling, engine steps, events and
// periodic status. The socket and the engine belong to the thread that calls run_worker.
#include "engine/worker.h"

#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#ifdef BG_HAVE_CUDA
#include "backend/cuda/device_buffer.h"
#endif
#include "core/device_fault.h"
#include "core/error.h"
#include "core/log.h"
#include "dist/comm.h"
#include "dist/link_key.h"
#include "dist/rank_setup.h"
#include "engine/step_profile.h"
#include "ops/mla/mla_prefill_plan.h"
#include "sched/planner.h"

namespace bg::engine {
namespace {

using Clock = std::chrono::steady_clock;

class Worker {
 public:
  explicit Worker(const WorkerOptions& options);
  ~Worker();
  int run();

 private:
  bool wait_for_engine(std::future<std::unique_ptr<Engine>>& loading);
  void serve();
  void on_device_fault(const std::string& what);
  int serve_ranks();
  void poll_messages(int64_t timeout_ms);
  void handle(const zmq::message_t& frame);
  void on_generate(const proto::Message& m);
  void send(const std::string& frame);
  void send_event(const proto::TokenEvent& ev) { send(proto::encode("tokens", ev)); }
  void send_status();
  void flush_events();
  int64_t ms_until_status() const;
  bool parent_gone();

  const WorkerOptions& o_;
  std::optional<zmq::context_t> own_ctx_;
  zmq::socket_t sock_;
  proto::WorkerStatus status_;
  std::unique_ptr<Engine> engine_;
  Clock::time_point last_status_;
  bool stop_ = false;
  bool parent_is_ppid_ = false;  // the frontend is our direct parent (then a changed getppid() also means it died)
  bool parent_dead_ = false;
  int exit_code_ = 0;  // kExitDeviceFault after a device fault
  std::mutex phase_mu_;
  std::string load_phase_ = "loading";  // written by the loading thread ("joining" while it waits for the set)
  std::atomic<bool> abandon_{false};    // tells the loading thread to stop waiting for the other ranks
};

Worker::Worker(const WorkerOptions& options) : o_(options) {
  zmq::context_t* ctx = o_.context;
  if (ctx == nullptr) ctx = &own_ctx_.emplace(1);
  sock_ = zmq::socket_t(*ctx, zmq::socket_type::dealer);
  sock_.set(zmq::sockopt::routing_id, o_.routing_id.empty() ? "rank-" + std::to_string(o_.rank) : o_.routing_id);
  sock_.set(zmq::sockopt::sndhwm, 0);  // never drop or block on events; a dead frontend is noticed by --parent-pid
  sock_.set(zmq::sockopt::rcvhwm, 0);
  sock_.set(zmq::sockopt::linger, 2000);  // deliver the last events and status on exit
  BG_CHECK(!o_.endpoint.empty(), "--endpoint is required (the frontend's ROUTER, e.g. ipc:///tmp/bg/router.sock)");
  dist::secure_connect_side(sock_, dist::load_link_key(o_.node_secret_file).get());
  try {
    sock_.connect(o_.endpoint);
  } catch (const zmq::error_t& e) {
    fail("worker: cannot connect to --endpoint '{}': {}", o_.endpoint, e.what());
  }
  status_.rank = o_.rank;
  parent_is_ppid_ = o_.parent_pid > 0 && getppid() == static_cast<pid_t>(o_.parent_pid);
}

Worker::~Worker() {
  if (parent_dead_) sock_.set(zmq::sockopt::linger, 0);  // nobody is left to read what is queued
  sock_.close();
}

int Worker::run() {
  status_.phase = "loading";
  send_status();
  log::info("worker rank {}: loading {}", o_.rank, o_.model_dir.string());
  auto on_phase = [this](const std::string& phase) {
    std::lock_guard lock(phase_mu_);
    load_phase_ = phase;
  };
  auto loading = std::async(std::launch::async, [this, on_phase] {
    return load_engine(o_, on_phase, [this] { return abandon_.load(); });
  });
  if (!wait_for_engine(loading)) return status_.phase == "failed" ? 1 : 0;
  status_.phase = "ready";
  send_status();
  log::info("worker rank {}: ready", o_.rank);
  if (engine_->model().collective()) {
    const int code = serve_ranks();
    if (code != 0) return code;
  } else {
    serve();
    if (exit_code_ != 0) return exit_code_;
  }
  log::info("worker rank {}: stopping ({})", o_.rank, parent_dead_ ? "the frontend process is gone" : "shutdown");
  return 0;
}

// Keeps answering (status, shutdown; generate is rejected with 503) while the model loads. False: do not serve.
bool Worker::wait_for_engine(std::future<std::unique_ptr<Engine>>& loading) {
  while (loading.wait_for(std::chrono::milliseconds(0)) != std::future_status::ready) {
    poll_messages(std::min<int64_t>(o_.idle_poll_ms, ms_until_status()));
    const bool gone = parent_gone();
    if ((stop_ || gone) && o_.exit_process_on_stop_while_loading) {
      log::info("worker rank {}: {} while loading; exiting", o_.rank, stop_ ? "shutdown" : "frontend gone");
      std::_Exit(0);
    }
    if (gone) stop_ = true;
    if (stop_) abandon_ = true;
    {
      std::lock_guard lock(phase_mu_);
      if (load_phase_ != status_.phase) {
        status_.phase = load_phase_;
        last_status_ = {};  // report the new phase now
      }
    }
    if (ms_until_status() <= 0) send_status();
  }
  try {
    engine_ = loading.get();
  } catch (const std::exception& e) {
    log::error("worker rank {}: loading failed: {}", o_.rank, e.what());
    status_.phase = "failed";
    status_.error = e.what();
    send_status();
    return false;
  }
  return !stop_;
}

void Worker::serve() {
  bool progressed = false;
  while (!stop_) {
    // Never wait while there is work; when idle (or stuck waiting for memory), wait for a message but wake for the
    // next status.
    const bool busy = progressed && engine_->has_work();
    poll_messages(busy ? 0 : std::min<int64_t>(o_.idle_poll_ms, ms_until_status()));
    if (stop_) break;
    if (parent_gone()) return;
    progressed = false;
    if (engine_->has_work()) {
      try {
        progressed = engine_->step();
      } catch (const DeviceFault& e) {
        on_device_fault(e.what());
        return;
      } catch (const std::exception& e) {
        log::error("worker rank {}: step failed: {}; failing the running requests", o_.rank, e.what());
        engine_->fail_all(fmt::format("internal error in the worker step: {}", e.what()), 500);
      }
    }
    flush_events();
    if (ms_until_status() <= 0) send_status();
  }
  flush_events();
}

// The device context is lost (a sticky CUDA error): nothing more can run in this process. Every request gets its final
// error event (running ones 500, waiting ones 503: they never started), the frontend a "failed" status naming the
// fault, and the worker exits with kExitDeviceFault so that the supervisor restarts it. The engine is deliberately not
// destroyed: its destructors would call into the dead context.
void Worker::on_device_fault(const std::string& what) {
  log::error("worker rank {}: device fault: {}; failing every request and exiting with status {} for a restart",
             o_.rank, what, kExitDeviceFault);
  flush_events();
  const sched::Scheduler& sched = engine_->scheduler();
  const std::vector<std::string> ids = sched.ids();  // running, then waiting
  for (size_t i = 0; i < ids.size(); ++i) {
    const sched::Request* r = sched.find(ids[i]);
    const bool running = static_cast<int64_t>(i) < sched.n_running();
    send_event(error_event(ids[i], running ? 500 : 503,
                           fmt::format("worker rank {} hit a device fault and is restarting; the request was not "
                                       "completed (retry it): {}", o_.rank, what),
                           r != nullptr ? r->n_prompt : 0, r != nullptr ? r->n_generated() : 0));
  }
  status_.phase = "failed";
  status_.error = fmt::format("device fault (the worker exits with status {} and is restarted): {}", kExitDeviceFault,
                              what);
  send(proto::encode("status", status_));  // not send_status: fill_status reads the engine, whose device is lost
  // Kept reachable (never destroyed): a leak checker must not report it, and no destructor may run on a lost device.
  static auto* abandoned = new std::vector<std::unique_ptr<Engine>>();
  abandoned->push_back(std::move(engine_));
  exit_code_ = kExitDeviceFault;
  stop_ = true;
}

// One rank of a set: every loop is a step agreement with the other ranks (Engine::step takes part even without work),
// so the loop never waits long for messages. A stop (shutdown, frontend gone) is voted so the whole set stops; a
// failed set (a peer died, a step failed) ends this worker with status "failed" and exit code 1, and the frontend
// restarts the set.
int Worker::serve_ranks() {
  bool progressed = false;
  for (;;) {
    const bool busy = progressed && engine_->has_work();
    poll_messages(busy ? 0 : std::min<int64_t>(o_.multi_rank_idle_poll_ms, ms_until_status()));
    if (parent_gone()) stop_ = true;
    try {
      if (stop_) {
        engine_->fail_all("the worker is shutting down", 503);
        engine_->model().sync_idle(true, {});  // a stop vote runs no step
        break;
      }
      progressed = engine_->step();
    } catch (const dist::SetStopping&) {
      engine_->fail_all("the rank set is shutting down", 503);
      break;
    } catch (const DeviceFault& e) {
      on_device_fault(e.what());
      return exit_code_;
    } catch (const std::exception& e) {
      log::error("worker rank {}: the rank set failed: {}", o_.rank, e.what());
      // The server lost a rank, not the request: 503 like the frontend's own report of the dead process (whichever
      // of the two reaches the client first).
      engine_->fail_all(fmt::format("the rank set failed: {}", e.what()), 503);
      flush_events();
      status_.phase = "failed";
      status_.error = e.what();
      send_status();
      return 1;
    }
    flush_events();
    if (ms_until_status() <= 0) send_status();
  }
  flush_events();
  return 0;
}

void Worker::poll_messages(int64_t timeout_ms) {
  zmq::pollitem_t item{sock_.handle(), 0, ZMQ_POLLIN, 0};
  zmq::poll(&item, 1, std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0)));
  if ((item.revents & ZMQ_POLLIN) == 0) return;
  zmq::message_t frame;
  while (!stop_ && sock_.recv(frame, zmq::recv_flags::dontwait)) handle(frame);
}

void Worker::handle(const zmq::message_t& frame) {
  if (frame.size() == 0) return;  // an empty delimiter frame, if a peer sends one
  proto::Message m;
  try {
    m = proto::decode(std::span<const std::byte>(static_cast<const std::byte*>(frame.data()), frame.size()));
  } catch (const std::exception& e) {
    log::warn("worker rank {}: dropped a malformed message: {}", o_.rank, e.what());
    return;
  }
  if (m.type == "generate") {
    log::debug("worker rank {}: a generate request arrived", o_.rank);
    on_generate(m);
  } else if (m.type == "cancel") {
    try {
      const auto c = proto::body_as<proto::Cancel>(m);
      if (engine_) engine_->cancel(c.id);
    } catch (const std::exception& e) {
      log::warn("worker rank {}: bad cancel: {}", o_.rank, e.what());
    }
  } else if (m.type == "status_request") {
    send_status();
  } else if (m.type == "shutdown") {
    stop_ = true;
  } else {
    log::warn("worker rank {}: ignored a message of unknown type '{}'", o_.rank, m.type);
  }
}

void Worker::on_generate(const proto::Message& m) {
  proto::GenerateRequest g;
  try {
    g = proto::body_as<proto::GenerateRequest>(m);
  } catch (const std::exception& e) {
    auto it = m.body.find("id");
    if (it == m.body.end() || !it->is_string()) {
      log::warn("worker rank {}: dropped a generate without an id: {}", o_.rank, e.what());
      return;
    }
    send_event(error_event(it->get<std::string>(), 400, e.what()));
    return;
  }
  if (!engine_) {
    send_event(error_event(g.id, 503, fmt::format("worker rank {} is still loading the model", o_.rank)));
    return;
  }
  engine_->submit(std::move(g));
}

void Worker::send(const std::string& frame) { sock_.send(zmq::buffer(frame), zmq::send_flags::none); }

void Worker::send_status() {
  if (engine_) engine_->fill_status(status_);
  send(proto::encode("status", status_));
  last_status_ = Clock::now();
}

void Worker::flush_events() {
  if (!engine_) return;
  for (const proto::TokenEvent& ev : engine_->take_events()) send_event(ev);
}

int64_t Worker::ms_until_status() const {
  const auto since = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - last_status_).count();
  return o_.status_interval_ms - since;
}

bool Worker::parent_gone() {
  if (o_.parent_pid <= 0) return false;
  const auto pid = static_cast<pid_t>(o_.parent_pid);
  parent_dead_ = (parent_is_ppid_ && getppid() != pid) || (kill(pid, 0) != 0 && errno == ESRCH);
  return parent_dead_;
}

}  // namespace

void validate_worker_options(const WorkerOptions& o) {
  BG_CHECK(!o.model_dir.empty(), "--model is required");
  BG_CHECK(!o.endpoint.empty(), "--endpoint is required");
  BG_CHECK(o.rank >= 0, "--rank {} must be >= 0", o.rank);
  BG_CHECK(o.routing_id.size() <= 255, "--routing-id must be at most 255 bytes (a ZeroMQ routing id)");
  BG_CHECK(o.device == "cpu" || o.device == "cuda", "--device '{}' must be cpu or cuda", o.device);
  BG_CHECK(o.max_num_seqs >= 0, "--max-num-seqs {} must be >= 1", o.max_num_seqs);
  BG_CHECK(o.max_model_len == 0 || o.max_model_len >= 2, "--max-model-len {} must be >= 2", o.max_model_len);
  BG_CHECK(o.chunked_prefill_size >= 1, "--chunked-prefill-size {} must be >= 1", o.chunked_prefill_size);
  BG_CHECK(o.idle_prefill_size == -1 || o.idle_prefill_size == 0 || o.idle_prefill_size >= o.chunked_prefill_size,
           "--idle-prefill-size {} must be 0 (off) or >= --chunked-prefill-size {}", o.idle_prefill_size,
           o.chunked_prefill_size);
  BG_CHECK(o.max_queue >= 0, "--max-queue {} must be >= 0", o.max_queue);
  BG_CHECK(o.kv_block_size >= 1 && o.kv_block_size <= 4096, "--kv-block-size {} must be in [1, 4096]",
           o.kv_block_size);
  BG_CHECK(o.kv_cache_memory_bytes >= 0, "--kv-cache-memory-bytes {} must be > 0", o.kv_cache_memory_bytes);
  BG_CHECK(o.gpu_memory_utilization > 0.0 && o.gpu_memory_utilization <= 1.0,
           "--gpu-memory-utilization {} must be in (0, 1]", o.gpu_memory_utilization);
  BG_CHECK(o.parent_pid >= 0, "--parent-pid {} must be >= 0", o.parent_pid);
  BG_CHECK(o.host_memory_gb >= 0.0 && o.host_memory_gb <= 1e6, "--host-memory-gb {} must be in [0, 1e6]",
           o.host_memory_gb);
  BG_CHECK(o.snapshot_interval >= 0, "--prefix-snapshot-interval {} must be >= 1", o.snapshot_interval);
  BG_CHECK(o.swap_quantum_steps >= 0, "--swap-quantum-steps {} must be >= 0", o.swap_quantum_steps);
  kv::parse_state_codec(o.state_offload_dtype);
  BG_CHECK(o.status_interval_ms >= 1 && o.idle_poll_ms >= 1, "status interval {} ms and idle poll {} ms must be >= 1",
           o.status_interval_ms, o.idle_poll_ms);
  const dist::ParallelLayout layout = dist::ParallelLayout::from_flags(o.parallel);
  BG_CHECK(o.rank < layout.world(), "--rank {} is outside the {} ranks of {}", o.rank, layout.world(),
           layout.describe());
  BG_CHECK(!layout.multi_rank() || !o.rendezvous.empty(), "--rendezvous is required with several ranks ({})",
           layout.describe());
  BG_CHECK(dist::is_cuda_exchange(o.moe_exchange), "--k3-moe-exchange {} must be {}", o.moe_exchange,
           dist::kCudaExchangeNames);
  BG_CHECK(dist::exchange_fits_device(o.device, o.moe_exchange), "{}", dist::kLlFp8NeedsCuda);
  BG_CHECK(o.moe_exchange_tokens >= 0, "--moe-exchange-tokens {} must be >= 0", o.moe_exchange_tokens);
}

namespace {

// Ranks of this host on this rank's GPU: ll rank sets put local rank r on GPU r mod the visible GPUs (dist/rank_setup).
int64_t ranks_per_device(const WorkerOptions& o, const dist::RankPlace& place) {
  if (o.device != "cuda" || !place.layout.multi_rank() || !dist::is_ll_exchange(o.moe_exchange)) return 1;
#ifdef BG_HAVE_CUDA
  const int64_t gpus = cuda::device_count();
  if (gpus <= 0) return 1;  // the backend says there is no GPU
  const int64_t local = place.layout.ranks_per_node(), gpu = (place.rank % local) % gpus;
  return local / gpus + (gpu < local % gpus ? 1 : 0);
#else
  return 1;
#endif
}

// The plan again with `in` (after the step profile). A rank set agrees on it (the smallest of every rank's numbers);
// a rank whose plan fails marks the set failed first, so the others do not wait for it.
sched::Plan replan_for_set(const sched::ModelGeometry& geo, const sched::PlannerInput& in,
                           const sched::MemoryProbe& probe, const dist::RankContext* ranks, int32_t rank) {
  sched::Plan plan;
  try {
    plan = sched::make_plan(geo, in, probe);
  } catch (const Error& e) {
    if (ranks != nullptr) ranks->world->mark_failed(fmt::format("rank {}: {}", rank, e.what()));
    throw;
  }
  if (ranks == nullptr) return plan;
  std::array<int64_t, 3> least{-plan.max_num_seqs, -plan.running_kv_blocks(), -plan.max_model_len};
  ranks->world->all_reduce_max(least);  // the max of the negated numbers: their minimum
  plan.agree(-least[0], -least[1], -least[2]);
  return plan;
}

}  // namespace

std::unique_ptr<Engine> load_engine(const WorkerOptions& o, const std::function<void(const std::string&)>& on_phase,
                                    const std::function<bool()>& abandon) {
  validate_worker_options(o);
  const dist::RankPlace place{dist::ParallelLayout::from_flags(o.parallel), o.rank};
  // CUDA: a streamed MXFP4 expert's pool buffer holds it twice (as copied, and laid out for the W4A16 kernel).
  const sched::ModelGeometry geo =
      sched::read_model_geometry(o.model_dir, place, o.resident_experts, o.device == "cuda" ? 2 : 1);
  sched::PlannerInput in;
  in.device = o.device;
  in.kv_block_size = o.kv_block_size;
  in.max_num_seqs = o.max_num_seqs;
  in.max_model_len = o.max_model_len;
  in.kv_cache_memory_bytes = o.kv_cache_memory_bytes;
  in.gpu_memory_utilization = o.gpu_memory_utilization;
  in.ranks_per_device = ranks_per_device(o, place);
  in.host_memory_bytes = static_cast<int64_t>(o.host_memory_gb * static_cast<double>(int64_t{1} << 30));
  // TP ranks run their leader's step layouts on pools of their own, so those pools must hold what the leader's hold:
  // the prefix cache and the host tier, which move state only in the leader's pools, are not available with TP.
  const bool tp = place.layout.tp() > 1;
  BG_CHECK(!tp || in.host_memory_bytes == 0, "--host-memory-gb is not available with --tp {} (docs/PARALLEL.md)",
           place.layout.tp());
  in.prefix_cache = o.prefix_cache && !tp;
  if (o.prefix_cache && tp) log::info("worker rank {}: prefix cache off with --tp {} (docs/PARALLEL.md)", o.rank,
                                      place.layout.tp());
  in.snapshot_interval = o.snapshot_interval;
  in.state_codec = kv::parse_state_codec(o.state_offload_dtype);
  in.deterministic = o.deterministic;
  // One probe before the weights load: a second plan (after the profile step below) must see the same free memory.
  const sched::DeviceMemory device_memory =
      o.kv_cache_memory_bytes > 0 ? sched::DeviceMemory{} : sched::probe_device_memory(o.device);
  const sched::MemoryProbe probe = [&](const std::string&) { return device_memory; };
  sched::Plan plan = sched::make_plan(geo, in, probe);
  log::info("worker rank {}: {}", o.rank, plan.describe());
  std::shared_ptr<dist::RankContext> ranks;
  if (place.layout.multi_rank()) {
    // Join the set with this rank's plan; every rank then runs the smallest (TP ranks mirror their leader's pools).
    if (on_phase) on_phase("joining");
    dist::RankSetup s;
    s.place = place;
    s.device = o.device;
    s.exchange = o.moe_exchange;
    s.rendezvous = o.rendezvous;
    s.link_key = dist::load_link_key(o.node_secret_file);
    s.plan = {plan.max_num_seqs, plan.running_kv_blocks(), plan.max_model_len};
    s.max_tokens_per_call = o.moe_exchange_tokens;
    s.abandon = abandon;
    dist::StartedRank started = dist::start_rank(s);
    plan.agree(started.plan.at(0), started.plan.at(1), started.plan.at(2));
    log::info("worker rank {}: the set runs {}", o.rank, plan.describe());
    ranks = std::move(started.ranks);
    if (on_phase) on_phase("loading");
  }
  const int64_t idle_prefill_size = o.idle_prefill_size == -1 ? idle_prefill_default(o.device, o.chunked_prefill_size)
                                                              : o.idle_prefill_size;
  LoadOptions lo = plan.load_options();
  lo.ranks = ranks;
  lo.weight_store = o.weight_store;
  lo.distributed_weight_config = o.distributed_weight_config;
  lo.resident_experts = o.resident_experts;
  lo.expert_trace = o.expert_trace;
  lo.background_plans = true;  // no request waits for a cuDNN plan build (BackendOptions::background_plans)
  std::unique_ptr<Model> model = load_model(o.model_dir, lo);
  // A CUDA budget from free memory: measure the largest step and plan again without its memory. In a rank set every
  // rank measures together (the largest need over the set) and the set agrees on the new plan.
  if (o.device == "cuda" && o.kv_cache_memory_bytes == 0 && o.profile_memory) {
    if (on_phase) on_phase("measuring a step");
    const int64_t step = o.deterministic ? o.chunked_prefill_size : std::max(o.chunked_prefill_size, idle_prefill_size);
    try {
      in.activation_reserve_bytes = profile_step_memory(*model, ranks.get(), step, plan.max_model_len,
                                                        ops::MlaPrefillOptions{}.max_pass_rows);
    } catch (const DeviceFault&) {
      throw;  // the context is gone: the supervisor's report names the fault
    } catch (const dist::RankFailure&) {
      throw;  // another rank failed: its own error says why
    } catch (const Error& e) {
      const std::string why = fmt::format("worker rank {}: measuring a {}-token prefill step before sizing the KV "
                                          "cache failed: {} (lower --idle-prefill-size / --chunked-prefill-size, or "
                                          "--no-step-profile to size the cache without it)", o.rank, step, e.what());
      if (ranks) ranks->world->mark_failed(why);
      fail("{}", why);
    }
    plan = replan_for_set(geo, in, probe, ranks.get(), o.rank);
    log::info("worker rank {}: with the largest step measured{}: {}", o.rank, ranks ? " (over the set)" : "",
              plan.describe());
  }
  BG_CHECK(o.chunked_prefill_size >= plan.max_num_seqs, "--chunked-prefill-size {} must be >= --max-num-seqs {} "
           "(every running sequence decodes one token per step)", o.chunked_prefill_size, plan.max_num_seqs);
  sched::SchedulerConfig sc;
  sc.max_num_seqs = plan.max_num_seqs;
  sc.max_model_len = plan.max_model_len;
  sc.chunked_prefill_size = o.chunked_prefill_size;
  sc.idle_prefill_size = idle_prefill_size;
  sc.max_queue = o.max_queue;
  sc.swap_quantum_steps = o.swap_quantum_steps;
  sc.deterministic = o.deterministic;
  auto engine = std::make_unique<Engine>(std::move(model), plan.state_plan(), sc);
  if (o.warmup && o.device == "cuda" && !ranks) {
    if (on_phase) on_phase("warming up");
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t steps = engine->warm_up();
    log::info("worker rank {}: warmed up in {:.2f} s ({} steps: a {}-token prefill step, then decode graphs of 1 to "
              "{} sequences)", o.rank, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
              steps, engine->warm_up_prefill_tokens(), sc.max_num_seqs);
  }
  if (ranks) ranks->world->barrier();  // ready only once every rank has loaded
  return engine;
}

int64_t idle_prefill_default(const std::string& device, int64_t chunked_prefill_size) {
  return device == "cuda" ? std::max<int64_t>(8192, chunked_prefill_size) : 0;
}

int run_worker(const WorkerOptions& options) {
  Worker worker(options);
  return worker.run();
}

}  // namespace bg::engine
