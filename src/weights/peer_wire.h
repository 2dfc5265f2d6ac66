// The weight-peer protocol over UCX active messages: fixed-size request / reply headers, the mutual HMAC-SHA256
// challenge (shared secret, fresh nonces from both sides), the session key that authenticates the manifest, and the
// limits every field is checked against. Requests go to AM id kPeerRequestId, replies to kPeerReplyId.
//
//   client                                server
//   HELLO  {Nc}                     ->    {Ns, HMAC(secret, "server" Nc Ns)}      client checks: a peer with the
//   AUTH   {HMAC(secret, "client" Nc Ns)} -> ok | error + disconnect             secret
//   MANIFEST                        ->    manifest bytes, HMAC(session, bytes)    session = HMAC(secret, "session" Nc Ns)
//   READ   {tensor, offset, bytes}  ->    exactly `bytes` bytes of that tensor    range checked against the server's
//                                                                                 own manifest; length checked by the
//                                                                                 client; checksum per tensor
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace bg::weights {

inline constexpr unsigned kPeerRequestId = 41;
inline constexpr unsigned kPeerReplyId = 42;
inline constexpr uint32_t kPeerMagic = 0x42475750;  // "BGWP"
inline constexpr uint64_t kPeerMaxRead = uint64_t{64} << 20;
inline constexpr uint64_t kPeerMaxManifest = uint64_t{1} << 30;

using Digest = std::array<uint8_t, 32>;

enum class PeerOp : uint32_t { kHello = 1, kAuth = 2, kManifest = 3, kRead = 4 };

struct PeerRequest {
  uint32_t magic = kPeerMagic;
  uint32_t op = 0;
  uint64_t id = 0;      // echoed in the reply
  Digest nonce_or_mac{};
  uint32_t tensor = 0;  // kRead: index into the server's manifest
  uint32_t pad = 0;
  uint64_t offset = 0;  // kRead: bytes into the tensor
  uint64_t bytes = 0;   // kRead: how many
};

struct PeerReply {
  uint32_t magic = kPeerMagic;
  uint32_t ok = 0;
  uint64_t id = 0;
  Digest nonce{};       // kHello: the server's nonce
  Digest mac{};         // kHello: server proof; kManifest: MAC of the manifest bytes
  uint64_t bytes = 0;   // payload bytes that follow
  char error[152] = {};
};

// HMAC-SHA256(key, label || a || b).
Digest peer_mac(std::span<const uint8_t> key, const std::string& label, const Digest& a, const Digest& b);
Digest peer_mac_bytes(std::span<const uint8_t> key, std::span<const std::byte> data);
Digest random_nonce();
bool digest_equal(const Digest& a, const Digest& b);  // constant time
std::span<const uint8_t> key_bytes(const std::string& secret);
std::span<const uint8_t> key_bytes(const Digest& d);
void set_error(PeerReply& r, const std::string& message);
std::string reply_error(const PeerReply& r);  // the error text, bounded and printable

}  // namespace bg::weights
