// The DLPack ABI (DLManagedTensor in a capsule named "dltensor", as torch.from_dlpack takes
// it), declared from the DLPack specification with its official names so that building the
// wheel needs no DLPack or torch headers — the same choice as deepinfer-cuda. The layout and
// enum values are the spec's; only the members this backend uses are declared.
#pragma once

#include <cstdint>

enum DLDeviceType : int32_t {
  kDLCPU = 1,
  kDLExtDev = 12,  // torch routes it to its PrivateUse1 device (torch_npu's "npu")
};

enum DLDataTypeCode : uint8_t {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLBfloat = 4,
  kDLBool = 6,
};

struct DLDevice {
  DLDeviceType device_type;
  int32_t device_id;
};

struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact row-major
  uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
