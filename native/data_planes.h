// data_planes.h: which data plane carries a group of tensors.
//
// Host tensors run on their process set's backend (backend.cc chose it for
// the job: shared memory, TCP, MPI, or a hierarchy of them). A GPU's
// tensors run on a device plane made for the set and the device at its
// first op there: NCCL where it can serve, else staging through host
// memory. This file and backend.cc are the only places that choose; the
// planes themselves (cuda/, nccl/) know nothing of each other.
#pragma once

#include <memory>
#include <string>

#include "backend.h"
#include "cuda/device_plane.h"

namespace unison {

// What a rank knows of itself when its set makes a plane.
struct PlaneRequest {
  std::string hostname;      // Config::hostname, else gethostname()
  std::string choice;        // Config::gpu_data_plane: auto, nccl or staging
  bool hierarchical = true;  // Config::hierarchical: NCCL within hosts, not across them
  int set_id = 0;            // keeps the plane's cross-host groups apart from other sets'
  int device = 0;
};

// The plane for `request.device` in the process set whose backend is
// `host`. Collective over the set: its ranks learn where the others are and
// choose NCCL where it can serve (each rank its own GPU, NCCL found
// everywhere), else staging; the choice can insist on either. Where the set
// spans hosts, NCCL is hierarchical unless every rank asks for it flat.
Status make_device_plane(const PlaneRequest& request, Backend* host, std::unique_ptr<DevicePlane>* out);

// What --check-build prints: the CUDA runtime, its devices, NCCL.
std::string device_support_report();

}  // namespace unison
