// dynamic_library.h: opening a library the core does not link (CUDA, NCCL)
// and taking its functions by name.
#pragma once

#include <dlfcn.h>

#include <string>

namespace unison {

// Opens the first of `names` (null-terminated) that the process has already
// loaded, else the first the loader finds, so that unison and a framework
// (PyTorch ships both CUDA and NCCL) share one copy. Null if none opens.
inline void* open_library(const char* const* names, std::string* opened) {
  for (int pass = 0; pass < 2; ++pass) {
    for (const char* const* name = names; *name != nullptr; ++name) {
      void* handle = dlopen(*name, RTLD_NOW | RTLD_GLOBAL | (pass == 0 ? RTLD_NOLOAD : 0));
      if (handle != nullptr) {
        *opened = *name;
        return handle;
      }
    }
  }
  return nullptr;
}

// *out = the function `symbol`; the first one missing is named in *missing.
template <typename F>
void bind(void* library, const char* symbol, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(library, symbol));
  if (*out == nullptr && missing->empty()) *missing = symbol;
}

}  // namespace unison
