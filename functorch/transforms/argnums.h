#pragma once

// Argnums: which positional arguments a derivative is taken with respect to,
// Python's `argnums: int | Tuple[int, ...]`. A single int yields the
// derivative itself; a tuple (even of one element) yields a tuple of
// derivatives, one per entry, in the order given.
//
//   functorch::grad(f)          // argnums=0
//   functorch::grad(f, 1)       // argnums=1
//   functorch::grad(f, {0, 1})  // argnums=(0, 1)

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace functorch {

class Argnums {
 public:
  Argnums(int64_t argnum) : is_tuple_(false), values_{argnum} {}  // NOLINT
  Argnums(int argnum) : is_tuple_(false), values_{argnum} {}      // NOLINT
  Argnums(std::initializer_list<int64_t> argnums)                 // NOLINT
      : is_tuple_(true), values_(argnums) {}
  static Argnums tuple(std::vector<int64_t> argnums) {
    Argnums a(0);
    a.is_tuple_ = true;
    a.values_ = std::move(argnums);
    return a;
  }

  bool is_tuple() const { return is_tuple_; }
  const std::vector<int64_t>& values() const { return values_; }
  // `1` or `(0, 1)`, as Python prints it.
  std::string to_string() const;

  // Wraps negative entries against `num_args` and checks range and
  // uniqueness with Python's messages ("Got argnum=3, but only 2 positional
  // inputs", "argnums must be non-empty", "argnums elements must be unique").
  std::vector<int64_t> validate(int64_t num_args) const;

 private:
  bool is_tuple_;
  std::vector<int64_t> values_;
};

}  // namespace functorch
