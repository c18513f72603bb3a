// library.h: NCCL, found at run time (libnccl.so.2), like the CUDA runtime
// (../cuda/runtime.h). The declarations are written out here; the values
// are NCCL's stable ABI since 2.x.
#pragma once

#include <string>

#include "../cuda/runtime.h"

namespace unison {

using ncclComm_t = void*;
using ncclResult_t = int;
struct ncclUniqueId {
  char internal[128];
};

struct NcclLibrary {
  enum DataType { kInt8 = 0, kUint8 = 1, kInt32 = 2, kUint32 = 3, kInt64 = 4, kUint64 = 5, kFloat16 = 6,
                  kFloat32 = 7, kFloat64 = 8, kBfloat16 = 9 };
  enum RedOp { kSum = 0, kProd = 1, kMax = 2, kMin = 3 };
  static constexpr ncclResult_t kInProgress = 7;

  std::string library;
  int version = 0;  // 22803 for 2.28.3

  ncclResult_t (*GetVersion)(int*);
  const char* (*GetErrorString)(ncclResult_t);
  ncclResult_t (*GetUniqueId)(ncclUniqueId*);
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*);
  ncclResult_t (*AllReduce)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Broadcast)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Reduce)(const void*, void*, size_t, int, int, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Send)(const void*, size_t, int, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void*, size_t, int, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();

  Status check(ncclResult_t code, const std::string& what) const;
};

// NCCL, loaded once; null when it cannot be (nccl_missing() says why).
const NcclLibrary* nccl_library();
const std::string& nccl_missing();

}  // namespace unison
