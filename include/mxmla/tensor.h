// mxmla — tensor descriptors and errors of the public C++ API.
//
// A TensorDesc does not own memory: it names a data pointer, a dtype, a shape and strides (in
// elements) and the device the pointer lives on. Ops take input descriptors and caller-allocated
// output descriptors; every op has a CPU implementation and a CUDA one, chosen by `device`.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

struct CUstream_st;

namespace mxmla {

// Opaque CUDA stream (the same type as cudaStream_t); nullptr is the legacy default stream.
using Stream = CUstream_st*;

enum class DType : uint8_t {
  kFloat32,
  kFloat16,
  kBFloat16,
  kFloat8E4M3,  // MXFP8 element codes, E4M3 (OCP "fn": no Inf, NaN = S.1111.111)
  kFloat8E5M2,  // MXFP8 element codes, E5M2
  kE8M0,        // MXFP8 block scales: biased power-of-two exponents
  kUInt8,       // raw bytes (accepted wherever codes or scales are expected)
  kInt32,       // index tensors (cu_seqlens)
  kInt64,
};

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  bool operator==(const Device& o) const { return type == o.type && (type == DeviceType::kCPU || index == o.index); }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

const char* dtype_name(DType t);
// Number of elements of a shape (1 for a 0-D shape).
int64_t numel(const std::vector<int64_t>& shape);
const char* device_name(DeviceType t);
int64_t dtype_size(DType t);

struct TensorDesc {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in elements; empty means contiguous row-major
  Device device;

  TensorDesc() = default;
  TensorDesc(void* d, DType t, std::vector<int64_t> s, Device dev = {}, std::vector<int64_t> st = {})
      : data(d), dtype(t), shape(std::move(s)), strides(std::move(st)), device(dev) {}

  int64_t ndim() const { return static_cast<int64_t>(shape.size()); }
  int64_t numel() const;
  int64_t stride(int64_t dim) const;  // effective stride (contiguous strides when `strides` is empty)
  bool is_contiguous() const;
};

// The error every op throws for bad input. The message names the op, the argument and the rule
// it broke, e.g. "mxmla.quantize: argument 'input': last dimension 100 must be a multiple of 32".
class Error : public std::invalid_argument {
 public:
  Error(const std::string& op, const std::string& arg, const std::string& rule);
  const std::string& op() const { return op_; }
  const std::string& arg() const { return arg_; }
  const std::string& rule() const { return rule_; }

 private:
  std::string op_, arg_, rule_;
};

// A CUDA failure (launch error, bad device); message carries the CUDA error string.
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace mxmla
