// Small project-local status macros (Abseil 20220623 has none public).
#ifndef ROPEATTN_CORE_STATUS_MACROS_H_
#define ROPEATTN_CORE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define RA_CONCAT_INNER_(a, b) a##b
#define RA_CONCAT_(a, b) RA_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function if `expr` is not OK.
#define RA_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::absl::Status ra_status_ = (expr);      \
    if (!ra_status_.ok()) return ra_status_; \
  } while (0)

// `lhs = value of statusor_expr`, or return its status.
#define RA_ASSIGN_OR_RETURN(lhs, statusor_expr) \
  RA_ASSIGN_OR_RETURN_IMPL_(RA_CONCAT_(ra_statusor_, __LINE__), lhs, statusor_expr)
#define RA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, statusor_expr) \
  auto tmp = (statusor_expr);                              \
  if (!tmp.ok()) return tmp.status();                      \
  lhs = std::move(tmp).value()

#endif  // ROPEATTN_CORE_STATUS_MACROS_H_
