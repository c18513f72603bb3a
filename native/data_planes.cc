// data_planes.cc: the choice of a GPU's data plane (data_planes.h), and the
// engine's planes by process set and device.
#include "data_planes.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "engine.h"
#include "nccl/library.h"
#include "nccl/nccl_plane.h"

namespace unison {

namespace {

std::string this_host() {
  char name[256] = {0};
  gethostname(name, sizeof(name) - 1);
  return name;
}

// What a rank tells the others about itself, in a fixed-size record so that
// one allgather carries everyone's: host, GPU bus id, NCCL found, choice,
// hierarchical, one per line.
constexpr size_t kRecordBytes = 256;
struct Where {
  std::string host, bus, choice;
  bool nccl = false, hierarchical = true;
};

Where parse(const char* record) {
  std::vector<std::string> lines;
  std::string text(record, strnlen(record, kRecordBytes));
  for (size_t at = 0;;) {
    const size_t end = text.find('\n', at);
    lines.push_back(text.substr(at, end == std::string::npos ? std::string::npos : end - at));
    if (end == std::string::npos) break;
    at = end + 1;
  }
  lines.resize(5);
  return Where{lines[0], lines[1], lines[3], lines[2] == "1", lines[4] != "0"};
}

// Cross groups' split ids, out of the way of process sets' (engine.cc
// numbers those from 1): each set's device planes get 1024 of their own.
constexpr int kCrossGroupIds = 1 << 24;

}  // namespace

Status make_device_plane(const PlaneRequest& request, Backend* host, std::unique_ptr<DevicePlane>* out) {
  const CudaRuntime* cuda = cuda_runtime();
  if (cuda == nullptr) return Status::Error(UNISON_ERR_UNSUPPORTED, "unison: no CUDA: " + cuda_missing());
  const int device = request.device;
  DeviceGuard guard(*cuda, device);
  char bus[64] = {0};
  Status s = cuda->check(cuda->DeviceGetPCIBusId(bus, sizeof bus, device), "reading GPU " + std::to_string(device) +
                                                                              "'s PCI bus id");
  if (!s.ok()) return s;
  std::vector<char> mine(kRecordBytes, 0);
  std::snprintf(mine.data(), kRecordBytes, "%s\n%s\n%d\n%s\n%d", request.hostname.substr(0, 150).c_str(), bus,
                nccl_library() != nullptr ? 1 : 0, request.choice.c_str(), request.hierarchical ? 1 : 0);
  const int n = host->size();
  std::vector<char> all((size_t)n * kRecordBytes);
  AllgatherOptions gather;
  gather.tensors.push_back({mine.data(), all.data(), std::vector<size_t>(n, kRecordBytes)});
  s = host->allgather(gather);
  if (!s.ok()) return s;
  std::vector<Where> where;
  for (int r = 0; r < n; ++r) where.push_back(parse(all.data() + (size_t)r * kRecordBytes));

  // Every rank decides from the same records, so all decide alike.
  std::string no_nccl;  // why NCCL cannot serve, naming ranks
  for (int r = 0; r < n && no_nccl.empty(); ++r) {
    // Ranks share an install as a rule, so this rank's reason, where it
    // has one, is most likely theirs too.
    if (!where[r].nccl)
      no_nccl = "rank " + std::to_string(r) + " could not load NCCL" +
                (nccl_library() == nullptr ? " (on this rank: " + nccl_missing() + ")" : "");
    for (int q = 0; q < r && no_nccl.empty(); ++q)
      if (where[q].host == where[r].host && where[q].bus == where[r].bus)
        no_nccl = "ranks " + std::to_string(q) + " and " + std::to_string(r) + " share one GPU (" + where[r].bus +
                  " on " + where[r].host + "), and NCCL takes one rank per GPU";
  }
  bool staging = !no_nccl.empty();
  for (int r = 0; r < n; ++r) {
    if (where[r].choice == "staging") staging = true;
    if (where[r].choice == "nccl" && !no_nccl.empty())
      return Status::Error(UNISON_ERR_UNSUPPORTED, "unison: UNISON_GPU_DATA_PLANE=nccl on rank " + std::to_string(r) +
                                                       ", but " + no_nccl);
  }
  if (staging) return make_staging_plane(*cuda, device, host, out);

  // The hosts, in the order of their first ranks, and each one's ranks.
  std::vector<std::vector<int>> hosts;
  std::vector<int> host_of(n);
  for (int r = 0; r < n; ++r) {
    int h = 0;
    while (h < (int)hosts.size() && where[hosts[h][0]].host != where[r].host) ++h;
    if (h == (int)hosts.size()) hosts.emplace_back();
    hosts[h].push_back(r);
    host_of[r] = h;
  }
  bool hierarchical = false;
  for (const Where& w : where) hierarchical |= w.hierarchical;
  NcclLayout layout;
  layout.cross_group_id = kCrossGroupIds + request.set_id * 1024;
  if (hosts.size() == 1 || !hierarchical) {
    for (int r = 0; r < n; ++r) layout.communicator.push_back(r);
  } else {
    layout.communicator = hosts[host_of[host->rank()]];
    bool even = true;
    for (const auto& h : hosts) even &= h.size() == hosts[0].size();
    const size_t groups = even ? std::min<size_t>(hosts[0].size(), 1024) : 1;
    for (size_t l = 0; l < groups; ++l) {
      std::vector<int> group;
      for (const auto& h : hosts) group.push_back(h[l]);
      std::sort(group.begin(), group.end());  // Backend::split takes ascending ranks
      layout.cross_groups.push_back(group);
    }
  }
  return make_nccl_plane(*cuda, device, host, layout, out);
}

std::string device_support_report() {
  std::string report;
  const CudaRuntime* cuda = cuda_runtime();
  if (cuda == nullptr) {
    report = "CUDA: not found (" + cuda_missing() + "); GPU tensors are refused";
  } else {
    report = "CUDA: " + cuda->library + " (runtime " + std::to_string(cuda->version / 1000) + "." +
             std::to_string(cuda->version % 1000 / 10) + "), " + std::to_string(cuda->devices) + " device(s)";
  }
  const NcclLibrary* nccl = nccl_library();
  if (nccl == nullptr) {
    report += "; NCCL: not found (" + nccl_missing() + "); GPU collectives are staged through host memory";
  } else {
    const int v = nccl->version;
    report += "; NCCL: " + nccl->library + " (" + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) +
              "." + std::to_string(v % 100) + ")";
  }
  return report;
}

Status Engine::device_plane(ProcessSetState& set, int device, DevicePlane** out) {
  if (device < 0) {
    // A joined rank: it takes part on the plane it has, or on its first GPU.
    if (!set.device_planes.empty()) {
      *out = set.device_planes.begin()->second.get();
      return Status::OK();
    }
    device = 0;
  }
  auto it = set.device_planes.find(device);
  if (it == set.device_planes.end()) {
    std::unique_ptr<DevicePlane> plane;
    PlaneRequest request;
    request.hostname = config_.hostname.empty() ? this_host() : config_.hostname;
    request.choice = config_.gpu_data_plane;
    request.hierarchical = config_.hierarchical;
    request.set_id = set.id;
    request.device = device;
    Status s = make_device_plane(request, set.backend, &plane);
    if (!s.ok()) return s;
    it = set.device_planes.emplace(device, std::move(plane)).first;
  }
  *out = it->second.get();
  return Status::OK();
}

}  // namespace unison
