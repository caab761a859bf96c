// Python-wrapped RequestOutputData recycled through a pool, and the list build_request_outputs
// returns.
#pragma once

#include <pybind11/pybind11.h>

#include <utility>
#include <vector>

#include "core/request_output.h"

namespace deepinfer {

// An object is reused once nothing outside the pool references it (its refcount is back to 1).
class RequestOutputPool {
 public:
  explicit RequestOutputPool(size_t max_size) : max_size_(max_size) {}
  // Call with the GIL held, once per build: finds the reusable objects.
  void collect();
  // An object to refill (the GIL held).
  std::pair<pybind11::object, RequestOutputData*> acquire();
  size_t size() const { return objs_.size(); }
  size_t max_size() const { return max_size_; }
  size_t num_free() const { return free_.size(); }
  // The requests whose plain deltas build_request_outputs writes as rows (core/request_output.h).
  DeltaColumns& columns() { return columns_; }

 private:
  size_t max_size_;
  std::vector<std::pair<pybind11::object, RequestOutputData*>> objs_;
  std::vector<size_t> free_;
  DeltaColumns columns_;
};

// The RequestOutputs of core's build_request_outputs, as a list of pooled objects (GIL held).
pybind11::list request_output_list(Scheduler& sched, RequestOutputPool& pool);

}  // namespace deepinfer
