// The CUDA driver API, resolved at run time from libcuda.so.1.
//
// The wheel links no CUDA library: every entry point is looked up once with
// cuGetProcAddress at the CUDA 12.0 ABI, so the same binary serves every CUDA 12 and 13
// driver. The function-pointer types below spell out the 12.0 signatures on purpose:
// the CUDA 13 headers declare newer ABIs (edge data, ...) under the same names.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace deepinfer_cuda {

// Entry points used by the backend, at the CUDA 12.0 ABI.
struct DriverApi {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetUuid)(CUuuid*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxPushCurrent)(CUcontext);
  CUresult (*cuCtxPopCurrent)(CUcontext*);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxGetDevice)(CUdevice*);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemGetInfo)(size_t*, size_t*);
  CUresult (*cuMemGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr);
  CUresult (*cuPointerGetAttribute)(void*, CUpointer_attribute, CUdeviceptr);
  CUresult (*cuIpcGetMemHandle)(CUipcMemHandle*, CUdeviceptr);
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned int);
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
  CUresult (*cuEventCreate)(CUevent*, unsigned int);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventRecordWithFlags)(CUevent, CUstream, unsigned int);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuEventElapsedTime)(float*, CUevent, CUevent);
  CUresult (*cuStreamIsCapturing)(CUstream, CUstreamCaptureStatus*);
  CUresult (*cuStreamGetCtx)(CUstream, CUcontext*);
  CUresult (*cuGraphGetNodes)(CUgraph, CUgraphNode*, size_t*);
  CUresult (*cuGraphGetEdges)(CUgraph, CUgraphNode*, CUgraphNode*, size_t*);
  CUresult (*cuGraphNodeGetType)(CUgraphNode, CUgraphNodeType*);
  CUresult (*cuGraphNodeGetDependencies)(CUgraphNode, CUgraphNode*, size_t*);
  CUresult (*cuGraphNodeGetDependentNodes)(CUgraphNode, CUgraphNode*, size_t*);
  CUresult (*cuGraphAddEventRecordNode)(CUgraphNode*, CUgraph, const CUgraphNode*, size_t, CUevent);
  CUresult (*cuGraphAddDependencies)(CUgraph, const CUgraphNode*, const CUgraphNode*, size_t);
  CUresult (*cuGraphRemoveDependencies)(CUgraph, const CUgraphNode*, const CUgraphNode*, size_t);
  CUresult (*cuGraphDestroyNode)(CUgraphNode);
  CUresult (*cuGraphEventRecordNodeGetEvent)(CUgraphNode, CUevent*);
  CUresult (*cuGraphExecEventRecordNodeSetEvent)(CUgraphExec, CUgraphNode, CUevent);
  CUresult (*cuGraphKernelNodeGetParams)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS_v2*);
  CUresult (*cuGraphInstantiateWithFlags)(CUgraphExec*, CUgraph, unsigned long long);
  CUresult (*cuGraphExecDestroy)(CUgraphExec);
  CUresult (*cuGraphLaunch)(CUgraphExec, CUstream);
  // Optional (CUDA 12.3+): the edge-data forms of the graph-edge calls (requested at the 12.3
  // ABI, where the driver gives its *_v2 entry points). Graphs whose edges carry data
  // (programmatic dependent launch, e.g. cuBLAS kernels on Hopper) can only be read and
  // edited through these; null when the driver is older.
  CUresult (*cuGraphGetEdgesWithData)(CUgraph, CUgraphNode*, CUgraphNode*, CUgraphEdgeData*, size_t*);
  CUresult (*cuGraphNodeGetDependenciesWithData)(CUgraphNode, CUgraphNode*, CUgraphEdgeData*, size_t*);
  CUresult (*cuGraphNodeGetDependentNodesWithData)(CUgraphNode, CUgraphNode*, CUgraphEdgeData*, size_t*);
  CUresult (*cuGraphAddDependenciesWithData)(CUgraph, const CUgraphNode*, const CUgraphNode*,
                                             const CUgraphEdgeData*, size_t);
  CUresult (*cuGraphRemoveDependenciesWithData)(CUgraph, const CUgraphNode*, const CUgraphNode*,
                                                const CUgraphEdgeData*, size_t);
  // Optional (CUDA 12.3+): kernel names for GraphHandle.kernel_names(); null when absent.
  CUresult (*cuFuncGetName)(const char**, CUfunction);
  CUresult (*cuKernelGetName)(const char**, CUkernel);
};

// A driver call failed; carries the CUresult and its name ("CUDA_ERROR_...").
class CudaError : public std::runtime_error {
 public:
  CudaError(CUresult code, const std::string& message) : std::runtime_error(message), code_(code) {}
  CUresult code() const { return code_; }

 private:
  CUresult code_;
};

// The driver, loaded and initialised on first use; throws CudaError / std::runtime_error
// saying why when libcuda.so.1 is missing, too old, or cuInit fails.
const DriverApi& driver();

// "CUDA_ERROR_NOT_READY (600): device not ready"
std::string describe(CUresult code);

// Throws CudaError naming the call when code != CUDA_SUCCESS.
void check(CUresult code, const char* call);

// Number of visible devices; validates 0 <= device < count (ValueError-style message).
int device_count();
void validate_device(int device, const char* argument);

// The device's primary context, retained once per process and never released: memory
// handed to torch may be freed at any later time, even at interpreter shutdown.
CUcontext primary_context(int device);

// Device ordinal of the calling thread's current context, or -1 when it has none.
int current_device_or_none();

// Makes a device's primary context current for the scope of a call.
class ContextScope {
 public:
  explicit ContextScope(int device);
  explicit ContextScope(CUcontext context);
  ~ContextScope();
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  void push(CUcontext context);
  bool pushed_ = false;
};

}  // namespace deepinfer_cuda
