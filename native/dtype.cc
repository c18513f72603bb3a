#include "dtype.h"

namespace unison {

bool dtype_valid(int dtype) { return dtype >= UNISON_UINT8 && dtype <= UNISON_COMPLEX128; }

size_t dtype_size(int dtype) {
  switch (dtype) {
    case UNISON_UINT8: case UNISON_INT8: case UNISON_BOOL: return 1;
    case UNISON_INT16: case UNISON_UINT16: case UNISON_FLOAT16: case UNISON_BFLOAT16: return 2;
    case UNISON_INT32: case UNISON_UINT32: case UNISON_FLOAT32: return 4;
    case UNISON_INT64: case UNISON_UINT64: case UNISON_FLOAT64: case UNISON_COMPLEX64: return 8;
    case UNISON_COMPLEX128: return 16;
    default: return 0;
  }
}

const char* dtype_name(int dtype) {
  switch (dtype) {
    case UNISON_UINT8: return "uint8";
    case UNISON_INT8: return "int8";
    case UNISON_INT16: return "int16";
    case UNISON_INT32: return "int32";
    case UNISON_INT64: return "int64";
    case UNISON_FLOAT16: return "float16";
    case UNISON_BFLOAT16: return "bfloat16";
    case UNISON_FLOAT32: return "float32";
    case UNISON_FLOAT64: return "float64";
    case UNISON_BOOL: return "bool";
    case UNISON_UINT16: return "uint16";
    case UNISON_UINT32: return "uint32";
    case UNISON_UINT64: return "uint64";
    case UNISON_COMPLEX64: return "complex64";
    case UNISON_COMPLEX128: return "complex128";
    default: return "unknown dtype";
  }
}

bool dtype_is_float(int dtype) {
  return dtype == UNISON_FLOAT16 || dtype == UNISON_BFLOAT16 || dtype == UNISON_FLOAT32 ||
         dtype == UNISON_FLOAT64;
}

bool dtype_is_complex(int dtype) { return dtype == UNISON_COMPLEX64 || dtype == UNISON_COMPLEX128; }

int reduced_as(int dtype) {
  if (dtype == UNISON_COMPLEX64) return UNISON_FLOAT32;
  if (dtype == UNISON_COMPLEX128) return UNISON_FLOAT64;
  return dtype;
}

const char* op_name(int op) {
  switch (op) {
    case UNISON_ALLREDUCE: return "allreduce";
    case UNISON_ALLGATHER: return "allgather";
    case UNISON_BROADCAST: return "broadcast";
    case UNISON_ALLTOALL: return "alltoall";
    case UNISON_REDUCESCATTER: return "reducescatter";
    case UNISON_BARRIER: return "barrier";
    case UNISON_JOIN: return "join";
    case UNISON_ADD_PROCESS_SET: return "add_process_set";
    case UNISON_REMOVE_PROCESS_SET: return "remove_process_set";
    default: return "unknown op";
  }
}

const char* reduce_op_name(int reduce_op) {
  switch (reduce_op) {
    case UNISON_SUM: return "Sum";
    case UNISON_AVERAGE: return "Average";
    case UNISON_MIN: return "Min";
    case UNISON_MAX: return "Max";
    case UNISON_PRODUCT: return "Product";
    case UNISON_ADASUM: return "Adasum";
    default: return "unknown reduce op";
  }
}

}  // namespace unison
