// NodePool (native/node_pool.h): what the engine's tables of names and
// handles rely on when they recycle nodes.
#define UNIT_FILE "node_pool"
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "node_pool.h"
#include "unit.h"

namespace {

using Names = std::unordered_set<std::string>;
using Handles = std::unordered_map<int64_t, std::string>;

}  // namespace

UNIT_TEST(empty_pool_gives_an_empty_node) {
  unison::NodePool<Names> pool;
  EXPECT(pool.take().empty());
}

UNIT_TEST(an_erased_name_comes_back_with_its_memory) {
  Names names = {"model.layer1.weight.gradient", "model.layer1.bias.gradient"};
  unison::NodePool<Names> pool;
  pool.erase(names, names.find("model.layer1.weight.gradient"));
  EXPECT_EQ(names.size(), (size_t)1);
  EXPECT(names.count("model.layer1.weight.gradient") == 0);

  Names::node_type node = pool.take();
  EXPECT(!node.empty());
  EXPECT_EQ(node.value(), std::string("model.layer1.weight.gradient"));
  const char* memory = node.value().data();
  node.value() = "model.layer2.weight.gradient";  // no longer than before: written in place
  EXPECT(node.value().data() == memory);
  auto placed = names.insert(std::move(node));
  EXPECT(placed.inserted);
  EXPECT_EQ(names.size(), (size_t)2);
  EXPECT(names.count("model.layer2.weight.gradient") == 1);
  EXPECT(pool.take().empty());  // the one kept node is in use again
}

UNIT_TEST(a_refused_insert_returns_the_node) {
  Names names = {"a.name.long.enough.to.live.on.the.heap"};
  unison::NodePool<Names> pool;
  Names::node_type node;  // empty
  EXPECT(node.empty());
  pool.keep(std::move(node));  // an empty node is not kept
  EXPECT(pool.take().empty());

  Names other = {"a.name.long.enough.to.live.on.the.heap"};
  pool.erase(other, other.begin());
  node = pool.take();
  auto placed = names.insert(std::move(node));  // the name is there already
  EXPECT(!placed.inserted);
  EXPECT(!placed.node.empty());
  pool.keep(std::move(placed.node));
  EXPECT(!pool.take().empty());
  EXPECT_EQ(names.size(), (size_t)1);
}

UNIT_TEST(map_nodes_take_new_keys) {
  Handles handles;
  for (int64_t h = 1; h <= 3; ++h) handles.emplace(h, "op." + std::to_string(h));
  unison::NodePool<Handles> pool;
  pool.erase(handles, handles.find(2));
  Handles::node_type node = pool.take();
  EXPECT_EQ(node.key(), (int64_t)2);
  node.key() = 4;
  node.mapped() = "op.4";
  handles.insert(std::move(node));
  EXPECT(handles.count(2) == 0);
  EXPECT_EQ(handles.at(4), std::string("op.4"));
  EXPECT_EQ(handles.size(), (size_t)3);
}

UNIT_TEST(keeps_a_bounded_number) {
  // A burst of 10,000 ops in flight keeps 4096 nodes, not all of them.
  Handles handles;
  for (int64_t h = 0; h < 10000; ++h) handles.emplace(h, std::string());
  unison::NodePool<Handles> pool;
  while (!handles.empty()) pool.erase(handles, handles.begin());
  int kept = 0;
  while (!pool.take().empty()) ++kept;
  EXPECT_EQ(kept, 4096);
}
