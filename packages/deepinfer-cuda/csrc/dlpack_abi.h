// The DLPack ABI (the legacy DLManagedTensor that torch.from_dlpack accepts in a capsule
// named "dltensor"), declared here from the DLPack specification so that the wheel needs
// no DLPack or torch headers. Only the members this backend fills are spelled out.
#pragma once

#include <cstdint>

namespace deepinfer_cuda::dlpack {

enum DeviceType : int32_t { kCPU = 1, kCUDA = 2 };
enum TypeCode : uint8_t { kUInt = 1 };

struct Device {
  DeviceType device_type;
  int32_t device_id;
};

struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact row-major
  uint64_t byte_offset;
};

struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};

}  // namespace deepinfer_cuda::dlpack
