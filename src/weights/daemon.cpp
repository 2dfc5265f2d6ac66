// WeightDaemon: the lock, the control loop (main thread) and the loader thread (adopt or build, then serve peers).
#include "weights/daemon.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "core/error.h"
#include "core/log.h"
#include "weights/control.h"
#include "weights/dist_config.h"
#include "weights/peer_fetch.h"
#include "weights/peer_server.h"
#include "weights/progress.h"

namespace bg::weights {

using json = nlohmann::json;

struct WeightDaemon::State {
  DaemonOptions o;
  std::mutex mu;  // guards everything below that the loader writes and the control loop reads
  std::string phase = "starting";
  std::string error;
  std::string origin;  // "loaded" | "adopted"
  std::vector<std::string> repaired;
  BuildReport report;
  double ready_seconds = 0.0;
  Manifest manifest;
  std::vector<MappedSegment> segments;
  const LoadProgress* progress = nullptr;
  std::unique_ptr<PeerServer> peer_server;
  std::map<pid_t, std::pair<unsigned long long, int>> clients;  // pid -> (start ticks, attaches)
  std::atomic<bool> stop{false};
  std::atomic<bool> cancel_load{false};
  bool remove_segments = true;
  std::function<void(const std::string&)> on_ready;
  std::thread loader;
  int lock_fd = -1;

  void set_phase(const std::string& p) {
    std::lock_guard lock(mu);
    phase = p;
  }
  void load();
  void load_store(const std::vector<std::string>* shards, const DistConfig* dist);
  json status();
  json handle(const json& req, const PeerCredentials& peer);
  void prune_clients();
};

namespace {

int take_lock(const std::string& name) {
  const auto path = lock_file_path(name);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  BG_CHECK(fd >= 0, "cannot open {}: {}", path.string(), std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char buf[32] = {};
    const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    ::close(fd);
    fail("a weight daemon named '{}' is already running (pid {}); `batchgen weightd status --name {}` shows it", name,
         n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("?"), name);
  }
  const std::string pid = std::to_string(::getpid());
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    log::warn("cannot write the pid into {}", path.string());
  }
  return fd;
}

std::string hex(uint64_t v) { return fmt::format("{:016x}", v); }

}  // namespace

void WeightDaemon::State::prune_clients() {
  for (auto it = clients.begin(); it != clients.end();) {
    it = process_start_ticks(it->first) != it->second.first ? clients.erase(it) : std::next(it);
  }
}

json WeightDaemon::State::status() {
  std::lock_guard lock(mu);
  prune_clients();
  int n_clients = 0;
  for (const auto& [pid, c] : clients) n_clients += c.second;
  size_t n_expert = 0;
  uint64_t tensor_bytes = 0;
  for (const GroupInfo& g : manifest.groups) n_expert += g.kind == GroupKind::kExpert;
  for (const TensorInfo& t : manifest.tensors) tensor_bytes += is_packed_role(t.role) ? 0 : t.bytes;
  json j = {{"name", o.name},
            {"pid", ::getpid()},
            {"phase", phase},
            {"model", o.model_dir.string()},
            {"layout_version", kStoreLayoutVersion},
            {"clients", n_clients}};
  if (!error.empty()) j["error"] = error;
  if (progress != nullptr) j["progress"] = {{"bytes", progress->done_bytes()}, {"total", progress->total_bytes()}};
  if (phase == "ready") {
    j["origin"] = origin;
    j["adopted"] = origin == "adopted";
    j["loaded"] = origin == "loaded";
    j["arch"] = manifest.arch;
    j["generation"] = hex(manifest.generation);
    j["bytes"] = manifest.total_bytes();
    j["tensor_bytes"] = tensor_bytes;
    j["tensors"] = manifest.n_checkpoint_tensors();
    j["segments"] = manifest.segments.size();
    j["expert_blocks"] = n_expert;
    j["expert_layout"] = expert_layout_name(manifest.expert_layout);
    j["w4a16_blocks"] = manifest.packed.size();  // experts held in the GPU kernel's layout (the others as stored)
    std::set<int32_t> numa;
    for (const SegmentInfo& seg : manifest.segments) numa.insert(seg.numa_node);
    j["numa_nodes"] = numa;  // -1: no NUMA policy (one node)
    j["repaired_tensors"] = repaired;
    j["ready_seconds"] = ready_seconds;
    if (origin == "loaded") {
      j["load"] = {{"bytes", report.bytes}, {"seconds", report.seconds}, {"reader", report.reader},
                   {"gb_per_s", report.seconds > 0 ? static_cast<double>(report.bytes) / report.seconds / 1e9 : 0.0}};
      if (manifest.expert_layout == ExpertLayout::kW4a16) {
        j["load"]["w4a16_pack_seconds"] = report.pack_seconds;
        if (report.w4a16_kept > 0) j["load"]["w4a16_kept"] = {report.w4a16_kept, report.w4a16_first_kept};
      }
    }
    if (peer_server) j["peer"] = {{"port", peer_server->port()}, {"bytes_served", peer_server->bytes_served()},
                                  {"refused", peer_server->n_refused()}};
  }
  return j;
}

