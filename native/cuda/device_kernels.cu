// device_kernels.cu: the work unison does on device memory itself: the
// arithmetic around NCCL's sums, and batched copies into and out of the
// fusion buffer.
//
// NCCL sums, but the scale factors and Average around it are the core's,
// and they must give the bits the CPU path gives (native/reduce.cc): a
// value is loaded into its compute type (float for half and bfloat16),
// divided by the rank count for Average (integers truncate toward zero),
// scaled (integers through double, truncated), and stored once.
//
// This file is compiled to PTX by make_device_kernels.sh and the PTX is
// kept in device_kernels_ptx.cc, so building unison needs no CUDA: the
// driver compiles the PTX for whatever GPU it finds, at first use.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

template <typename T>
struct Codec {
  using Compute = T;
  __device__ static T load(T v) { return v; }
  __device__ static T store(T v) { return v; }
};
template <>
struct Codec<__half> {
  using Compute = float;
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static __half store(float v) { return __float2half_rn(v); }
};
template <>
struct Codec<__nv_bfloat16> {
  using Compute = float;
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

template <typename C>
__device__ C scaled(C v, double factor) {
  if constexpr (sizeof(C) == 4 && C(0.5) != C(0)) {
    return v * (float)factor;
  } else if constexpr (C(0.5) != C(0)) {
    return v * factor;
  } else {
    return (C)((double)v * factor);
  }
}

// out[i] = scaled(in[i], factor): the prescale, into the buffer that is
// then reduced (in may equal out).
template <typename T>
__device__ void prescale(T* out, const T* in, uint64_t n, double factor) {
  using C = typename Codec<T>::Compute;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    out[i] = Codec<T>::store(scaled<C>(Codec<T>::load(in[i]), factor));
}

// data[i] = scaled(data[i] / ranks, postscale): what follows the sum. A
// power-of-two rank count multiplies floats by its reciprocal, as the CPU
// path does; the bits are the same as dividing.
template <typename T>
__device__ void finish(T* data, uint64_t n, int ranks, double postscale) {
  using C = typename Codec<T>::Compute;
  const bool floating = C(0.5) != C(0);
  const bool by_reciprocal = floating && (ranks & (ranks - 1)) == 0;
  const C reciprocal = (C)1 / (C)ranks;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
    C v = Codec<T>::load(data[i]);
    if (ranks > 1) v = by_reciprocal ? v * reciprocal : v / (C)ranks;
    if (postscale != 1.0) v = scaled<C>(v, postscale);
    data[i] = Codec<T>::store(v);
  }
}

// Up to kCopiesPerBatch copies in one launch, their addresses passed by
// value: a fused group of many small tensors costs one launch to pack and
// one to unpack, not one copy call per tensor. Block row y copies entry y;
// the blocks of a row stride through it in 16-byte words where both ends
// allow, else 4-byte words, and bytes for what is left.
constexpr int kCopiesPerBatch = 64;  // 64 x 24 bytes stays within the 4 KiB of kernel parameters
struct CopyBatch {
  const char* from[kCopiesPerBatch];
  char* to[kCopiesPerBatch];
  uint64_t bytes[kCopiesPerBatch];
};

template <typename Word>
__device__ uint64_t copy_words(const char* from, char* to, uint64_t bytes) {
  const uint64_t words = bytes / sizeof(Word);
  const Word* in = reinterpret_cast<const Word*>(from);
  Word* out = reinterpret_cast<Word*>(to);
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < words; i += (uint64_t)gridDim.x * blockDim.x)
    out[i] = in[i];
  return words * sizeof(Word);
}

extern "C" __global__ void unison_batched_copy(CopyBatch batch) {
  const char* from = batch.from[blockIdx.y];
  char* to = batch.to[blockIdx.y];
  const uint64_t bytes = batch.bytes[blockIdx.y];
  const uintptr_t ends = reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to);
  uint64_t done = 0;
  if (ends % 16 == 0) {
    done = copy_words<uint4>(from, to, bytes);
  } else if (ends % 4 == 0) {
    done = copy_words<uint32_t>(from, to, bytes);
  }
  for (uint64_t i = done + blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < bytes; i += (uint64_t)gridDim.x * blockDim.x)
    to[i] = from[i];
}

#define UNISON_KERNELS(T, suffix)                                                                   \
  extern "C" __global__ void unison_prescale_##suffix(T* out, const T* in, uint64_t n, double f) { \
    prescale<T>(out, in, n, f);                                                                     \
  }                                                                                                 \
  extern "C" __global__ void unison_finish_##suffix(T* data, uint64_t n, int ranks, double f) {    \
    finish<T>(data, n, ranks, f);                                                                   \
  }

UNISON_KERNELS(uint8_t, uint8)
UNISON_KERNELS(int8_t, int8)
UNISON_KERNELS(int16_t, int16)
UNISON_KERNELS(int32_t, int32)
UNISON_KERNELS(int64_t, int64)
UNISON_KERNELS(__half, float16)
UNISON_KERNELS(__nv_bfloat16, bfloat16)
UNISON_KERNELS(float, float32)
UNISON_KERNELS(double, float64)
UNISON_KERNELS(uint16_t, uint16)
UNISON_KERNELS(uint32_t, uint32)
UNISON_KERNELS(uint64_t, uint64)
