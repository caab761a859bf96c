// deepinfer_ascend._native.graph_timer: timing events and handles on aclmdlRI captured models.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <mutex>

#include "acl_api.h"
#include "stub_types.h"

namespace py = pybind11;

namespace deepinfer_ascend {

namespace {

// Timing needs ACL_EVENT_TIME_LINE; ACL_EVENT_EXTERNAL makes a record made while the stream
// is captured an external record in the model, so the host can read its timestamp after
// each replay.
constexpr uint32_t kEventFlags = ACL_EVENT_TIME_LINE | ACL_EVENT_EXTERNAL;

const char* kNoInsertAfterCapture =
    "ACL cannot add tasks to an aclmdlRI model after capture (there is no counterpart of CUDA's "
    "cuGraphAddEventRecordNode/cuGraphExecUpdate); record the events while the stream is captured "
    "instead: EventHandle.record(stream) or EventRecordNodeHandle(event, stream)";

aclrtStream as_stream(uintptr_t stream) { return reinterpret_cast<aclrtStream>(stream); }

class Event;

// While `stream` is captured by a GraphHandle, that graph keeps `event` alive: the model
// holds the raw aclrtEvent.
void hold_for_capture(aclrtStream stream, const std::shared_ptr<Event>& event);

class Event : public std::enable_shared_from_this<Event> {
 public:
  explicit Event(int device) : device_(device) {
    use_device(device_);
    ACL_CHECKED(aclrtCreateEventWithFlag, &event_, kEventFlags);
  }
  ~Event() {
    try {
      use_device(device_);
      check(acl().aclrtDestroyEvent(event_), "aclrtDestroyEvent");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "deepinfer-ascend: destroying an event failed: %s\n", e.what());
    }
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(uintptr_t stream) {
    use_device(device_);
    ACL_CHECKED(aclrtRecordEvent, event_, as_stream(stream));
    hold_for_capture(as_stream(stream), shared_from_this());
  }
  bool query() {
    use_device(device_);
    aclrtEventRecordedStatus status = ACL_EVENT_RECORDED_STATUS_NOT_READY;
    ACL_CHECKED(aclrtQueryEventStatus, event_, &status);
    return status == ACL_EVENT_RECORDED_STATUS_COMPLETE;
  }
  void synchronize() {
    py::gil_scoped_release nogil;
    use_device(device_);
    ACL_CHECKED(aclrtSynchronizeEvent, event_);
  }
  float elapsed_ms(const Event& end) {
    use_device(device_);
    float ms = 0.0f;
    ACL_CHECKED(aclrtEventElapsedTime, &ms, event_, end.event_);
    return ms;
  }
  aclrtEvent raw() const { return event_; }
  int device() const { return device_; }

 private:
  int device_;
  aclrtEvent event_ = nullptr;
};

// Events this process created, by raw handle, so nodes found in a model can name them.
std::mutex g_events_mutex;
std::map<aclrtEvent, std::weak_ptr<Event>> g_events;

std::shared_ptr<Event> make_event(int device) {
  auto ev = std::make_shared<Event>(device);
  std::lock_guard<std::mutex> lock(g_events_mutex);
  for (auto it = g_events.begin(); it != g_events.end();) it = it->second.expired() ? g_events.erase(it) : ++it;
  g_events[ev->raw()] = ev;
  return ev;
}

std::map<aclrtEvent, std::shared_ptr<Event>> live_events() {
  std::lock_guard<std::mutex> lock(g_events_mutex);
  std::map<aclrtEvent, std::shared_ptr<Event>> out;
  for (auto& [raw, weak] : g_events)
    if (auto ev = weak.lock()) out[raw] = ev;
  return out;
}

// The state behind a GraphHandle, shared with the node handles found in it so the model
// outlives them.
struct Graph {
  aclmdlRI model = nullptr;
  bool owned = false;
  bool destroyed = false;
  aclrtStream capture_stream = nullptr;
  bool capturing = false;
  int device = 0;
  // The event each event-record task records now: ACL holds raw aclrtEvents, so the graph
  // keeps them alive (those recorded during capture, and every one swapped in since).
  std::map<aclmdlRITask, std::shared_ptr<Event>> installed;
  std::vector<std::shared_ptr<Event>> recorded_in_capture;