json WeightDaemon::State::handle(const json& req, const PeerCredentials& peer) {
  const std::string cmd = req.is_object() && req.contains("cmd") && req["cmd"].is_string() ? req["cmd"].get<std::string>()
                                                                                           : "";
  if (cmd == "status") return {{"ok", true}, {"status", status()}};
  if (cmd == "attach") {
    json st = status();
    if (st["phase"] != "ready") return {{"ok", false}, {"status", st}, {"error", "the store is not ready"}};
    std::lock_guard lock(mu);
    auto& c = clients[peer.pid];
    const unsigned long long ticks = process_start_ticks(peer.pid);
    if (c.first != ticks) c = {ticks, 0};
    ++c.second;
    return {{"ok", true}, {"store", o.name}, {"generation", hex(manifest.generation)}, {"status", st}};
  }
  if (cmd == "detach") {
    std::lock_guard lock(mu);
    auto it = clients.find(peer.pid);
    if (it != clients.end() && --it->second.second <= 0) clients.erase(it);
    return {{"ok", true}};
  }
  if (cmd == "shutdown") {
    remove_segments = !(req.contains("keep_segments") && req["keep_segments"].is_boolean() &&
                        req["keep_segments"].get<bool>());
    stop = true;
    return {{"ok", true}, {"status", status()}};
  }
  return {{"ok", false}, {"error", fmt::format("unknown command '{}' (status, attach, detach, shutdown)", cmd)}};
}

