#include "python/request_output_pool.h"

#include <algorithm>

namespace deepinfer {

namespace py = pybind11;

void RequestOutputPool::collect() {
  free_.clear();
  for (size_t i = 0; i < objs_.size(); ++i)
    if (Py_REFCNT(objs_[i].first.ptr()) == 1) free_.push_back(i);
  std::reverse(free_.begin(), free_.end());  // pop_back hands out objects in pool order
}

std::pair<py::object, RequestOutputData*> RequestOutputPool::acquire() {
  if (!free_.empty()) {
    auto& e = objs_[free_.back()];
    free_.pop_back();
    return e;
  }
  auto* d = new RequestOutputData();
  py::object o = py::cast(d, py::return_value_policy::take_ownership);
  if (objs_.size() < max_size_) objs_.emplace_back(o, d);
  return {o, d};
}

py::list request_output_list(Scheduler& sched, RequestOutputPool& pool) {
  pool.collect();
  py::list result(0);
  build_request_outputs(sched, [&]() -> RequestOutputData& {
    auto [obj, d] = pool.acquire();
    result.append(obj);
    return *d;
  }, &pool.columns());
  return result;
}

}  // namespace deepinfer
