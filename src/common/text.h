// mxmla internal — formatting for error messages.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mxmla/tensor.h"

namespace mxmla::detail {

inline std::string shape_str(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

// "cuda:0", "cpu:0".
inline std::string device_str(const Device& d) { return std::string(device_name(d.type)) + ":" + std::to_string(d.index); }

}  // namespace mxmla::detail