void WeightDaemon::State::load_store(const std::vector<std::string>* shards, const DistConfig* dist) {
  StoreInput in = scan_model(o.model_dir, shards);
  // Tensors of other nodes' shards, when this daemon fetches what it lacks.
  PeerSet peers;
  std::map<std::string, RemoteTensor> remote;
  std::vector<PlannedTensor> extra;
  if (dist != nullptr && o.fetch_missing) {
    set_phase("connecting");
    peers = PeerSet::connect(*dist, o.node, o.model_dir, [&](const std::string& n) { return in.ranges.count(n) != 0; });
    remote = plan_fetch(peers, [&](const std::string& n) { return in.ranges.count(n) != 0; });
    const Placement placement = Placement::for_model(o.model_dir);
    extra = remote_planned(peers, remote, placement, static_cast<uint32_t>(in.sources.size()));
    for (const auto& c : peers.clients) in.sources.push_back("peer:" + c->node());
  }
  std::vector<PlannedTensor> expected = in.tensors;
  expected.insert(expected.end(), extra.begin(), extra.end());
  set_phase("verifying");
  // A store-layout directory brings its own expert layout.
  const ExpertLayout want = in.prebuilt ? in.prebuilt->expert_layout : o.build.expert_layout;
  AdoptResult a = open_for_adoption(o.name, expected, in.arch, in.config_xxh64, want, o.verify_threads,
                                    o.progress_tty);
  if (a.adopted) {
    std::vector<std::string> bad;
    for (uint32_t i : a.corrupt) bad.push_back(a.manifest.tensors[i].name);
    if (!bad.empty() && o.on_corrupt == OnCorrupt::kRefuse) {
      fail("weight store {}: {} tensor(s) no longer match their checksums (first: '{}'); the store was left as it is "
           "(--on-corrupt reload re-reads them; `batchgen weightd stop --name {}` removes the store)", o.name,
           bad.size(), bad.front(), o.name);
    }
    if (!bad.empty()) {
      log::warn("weight store {}: {} corrupt tensor(s) (first: '{}'); re-reading them", o.name, bad.size(),
                bad.front());
      std::vector<uint32_t> local;
      std::map<std::string, RemoteTensor> refetch;
      for (uint32_t i : a.corrupt) {
        const std::string& n = a.manifest.tensors[i].name;
        if (in.ranges.count(n)) local.push_back(i); else refetch[n] = remote.at(n);
      }
      if (!local.empty()) repair_from_input(in, a, local, o.build.read);
      if (!refetch.empty()) fetch_into(peers, refetch, a.manifest, a.segments, o.progress_tty);
    }
    std::lock_guard lock(mu);
    origin = "adopted";
    repaired = std::move(bad);
    manifest = std::move(a.manifest);
    segments = std::move(a.segments);
    return;
  }
  if (!list_store_shm(o.name).empty()) {
    BG_CHECK(o.on_corrupt != OnCorrupt::kRefuse, "weight store {}: the existing store cannot be adopted ({}); it was "
             "left as it is (--on-corrupt reload rebuilds it)", o.name, a.not_adopted);
    log::warn("weight store {}: not adopting the existing segments ({}); rebuilding", o.name, a.not_adopted);
    remove_store_shm(o.name);
  }
  set_phase("loading");
  BuildOptions bo = o.build;
  bo.progress_tty = o.progress_tty;
  bo.read.cancel = &cancel_load;
  bo.on_progress = [this](const LoadProgress* p) {
    std::lock_guard lock(mu);
    progress = p;
  };
  BuiltStore b = build_store(in, StoreTarget::shm(o.name), bo, extra);
  if (!extra.empty()) {
    set_phase("fetching");
    try {
      fetch_into(peers, remote, b.manifest, b.segments, o.progress_tty);
      StoreTarget::shm(o.name).finish(b.manifest);
    } catch (...) {
      b.segments.clear();
      remove_store_shm(o.name);
      throw;
    }
  }
  std::lock_guard lock(mu);
  origin = "loaded";
  report = b.report;
  manifest = std::move(b.manifest);
  segments = std::move(b.segments);
}

void WeightDaemon::State::load() {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    std::optional<DistConfig> dist;
    const std::vector<std::string>* shards = nullptr;
    if (!o.distributed_config.empty()) {
      BG_CHECK(o.build.expert_layout == ExpertLayout::kCheckpoint, "--expert-layout w4a16 is not supported with "
               "--distributed-weight-config yet: peers exchange tensors as the checkpoint holds them");
      dist = load_dist_config(o.distributed_config);
      shards = &dist->node(o.node).shards;
    }
    load_store(shards, dist ? &*dist : nullptr);
    if (dist) {
      const DistNode& self = dist->node(o.node);
      std::vector<const std::byte*> bases;
      for (const MappedSegment& s : segments) bases.push_back(s.data());
      auto catalog = std::make_shared<StoreCatalog>(manifest, std::move(bases));
      auto server = std::make_unique<PeerServer>(PeerServerOptions{self.host, self.port, dist->secret}, catalog);
      std::lock_guard lock(mu);
      peer_server = std::move(server);
    }
    {
      std::lock_guard lock(mu);
      ready_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      phase = "ready";
    }
    log::info("weight store {} ready ({}): {} tensors, {} in {} segments, {:.2f} s", o.name, origin,
              manifest.n_checkpoint_tensors(), format_bytes(manifest.total_bytes()), manifest.segments.size(),
              ready_seconds);
    on_ready("");
  } catch (const std::exception& e) {
    {
      std::lock_guard lock(mu);
      phase = "failed";
      error = e.what();
    }
    log::error("weight store {}: {}", o.name, e.what());
    on_ready(e.what());
  }
}

