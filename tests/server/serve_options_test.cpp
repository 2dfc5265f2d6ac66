// `batchgen serve` option validation: features that do not exist yet are startup errors, bad paths are named,
// defaults are filled in, and the worker command line carries exactly the flags that were given.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>

#include "core/error.h"
#include "server/frontend/serve.h"
#include "temp_dir.h"

namespace bg::frontend {
namespace {

// Runs validation; returns the error message ("" when valid).
std::string validation_error(ServeOptions opt) {
  try {
    validate_serve_options(opt);
    return "";
  } catch (const bg::Error& e) {
    return e.what();
  }
}

TEST(ServeOptions, DefaultsAndModelName) {
  bg::testing::TempDir tmp;
  std::filesystem::create_directories(tmp / "my-model");
  ServeOptions opt;
  opt.model_dir = (tmp / "my-model").string() + "/";
  validate_serve_options(opt);
  EXPECT_EQ(opt.served_model_name, "my-model");
  EXPECT_EQ(opt.host, "127.0.0.1");
  EXPECT_EQ(opt.port, 8000);
  opt.served_model_name = "custom";
  validate_serve_options(opt);
  EXPECT_EQ(opt.served_model_name, "custom");
}

TEST(ServeOptions, UnavailableFeaturesAndBadValuesAreErrors) {
  bg::testing::TempDir tmp;
  ServeOptions base;
  base.model_dir = tmp.path().string();
  EXPECT_EQ(validation_error(base), "");

  ServeOptions o = base;
  o.k3_moe_exchange = "ll";
  EXPECT_EQ(validation_error(o), "");  // one rank (or CPU ranks): no CUDA exchange runs
  o.device = "cuda";
  o.parallel.ep = 2;
  EXPECT_EQ(validation_error(o), "");  // CUDA ranks of one host, over CUDA IPC (they may share a GPU)
  o = base;
  o.idle_prefill_size = -2;
  EXPECT_NE(validation_error(o).find("--idle-prefill-size -2 must be >= 0"), std::string::npos);
  o = base;
  o.k3_moe_exchange = "mpi";
  EXPECT_NE(validation_error(o).find("must be nccl, ll or ll-fp8"), std::string::npos);
  o = base;
  o.device = "cpu";
  o.k3_moe_exchange = "ll-fp8";  // the CPU exchange is exact: FP8 rows are not something it can give
  EXPECT_NE(validation_error(o).find("ll-fp8 quantizes the dispatched rows of CUDA ranks"), std::string::npos);

  o = base;
  o.distributed_weight_config = (tmp / "missing.json").string();
  EXPECT_NE(validation_error(o).find("no such file"), std::string::npos) << validation_error(o);
  std::ofstream(tmp / "bad.json") << "{not json";
  o.distributed_weight_config = (tmp / "bad.json").string();
  EXPECT_NE(validation_error(o).find("not valid JSON"), std::string::npos) << validation_error(o);
  std::ofstream(tmp / "ok.json") << R"({"nodes": []})";
  o.distributed_weight_config = (tmp / "ok.json").string();
  EXPECT_NE(validation_error(o).find("'version' must be 1"), std::string::npos) << validation_error(o);

  o = base;
  o.model_dir = (tmp / "nope").string();
  EXPECT_NE(validation_error(o).find("does not exist"), std::string::npos);
  o = base;
  o.port = 70000;
  EXPECT_NE(validation_error(o).find("--port"), std::string::npos);
  o = base;
  o.max_num_seqs = 0;
  EXPECT_NE(validation_error(o).find("--max-num-seqs"), std::string::npos);
  o = base;
  o.device = "tpu";
  EXPECT_NE(validation_error(o).find("--device"), std::string::npos);
  o = base;
  o.parallel.dp = 2;
  o.parallel.tp = 2;
  o.parallel.ep = 8;
  EXPECT_NE(validation_error(o).find("--ep must equal --dp x --tp"), std::string::npos) << validation_error(o);
  o = base;
  o.parallel.ep = 4;
  o.parallel.nnodes = 2;
  EXPECT_NE(validation_error(o).find("--dist-init-addr HOST:PORT is required"), std::string::npos)
      << validation_error(o);
  o.dist_init_addr = "10.0.0.1:29500";
  EXPECT_EQ(validation_error(o), "");  // several nodes: node 0 serves, the others run their agents
  o.parallel.node_rank = 1;
  EXPECT_EQ(validation_error(o), "");
  o.parallel.node_rank = 2;
  EXPECT_NE(validation_error(o).find("--node-rank 2 must be in [0, 2)"), std::string::npos) << validation_error(o);
  o.parallel.node_rank = 0;
  o.dist_init_addr = "10.0.0.1";
  EXPECT_NE(validation_error(o).find("must be host:port"), std::string::npos) << validation_error(o);
  o.dist_init_addr = "10.0.0.1:65535";  // the worker link takes the next port
  EXPECT_NE(validation_error(o).find("[1, 65534]"), std::string::npos) << validation_error(o);
  o.dist_init_addr = "*:29500";
  EXPECT_NE(validation_error(o).find("is not a host name or address"), std::string::npos) << validation_error(o);
  o.dist_init_addr = "10.0.0.1:29500";
  o.device = "cuda";
  o.k3_moe_exchange = "ll";  // CUDA IPC: one host
  EXPECT_NE(validation_error(o).find("runs within one host (CUDA IPC); 2 nodes need --k3-moe-exchange nccl"),
            std::string::npos) << validation_error(o);
  o.k3_moe_exchange = "nccl";
  EXPECT_EQ(validation_error(o), "");
  o.node_timeout_s = 0.1;
  EXPECT_NE(validation_error(o).find("--node-timeout"), std::string::npos);
  o = base;
  o.moe_exchange_tokens = -1;
  EXPECT_NE(validation_error(o).find("--moe-exchange-tokens"), std::string::npos);
  o = base;
  o.max_connections = 0;
  EXPECT_NE(validation_error(o).find("--max-connections"), std::string::npos);
  o = base;
  o.header_timeout_s = 0;
  EXPECT_NE(validation_error(o).find("--header-timeout"), std::string::npos);
  o = base;
  o.shutdown_timeout_s = -1;
  EXPECT_NE(validation_error(o).find("--shutdown-timeout"), std::string::npos);
  o = base;
  o.worker_heartbeat_timeout_s = 0.5;
  EXPECT_NE(validation_error(o).find("--worker-heartbeat-timeout"), std::string::npos);
  o = base;
  o.max_worker_restarts = -1;
  EXPECT_NE(validation_error(o).find("--max-worker-restarts"), std::string::npos);
  o = base;
  o.allowed_hosts = {"example.com:8000"};
  EXPECT_NE(validation_error(o).find("--allowed-hosts"), std::string::npos);
  o = base;
  o.allowed_hosts = {"http://x"};
  EXPECT_NE(validation_error(o).find("--allowed-hosts"), std::string::npos);
  o = base;
  o.allowed_hosts = {"LocalHost", "[::1]", "10.0.0.1"};
  validate_serve_options(o);
  EXPECT_EQ(o.allowed_hosts, (std::vector<std::string>{"localhost", "::1", "10.0.0.1"}));
}

TEST(ServeOptions, WorkerCommandLine) {
  ServeOptions opt;
  opt.model_dir = "/m";
  opt.max_model_len = 512;
  auto argv = worker_command(opt, "/bin/batchgen", "ipc:///tmp/x/workers.sock", 0, "rank-0-i3");
  const std::vector<std::string> head = {"/bin/batchgen", "worker", "--model", "/m", "--endpoint",
                                         "ipc:///tmp/x/workers.sock", "--rank", "0", "--routing-id", "rank-0-i3",
                                         "--parent-pid"};
  ASSERT_GE(argv.size(), head.size());
  EXPECT_EQ(std::vector<std::string>(argv.begin(), argv.begin() + static_cast<long>(head.size())), head);
  const std::vector<std::string> tail = {"--device", "cpu", "--max-model-len", "512"};
  EXPECT_EQ(std::vector<std::string>(argv.end() - static_cast<long>(tail.size()), argv.end()), tail);
  opt.prefix_cache = false;
  opt.host_memory_gb = 1.5;
  opt.state_offload_dtype = "bf16";
  argv = worker_command(opt, "/bin/batchgen", "ipc:///tmp/x/workers.sock", 0, "rank-0-i0");
  const std::vector<std::string> state = {"--no-prefix-cache", "--host-memory-gb", "1.5", "--state-offload-dtype",
                                          "bf16"};
  EXPECT_EQ(std::vector<std::string>(argv.end() - static_cast<long>(state.size()), argv.end()), state);
  opt.resident_experts = 0.25;
  opt.expert_trace = "/t.json";
  argv = worker_command(opt, "/bin/batchgen", "ipc:///tmp/x/workers.sock", 0, "rank-0-i0");
  const std::vector<std::string> streamed = {"--resident-experts", "0.25", "--expert-trace", "/t.json"};
  EXPECT_NE(std::search(argv.begin(), argv.end(), streamed.begin(), streamed.end()), argv.end());
  opt.chunked_prefill_size = 1024;
  opt.idle_prefill_size = 0;  // off is a value, not "unset"
  argv = worker_command(opt, "/bin/batchgen", "ipc:///tmp/x/workers.sock", 0, "rank-0-i0");
  const std::vector<std::string> steps = {"--chunked-prefill-size", "1024", "--idle-prefill-size", "0"};
  EXPECT_NE(std::search(argv.begin(), argv.end(), steps.begin(), steps.end()), argv.end());
  EXPECT_EQ(std::find(argv.begin(), argv.end(), "--no-step-profile"), argv.end());  // measured by default
  opt.profile_memory = false;
  argv = worker_command(opt, "/bin/batchgen", "ipc:///tmp/x/workers.sock", 0, "rank-0-i0");
  EXPECT_NE(std::find(argv.begin(), argv.end(), "--no-step-profile"), argv.end());
}

TEST(ServeOptions, WorkerCommandLineOfARankSet) {
  ServeOptions opt;
  opt.model_dir = "/m";
  opt.parallel.dp = 2;
  opt.parallel.ep = 4;
  auto argv = worker_command(opt, "/bin/batchgen", "ipc:///tmp/x/workers.sock", 3, "rank-3-i1", "ipc:///tmp/x/r.sock");
  const std::vector<std::string> tail = {"--dp", "2", "--tp", "2", "--rendezvous", "ipc:///tmp/x/r.sock",
                                         "--k3-moe-exchange", "nccl", "--moe-exchange-tokens", "0"};
  ASSERT_GE(argv.size(), tail.size());
  EXPECT_EQ(std::vector<std::string>(argv.end() - static_cast<long>(tail.size()), argv.end()), tail);
  EXPECT_EQ(argv[7], "3");
  // Across nodes every rank knows its node (rank 3 of 4 over 2 nodes: node 1).
  opt.parallel.nnodes = 2;
  argv = worker_command(opt, "/bin/batchgen", "tcp://10.0.0.1:29501", 3, "rank-3-i1-ab", "tcp://10.0.0.1:40000");
  const std::vector<std::string> nodes = {"--nnodes", "2", "--node-rank", "1"};
  EXPECT_NE(std::search(argv.begin(), argv.end(), nodes.begin(), nodes.end()), argv.end());
  // What nodes must agree on.
  ServeOptions other = opt;
  other.model_dir = "/elsewhere";  // a path of the node's own
  EXPECT_EQ(node_config_signature(other), node_config_signature(opt));
  other.parallel.ep = 2;
  other.parallel.dp = 2;
  other.parallel.tp = 1;
  EXPECT_NE(node_config_signature(other), node_config_signature(opt));
  other = opt;
  other.moe_exchange_tokens = 16;
  EXPECT_NE(node_config_signature(other), node_config_signature(opt));
}

}  // namespace
}  // namespace bg::frontend
