// node_pool.h: keeps the nodes erased from a std::unordered_map or
// unordered_set for the next insert.
//
// Why. Every tensor of every step passes through a few such tables: its
// handle (handles.cc), its name while in flight and its pending op
// (engine.cc), each in at enqueue and out a cycle later. With a step's
// 200 gradients in flight at once, malloc's per-thread cache (7 blocks of
// a size) overflows, and each node and each copy of a name went through
// the allocator's slow path: at one rank, malloc and free were a third of
// the core's work per tensor. A kept node comes back with its memory, and
// with its string's capacity where the key is a name.
//
// Not thread-safe: each pool is used under the lock of its table.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace unison {

template <typename Table>
class NodePool {
 public:
  using Node = typename Table::node_type;

  // Erases the element at `it` from `table`, keeping its node.
  void erase(Table& table, typename Table::const_iterator it) { keep(table.extract(it)); }

  // Keeps a node taken out of a table (an empty one is dropped).
  void keep(Node&& node) {
    if (!node.empty() && spare_.size() < kKept) spare_.push_back(std::move(node));
  }

  // A kept node, still holding its last key and value for the caller to
  // overwrite; an empty one when none is kept.
  Node take() {
    if (spare_.empty()) return Node();
    Node node = std::move(spare_.back());
    spare_.pop_back();
    return node;
  }

 private:
  // As many as a burst of tensors in flight needs again; past that, the
  // memory goes back.
  static constexpr size_t kKept = 4096;
  std::vector<Node> spare_;
};

}  // namespace unison