WeightDaemon::WeightDaemon(DaemonOptions options) : s_(std::make_unique<State>()) { s_->o = std::move(options); }

WeightDaemon::~WeightDaemon() {
  s_->cancel_load = true;
  if (s_->loader.joinable()) s_->loader.join();
}

void WeightDaemon::request_stop(bool remove_segments) {
  std::lock_guard lock(s_->mu);
  s_->remove_segments = remove_segments;
  s_->stop = true;
}

int WeightDaemon::run(const std::function<void(const std::string& error)>& on_ready) {
  State& s = *s_;
  check_store_name(s.o.name);
  s.on_ready = on_ready;
  s.lock_fd = take_lock(s.o.name);
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  if (s.o.handle_signals) pthread_sigmask(SIG_BLOCK, &sigs, nullptr);  // the loader thread inherits the mask
  const auto sock_path = control_socket_path(s.o.name);
  ::unlink(sock_path.c_str());  // a socket left by a killed daemon (we hold the lock, so nobody else owns it)
  zmq::context_t ctx(1);
  zmq::socket_t sock(ctx, zmq::socket_type::router);
  sock.set(zmq::sockopt::linger, 0);
  const int uid = static_cast<int>(::geteuid());
  // Kernel-level filter: connections from other uids are dropped before any message (the runtime dir is 0700 too).
  zmq_setsockopt(sock.handle(), ZMQ_IPC_FILTER_UID, &uid, sizeof(uid));
  sock.bind("ipc://" + sock_path.string());
  ::chmod(sock_path.c_str(), 0600);
  log::info("weight daemon {} (pid {}): control socket {}", s.o.name, ::getpid(), sock_path.string());
  s.loader = std::thread([&s] { s.load(); });
  while (!s.stop) {
    zmq::pollitem_t item{sock.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(200));
    if ((item.revents & ZMQ_POLLIN) != 0) {
      std::vector<zmq::message_t> frames;
      (void)zmq::recv_multipart(sock, std::back_inserter(frames));
      if (frames.size() == 3) {
        auto cred = parse_peer_address(frames[2].gets("Peer-Address"));
        json reply;
        if (!cred || cred->uid != ::geteuid()) {
          reply = {{"ok", false}, {"error", "refused: the connecting process does not belong to this user"}};
        } else {
          json req = json::parse(frames[2].to_string_view(), nullptr, /*allow_exceptions=*/false);
          reply = req.is_discarded() ? json{{"ok", false}, {"error", "the request is not JSON"}} : s.handle(req, *cred);
        }
        const std::string text = reply.dump();
        std::array<zmq::const_buffer, 3> out = {zmq::buffer(frames[0].data(), frames[0].size()), zmq::const_buffer{},
                                                zmq::buffer(text)};
        (void)zmq::send_multipart(sock, out);
      }
    }
    if (s.o.handle_signals) {
      const timespec zero{0, 0};
      if (const int sig = sigtimedwait(&sigs, nullptr, &zero); sig > 0) {
        log::info("weight daemon {}: {} received; stopping (segments kept for adoption)", s.o.name, strsignal(sig));
        s.remove_segments = false;
        s.stop = true;
      }
    }
    std::lock_guard lock(s.mu);
    if (s.phase == "failed") break;
  }
  s.cancel_load = true;
  if (s.loader.joinable()) s.loader.join();
  {
    std::lock_guard lock(s.mu);
    s.peer_server.reset();
    s.segments.clear();
  }
  const bool failed = s.phase == "failed";
  if (s.remove_segments && !failed) {
    log::info("weight daemon {}: removed {} shared-memory objects", s.o.name, remove_store_shm(s.o.name));
  }
  sock.close();
  ::unlink(sock_path.c_str());
  ::close(s.lock_fd);
  return failed ? 1 : 0;
}

}  // namespace bg::weights
