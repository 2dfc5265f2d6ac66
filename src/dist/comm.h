// Collectives between the ranks of a group (the world, or one DP group's TP ranks): sums and gathers of backend
// tensors for tensor parallelism, and small host values for the per-step agreement and step descriptors. One
// implementation per transport: POSIX shared memory between CPU rank processes (shm_comm.h) and NCCL between CUDA
// ranks (nccl_comm.h). Every member calls the same collectives in the same order; a member that dies or fails makes
// the others throw RankFailure instead of hanging.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"

namespace bg::dist {

// A peer rank died, failed, or did not answer within the wait limit; the rank set must be restarted.
class RankFailure : public Error {
 public:
  explicit RankFailure(const std::string& what) : Error(what) {}
};

// Another rank voted to stop the set (shutdown): the step did not run.
class SetStopping : public Error {
 public:
  explicit SetStopping(const std::string& what) : Error(what) {}
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual std::string_view transport() const = 0;
  // This member's index in the group and the group's size.
  virtual int32_t rank() const = 0;
  virtual int32_t size() const = 0;

  // ---- backend tensors (the backend's memory: host for CPU, device for CUDA) -----------------------------------
  // t = sum over the members' t, in member order, so every member holds the same bits. F32 (CPU) or BF16/F32 (CUDA).
  virtual void all_reduce_sum(Backend& be, Tensor& t) = 0;
  // out [size * in.rows(), ...] = the members' `in` stacked in member order (each member's `in` has the same shape).
  virtual void all_gather(Backend& be, const Tensor& in, Tensor& out) = 0;
  // in [size * n, ...]: member r gets out [n, ...] = sum over the members of their rows [r * n, (r + 1) * n).
  virtual void reduce_scatter_sum(Backend& be, const Tensor& in, Tensor& out) = 0;

  // ---- host values --------------------------------------------------------------------------------------------
  virtual void barrier() = 0;
  // values[i] = max over the members of values[i] (every member passes the same count).
  virtual void all_reduce_max(std::span<int64_t> values) = 0;
  // bytes = the root's bytes on every member (the others' input is ignored).
  virtual void broadcast(std::vector<std::byte>& bytes, int32_t root) = 0;
  // Every member's bytes, in member order (sizes may differ).
  virtual std::vector<std::vector<std::byte>> all_gather_bytes(std::span<const std::byte> bytes) = 0;

  // Marks the whole rank set failed (a step threw half-way): every member's next wait throws RankFailure at once.
  virtual void mark_failed(const std::string& reason) = 0;
};

}  // namespace bg::dist
