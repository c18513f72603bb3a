// device_kernels.h: launching device_kernels.cu's kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "../data_plane.h"
#include "runtime.h"

namespace unison {

extern const char* const kDeviceKernelsPtx;  // device_kernels_ptx.cc

// The kernels of one device, loaded into its context at first use.
class DeviceKernels {
 public:
  // Loads the module on the current device.
  Status load(const CudaRuntime& cuda);
  // out[i] = in[i] * factor, as the CPU path scales (in may equal out).
  Status prescale(int dtype, void* out, const void* in, uint64_t count, double factor, cudaStream_t stream);
  // data[i] = (data[i] / ranks) * postscale; ranks 1 is no division.
  Status finish(int dtype, void* data, uint64_t count, int ranks, double postscale, cudaStream_t stream);
  // Each segment's input bytes to its output, in one launch per 64.
  Status copy(const std::vector<Segment>& copies, cudaStream_t stream);

 private:
  Status launch(void* function, uint64_t count, void** arguments, cudaStream_t stream);
  const CudaRuntime* cuda_ = nullptr;
  void* prescale_[16] = {};  // by dtype code
  void* finish_[16] = {};
  void* batched_copy_ = nullptr;
};

}  // namespace unison
