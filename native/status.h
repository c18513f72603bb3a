// status.h: the result of anything that can fail inside the core.
#pragma once

#include <string>
#include <utility>

#include "unison.h"

namespace unison {

struct Status {
  int code = UNISON_OK;
  std::string message;

  static Status OK() { return Status(); }
  static Status Error(int code, std::string message) {
    Status s;
    s.code = code;
    s.message = std::move(message);
    return s;
  }
  bool ok() const { return code == UNISON_OK; }
};

}  // namespace unison
