// The host-staging plane: for GPUs that NCCL cannot serve (several ranks on
// one GPU, which NCCL refuses, or no NCCL). Each collective copies its
// device inputs to pinned host memory on the plane's stream, runs on the
// process set's CPU backend, and copies the results back on the stream.
#include "device_plane.h"

namespace unison {
namespace {

class StagingPlane : public DevicePlane {
 public:
  using DevicePlane::DevicePlane;
  const char* name() const override { return "staging"; }
  Status allreduce(const AllreduceOptions& o) override { return stage_allreduce(o); }
  Status allgather(const AllgatherOptions& o) override { return stage_allgather(o); }
  Status broadcast(const BroadcastOptions& o) override { return stage_broadcast(o); }
  Status alltoall(const AlltoallOptions& o) override { return stage_alltoall(o); }
  Status reducescatter(const ReducescatterOptions& o) override { return stage_reducescatter(o); }
  Status created() const { return ready_; }
};

}  // namespace

Status make_staging_plane(const CudaRuntime& cuda, int device, Backend* host, std::unique_ptr<DevicePlane>* out) {
  auto plane = std::make_unique<StagingPlane>(cuda, device, host);
  if (!plane->created().ok()) return plane->created();
  *out = std::move(plane);
  return Status::OK();
}

}  // namespace unison