  void require_model(const char* what) const {
    if (destroyed) throw py::value_error(std::string("GraphHandle.") + what + ": the graph has been destroyed");
    if (capturing) throw std::runtime_error(std::string("GraphHandle.") + what + ": the graph is still being captured");
    if (model == nullptr) throw std::runtime_error(std::string("GraphHandle.") + what + ": nothing has been captured");
  }
  void destroy() {
    if (model != nullptr && owned && !destroyed) {
      use_device(device);
      ACL_CHECKED(aclmdlRIDestroy, model);
    }
    destroyed = true;
  }
  ~Graph() {
    try {
      if (!capturing) destroy();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "deepinfer-ascend: destroying a graph failed: %s\n", e.what());
    }
  }
};

std::mutex g_graphs_mutex;
std::map<aclmdlRI, std::weak_ptr<Graph>> g_graphs;  // models being captured by a GraphHandle

void hold_for_capture(aclrtStream stream, const std::shared_ptr<Event>& event) {
  const AclApi& api = acl();
  if (api.aclmdlRICaptureGetInfo == nullptr) return;
  aclmdlRICaptureStatus status = ACL_MODEL_RI_CAPTURE_STATUS_NONE;
  aclmdlRI model = nullptr;
  if (api.aclmdlRICaptureGetInfo(stream, &status, &model) != ACL_SUCCESS) return;
  if (status != ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE || model == nullptr) return;
  std::lock_guard<std::mutex> lock(g_graphs_mutex);
  auto it = g_graphs.find(model);
  if (it == g_graphs.end()) return;
  if (auto graph = it->second.lock()) graph->recorded_in_capture.push_back(event);
}

// Tasks of a captured model in stream order (aclmdlRIGetStreams, aclmdlRIGetTasksByStream).
std::vector<aclmdlRITask> model_tasks(aclmdlRI model) {
  uint32_t num_streams = 0;
  ACL_CHECKED(aclmdlRIGetStreams, model, nullptr, &num_streams);
  std::vector<aclrtStream> streams(num_streams);
  ACL_CHECKED(aclmdlRIGetStreams, model, streams.data(), &num_streams);
  streams.resize(num_streams);
  std::vector<aclmdlRITask> all;
  for (aclrtStream s : streams) {
    uint32_t n = 0;
    ACL_CHECKED(aclmdlRIGetTasksByStream, s, nullptr, &n);
    std::vector<aclmdlRITask> tasks(n);
    ACL_CHECKED(aclmdlRIGetTasksByStream, s, tasks.data(), &n);
    tasks.resize(n);
    all.insert(all.end(), tasks.begin(), tasks.end());
  }
  return all;
}

aclmdlRITaskType task_type(aclmdlRITask task) {
  aclmdlRITaskType type = ACL_MODEL_RI_TASK_DEFAULT;
  ACL_CHECKED(aclmdlRITaskGetType, task, &type);
  return type;
}

const char* task_type_name(aclmdlRITaskType type) {
  switch (type) {
    case ACL_MODEL_RI_TASK_KERNEL: return "kernel";
    case ACL_MODEL_RI_TASK_EVENT_RECORD: return "event_record";
    case ACL_MODEL_RI_TASK_EVENT_WAIT: return "event_wait";
    case ACL_MODEL_RI_TASK_EVENT_RESET: return "event_reset";
    case ACL_MODEL_RI_TASK_VALUE_WRITE: return "value_write";
    case ACL_MODEL_RI_TASK_VALUE_WAIT: return "value_wait";
    default: return "other";
  }
}

// An event-record task of a captured model. Made at capture time (the ACL way) or found in
// a captured model by GraphHandle.event_record_nodes(); its task is looked up on first use
// after capture, by the event it records.
class EventRecordNode {
 public:
  // Capture-time construction: records `event` on the capturing `stream`.
  EventRecordNode(std::shared_ptr<Event> event, uintptr_t stream) : event_(std::move(event)) {
    use_device(event_->device());
    aclmdlRICaptureStatus status = ACL_MODEL_RI_CAPTURE_STATUS_NONE;
    aclmdlRI model = nullptr;
    ACL_CHECKED(aclmdlRICaptureGetInfo, as_stream(stream), &status, &model);
    if (status != ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE) {
      throw std::runtime_error(
          "EventRecordNodeHandle(event, stream): stream is not being captured; ACL can only create event-record "
          "tasks during capture (it cannot add tasks to a model afterwards)");
    }
    event_->record(stream);
    model_ = model;
    std::lock_guard<std::mutex> lock(g_graphs_mutex);
    auto it = g_graphs.find(model);
    if (it != g_graphs.end()) graph_ = it->second.lock();
  }
  EventRecordNode(std::shared_ptr<Graph> graph, aclmdlRITask task, std::shared_ptr<Event> event)
      : graph_(std::move(graph)), model_(graph_->model), task_(task), event_(std::move(event)) {}

