// derive_link_key / load_link_key / secure_*_side.
#include "dist/link_key.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <array>
#include <cstdint>

#include "core/error.h"
#include "core/secret_file.h"

namespace bg::dist {

namespace {

constexpr char kLabel[] = "batchgen node link curve key v1";

}  // namespace

LinkKey derive_link_key(const std::string& secret) {
  BG_CHECK(secret.size() >= kMinSecretBytes, "the node secret has {} bytes; at least {} are required", secret.size(),
           kMinSecretBytes);
  BG_CHECK(zmq_has("curve") != 0, "this libzmq was built without CURVE security; --node-secret-file needs it");
  std::array<uint8_t, 32> raw{};
  unsigned int len = 0;
  const unsigned char* r = HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
                                reinterpret_cast<const unsigned char*>(kLabel), sizeof(kLabel) - 1, raw.data(), &len);
  BG_CHECK(r != nullptr && len == raw.size(), "HMAC-SHA256 failed");
  std::array<char, 41> sec{}, pub{};
  BG_CHECK(zmq_z85_encode(sec.data(), raw.data(), raw.size()) != nullptr, "Z85 encoding of the node key failed");
  BG_CHECK(zmq_curve_public(pub.data(), sec.data()) == 0, "deriving the node link's public key failed");
  return LinkKey{std::string(pub.data(), 40), std::string(sec.data(), 40)};
}

LinkKeyPtr load_link_key(const std::string& secret_file) {
  if (secret_file.empty()) return nullptr;
  return std::make_shared<const LinkKey>(derive_link_key(read_secret_file(secret_file, "--node-secret-file")));
}

void secure_bind_side(zmq::socket_t& sock, const LinkKey* key) {
  if (key == nullptr) return;
  sock.set(zmq::sockopt::curve_server, 1);
  sock.set(zmq::sockopt::curve_secretkey, key->secret_key);
}

void secure_connect_side(zmq::socket_t& sock, const LinkKey* key) {
  if (key == nullptr) return;
  sock.set(zmq::sockopt::curve_serverkey, key->public_key);
  sock.set(zmq::sockopt::curve_publickey, key->public_key);
  sock.set(zmq::sockopt::curve_secretkey, key->secret_key);
}

}  // namespace bg::dist
