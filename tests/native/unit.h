// unit.h: the least harness the core's in-process unit tests need. Each
// test is a function registered under "file.name"; tests/test_native.py
// builds every tests/native/*.cc with the core sources they test into one
// program and runs it, one pytest case per file.
#pragma once

#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

namespace unit {

struct Case {
  std::string name;
  void (*run)();
};

inline std::vector<Case>& cases() {
  static std::vector<Case> all;
  return all;
}

struct Register {
  Register(const char* file, const char* name, void (*run)()) { cases().push_back({std::string(file) + "." + name, run}); }
};

// Failures of the case now running, each "file:line: what".
inline std::vector<std::string>& failures() {
  static std::vector<std::string> found;
  return found;
}

inline void fail(const char* file, int line, const std::string& what) {
  std::ostringstream text;
  text << file << ":" << line << ": " << what;
  failures().push_back(text.str());
}

}  // namespace unit

// UNIT_FILE names the file's group of cases: define it before including.
#define UNIT_TEST(name)                                                \
  static void name();                                                  \
  static const unit::Register name##_registered(UNIT_FILE, #name, name); \
  static void name()

#define EXPECT(condition) \
  ((condition) ? (void)0 : unit::fail(__FILE__, __LINE__, "expected " #condition))

#define EXPECT_EQ(actual, expected)                                                              \
  do {                                                                                           \
    const auto& actual_value = (actual);                                                         \
    const auto& expected_value = (expected);                                                     \
    if (!(actual_value == expected_value)) {                                                     \
      std::ostringstream text;                                                                   \
      text << #actual " is " << actual_value << ", expected " << expected_value;                 \
      unit::fail(__FILE__, __LINE__, text.str());                                                \
    }                                                                                            \
  } while (0)