  std::shared_ptr<Event> event() const { return event_; }

  // aclmdlRITaskSetParams with the new event, then aclmdlRIUpdate so the next replay uses it.
  void set_event(std::shared_ptr<Event> event) {
    if (!event) throw py::type_error("event must be an EventHandle, got None");
    if (graph_) graph_->require_model("EventRecordNodeHandle.set_event");
    use_device(event->device());
    stage_event(event, model_);
    ACL_CHECKED(aclmdlRIUpdate, model_);
  }

  // aclmdlRITaskSetParams only; the caller runs aclmdlRIUpdate on `model`.
  void stage_event(std::shared_ptr<Event> event, aclmdlRI model) {
    if (model != model_) throw py::value_error("set_events: a node belongs to another graph");
    aclmdlRITask task = resolve_task();
    aclmdlRITaskParams params{};
    ACL_CHECKED(aclmdlRITaskGetParams, task, &params);
    params.eventRecordTaskParams.event = event->raw();
    ACL_CHECKED(aclmdlRITaskSetParams, task, &params);
    if (graph_) graph_->installed[task] = event;
    event_ = std::move(event);
  }

  uintptr_t task() { return reinterpret_cast<uintptr_t>(resolve_task()); }

 private:
  aclmdlRITask resolve_task() {
    if (task_ != nullptr) return task_;
    if (graph_ && graph_->capturing) {
      throw std::runtime_error("EventRecordNodeHandle: the graph is still being captured; end the capture first");
    }
    for (aclmdlRITask t : model_tasks(model_)) {
      if (task_type(t) != ACL_MODEL_RI_TASK_EVENT_RECORD) continue;
      aclmdlRITaskParams params{};
      ACL_CHECKED(aclmdlRITaskGetParams, t, &params);
      if (params.eventRecordTaskParams.event == event_->raw()) return task_ = t;
    }
    throw std::runtime_error("EventRecordNodeHandle: the captured model has no event-record task for this event");
  }

  std::shared_ptr<Graph> graph_;
  aclmdlRI model_ = nullptr;
  aclmdlRITask task_ = nullptr;
  std::shared_ptr<Event> event_;
};

class GraphHandle {
 public:
  GraphHandle(uintptr_t model, int device) : graph_(std::make_shared<Graph>()) {
    graph_->model = reinterpret_cast<aclmdlRI>(model);  // 0: capture one with capture_begin
    graph_->device = device;
  }

  void capture_begin(uintptr_t stream) {
    const int device = graph_->device;
    if (stream == 0) throw py::value_error("stream=0: ACL cannot capture the default stream; pass a created stream");
    if (graph_->capturing) throw std::runtime_error("GraphHandle.capture_begin: a capture is already in progress");
    if (graph_->model != nullptr) throw std::runtime_error("GraphHandle.capture_begin: this handle already holds a graph");
    use_device(device);
    ACL_CHECKED(aclmdlRICaptureBegin, as_stream(stream), ACL_MODEL_RI_CAPTURE_MODE_GLOBAL);
    graph_->device = device;
    graph_->capture_stream = as_stream(stream);
    graph_->capturing = true;
    aclmdlRICaptureStatus status = ACL_MODEL_RI_CAPTURE_STATUS_NONE;
    aclmdlRI model = nullptr;
    ACL_CHECKED(aclmdlRICaptureGetInfo, as_stream(stream), &status, &model);
    if (model != nullptr) {
      std::lock_guard<std::mutex> lock(g_graphs_mutex);
      g_graphs[model] = graph_;
    }
  }

