// The weight peers over UCX on loopback: fetching verified tensors; refusing a wrong secret (both ways), reads outside
// a tensor, and lying peers (bad offsets in the manifest, too-long replies, corrupt bytes); two daemons sharing a
// checkpoint's shards, an engine reading through them (identical logits), and a daemon fetching what it lacks.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>
#include <vector>

#include "formats/checkpoint.h"
#include "model/model_testing.h"
#include "port_testing.h"
#include "weights/dist_config.h"
#include "weights/checksum.h"
#include "weights/peer_client.h"
#include "weights/peer_server.h"
#include "weights/peer_wire.h"
#include "weights/store_builder.h"
#include "weights/store_source.h"
#include "weights/ucx.h"
#include "weights_testing.h"

namespace bg::testing {
namespace {

using namespace bg::weights;
using json = nlohmann::json;

const std::string kSecret = "0123456789abcdef0123456789abcdef-test";

PeerClientOptions fast() {
  PeerClientOptions o;
  o.timeout_ms = 20000;
  o.connect_timeout_ms = 3000;
  o.chunk_bytes = 8192;  // many chunks in flight even for tiny tensors
  return o;
}

// A store of `model` in shared memory, mapped, served by a catalog.
struct ServedStore {
  StoreGuard guard;
  std::shared_ptr<StoreSource> source;
  std::shared_ptr<StoreCatalog> catalog;
  explicit ServedStore(const std::string& model) {
    BuildOptions o;
    o.progress_tty = 0;
    build_store(scan_model(golden_model(model), nullptr), StoreTarget::shm(guard.name()), o);
    source = StoreSource::open_shm(guard.name(), 0);
    std::vector<const std::byte*> bases;
    for (const HostRegion& r : source->pinnable_regions()) bases.push_back(r.data);
    catalog = std::make_shared<StoreCatalog>(source->manifest(), bases);
  }
};

TEST(Peer, FetchesEveryTensorVerifiedAndRefusesReadsOutsideATensor) {
  ServedStore s("deepseek_v3/tiny-fp8");
  PeerServer server({"127.0.0.1", 0, kSecret}, s.catalog);
  PeerClient client("a", "127.0.0.1", server.port(), kSecret, fast());
  const Manifest& m = client.manifest();
  ASSERT_EQ(m.tensors.size(), s.source->manifest().tensors.size());
  for (uint32_t i = 0; i < m.tensors.size(); ++i) {
    std::vector<std::byte> dst(m.tensors[i].bytes);
    client.fetch(i, dst.data());
    const auto want = s.source->tensor_bytes(i);
    ASSERT_EQ(std::memcmp(dst.data(), want.data(), want.size()), 0) << m.tensors[i].name;
  }
  std::vector<std::byte> buf(1 << 16);
  const uint64_t size0 = m.tensors[0].bytes;
  EXPECT_NE(bg_error_of([&] { client.read(0, size0, 1, buf.data()); }).find("outside tensor"), std::string::npos);
  EXPECT_NE(bg_error_of([&] { client.read(0, 1, size0, buf.data()); }).find("outside tensor"), std::string::npos);
  EXPECT_NE(bg_error_of([&] { client.read(99999, 0, 1, buf.data()); }).find("does not exist"), std::string::npos);
  EXPECT_NE(bg_error_of([&] { client.read(0, ~uint64_t{0} - 2, 8, buf.data()); }).find("outside tensor"),
            std::string::npos);
  EXPECT_GE(server.n_refused(), 4u);
  client.read(0, 0, std::min<uint64_t>(size0, 100), buf.data());  // the connection survives refusals
}

TEST(Peer, ClientRefusesAServerWithoutTheSecret) {
  ServedStore s("deepseek_v3/tiny-fp8");
  PeerServer server({"127.0.0.1", 0, std::string(40, 'x')}, s.catalog);
  EXPECT_NE(bg_error_of([&] { PeerClient("a", "127.0.0.1", server.port(), kSecret, fast()); })
                .find("does not know the shared secret"),
            std::string::npos);
}

// A raw client that skips the server check and answers the challenge wrongly: the server refuses it and serves it
// nothing (no manifest, no bytes).
TEST(Peer, ServerRefusesAClientWithoutTheSecret) {
  ServedStore s("deepseek_v3/tiny-fp8");
  PeerServer server({"127.0.0.1", 0, kSecret}, s.catalog);
  UcxWorker w(false);
  struct Got {
    PeerReply reply;
    size_t length = 0;
    bool done = false;
  } got;
  w.set_am_handler(
      kPeerReplyId,
      [](void* arg, const void* header, size_t header_length, void*, size_t length,
         const ucp_am_recv_param_t* param) -> ucs_status_t {
        auto* g = static_cast<Got*>(arg);
        if (header_length == sizeof(PeerReply)) std::memcpy(&g->reply, header, sizeof(PeerReply));
        g->length = length;
        g->done = true;
        return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 ? UCS_ERR_CANCELED : UCS_OK;
      },
      &got);
  ucp_ep_h ep = ucx_connect(w, "127.0.0.1", server.port(), [](void*, ucp_ep_h, ucs_status_t) {}, nullptr);
  auto request = [&](PeerOp op, const Digest& d) {
    PeerRequest r;
    r.op = static_cast<uint32_t>(op);
    r.nonce_or_mac = d;
    got = {};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    w.wait_request(ucp_am_send_nbx(ep, kPeerRequestId, &r, sizeof(r), nullptr, 0, &p), 10000, "send");
    EXPECT_TRUE(wait_for([&] { w.progress(); return got.done; }, 10000));
    return got;
  };
  Got hello = request(PeerOp::kHello, random_nonce());
  EXPECT_EQ(hello.reply.ok, 1u);
  Got auth = request(PeerOp::kAuth, random_nonce());  // not HMAC(secret, ...)
  EXPECT_EQ(auth.reply.ok, 0u);
  EXPECT_NE(reply_error(auth.reply).find("authentication failed"), std::string::npos);
  Got manifest = request(PeerOp::kManifest, {});
  EXPECT_EQ(manifest.reply.ok, 0u);
  EXPECT_EQ(manifest.length, 0u);
  EXPECT_NE(reply_error(manifest.reply).find("not authenticated"), std::string::npos);
  ucx_close(w, ep, 1000);
}

// Serves an honest store with one lie.
class LyingCatalog final : public PeerCatalog {
 public:
  enum class Lie { kOffsetOutsideSegment, kLongReply, kCorruptBytes };
  LyingCatalog(const ServedStore& s, Lie lie) : honest_(*s.catalog), lie_(lie) {
    Manifest m = s.source->manifest();
    if (lie == Lie::kOffsetOutsideSegment) m.tensors[5].offset = m.segments[m.tensors[5].segment].bytes + 4096;
    manifest_ = encode_manifest(m);
    for (uint32_t i = 0; i < honest_.n_tensors(); ++i) {
      auto b = honest_.read(i, 0, honest_.tensor_bytes(i));
      copies_.emplace_back(b.begin(), b.end());
      copies_.back().resize(b.size() + 64);
    }
  }
  std::span<const std::byte> manifest_bytes() const override { return manifest_; }
  size_t n_tensors() const override { return honest_.n_tensors(); }
  uint64_t tensor_bytes(uint32_t i) const override { return honest_.tensor_bytes(i); }
  std::span<const std::byte> read(uint32_t i, uint64_t offset, uint64_t bytes) const override {
    auto& c = const_cast<std::vector<std::byte>&>(copies_[i]);
    if (lie_ == Lie::kLongReply) return {c.data() + offset, bytes + 16};
    if (lie_ == Lie::kCorruptBytes) c[offset] ^= std::byte{1};
    return {c.data() + offset, bytes};
  }

