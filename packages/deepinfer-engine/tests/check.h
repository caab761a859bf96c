// Minimal checks for the plain C++ tests (run by ctest): a failed check prints where and what,
// and the test exits non-zero. (assert() would vanish in the Release builds the tests use.)
#pragma once

#include <cstdlib>
#include <iostream>
#include <string>

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::cerr << __FILE__ << ":" << __LINE__ << ": CHECK(" #cond ") failed\n";      \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

#define CHECK_EQ(a, b)                                                                            \
  do {                                                                                            \
    const auto& check_a_ = (a);                                                                   \
    const auto& check_b_ = (b);                                                                   \
    if (!(check_a_ == check_b_)) {                                                                \
      std::cerr << __FILE__ << ":" << __LINE__ << ": CHECK_EQ(" #a ", " #b ") failed: " << check_a_ \
                << " != " << check_b_ << "\n";                                                    \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// The statement throws deepinfer::InvalidArgument naming `arg`.
#define CHECK_INVALID_ARGUMENT(stmt, arg)                                                            \
  do {                                                                                               \
    bool check_thrown_ = false;                                                                      \
    try {                                                                                            \
      stmt;                                                                                          \
    } catch (const deepinfer::InvalidArgument& e) {                                                  \
      check_thrown_ = true;                                                                          \
      if (e.argument() != std::string(arg)) {                                                        \
        std::cerr << __FILE__ << ":" << __LINE__ << ": " #stmt " named '" << e.argument()            \
                  << "', expected '" << (arg) << "' (" << e.what() << ")\n";                         \
        std::exit(1);                                                                                \
      }                                                                                              \
    }                                                                                                \
    if (!check_thrown_) {                                                                            \
      std::cerr << __FILE__ << ":" << __LINE__ << ": " #stmt " did not throw InvalidArgument\n";     \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

// Runs each test function, printing its name (ctest shows the output of a failing test).
#define RUN(test)                     \
  do {                                \
    std::cout << #test << std::endl;  \
    test();                           \
  } while (0)