  void capture_end() {
    if (!graph_->capturing) throw std::runtime_error("GraphHandle.capture_end: no capture in progress");
    use_device(graph_->device);
    aclmdlRI model = nullptr;
    graph_->capturing = false;
    ACL_CHECKED(aclmdlRICaptureEnd, graph_->capture_stream, &model);
    graph_->model = model;
    graph_->owned = true;
  }

  void replay(uintptr_t stream) {
    graph_->require_model("replay");
    use_device(graph_->device);
    const aclmdlRI model = graph_->model;  // read under the GIL
    py::gil_scoped_release nogil;
    ACL_CHECKED(aclmdlRIExecuteAsync, model, as_stream(stream));
  }

  std::vector<std::pair<uintptr_t, std::string>> nodes() {
    graph_->require_model("nodes");
    use_device(graph_->device);
    std::vector<std::pair<uintptr_t, std::string>> out;
    for (aclmdlRITask t : model_tasks(graph_->model))
      out.emplace_back(reinterpret_cast<uintptr_t>(t), task_type_name(task_type(t)));
    return out;
  }

  std::vector<uintptr_t> kernel_nodes() {
    std::vector<uintptr_t> out;
    for (const auto& [task, type] : nodes())
      if (type == "kernel") out.push_back(task);
    return out;
  }

  std::vector<EventRecordNode> event_record_nodes(const std::map<aclrtEvent, std::shared_ptr<Event>>& known) {
    graph_->require_model("event_record_nodes");
    use_device(graph_->device);
    std::vector<EventRecordNode> out;
    for (aclmdlRITask t : model_tasks(graph_->model)) {
      if (task_type(t) != ACL_MODEL_RI_TASK_EVENT_RECORD) continue;
      aclmdlRITaskParams params{};
      ACL_CHECKED(aclmdlRITaskGetParams, t, &params);
      auto it = known.find(params.eventRecordTaskParams.event);
      out.emplace_back(graph_, t, it == known.end() ? nullptr : it->second);
    }
    return out;
  }

  EventRecordNode find_event_record_node(const std::shared_ptr<Event>& event) {
    if (!event) throw py::type_error("event must be an EventHandle, got None");
    graph_->require_model("find_event_record_node");
    use_device(graph_->device);
    for (aclmdlRITask t : model_tasks(graph_->model)) {
      if (task_type(t) != ACL_MODEL_RI_TASK_EVENT_RECORD) continue;
      aclmdlRITaskParams params{};
      ACL_CHECKED(aclmdlRITaskGetParams, t, &params);
      if (params.eventRecordTaskParams.event == event->raw()) return EventRecordNode(graph_, t, event);
    }
    throw py::value_error("event is not recorded by any task of this graph (record it while the stream is captured)");
  }

  // Every swap first, then one aclmdlRIUpdate for the whole model.
  void set_events(std::vector<EventRecordNode*> nodes, const std::vector<std::shared_ptr<Event>>& events) {
    if (nodes.size() != events.size()) {
      throw py::value_error("set_events: " + std::to_string(nodes.size()) + " nodes but " +
                            std::to_string(events.size()) + " events");
    }
    graph_->require_model("set_events");
    use_device(graph_->device);
    for (std::size_t i = 0; i < nodes.size(); ++i) {
      if (nodes[i] == nullptr || !events[i]) throw py::type_error("set_events: None in nodes or events");
      nodes[i]->stage_event(events[i], graph_->model);
    }
    ACL_CHECKED(aclmdlRIUpdate, graph_->model);
  }

  void set_timing_enabled(bool enabled) {
    if (!enabled) {
      throw AclUnsupported(
          "ACL cannot remove or skip the event-record tasks of a captured aclmdlRI model, so timing cannot be "
          "switched off without recapture; capture the graph without timer regions instead");
    }
  }

