// device_plane.h: collectives on one GPU's memory.
//
// A DevicePlane is a data plane (../data_plane.h) on device pointers: NCCL
// (../nccl/nccl_plane.cc) or, where NCCL cannot serve, host staging
// (staging_plane.cc), which copies to pinned host memory and runs the
// process set's own CPU backend. It has no control plane: negotiation and
// cycles stay on that CPU backend, which the engine calls directly.
// ../data_planes.cc chooses among the planes.
//
// All of a plane's device work goes on its own stream, in the order the
// engine runs groups (the same on every rank). The framework's streams meet
// it through events: before a group, the plane's stream waits for the event
// recorded on each op's stream at enqueue (so a collective never reads an
// input whose kernel is still running); after it, each op's stream waits
// for the plane's (so the framework uses the result without the host ever
// waiting). A plane is made, collectively, at the first device op of its
// process set, and the engine's driver calls it with its device current.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "../backend.h"
#include "../data_plane.h"
#include "device_kernels.h"
#include "runtime.h"

namespace unison {

class DevicePlane : public DataPlane {
 public:
  DevicePlane(const CudaRuntime& cuda, int device, Backend* host);
  ~DevicePlane() override;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  // Orders the plane's stream after `ready` (an op's input).
  Status wait_for(cudaEvent_t ready);
  // Orders each of `consumers` after everything the plane has queued.
  Status release_to(const std::vector<cudaStream_t>& consumers);
  // Device memory for results and scratch, and copies, on the plane's stream.
  Status allocate_result(size_t bytes, void** out);
  Status zeros(size_t bytes, void** out);  // freed at the next end_group()
  Status copy(void* to, const void* from, size_t bytes);
  void end_group();
  // True while the device still runs collectives the plane has queued: the
  // handles completed at launch, so only this says a peer is still needed.
  bool busy() const;
  // Called once a peer is lost (dead or frozen): ends device work that
  // waits on it, which would otherwise never finish, and with it every
  // stream ordered after that work. NCCL's kernels are aborted; staging
  // waits on the host, where the CPU backend has already failed, so has
  // nothing to end.
  virtual void abandon() {}
  // An error the device library found on its own, outside any call, after
  // which the plane's queued work will never end: NCCL's asynchronous
  // errors (a network failure, a peer's connection gone). OK elsewhere.
  virtual Status asynchronous_error() const { return Status::OK(); }
  // Adasum weighs whole gradients on the CPU (../adasum.h): staged through
  // host memory on every plane.
  Status adasum(int dtype, const std::vector<Segment>& segments);

  // The ranks are its process set's.
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }

 protected:
  // Pinned host memory for staging one collective: reserve() the total,
  // then take inputs (copied down from the device) and outputs (copied up
  // to it by deliver()). An output at the same device address as an input
  // shares its host copy.
  class Staging;
  template <typename Reduce>
  Status stage_segments(const std::vector<Segment>& segments, Reduce reduce);
  // On `across` when given (a hierarchical plane's cross-host group), else
  // on the set's CPU backend.
  Status stage_allreduce(const AllreduceOptions& options, DataPlane* across = nullptr);
  Status stage_allgather(const AllgatherOptions& options);
  Status stage_broadcast(const BroadcastOptions& options);
  Status stage_alltoall(const AlltoallOptions& options);
  Status stage_reducescatter(const ReducescatterOptions& options);

  const CudaRuntime& cuda_;
  const int device_;
  Backend* const host_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  DeviceKernels kernels_;
  Status ready_;  // what creating the stream and event said
  std::vector<void*> scratch_;
  char* pinned_ = nullptr;
  size_t pinned_bytes_ = 0;
};

// The staging plane, for any GPU.
Status make_staging_plane(const CudaRuntime& cuda, int device, Backend* host, std::unique_ptr<DevicePlane>* out);

}  // namespace unison
