// Early return for absl::StatusOr, as the codebase has no status macros of
// its own (Abseil's are not public).
#pragma once

// Evaluates `expr` (an absl::StatusOr<T>); returns its status from the
// enclosing function on error, else moves its value into `lhs`.
#define STATE_DICT_ASSIGN_OR_RETURN(lhs, expr) \
  do {                                         \
    auto _state_dict_value = (expr);           \
    if (!_state_dict_value.ok()) {             \
      return _state_dict_value.status();       \
    }                                          \
    lhs = *std::move(_state_dict_value);       \
  } while (false)
