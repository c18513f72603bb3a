// Runs the registered unit tests whose names start with one of the
// arguments (every test without arguments), and prints PASS or FAIL with
// the reasons for each. The exit status is the number of failed tests.
#include <cstdio>
#include <cstring>

#include "unit.h"

int main(int argc, char** argv) {
  int failed = 0, ran = 0;
  for (const unit::Case& c : unit::cases()) {
    bool chosen = argc < 2;
    for (int i = 1; i < argc; ++i) chosen |= c.name.compare(0, std::strlen(argv[i]), argv[i]) == 0;
    if (!chosen) continue;
    unit::failures().clear();
    c.run();
    ++ran;
    if (unit::failures().empty()) {
      std::printf("PASS %s\n", c.name.c_str());
      continue;
    }
    ++failed;
    std::printf("FAIL %s\n", c.name.c_str());
    for (const std::string& why : unit::failures()) std::printf("    %s\n", why.c_str());
  }
  std::printf("%d ran, %d failed\n", ran, failed);
  return failed > 125 ? 125 : failed;
}
