// Host-side plan of a varlen chunked KDA launch: which sequences of a step go to the chunked kernels, cut into
// chunks of at most kKdaDefaultChunkSize tokens that never cross a sequence, and the packed int32 table the kernels
// read (uploaded with the step's metadata, so the launch itself reads nothing on the host).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace bg::ops {

// One chunk: tokens [token_begin, token_begin + n_tokens) of the step's token rows, n_tokens in [1, chunk size].
struct KdaChunkDesc {
  int32_t token_begin = 0;
  int32_t n_tokens = 0;
};

// One chunked sequence: its chunks [chunk_begin, chunk_begin + n_chunks) in the plan, its state slot, and its index
// in the step (seq_begin's index).
struct KdaSeqDesc {
  int32_t chunk_begin = 0;
  int32_t n_chunks = 0;
  int32_t slot = 0;
  int32_t step_seq = 0;
};

inline constexpr int kKdaPackedChunkInts = 2;  // KdaChunkDesc as int32
inline constexpr int kKdaPackedSeqInts = 4;    // KdaSeqDesc as int32

struct KdaVarlenPlan {
  std::vector<KdaChunkDesc> chunks;  // all chunked sequences' chunks, sequence by sequence, in token order
  std::vector<KdaSeqDesc> seqs;      // the sequences with at least min_tokens tokens, in step order
  std::vector<int32_t> short_seqs;   // step indices of the nonempty sequences below min_tokens (recurrent)
  int64_t n_chunked_tokens = 0;      // tokens covered by chunks
  int64_t n_chunks() const { return static_cast<int64_t>(chunks.size()); }
  int64_t n_seqs() const { return static_cast<int64_t>(seqs.size()); }
  // The device table: chunks (2 int32 each) then sequences (4 int32 each).
  std::vector<int32_t> packed() const;
};

// seq_begin [n_seqs + 1] token offsets (non-decreasing, from 0), slots [n_seqs] state slots (>= 0). Sequences with
// fewer than min_tokens tokens (>= 1) go to short_seqs, empty ones nowhere; the rest are cut into chunks of
// chunk_size tokens (the last one shorter). Throws bg::Error on malformed input or int32 overflow.
KdaVarlenPlan kda_varlen_plan(std::span<const int64_t> seq_begin, std::span<const int32_t> slots,
                              int64_t min_tokens = 2, int64_t chunk_size = 64);

}  // namespace bg::ops
