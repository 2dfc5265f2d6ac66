// HMAC-SHA256 (OpenSSL), nonces from the OS's CSPRNG, constant-time comparison, bounded error strings.
#include "weights/peer_wire.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace bg::weights {

Digest peer_mac(std::span<const uint8_t> key, const std::string& label, const Digest& a, const Digest& b) {
  std::vector<uint8_t> msg(label.begin(), label.end());
  msg.insert(msg.end(), a.begin(), a.end());
  msg.insert(msg.end(), b.begin(), b.end());
  return peer_mac_bytes(key, std::as_bytes(std::span(msg)));
}

Digest peer_mac_bytes(std::span<const uint8_t> key, std::span<const std::byte> data) {
  Digest out{};
  unsigned int len = 0;
  const unsigned char* r = HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
                                reinterpret_cast<const unsigned char*>(data.data()), data.size(), out.data(), &len);
  BG_CHECK(r != nullptr && len == out.size(), "HMAC-SHA256 failed");
  return out;
}

Digest random_nonce() {
  Digest d{};
  BG_CHECK(RAND_bytes(d.data(), static_cast<int>(d.size())) == 1, "cannot draw a random nonce");
  return d;
}

bool digest_equal(const Digest& a, const Digest& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

std::span<const uint8_t> key_bytes(const std::string& secret) {
  return {reinterpret_cast<const uint8_t*>(secret.data()), secret.size()};
}

std::span<const uint8_t> key_bytes(const Digest& d) { return {d.data(), d.size()}; }

void set_error(PeerReply& r, const std::string& message) {
  r.ok = 0;
  const size_t n = std::min(message.size(), sizeof(r.error) - 1);
  std::memcpy(r.error, message.data(), n);
  r.error[n] = '\0';
}

std::string reply_error(const PeerReply& r) {
  std::string out;
  for (size_t i = 0; i < sizeof(r.error) && r.error[i] != '\0'; ++i) {
    const auto c = static_cast<unsigned char>(r.error[i]);
    out.push_back(c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?');
  }
  return out;
}

}  // namespace bg::weights
