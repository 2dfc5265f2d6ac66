// `batchgen rank`: one non-zero rank of a single-process CLI's rank set (started by score / generate, never by
// hand): joins the rendezvous, loads its share of the model with the plan rank 0 sent, then takes part in every step
// (empty ones: it has no requests) until rank 0 stops the set.
#include <cstdlib>
#include <limits>

#include "core/error.h"
#include "core/log.h"
#include "dist/rank_setup.h"
#include "kv/state_manager.h"
#include "model/model.h"
#include "tools/cli_util.h"
#include "tools/commands.h"
#include "tools/parallel_cli.h"

namespace bg::tools {
namespace {

struct RankArgs {
  ParallelArgs par;
  std::string model_dir;
  std::string device = "cpu";
  int32_t rank = 1;
  std::string rendezvous;
  std::string weight_store;
  std::string distributed_weight_config;
  double resident_experts = 1.0;
  std::string expert_trace;
};

int run_rank(const RankArgs& a) {
  dist::RankSetup s;
  s.place = {a.par.layout(), a.rank};
  BG_CHECK(a.rank >= 1 && a.rank < s.place.layout.world(), "--rank {} must be in [1, {})", a.rank,
           s.place.layout.world());
  s.device = a.device;
  s.exchange = a.par.exchange;
  s.rendezvous = a.rendezvous;
  constexpr int64_t kAny = std::numeric_limits<int64_t>::max();  // rank 0's plan wins (the set takes the minimum)
  s.plan = {kAny, kAny};
  s.max_tokens_per_call = a.par.max_tokens_per_call;
  s.link_key = dist::load_link_key(a.par.node_secret_file);
  const dist::StartedRank started = dist::start_rank(s);
  LoadOptions o;
  o.device = a.device;
  o.weight_store = a.weight_store;
  o.distributed_weight_config = a.distributed_weight_config;
  o.resident_experts = a.resident_experts;
  o.expert_trace = a.expert_trace;
  o.ranks = started.ranks;
  auto model = load_model(a.model_dir, o);
  // The same state as rank 0's (LocalRanks::StateSize): a TP follower runs rank 0's layouts on it.
  auto state = make_state(*model, started.plan.at(0), started.plan.at(1));
  while (model->sync_idle(false, state->step_pools())) {
  }
  log::debug("rank {}: the set stopped", a.rank);
  return 0;
}

}  // namespace

void register_rank(CLI::App& app) {
  auto a = std::make_shared<RankArgs>();
  auto* cmd = app.add_subcommand("rank", "One rank of a score/generate rank set (started by them, not by hand)");
  cmd->group("");  // hidden from --help
  cmd->add_option("--model", a->model_dir, "Checkpoint directory")->required();
  cmd->add_option("--device", a->device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--rank", a->rank, "This rank")->required();
  cmd->add_option("--rendezvous", a->rendezvous, "The rendezvous endpoint of rank 0")->required();
  add_parallel_flags(cmd, a->par, true);
  add_weight_source_options(cmd, a->weight_store, a->distributed_weight_config);
  add_expert_residency_options(cmd, a->resident_experts, a->expert_trace);
  cmd->callback([a] {
    int code = 1;
    try {
      code = run_rank(*a);
    } catch (const std::exception& e) {
      log::error("rank {}: {}", a->rank, e.what());
    }
    if (code != 0) std::exit(code);
  });
}

}  // namespace bg::tools
