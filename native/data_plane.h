// data_plane.h: the collectives, and nothing else.
//
// A DataPlane moves the bytes of one group of tensors among its ranks.
// Every rank calls it with matching options, in the same order; the engine
// has already agreed with the other ranks on what runs (negotiation is the
// control plane's, control_plane.h). The host backends (backend.h) are data
// planes over host memory; a GPU's planes (cuda/, nccl/) are data planes over
// device memory and nothing more, because a process set negotiates on its
// host backend whatever memory its tensors are in. Adasum (adasum.h) is built
// on these collectives alone. Barriers are no collective of their own: a
// barrier is a negotiated op with no bytes.
#pragma once

#include <cstddef>
#include <vector>

#include "reduce.h"
#include "status.h"

namespace unison {

// One tensor's part of a fused collective: `bytes` read from `input` and
// written to `output` (which may be the same memory).
struct Segment {
  const void* input;
  void* output;
  size_t bytes;
};

struct AllreduceOptions {
  std::vector<Segment> segments;  // read and written as one logical stream
  ReduceSpec reduce;
};

struct AllgatherOptions {
  struct Tensor {
    const void* input;                 // this rank's bytes_per_rank[rank] bytes
    void* output;                      // every rank's bytes, in rank order
    std::vector<size_t> bytes_per_rank;
  };
  std::vector<Tensor> tensors;
};

struct BroadcastOptions {
  void* buffer;  // holds the data on the root; receives it elsewhere
  size_t bytes;
  int root;
};

struct AlltoallOptions {
  const void* input;            // this rank's sends, in receiver order
  void* output;                 // this rank's receives, in sender order
  std::vector<size_t> bytes;    // size*size, [sender][receiver]
};

struct ReducescatterOptions {
  struct Tensor {
    const void* input;                  // the whole tensor
    void* output;                       // this rank's part
    std::vector<size_t> bytes_per_rank; // consecutive parts, in rank order
  };
  std::vector<Tensor> tensors;
  ReduceSpec reduce;
};

class DataPlane {
 public:
  virtual ~DataPlane() = default;
  // What the timeline calls the plane's collectives: "shm", "nccl", ...
  virtual const char* name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  virtual Status allreduce(const AllreduceOptions& options) = 0;
  virtual Status allgather(const AllgatherOptions& options) = 0;
  virtual Status broadcast(const BroadcastOptions& options) = 0;
  virtual Status alltoall(const AlltoallOptions& options) = 0;
  virtual Status reducescatter(const ReducescatterOptions& options) = 0;

  // For the autotuner: a plane that can run its allreduce both
  // hierarchically and flat switches to `on`, and says it could.
  virtual bool set_hierarchical(bool /*on*/) { return false; }
};

}  // namespace unison
