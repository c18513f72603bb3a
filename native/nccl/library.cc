#include "library.h"

#include "../cuda/dynamic_library.h"

namespace unison {
namespace {

struct Loaded {
  NcclLibrary nccl;
  std::string missing;
  bool ok = false;
};

Loaded load() {
  Loaded loaded;
  NcclLibrary& n = loaded.nccl;
  static const char* const kNames[] = {"libnccl.so.2", nullptr};
  void* library = open_library(kNames, &n.library);
  if (library == nullptr) {
    loaded.missing = "libnccl.so.2 could not be opened (pip install nvidia-nccl-cu13, or put NCCL on LD_LIBRARY_PATH)";
    return loaded;
  }
  std::string symbol;
  bind(library, "ncclGetVersion", &n.GetVersion, &symbol);
  bind(library, "ncclGetErrorString", &n.GetErrorString, &symbol);
  bind(library, "ncclGetUniqueId", &n.GetUniqueId, &symbol);
  bind(library, "ncclCommInitRank", &n.CommInitRank, &symbol);
  bind(library, "ncclCommDestroy", &n.CommDestroy, &symbol);
  bind(library, "ncclCommAbort", &n.CommAbort, &symbol);
  bind(library, "ncclCommGetAsyncError", &n.CommGetAsyncError, &symbol);
  bind(library, "ncclAllReduce", &n.AllReduce, &symbol);
  bind(library, "ncclBroadcast", &n.Broadcast, &symbol);
  bind(library, "ncclReduce", &n.Reduce, &symbol);
  bind(library, "ncclSend", &n.Send, &symbol);
  bind(library, "ncclRecv", &n.Recv, &symbol);
  bind(library, "ncclGroupStart", &n.GroupStart, &symbol);
  bind(library, "ncclGroupEnd", &n.GroupEnd, &symbol);
  if (!symbol.empty()) {
    loaded.missing = "libnccl.so.2 has no " + symbol + " (NCCL 2.7 or later is needed)";
    return loaded;
  }
  n.GetVersion(&n.version);
  loaded.ok = true;
  return loaded;
}

const Loaded& loaded() {
  static const Loaded once = load();
  return once;
}

}  // namespace

Status NcclLibrary::check(ncclResult_t code, const std::string& what) const {
  if (code == 0) return Status::OK();
  return Status::Error(UNISON_ERR_INTERNAL, "unison: " + what + " failed: NCCL error " + std::to_string(code) + " (" +
                                                GetErrorString(code) + ")");
}

const NcclLibrary* nccl_library() { return loaded().ok ? &loaded().nccl : nullptr; }

const std::string& nccl_missing() { return loaded().missing; }

}  // namespace unison