 private:
  const StoreCatalog& honest_;
  Lie lie_;
  std::vector<std::byte> manifest_;
  std::vector<std::vector<std::byte>> copies_;
};

TEST(Peer, LyingPeersAreRefused) {
  ServedStore s("deepseek_v3/tiny-fp8");
  using Lie = LyingCatalog::Lie;
  {
    PeerServer server({"127.0.0.1", 0, kSecret}, std::make_shared<LyingCatalog>(s, Lie::kOffsetOutsideSegment));
    EXPECT_NE(bg_error_of([&] { PeerClient("a", "127.0.0.1", server.port(), kSecret, fast()); }).find("outside"),
              std::string::npos);
  }
  for (Lie lie : {Lie::kLongReply, Lie::kCorruptBytes}) {
    PeerServer server({"127.0.0.1", 0, kSecret}, std::make_shared<LyingCatalog>(s, lie));
    PeerClient client("a", "127.0.0.1", server.port(), kSecret, fast());
    const uint32_t big = static_cast<uint32_t>(std::max_element(client.manifest().tensors.begin(),
                                                                client.manifest().tensors.end(),
                                                                [](auto& a, auto& b) { return a.bytes < b.bytes; }) -
                                               client.manifest().tensors.begin());
    std::vector<std::byte> dst(client.manifest().tensors[big].bytes + 64, std::byte{0x77});
    const std::string err = bg_error_of([&] { client.fetch(big, dst.data()); });
    EXPECT_NE(err.find(lie == Lie::kLongReply ? "for a request of" : "arrived with checksum"), std::string::npos)
        << err;
    EXPECT_EQ(dst.back(), std::byte{0x77}) << "nothing written past the tensor";
  }
}

// n distinct loopback ports that were free a moment ago (consecutive, outside the ephemeral range).
std::vector<uint16_t> free_ports(size_t n) {
  const int first = free_tcp_ports(static_cast<int>(n));
  std::vector<uint16_t> ports;
  for (size_t i = 0; i < n; ++i) ports.push_back(static_cast<uint16_t>(first + static_cast<int>(i)));
  return ports;
}
uint16_t free_port() { return free_ports(1)[0]; }

// Two daemons each load one shard of the checkpoint; an engine attached to one of them fetches the other shard's
// tensors from the other daemon (UCX's TCP transport on loopback); a third daemon fetches everything it lacks.
TEST(Peer, TwoDaemonsShareACheckpointOverLoopback) {
  ::setenv("UCX_TLS", "tcp,self", 1);  // the TCP transport, as between two hosts (children inherit it)
  TempDir tmp;
  StoreGuard a("a"), b("b"), c("c");
  const auto model = golden_model("kimi_k3/k3-tiny");
  std::ofstream(tmp / "secret") << kSecret << "\n";
  std::filesystem::permissions(tmp / "secret", std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  const std::vector<uint16_t> ports = free_ports(3);
  const json cfg = {{"version", 1},
                    {"secret_file", "secret"},
                    {"nodes", {{{"name", "a"}, {"host", "127.0.0.1"}, {"port", ports[0]}, {"store", a.name()},
                                {"shards", {"model-00001-of-00002.safetensors"}}},
                               {{"name", "b"}, {"host", "127.0.0.1"}, {"port", ports[1]}, {"store", b.name()},
                                {"shards", {"model-00002-of-00002.safetensors"}}},
                               {{"name", "c"}, {"host", "127.0.0.1"}, {"port", ports[2]}, {"store", c.name()},
                                {"shards", json::array()}}}}};
  std::ofstream(tmp / "cfg.json") << cfg.dump(2);
  const std::string cfg_path = (tmp / "cfg.json").string();
  const std::vector<float> direct = score_logits(model, {});
  for (const auto& [guard, node] : {std::pair<StoreGuard*, std::string>{&b, "b"}, {&a, "a"}}) {
    const CmdResult r = run_batchgen({"weightd", "start", "--model", model.string(), "--name", guard->name(),
                                      "--distributed-weight-config", cfg_path, "--node", node});
    ASSERT_EQ(r.rc, 0) << r.err;
  }
  const json sa = store_status(a.name()), sb = store_status(b.name());
  EXPECT_GT(sa["tensors"].get<int64_t>(), 0);
  EXPECT_GT(sb["tensors"].get<int64_t>(), 0);
  EXPECT_EQ(sa["tensors"].get<int64_t>() + sb["tensors"].get<int64_t>(),
            static_cast<int64_t>(Checkpoint::open(model)->names().size()));
  // An engine on node a: its own store plus node b's tensors.
  EXPECT_EQ(score_logits(model, {"--weight-store", a.name(), "--distributed-weight-config", cfg_path}), direct);
  // An engine with no local store: everything from the peers.
  EXPECT_EQ(score_logits(model, {"--distributed-weight-config", cfg_path}), direct);
  // Node c holds no shard and fetches what it lacks: its store alone serves an engine.
  const CmdResult rc = run_batchgen({"weightd", "start", "--model", model.string(), "--name", c.name(),
                                     "--distributed-weight-config", cfg_path, "--node", "c", "--fetch-missing"});
  ASSERT_EQ(rc.rc, 0) << rc.err;
  EXPECT_EQ(store_status(c.name())["tensors"], sa["tensors"].get<int64_t>() + sb["tensors"].get<int64_t>());
  EXPECT_EQ(score_logits(model, {"--weight-store", c.name()}), direct);
  EXPECT_GT(store_status(b.name())["peer"]["bytes_served"].get<int64_t>(), 0);
  // A config with the wrong secret on the engine side is refused by the daemons' check.
  json wrong = cfg;
  wrong.erase("secret_file");
  wrong["secret"] = std::string(40, 'w');
  std::ofstream(tmp / "wrong.json") << wrong.dump();
  std::filesystem::permissions(tmp / "wrong.json", std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  const CmdResult refused = run_batchgen({"score", "--model", model.string(), "--tokens", "1,2", "--out",
                                          (tmp / "x.safetensors").string(), "--distributed-weight-config",
                                          (tmp / "wrong.json").string()});
  EXPECT_NE(refused.rc, 0);
  EXPECT_NE(refused.err.find("shared secret"), std::string::npos) << refused.err;
  ::unsetenv("UCX_TLS");
}

// A peer daemon that dies (SIGKILL) between two fetches: the next fetch fails within the timeout with an error that
// names the peer, and nothing is written past the tensor.
TEST(Peer, ADaemonThatDiesIsAClearError) {
  ::setenv("UCX_TLS", "tcp,self", 1);
  TempDir tmp;
  StoreGuard a("a");
  const auto model = golden_model("kimi_k3/k3-tiny");
  const uint16_t port = free_port();
  const json cfg = {{"version", 1},
                    {"secret", kSecret},
                    {"nodes", {{{"name", "a"}, {"host", "127.0.0.1"}, {"port", port}, {"store", a.name()},
                                {"shards", {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}}}}}};
  std::ofstream(tmp / "cfg.json") << cfg.dump(2);
  std::filesystem::permissions(tmp / "cfg.json", std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  const CmdResult r = run_batchgen({"weightd", "start", "--model", model.string(), "--name", a.name(),
                                    "--distributed-weight-config", (tmp / "cfg.json").string(), "--node", "a"});
  ASSERT_EQ(r.rc, 0) << r.err;
  PeerClientOptions o = fast();
  o.timeout_ms = 3000;
  PeerClient client("a", "127.0.0.1", port, kSecret, o);
  std::vector<std::byte> first(client.manifest().tensors[0].bytes);
  client.fetch(0, first.data());
  a.kill_daemon();
  const uint32_t last = static_cast<uint32_t>(client.manifest().tensors.size() - 1);
  std::vector<std::byte> dst(client.manifest().tensors[last].bytes + 64, std::byte{0x77});
  const std::string err = bg_error_of([&] { client.fetch(last, dst.data()); });
  EXPECT_NE(err.find("weight peer a (127.0.0.1:"), std::string::npos) << err;
  EXPECT_EQ(dst.back(), std::byte{0x77}) << "nothing written past the tensor";
  ::unsetenv("UCX_TLS");
}

TEST(DistConfig, ValidatesEveryField) {
  TempDir tmp;
  auto write = [&](const json& j, const std::string& name = "c.json") {
    std::ofstream(tmp / name) << j.dump();
    std::filesystem::permissions(tmp / name, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
    return tmp / name;
  };
  const json node = {{"name", "a"}, {"host", "127.0.0.1"}, {"port", 1234}, {"store", "s"}, {"shards", {"x.safetensors"}}};
  const json good = {{"version", 1}, {"secret", kSecret}, {"nodes", {node}}};
  EXPECT_EQ(load_dist_config(write(good)).nodes.at(0).port, 1234);
  auto err = [&](json j) { return bg_error_of([&] { load_dist_config(write(j)); }); };
  json j = good;
  j["secret"] = "short";
  EXPECT_NE(err(j).find("at least 32"), std::string::npos);
  j = good;
  j["nodes"][0]["port"] = 70000;
  EXPECT_NE(err(j).find("'port'"), std::string::npos);
  j = good;
  j["nodes"][0]["shards"] = {"../etc/passwd"};
  EXPECT_NE(err(j).find("not a plain file name"), std::string::npos);
  j = good;
  j["nodes"].push_back(node);
  EXPECT_NE(err(j).find("appears twice"), std::string::npos);
  j = good;
  j["nodes"][0]["extra"] = 1;
  EXPECT_NE(err(j).find("unknown field"), std::string::npos);
  const auto open = write(good, "open.json");
  std::filesystem::permissions(open, std::filesystem::perms::others_read, std::filesystem::perm_options::add);
  EXPECT_NE(bg_error_of([&] { load_dist_config(open); }).find("chmod 600"), std::string::npos);
}

}  // namespace
}  // namespace bg::testing
