// Authentication and encryption of the ZeroMQ links between the nodes of a rank set (the rendezvous, serve's node
// control socket and its worker link), from a shared secret (--node-secret-file). ZeroMQ's CURVE mechanism with one
// key pair derived from the secret (HMAC-SHA256 of a fixed label): the binding side is the CURVE server, every
// connecting side a client that must name the server's public key. That public key never travels on the wire, so a
// peer that does not hold the secret cannot complete the handshake (libzmq drops it before any message is read),
// cannot read the traffic, and cannot pose as node 0. docs/PARALLEL.md, "Several nodes".
#pragma once

#include <memory>
#include <string>

#include <zmq.hpp>

namespace bg::dist {

struct LinkKey {
  std::string public_key;  // Z85, 40 characters
  std::string secret_key;  // Z85, 40 characters
};
using LinkKeyPtr = std::shared_ptr<const LinkKey>;

// The key pair of `secret` (at least kMinSecretBytes bytes). Throws bg::Error when libzmq lacks CURVE.
LinkKey derive_link_key(const std::string& secret);
// null for "" (no secret: the links are not authenticated); else the key of the secret in the file
// (read_secret_file: mode 600, at least 32 bytes; errors name --node-secret-file).
LinkKeyPtr load_link_key(const std::string& secret_file);

// Before bind / connect. Both do nothing when `key` is null.
void secure_bind_side(zmq::socket_t& sock, const LinkKey* key);
void secure_connect_side(zmq::socket_t& sock, const LinkKey* key);

}  // namespace bg::dist
