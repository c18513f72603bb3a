// nccl_plane.h: the NCCL plane (nccl_plane.cc), among ranks that chose it
// (../data_planes.cc decides who does, and lays out its communicators).
#pragma once

#include <memory>
#include <vector>

#include "../backend.h"
#include "../cuda/device_plane.h"

namespace unison {

// Whom an NCCL plane's communicator joins, and who carries what across hosts.
struct NcclLayout {
  std::vector<int> communicator;  // the set's ranks in this rank's: all of them, or its host's
  // Hierarchical only: cross group l holds local rank l of every host and
  // carries chunk l of an allreduce between hosts. Every host has as many
  // groups as it has ranks when hosts are even, else one (their first ranks).
  std::vector<std::vector<int>> cross_groups;
  int cross_group_id = 0;  // the first group's id for Backend::split; the next ones follow
};

Status make_nccl_plane(const CudaRuntime& cuda, int device, Backend* host, const NcclLayout& layout,
                       std::unique_ptr<DevicePlane>* out);

}  // namespace unison
