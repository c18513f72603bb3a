// kernels_core.h: what unison.tensorflow's two compiled libraries share,
// kernels.cc (the op kernels) and kernels_xla.cc (allreduce lowered to
// XLA). Each is built on its own, since XLA's headers may not build where
// TensorFlow's do, and each is handed the core's functions once loaded.
#ifndef UNISON_TF_KERNELS_CORE_H
#define UNISON_TF_KERNELS_CORE_H

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "unison.h"

namespace unison_tf {

// The core's functions, from unison_tf_bind.
struct Core {
  int (*enqueue)(const unison_op_options*, unison_handle*);
  int (*group_begin)(void);
  int (*group_end)(int);
  int (*on_done)(unison_handle, unison_done_fn, void*);
  int (*handle_error)(unison_handle, char*, int64_t);
  int (*handle_result)(unison_handle, int, void**, int64_t*, int*, int64_t*);
  int (*received_splits)(unison_handle, int64_t*, int);
  int (*join_rank)(unison_handle, int*);
  int (*release)(unison_handle);
  const char* (*last_error)(void);
  int (*wait)(unison_handle, double);
};
// One of each per library: both are built with hidden symbols.
inline Core core;
inline std::atomic<bool> bound{false};

// A core status as TensorFlow's, with the class unison.tensorflow raises
// eagerly named first ("MismatchError: unison: ..."), as the Python nodes
// named it: hvd.elastic.run reads it back (tf_adapter/elastic.py). The
// TensorFlow codes are Horovod's: ranks that disagree are a failed
// precondition, a lost peer or a shutdown aborts the step.
inline absl::Status as_tensorflow(int code, const std::string& message) {
  const char* kind = "UnisonInternalError";
  absl::StatusCode tf_code = absl::StatusCode::kUnknown;
  switch (code) {
    case UNISON_ERR_INVALID_ARGUMENT: kind = "InvalidArgumentError"; tf_code = absl::StatusCode::kInvalidArgument; break;
    case UNISON_ERR_NOT_INITIALIZED: kind = "NotInitializedError"; tf_code = absl::StatusCode::kFailedPrecondition; break;
    case UNISON_ERR_MISMATCH: kind = "MismatchError"; tf_code = absl::StatusCode::kFailedPrecondition; break;
    case UNISON_ERR_RANK_FAILED: kind = "RankFailedError"; tf_code = absl::StatusCode::kAborted; break;
    case UNISON_ERR_SHUT_DOWN: kind = "ShutDownError"; tf_code = absl::StatusCode::kAborted; break;
    case UNISON_ERR_STALLED: kind = "StalledError"; tf_code = absl::StatusCode::kUnknown; break;
    case UNISON_ERR_DEADLOCK: kind = "DeadlockError"; tf_code = absl::StatusCode::kUnknown; break;
    case UNISON_ERR_UNSUPPORTED: kind = "UnsupportedError"; tf_code = absl::StatusCode::kUnimplemented; break;
    case UNISON_ERR_OUT_OF_MEMORY: kind = "OutOfMemoryError"; tf_code = absl::StatusCode::kResourceExhausted; break;
    case UNISON_ERR_TIMEOUT: kind = "UnisonInternalError"; tf_code = absl::StatusCode::kDeadlineExceeded; break;
    default: break;
  }
  return absl::Status(tf_code, std::string(kind) + ": " + message);
}

inline double factor_of(int64_t bits) {
  // Factors travel as a double's bits in an int attr: a float attr is 32
  // bits, and 1/3 rounded to float would not scale as the eager path does.
  double value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// Fills `core` from the addresses the cffi module has, in the order
// tf_adapter/kernels.py lists them (_BOUND). 0 when bound.
inline int bind_core(const uintptr_t* functions, int count) {
  if (count != 11) return 1;
  core.enqueue = reinterpret_cast<decltype(core.enqueue)>(functions[0]);
  core.group_begin = reinterpret_cast<decltype(core.group_begin)>(functions[1]);
  core.group_end = reinterpret_cast<decltype(core.group_end)>(functions[2]);
  core.on_done = reinterpret_cast<decltype(core.on_done)>(functions[3]);
  core.handle_error = reinterpret_cast<decltype(core.handle_error)>(functions[4]);
  core.handle_result = reinterpret_cast<decltype(core.handle_result)>(functions[5]);
  core.received_splits = reinterpret_cast<decltype(core.received_splits)>(functions[6]);
  core.join_rank = reinterpret_cast<decltype(core.join_rank)>(functions[7]);
  core.release = reinterpret_cast<decltype(core.release)>(functions[8]);
  core.last_error = reinterpret_cast<decltype(core.last_error)>(functions[9]);
  core.wait = reinterpret_cast<decltype(core.wait)>(functions[10]);
  bound.store(true);
  return 0;
}

}  // namespace unison_tf

#endif  // UNISON_TF_KERNELS_CORE_H
