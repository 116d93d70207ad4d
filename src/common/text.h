// mxmla internal — formatting for error messages.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mxmla::detail {

inline std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

}  // namespace mxmla::detail
