#include "device_kernels.h"

#include <algorithm>
#include <string>

#include "../dtype.h"

namespace unison {

Status DeviceKernels::load(const CudaRuntime& cuda) {
  if (cuda_ != nullptr) return Status::OK();
  void* module = nullptr;
  int code = cuda.ModuleLoadData(&module, kDeviceKernelsPtx);
  if (code != 0)
    return Status::Error(UNISON_ERR_INTERNAL, "unison: the driver could not load unison's device kernels (CUDA driver "
                                              "error " + std::to_string(code) + "); the driver may be older than "
                                              "CUDA 13.0, whose PTX they are");
  if (cuda.ModuleGetFunction(&batched_copy_, module, "unison_batched_copy") != 0)
    return Status::Error(UNISON_ERR_INTERNAL, "unison: the device kernels have no batched copy");
  for (int dtype = 0; dtype <= UNISON_UINT64; ++dtype) {
    if (dtype == UNISON_BOOL) continue;  // bools take no scale factors
    const std::string suffix = dtype_name(dtype);
    if (cuda.ModuleGetFunction(&prescale_[dtype], module, ("unison_prescale_" + suffix).c_str()) != 0 ||
        cuda.ModuleGetFunction(&finish_[dtype], module, ("unison_finish_" + suffix).c_str()) != 0)
      return Status::Error(UNISON_ERR_INTERNAL, "unison: the device kernels have no " + suffix + " variant");
  }
  cuda_ = &cuda;
  return Status::OK();
}

Status DeviceKernels::launch(void* function, uint64_t count, void** arguments, cudaStream_t stream) {
  if (count == 0) return Status::OK();
  // Grid-stride loops: enough blocks to fill any current GPU, no more.
  const unsigned threads = 256;
  const unsigned blocks = (unsigned)std::min<uint64_t>((count + threads - 1) / threads, 4096);
  const int code = cuda_->LaunchKernel(function, blocks, 1, 1, threads, 1, 1, 0, stream, arguments, nullptr);
  if (code != 0)
    return Status::Error(UNISON_ERR_INTERNAL, "unison: launching a scale kernel failed (CUDA driver error " +
                                                  std::to_string(code) + ")");
  return Status::OK();
}

Status DeviceKernels::prescale(int dtype, void* out, const void* in, uint64_t count, double factor,
                               cudaStream_t stream) {
  void* arguments[] = {&out, &in, &count, &factor};
  return launch(prescale_[dtype], count, arguments, stream);
}

Status DeviceKernels::finish(int dtype, void* data, uint64_t count, int ranks, double postscale,
                             cudaStream_t stream) {
  void* arguments[] = {&data, &count, &ranks, &postscale};
  return launch(finish_[dtype], count, arguments, stream);
}

Status DeviceKernels::copy(const std::vector<Segment>& copies, cudaStream_t stream) {
  // As device_kernels.cu's CopyBatch.
  constexpr size_t kPerBatch = 64;
  struct CopyBatch {
    const void* from[kPerBatch];
    void* to[kPerBatch];
    uint64_t bytes[kPerBatch];
  };
  for (size_t first = 0; first < copies.size(); first += kPerBatch) {
    CopyBatch batch{};
    unsigned rows = 0;
    uint64_t longest = 0;
    for (size_t i = first; i < copies.size() && i < first + kPerBatch; ++i) {
      if (copies[i].bytes == 0 || copies[i].input == copies[i].output) continue;
      batch.from[rows] = copies[i].input;
      batch.to[rows] = copies[i].output;
      batch.bytes[rows] = copies[i].bytes;
      longest = std::max<uint64_t>(longest, copies[i].bytes);
      ++rows;
    }
    if (rows == 0) continue;
    // A block moves 256 threads x 16 bytes x 4 strides; the longest copy
    // decides how many blocks each row gets, up to enough to fill a GPU.
    const unsigned threads = 256;
    const unsigned columns = (unsigned)std::clamp<uint64_t>(longest / (threads * 16 * 4), 1, 1024);
    void* arguments[] = {&batch};
    const int code = cuda_->LaunchKernel(batched_copy_, columns, rows, 1, threads, 1, 1, 0, stream, arguments, nullptr);
    if (code != 0)
      return Status::Error(UNISON_ERR_INTERNAL, "unison: launching a batched device copy failed (CUDA driver error " +
                                                    std::to_string(code) + ")");
  }
  return Status::OK();
}

}  // namespace unison
