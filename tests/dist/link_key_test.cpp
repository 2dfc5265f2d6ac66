// The node secret: its file must be private and long enough, its key depends on the secret alone, and a rendezvous
// bound with it lets in the ranks that hold the same secret and nobody else (without a key, or with another).
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/secret_file.h"
#include "dist/link_key.h"
#include "dist/rendezvous.h"
#include "temp_dir.h"

namespace bg::dist {
namespace {

using bg::testing::TempDir;
using bg::testing::write_secret_file;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(LinkKey, ComesFromTheSecretAloneAndItsFileMustBePrivate) {
  const std::string a(32, 'a'), b = std::string(31, 'a') + "b";
  const LinkKey ka = derive_link_key(a), ka2 = derive_link_key(a), kb = derive_link_key(b);
  EXPECT_EQ(ka.public_key.size(), 40u);
  EXPECT_EQ(ka.secret_key.size(), 40u);
  EXPECT_EQ(ka.public_key, ka2.public_key);
  EXPECT_EQ(ka.secret_key, ka2.secret_key);
  EXPECT_NE(ka.public_key, kb.public_key);
  EXPECT_EQ(ka.public_key.find(a), std::string::npos);
  EXPECT_NE(error_of([] { derive_link_key(std::string(31, 'x')); }).find("at least 32"), std::string::npos);

  TempDir tmp;
  EXPECT_EQ(load_link_key(""), nullptr) << "no secret file: no key";
  const LinkKeyPtr from_file = load_link_key(write_secret_file(tmp, "ok", a + "\n", 0600));
  ASSERT_NE(from_file, nullptr);
  EXPECT_EQ(from_file->public_key, ka.public_key) << "a trailing newline is not part of the secret";
  const std::string loose = write_secret_file(tmp, "loose", a, 0644);
  EXPECT_NE(error_of([&] { load_link_key(loose); }).find("chmod 600 it"), std::string::npos);
  const std::string shrt = write_secret_file(tmp, "short", "0123456789", 0600);
  EXPECT_NE(error_of([&] { load_link_key(shrt); }).find("--node-secret-file: the shared secret in"),
            std::string::npos);
  EXPECT_NE(error_of([&] { load_link_key((tmp / "absent").string()); }).find("is not a readable file"),
            std::string::npos);
}

TEST(LinkKey, ARendezvousWithASecretLetsInOnlyRanksThatHoldIt) {
  TempDir tmp;
  zmq::context_t ctx(1);
  const LinkKey key = derive_link_key(std::string(40, 's')), other = derive_link_key(std::string(40, 't'));
  RendezvousServer server(ctx, "ipc://" + (tmp / "rv.sock").string(), 2, "ep=2", &key);
  JoinInfo me;
  me.world = 2;
  me.layout = "ep=2";
  me.plan = {1};
  // Neither a rank without a key nor one with another secret gets through the handshake: they time out unseen.
  for (const LinkKey* k : {static_cast<const LinkKey*>(nullptr), &other}) {
    me.rank = 1;
    const std::string err = error_of([&] { rendezvous_join(ctx, server.endpoint(), me, 1.0, {}, k); });
    EXPECT_NE(err.find("did not join the rendezvous"), std::string::npos) << err;
    EXPECT_EQ(server.joined(), std::vector<bool>({false, false}));
  }
  EXPECT_NE(error_of([&] { rendezvous_join(ctx, server.endpoint(), me, 0.5, {}, &other); })
                .find("does every node hold the same --node-secret-file?"), std::string::npos);
  // Both ranks with the secret: the set completes.
  WorldInfo w1;
  std::thread rank1([&] { w1 = rendezvous_join(ctx, server.endpoint(), me, 10.0, {}, &key); });
  JoinInfo zero = me;
  zero.rank = 0;
  zero.transport_id = "ab";
  const WorldInfo w0 = rendezvous_join(ctx, server.endpoint(), zero, 10.0, {}, &key);
  rank1.join();
  EXPECT_EQ(w0.transport_id, "ab");
  EXPECT_EQ(w1.transport_id, "ab");
  EXPECT_TRUE(server.complete());
}

}  // namespace
}  // namespace bg::dist