  void destroy() {
    if (graph_->capturing) throw std::runtime_error("GraphHandle.destroy: end the capture first");
    graph_->destroy();
  }

  uintptr_t raw_model() const { return reinterpret_cast<uintptr_t>(graph_->model); }
  bool is_capturing() const { return graph_->capturing; }
  bool is_destroyed() const { return graph_->destroyed; }

 private:
  std::shared_ptr<Graph> graph_;
};

int check_device_index(int device, const char* arg) {
  if (device == -1) return current_device();
  const int count = device_count();
  if (device < 0 || device >= count) {
    throw py::value_error(std::string(arg) + "=" + std::to_string(device) + " is out of range: " +
                          std::to_string(count) + " NPU(s) visible");
  }
  return device;
}

}  // namespace

void bind_graph_timer(py::module_& m) {
  m.doc() = "Handles for timing regions inside a replayed aclmdlRI model (the Ascend device graph).";

  py::class_<Event, std::shared_ptr<Event>>(m, "EventHandle", R"doc(A timing event (aclrtCreateEventWithFlag with
ACL_EVENT_TIME_LINE | ACL_EVENT_EXTERNAL). Recorded while a stream is captured it becomes an
external event-record task of the model, stamped on every replay.)doc")
      .def(py::init([](int device) { return make_event(check_device_index(device, "device")); }),
           py::arg("device") = -1,
           "Create an event on NPU `device` (-1: the device set on this thread, else 0; ValueError when out of "
           "range).")
      .def("record", &Event::record, py::arg("stream") = 0,
           "Record the event on `stream` (an aclrtStream as an int; 0 is the default stream). During capture the "
           "record becomes a task of the model.")
      .def("query", &Event::query, "True when the work before the last record has completed (aclrtQueryEventStatus).")
      .def("synchronize", &Event::synchronize, "Wait for the event (aclrtSynchronizeEvent); releases the GIL.")
      .def("elapsed_ms", &Event::elapsed_ms, py::arg("end"),
           "Milliseconds from this event to `end` (aclrtEventElapsedTime); AclError when either was never recorded.")
      .def_property_readonly("raw", [](const Event& e) { return reinterpret_cast<uintptr_t>(e.raw()); },
                             "The aclrtEvent as an int.")
      .def_property_readonly("device", &Event::device, "The NPU index the event was created on.")
      .def_property_readonly_static("flags", [](py::handle) { return kEventFlags; },
                                    "The aclrtCreateEventWithFlag flags every EventHandle is created with.");

  py::class_<EventRecordNode>(m, "EventRecordNodeHandle", R"doc(An event-record task of a captured aclmdlRI model.
Create it while the stream is captured (ACL cannot add tasks afterwards), or get the ones a
captured graph holds from GraphHandle.event_record_nodes().)doc")
      .def(py::init([](std::shared_ptr<Event> event, uintptr_t stream) {
             if (!event) throw py::type_error("event must be an EventHandle, got None");
             return EventRecordNode(std::move(event), stream);
           }),
           py::arg("event"), py::arg("stream"),
           "Record `event` on the capturing `stream`; RuntimeError when the stream is not being captured.")
      .def_property_readonly(
          "event",
          [](const EventRecordNode& n) -> AnyAs<"EventHandle | None"> {
            return n.event() ? py::cast(n.event()) : py::none();
          },
                             "The EventHandle the task records (None for an event this process did not create).")
      .def("set_event", &EventRecordNode::set_event, py::arg("event"),
           "Make the task record `event` from the next replay on (aclmdlRITaskSetParams + aclmdlRIUpdate), so "
           "successive replays keep separate samples.")
      .def_property_readonly(
          "graph_event",
          [](const EventRecordNode& n) -> AnyAs<"EventHandle | None"> {
            return n.event() ? py::cast(n.event()) : py::none();
          },
          "Same as event: what the executable model records (the name the CUDA backend uses).")
      .def_property_readonly("task", &EventRecordNode::task, "The aclmdlRITask as an int (after capture).")
      .def_property_readonly("node", &EventRecordNode::task, "Same as task.");

  py::class_<GraphHandle>(m, "GraphHandle", R"doc(A handle on an aclmdlRI model (the Ascend device graph).
GraphHandle() captures its own: capture_begin(stream), work on the stream, capture_end(),
replay(stream). GraphHandle(model) wraps an existing aclmdlRI (not destroyed by the handle).)doc")
      .def(py::init([](uintptr_t model, int device) { return GraphHandle(model, check_device_index(device, "device")); }),
           py::arg("model") = 0, py::arg("device") = -1,
           "Wrap the aclmdlRI `model` (an int), or 0 to capture one, on NPU `device` (-1: the current one).")
      .def("capture_begin", &GraphHandle::capture_begin, py::arg("stream"),
           "Start capturing `stream` (aclmdlRICaptureBegin, global mode); ValueError for the default stream.")
      .def("capture_end", &GraphHandle::capture_end, "End the capture (aclmdlRICaptureEnd) and keep the model.")
      .def("replay", &GraphHandle::replay, py::arg("stream") = 0,
           "Launch the model on `stream` (aclmdlRIExecuteAsync); releases the GIL.")
      .def("launch", &GraphHandle::replay, py::arg("stream") = 0, "Same as replay(stream).")
      .def("instantiate", [](GraphHandle&) {},
           "Nothing to do on ACL: a captured aclmdlRI model is executable as is, and event swaps are applied by "
           "aclmdlRIUpdate when they are made.")
      .def_property_readonly("modified", [](const GraphHandle&) { return false; },
                             "Always False: ACL models are never changed structurally after capture.")
      .def_property_readonly("timing_enabled", [](const GraphHandle&) { return true; },
                             "Always True: the event-record tasks of a captured model always run.")
      .def("set_timing_enabled", &GraphHandle::set_timing_enabled, py::arg("enabled"),
           "True is a no-op; False raises NotImplementedError naming the ACL limit.")
      .def("find_event_record_node", &GraphHandle::find_event_record_node, py::arg("event"),
           "The EventRecordNodeHandle of the task that records `event`; ValueError when none does.")
      .def("set_events", &GraphHandle::set_events, py::arg("nodes"), py::arg("events"),
           "Swap events into several nodes of this graph with a single aclmdlRIUpdate.")
      .def("nodes", &GraphHandle::nodes,
           "Every task of the model in stream order as (task, type) with type kernel, event_record, event_wait, "
           "event_reset, value_write, value_wait or other (aclmdlRIGetStreams, aclmdlRIGetTasksByStream).")
      .def("kernel_nodes", &GraphHandle::kernel_nodes, "The kernel tasks of the model in order, as ints.")
      .def("event_record_nodes", [](GraphHandle& g) { return g.event_record_nodes(live_events()); },
           "The event-record tasks of the model in order, as EventRecordNodeHandle.")
      .def("insert_event_record_node",
           [](GraphHandle&, py::args, py::kwargs) -> void { throw AclUnsupported(kNoInsertAfterCapture); },
           "Not possible on ACL: raises NotImplementedError naming the limit.")
      .def("add_event_record_node",
           [](GraphHandle&, py::args, py::kwargs) -> void { throw AclUnsupported(kNoInsertAfterCapture); },
           "Not possible on ACL: raises NotImplementedError naming the limit.")
      .def("insert_timer_nodes",
           [](GraphHandle&, py::args, py::kwargs) -> void { throw AclUnsupported(kNoInsertAfterCapture); },
           "Not possible on ACL: raises NotImplementedError naming the limit.")
      .def("destroy", &GraphHandle::destroy, "Destroy the captured model now (aclmdlRIDestroy); later use raises.")
      .def_property_readonly("raw_model", &GraphHandle::raw_model, "The aclmdlRI as an int (0 before capture).")
      .def_property_readonly("is_capturing", &GraphHandle::is_capturing, "True between capture_begin and capture_end.")
      .def_property_readonly("is_destroyed", &GraphHandle::is_destroyed, "True after destroy().");
}

}  // namespace deepinfer_ascend
