// graph_timer: GraphHandle (a captured CUDA graph and its executable graph) and
// EventRecordNodeHandle (one timer node in it).
//
// Timer nodes are event-record nodes that either were captured (EventHandle.record on the
// capturing stream) or were inserted after capture. The handle can swap the event a node
// records on the executable graph between replays (so back-to-back replays keep separate
// samples), and can take every timer node out of the graph and put it back (so disabled
// timing costs nothing and needs no recapture, only a re-instantiation).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bindings.h"
#include "driver.h"
#include "events.h"

namespace py = pybind11;

namespace deepinfer_cuda {
namespace {

uintptr_t as_int(const void* p) { return reinterpret_cast<uintptr_t>(p); }

const char* node_type_name(CUgraphNodeType type) {
  switch (type) {
    case CU_GRAPH_NODE_TYPE_KERNEL: return "kernel";
    case CU_GRAPH_NODE_TYPE_MEMCPY: return "memcpy";
    case CU_GRAPH_NODE_TYPE_MEMSET: return "memset";
    case CU_GRAPH_NODE_TYPE_HOST: return "host";
    case CU_GRAPH_NODE_TYPE_GRAPH: return "graph";
    case CU_GRAPH_NODE_TYPE_EMPTY: return "empty";
    case CU_GRAPH_NODE_TYPE_WAIT_EVENT: return "wait_event";
    case CU_GRAPH_NODE_TYPE_EVENT_RECORD: return "event_record";
    case CU_GRAPH_NODE_TYPE_EXT_SEMAS_SIGNAL: return "ext_semas_signal";
    case CU_GRAPH_NODE_TYPE_EXT_SEMAS_WAIT: return "ext_semas_wait";
    case CU_GRAPH_NODE_TYPE_MEM_ALLOC: return "mem_alloc";
    case CU_GRAPH_NODE_TYPE_MEM_FREE: return "mem_free";
    case CU_GRAPH_NODE_TYPE_BATCH_MEM_OP: return "batch_mem_op";
    case CU_GRAPH_NODE_TYPE_CONDITIONAL: return "conditional";
    default: return "unknown";
  }
}

// A dependency edge with its data (ports and type; all zero for a plain full dependency).
struct Edge {
  CUgraphNode from;
  CUgraphNode to;
  CUgraphEdgeData data;
};

CUgraphEdgeData plain_edge() {
  CUgraphEdgeData d{};
  return d;
}

bool is_plain(const CUgraphEdgeData& d) {
  return d.from_port == 0 && d.to_port == 0 && d.type == CU_GRAPH_DEPENDENCY_TYPE_DEFAULT;
}

const char* kNeedsEdgeData =
    "the graph has edges with edge data (programmatic dependent launch, e.g. cuBLAS kernels on Hopper); "
    "reading them needs a CUDA 12.3 or newer driver";

// Reads a list whose length is unknown up front: `query(buffers..., &n)` with a growing
// capacity until the driver returns fewer entries than asked for. (The count-only form of the
// edge queries, all buffers NULL, is refused as lossy when edges carry data.)
template <typename Query>
std::vector<Edge> read_edges(Query query, const char* call) {
  for (size_t capacity = 64;; capacity *= 4) {
    std::vector<CUgraphNode> from(capacity), to(capacity);
    std::vector<CUgraphEdgeData> data(capacity);
    size_t n = capacity;
    CUresult rc = query(from.data(), to.data(), data.data(), &n);
    if (rc == CUDA_ERROR_LOSSY_QUERY) throw std::runtime_error(kNeedsEdgeData);
    check(rc, call);
    if (n < capacity) {
      std::vector<Edge> edges;
      edges.reserve(n);
      for (size_t i = 0; i < n; ++i) edges.push_back({from[i], to[i], data[i]});
      return edges;
    }
  }
}

// One timer node. `node` is null while timing is disabled (the node is out of the graph).
struct TimerNode {
  CUgraphNode node = nullptr;
  std::shared_ptr<EventHandle> graph_event;  // recorded by the node in the graph
  std::shared_ptr<EventHandle> exec_event;   // swapped in on the executable graph
  uintptr_t exec_for = 0;                    // the exec graph exec_event was set on
  bool captured = false;                     // recorded during capture (else inserted)
};

struct SavedEdge {
  // An endpoint is a timer (index >= 0) or a plain node (index < 0, node set).
  int from_timer, to_timer;
  CUgraphNode from_node, to_node;
  CUgraphEdgeData data;
};

struct GraphState {
  py::object owner;  // torch.cuda.CUDAGraph(keep_graph=True), or None for raw handles
  CUgraph graph = nullptr;
  CUgraphExec given_exec = nullptr;  // raw exec handle passed by the caller (not owned)
  CUgraphExec own_exec = nullptr;    // instantiated by this handle (owned)
  int device = 0;
  bool closed = false;
  bool modified = false;  // graph changed since the last instantiate()
  bool timing_enabled = true;
  std::vector<std::shared_ptr<TimerNode>> timers;
  std::vector<SavedEdge> saved_edges;                            // while disabled
  std::vector<std::pair<CUgraphNode, CUgraphNode>> added_edges;  // while disabled
  std::unordered_map<CUevent, std::shared_ptr<EventHandle>> kept_events;
  // Captured event-record nodes by the event they record; rebuilt after any change.
  std::unordered_map<CUevent, CUgraphNode> record_nodes_by_event;
  bool record_index_valid = false;

  ~GraphState() {
    if (own_exec != nullptr) {
      try {
        ContextScope scope(device);
        driver().cuGraphExecDestroy(own_exec);
      } catch (...) {
      }
    }
  }

  void keep(const std::shared_ptr<EventHandle>& event) { kept_events.emplace(event->event(), event); }

  // Raises unless the graph still exists as captured.
  void ensure_alive() {
    if (closed) throw std::runtime_error("this GraphHandle was closed");
    if (owner.is_none()) return;
    py::object raw;
    try {
      raw = owner.attr("raw_cuda_graph")();
    } catch (py::error_already_set& e) {
      throw std::runtime_error(
          std::string("the torch CUDAGraph no longer holds a captured graph (reset(), or not captured with "
                      "keep_graph=True): ") +
          e.what());
    }
    if (raw.cast<uintptr_t>() != as_int(graph)) {
      throw std::runtime_error(
          "the torch CUDAGraph was re-captured since this GraphHandle was made; make a new GraphHandle");
    }
  }

  CUgraphExec current_exec() {
    ensure_alive();
    if (!owner.is_none()) {
      py::object raw;
      try {
        raw = owner.attr("raw_cuda_graph_exec")();
      } catch (py::error_already_set& e) {
        throw std::runtime_error(std::string("the graph is not instantiated; call GraphHandle.instantiate() (or "
                                             "the CUDAGraph's instantiate()) first: ") +
                                 e.what());
      }
      auto exec = reinterpret_cast<CUgraphExec>(raw.cast<uintptr_t>());
      if (exec == nullptr) throw std::runtime_error("the graph is not instantiated; call GraphHandle.instantiate()");
      return exec;
    }
    if (own_exec != nullptr) return own_exec;
    if (given_exec != nullptr) return given_exec;
    throw std::runtime_error("the graph is not instantiated; call GraphHandle.instantiate() first");
  }

  std::vector<CUgraphNode> all_nodes() {
    size_t n = 0;
    check(driver().cuGraphGetNodes(graph, nullptr, &n), "cuGraphGetNodes");
    std::vector<CUgraphNode> nodes(n);
    if (n > 0) check(driver().cuGraphGetNodes(graph, nodes.data(), &n), "cuGraphGetNodes");
    nodes.resize(n);
    return nodes;
  }

  // Every edge with its data (through the CUDA 12.3 edge-data entry points when the driver has
  // them; an older driver can only read graphs whose edges are all plain).
  std::vector<Edge> all_edges() {
    const DriverApi& api = driver();
    if (api.cuGraphGetEdgesWithData != nullptr) {
      return read_edges(
          [&](CUgraphNode* f, CUgraphNode* t, CUgraphEdgeData* d, size_t* n) {
            return api.cuGraphGetEdgesWithData(graph, f, t, d, n);
          },
          "cuGraphGetEdges");
    }
    return read_edges(
        [&](CUgraphNode* f, CUgraphNode* t, CUgraphEdgeData*, size_t* n) { return api.cuGraphGetEdges(graph, f, t, n); },
        "cuGraphGetEdges");
  }

  // The edges into (dependencies) or out of `node`, with their data.
  std::vector<Edge> node_edges(CUgraphNode node, bool dependencies) {
    const DriverApi& api = driver();
    auto with_data = dependencies ? api.cuGraphNodeGetDependenciesWithData : api.cuGraphNodeGetDependentNodesWithData;
    auto plain = dependencies ? api.cuGraphNodeGetDependencies : api.cuGraphNodeGetDependentNodes;
    std::vector<Edge> edges = read_edges(
        [&](CUgraphNode* f, CUgraphNode*, CUgraphEdgeData* d, size_t* n) {
          return with_data != nullptr ? with_data(node, f, d, n) : plain(node, f, n);
        },
        dependencies ? "cuGraphNodeGetDependencies" : "cuGraphNodeGetDependentNodes");
    for (Edge& e : edges) {  // read_edges filled `from` with the neighbour
      CUgraphNode other = e.from;
      e.from = dependencies ? other : node;
      e.to = dependencies ? node : other;
      if (with_data == nullptr) e.data = plain_edge();
    }
    return edges;
  }

  void add_edge(CUgraphNode from, CUgraphNode to, const CUgraphEdgeData& data) {
    const DriverApi& api = driver();
    if (api.cuGraphAddDependenciesWithData != nullptr) {
      check(api.cuGraphAddDependenciesWithData(graph, &from, &to, &data, 1), "cuGraphAddDependencies");
    } else {
      if (!is_plain(data)) throw std::runtime_error(kNeedsEdgeData);
      check(api.cuGraphAddDependencies(graph, &from, &to, 1), "cuGraphAddDependencies");
    }
  }

  void remove_edge(CUgraphNode from, CUgraphNode to, const CUgraphEdgeData& data) {
    const DriverApi& api = driver();
    if (api.cuGraphRemoveDependenciesWithData != nullptr) {
      check(api.cuGraphRemoveDependenciesWithData(graph, &from, &to, &data, 1), "cuGraphRemoveDependencies");
    } else {
      check(api.cuGraphRemoveDependencies(graph, &from, &to, 1), "cuGraphRemoveDependencies");
    }
  }

  // Kahn's algorithm; ties broken by the driver's node order (capture order).
  std::vector<CUgraphNode> topological_nodes() {
    std::vector<CUgraphNode> nodes = all_nodes();
    std::unordered_map<CUgraphNode, size_t> index;
    for (size_t i = 0; i < nodes.size(); ++i) index[nodes[i]] = i;
    std::vector<std::vector<size_t>> out(nodes.size());
    std::vector<size_t> indegree(nodes.size(), 0);
    for (const Edge& e : all_edges()) {
      out[index.at(e.from)].push_back(index.at(e.to));
      indegree[index.at(e.to)] += 1;
    }
    std::set<size_t> ready;
    for (size_t i = 0; i < nodes.size(); ++i)
      if (indegree[i] == 0) ready.insert(i);
    std::vector<CUgraphNode> order;
    order.reserve(nodes.size());
    while (!ready.empty()) {
      size_t i = *ready.begin();
      ready.erase(ready.begin());
      order.push_back(nodes[i]);
      for (size_t j : out[i])
        if (--indegree[j] == 0) ready.insert(j);
    }
    return order;
  }

  CUgraphNodeType type_of(CUgraphNode node) {
    CUgraphNodeType type;
    check(driver().cuGraphNodeGetType(node, &type), "cuGraphNodeGetType");
    return type;
  }

  std::vector<CUgraphNode> kernel_nodes() {
    std::vector<CUgraphNode> kernels;
    for (CUgraphNode node : topological_nodes())
      if (type_of(node) == CU_GRAPH_NODE_TYPE_KERNEL) kernels.push_back(node);
    return kernels;
  }

  CUgraphNode node_of_this_graph(uintptr_t value, const char* argument) {
    auto node = reinterpret_cast<CUgraphNode>(value);
    for (CUgraphNode n : all_nodes())
      if (n == node) return node;
    throw py::value_error(std::string(argument) + "=" + hex(value) + " is not a node of this graph");
  }

  void require_enabled(const char* what) {
    if (!timing_enabled) {
      throw std::runtime_error(std::string(what) + " needs timing enabled; call set_timing_enabled(True) first");
    }
  }

  void validate_event(const std::shared_ptr<EventHandle>& event, const char* argument) {
    if (!event) throw py::type_error(std::string(argument) + " must be an EventHandle, not None");
    if (event->device() != device) {
      throw py::value_error(std::string(argument) + " is on CUDA device " + std::to_string(event->device()) +
                            " but the graph runs on device " + std::to_string(device));
    }
  }

  std::shared_ptr<TimerNode> add_timer(const std::shared_ptr<EventHandle>& event,
                                       const std::vector<CUgraphNode>& dependencies,
                                       const std::vector<CUgraphNode>& dependents) {
    auto timer = std::make_shared<TimerNode>();
    timer->graph_event = event;
    check(driver().cuGraphAddEventRecordNode(&timer->node, graph, dependencies.data(), dependencies.size(),
                                             event->event()),
          "cuGraphAddEventRecordNode");
    for (CUgraphNode d : dependents) add_edge(timer->node, d, plain_edge());
    keep(event);
    timers.push_back(timer);
    modified = true;
    record_index_valid = false;
    return timer;
  }

  CUgraphNode record_node_for(CUevent event) {
    if (!record_index_valid) {
      record_nodes_by_event.clear();
      for (CUgraphNode n : all_nodes()) {
        if (type_of(n) != CU_GRAPH_NODE_TYPE_EVENT_RECORD) continue;
        CUevent recorded = nullptr;
        check(driver().cuGraphEventRecordNodeGetEvent(n, &recorded), "cuGraphEventRecordNodeGetEvent");
        record_nodes_by_event.emplace(recorded, n);
      }
      record_index_valid = true;
    }
    auto it = record_nodes_by_event.find(event);
    return it == record_nodes_by_event.end() ? nullptr : it->second;
  }

  void disable_timing() {
    std::unordered_map<CUgraphNode, int> timer_index;
    for (size_t i = 0; i < timers.size(); ++i) timer_index[timers[i]->node] = static_cast<int>(i);
    std::vector<Edge> edges = all_edges();
    std::set<std::pair<CUgraphNode, CUgraphNode>> existing;
    std::unordered_map<CUgraphNode, std::vector<CUgraphNode>> successors;
    saved_edges.clear();
    for (const Edge& e : edges) {
      existing.insert({e.from, e.to});
      successors[e.from].push_back(e.to);
      auto ia = timer_index.find(e.from), ib = timer_index.find(e.to);
      if (ia == timer_index.end() && ib == timer_index.end()) continue;
      saved_edges.push_back({ia == timer_index.end() ? -1 : ia->second, ib == timer_index.end() ? -1 : ib->second,
                             e.from, e.to, e.data});
    }
    // Keep the ordering the timers carried: each plain node that fed a timer now feeds
    // the plain nodes reachable through timers only.
    added_edges.clear();
    for (const Edge& e : edges) {
      CUgraphNode a = e.from, b = e.to;
      if (timer_index.count(a) || !timer_index.count(b)) continue;
      std::vector<CUgraphNode> stack{b};
      std::set<CUgraphNode> seen{b};
      while (!stack.empty()) {
        CUgraphNode t = stack.back();
        stack.pop_back();
        for (CUgraphNode next : successors[t]) {
          if (!seen.insert(next).second) continue;
          if (timer_index.count(next)) {
            stack.push_back(next);
          } else if (!existing.count({a, next})) {
            existing.insert({a, next});
            added_edges.emplace_back(a, next);
          }
        }
      }
    }
    for (auto& timer : timers) {
      check(driver().cuGraphDestroyNode(timer->node), "cuGraphDestroyNode");
      timer->node = nullptr;
    }
    for (auto& [a, b] : added_edges) add_edge(a, b, plain_edge());
    timing_enabled = false;
    modified = true;
    record_index_valid = false;
  }

  void enable_timing() {
    for (auto& [a, b] : added_edges) remove_edge(a, b, plain_edge());
    added_edges.clear();
    for (auto& timer : timers) {
      check(driver().cuGraphAddEventRecordNode(&timer->node, graph, nullptr, 0, timer->graph_event->event()),
            "cuGraphAddEventRecordNode");
      timer->exec_event.reset();
    }
    for (const SavedEdge& e : saved_edges) {
      CUgraphNode a = e.from_timer >= 0 ? timers[e.from_timer]->node : e.from_node;
      CUgraphNode b = e.to_timer >= 0 ? timers[e.to_timer]->node : e.to_node;
      add_edge(a, b, e.data);
    }
    saved_edges.clear();
    timing_enabled = true;
    modified = true;
    record_index_valid = false;
  }
};

class EventRecordNodeHandle {
 public:
  EventRecordNodeHandle(std::shared_ptr<GraphState> state, std::shared_ptr<TimerNode> timer)
      : state_(std::move(state)), timer_(std::move(timer)) {}

  uintptr_t node() const { return as_int(timer_->node); }
  bool captured() const { return timer_->captured; }
  std::shared_ptr<EventHandle> graph_event() const { return timer_->graph_event; }

  // The event the executable graph records now (the graph's own until a swap).
  std::shared_ptr<EventHandle> event() {
    CUgraphExec exec = state_->current_exec();
    if (timer_->exec_event && timer_->exec_for == as_int(exec)) return timer_->exec_event;
    return timer_->graph_event;
  }

  std::shared_ptr<EventHandle> set_event(const std::shared_ptr<EventHandle>& event) {
    ContextScope scope(state_->device);
    state_->validate_event(event, "event");
    state_->require_enabled("set_event");
    if (state_->modified) {
      throw std::runtime_error("the graph changed since it was instantiated; call GraphHandle.instantiate() first");
    }
    CUgraphExec exec = state_->current_exec();
    return swap(exec, event);
  }

  // The swap itself, for an exec graph the caller already validated.
  std::shared_ptr<EventHandle> swap(CUgraphExec exec, const std::shared_ptr<EventHandle>& event) {
    std::shared_ptr<EventHandle> previous =
        (timer_->exec_event && timer_->exec_for == as_int(exec)) ? timer_->exec_event : timer_->graph_event;
    CUresult rc = driver().cuGraphExecEventRecordNodeSetEvent(exec, timer_->node, event->event());
    if (rc != CUDA_SUCCESS) {
      throw CudaError(rc, "cuGraphExecEventRecordNodeSetEvent failed: " + describe(rc) +
                              " (was the executable graph instantiated after this node was added?)");
    }
    state_->keep(event);
    timer_->exec_event = event;
    timer_->exec_for = as_int(exec);
    return previous;
  }

  const std::shared_ptr<GraphState>& state() const { return state_; }

 private:
  std::shared_ptr<GraphState> state_;
  std::shared_ptr<TimerNode> timer_;
};

class GraphHandle {
 public:
  GraphHandle(py::object graph, uintptr_t exec, int device) : state_(std::make_shared<GraphState>()) {
    bool raw_handle = py::isinstance<py::int_>(graph) && !py::isinstance<py::bool_>(graph);
    if (!raw_handle && !py::hasattr(graph, "raw_cuda_graph")) {
      throw py::type_error("graph must be a torch.cuda.CUDAGraph(keep_graph=True) or an int CUgraph handle, got " +
                           std::string(py::str(py::type::handle_of(graph).attr("__name__"))));
    }
    if (device < 0) {
      device = current_device_or_none();
      if (device < 0) device = 0;
    }
    validate_device(device, "device");
    state_->device = device;
    if (py::isinstance<py::int_>(graph) && !py::isinstance<py::bool_>(graph)) {
      auto raw = graph.cast<long long>();
      if (raw <= 0) throw py::value_error("graph=" + std::to_string(raw) + " is not a CUgraph handle");
      state_->graph = reinterpret_cast<CUgraph>(static_cast<uintptr_t>(raw));
      state_->given_exec = reinterpret_cast<CUgraphExec>(exec);
      state_->owner = py::none();
    } else if (py::hasattr(graph, "raw_cuda_graph")) {
      if (exec != 0) throw py::value_error("exec is only for raw int graph handles; torch's exec graph is used");
      state_->owner = graph;
      py::object raw;
      try {
        raw = graph.attr("raw_cuda_graph")();
      } catch (py::error_already_set& e) {
        throw py::value_error(std::string("graph has no captured CUDA graph (capture it with "
                                          "torch.cuda.CUDAGraph(keep_graph=True)): ") +
                              e.what());
      }
      state_->graph = reinterpret_cast<CUgraph>(raw.cast<uintptr_t>());
      if (state_->graph == nullptr) throw py::value_error("graph has no captured CUDA graph");
    } else {
      throw py::type_error("graph must be a torch.cuda.CUDAGraph(keep_graph=True) or an int CUgraph handle, got " +
                           std::string(py::str(py::type::handle_of(graph).attr("__name__"))));
    }
    // A cheap sanity query, so a foreign or dangling handle fails here rather than later.
    ContextScope scope(state_->device);
    state_->all_nodes();
  }

  uintptr_t graph() {
    state_->ensure_alive();
    return as_int(state_->graph);
  }
  uintptr_t exec() { return as_int(state_->current_exec()); }
  int device() const { return state_->device; }
  bool modified() const { return state_->modified; }
  bool timing_enabled() const { return state_->timing_enabled; }

  std::vector<uintptr_t> nodes() {
    ContextScope scope(state_->device);
    state_->ensure_alive();
    std::vector<uintptr_t> out;
    for (CUgraphNode n : state_->topological_nodes()) out.push_back(as_int(n));
    return out;
  }

  std::string node_type(uintptr_t node) {
    ContextScope scope(state_->device);
    state_->ensure_alive();
    return node_type_name(state_->type_of(state_->node_of_this_graph(node, "node")));
  }

  std::vector<uintptr_t> kernel_nodes() {
    ContextScope scope(state_->device);
    state_->ensure_alive();
    std::vector<uintptr_t> out;
    for (CUgraphNode n : state_->kernel_nodes()) out.push_back(as_int(n));
    return out;
  }

  std::vector<std::string> kernel_names() {
    ContextScope scope(state_->device);
    state_->ensure_alive();
    const DriverApi& api = driver();
    std::vector<std::string> names;
    for (CUgraphNode n : state_->kernel_nodes()) {
      CUDA_KERNEL_NODE_PARAMS_v2 params{};
      const char* name = nullptr;
      if (api.cuGraphKernelNodeGetParams(n, &params) == CUDA_SUCCESS) {
        if (params.func != nullptr && api.cuFuncGetName != nullptr) api.cuFuncGetName(&name, params.func);
        if (name == nullptr && params.kern != nullptr && api.cuKernelGetName != nullptr)
          api.cuKernelGetName(&name, params.kern);
      }
      names.emplace_back(name ? name : "");
    }
    return names;
  }

  std::vector<EventRecordNodeHandle> event_record_nodes() {
    ContextScope scope(state_->device);
    state_->ensure_alive();
    std::vector<EventRecordNodeHandle> out;
    for (auto& timer : state_->timers) out.emplace_back(state_, timer);
    return out;
  }

  EventRecordNodeHandle find_event_record_node(const std::shared_ptr<EventHandle>& event) {
    ContextScope scope(state_->device);
    state_->ensure_alive();
    state_->validate_event(event, "event");
    state_->require_enabled("find_event_record_node");
    for (auto& timer : state_->timers)
      if (timer->graph_event->event() == event->event()) return EventRecordNodeHandle(state_, timer);
    if (CUgraphNode n = state_->record_node_for(event->event()); n != nullptr) {
      auto timer = std::make_shared<TimerNode>();
      timer->node = n;
      timer->graph_event = event;
      timer->captured = true;
      state_->keep(event);
      state_->timers.push_back(timer);
      return EventRecordNodeHandle(state_, timer);
    }
    throw py::value_error("event " + hex(event->handle()) +
                          " is not recorded by any node of this graph (record it with EventHandle.record(stream) "
                          "on the capturing stream while the graph is captured)");
  }

  EventRecordNodeHandle add_event_record_node(const std::shared_ptr<EventHandle>& event,
                                              const std::vector<uintptr_t>& dependencies,
                                              const std::vector<uintptr_t>& dependents) {
    ContextScope scope(state_->device);
    state_->ensure_alive();
    state_->validate_event(event, "event");
    state_->require_enabled("add_event_record_node");
    std::vector<CUgraphNode> deps, succ;
    for (uintptr_t d : dependencies) deps.push_back(state_->node_of_this_graph(d, "dependencies"));
    for (uintptr_t d : dependents) succ.push_back(state_->node_of_this_graph(d, "dependents"));
    return EventRecordNodeHandle(state_, state_->add_timer(event, deps, succ));
  }

  std::pair<EventRecordNodeHandle, EventRecordNodeHandle> insert_timer_nodes(
      int64_t first, int64_t last, const std::shared_ptr<EventHandle>& start, const std::shared_ptr<EventHandle>& end) {
    ContextScope scope(state_->device);
    state_->ensure_alive();
    state_->validate_event(start, "start");
    state_->validate_event(end, "end");
    state_->require_enabled("insert_timer_nodes");
    std::vector<CUgraphNode> kernels = state_->kernel_nodes();
    auto n = static_cast<int64_t>(kernels.size());
    if (first < 0 || first >= n) {
      throw py::index_error("first=" + std::to_string(first) + " is out of range: the graph has " + std::to_string(n) +
                            " kernel nodes");
    }
    if (last < first || last >= n) {
      throw py::index_error("last=" + std::to_string(last) + " must be in [first=" + std::to_string(first) + ", " +
                            std::to_string(n - 1) + "]");
    }
    // The region is every node between the two kernels in topological order; the start node
    // runs before its entry nodes, the end node after its exit nodes.
    std::vector<CUgraphNode> order = state_->topological_nodes();
    auto pos_first = std::find(order.begin(), order.end(), kernels[first]) - order.begin();
    auto pos_last = std::find(order.begin(), order.end(), kernels[last]) - order.begin();
    std::set<CUgraphNode> region(order.begin() + pos_first, order.begin() + pos_last + 1);
    std::vector<CUgraphNode> entry_deps, entries, exits;
    std::set<CUgraphNode> entry_dep_set;
    for (CUgraphNode node : region) {
      bool has_inner_dep = false, has_inner_succ = false;
      for (CUgraphNode d : neighbours(node, true)) {
        if (region.count(d)) has_inner_dep = true;
        else if (entry_dep_set.insert(d).second) entry_deps.push_back(d);
      }
      for (CUgraphNode s : neighbours(node, false))
        if (region.count(s)) has_inner_succ = true;
      if (!has_inner_dep) entries.push_back(node);
      if (!has_inner_succ) exits.push_back(node);
    }
    auto start_timer = state_->add_timer(start, entry_deps, entries);
    auto end_timer = state_->add_timer(end, exits, {});
    return {EventRecordNodeHandle(state_, start_timer), EventRecordNodeHandle(state_, end_timer)};
  }

  void set_events(std::vector<EventRecordNodeHandle*> nodes, const std::vector<std::shared_ptr<EventHandle>>& events) {
    if (nodes.size() != events.size()) {
      throw py::value_error("nodes and events differ in length (" + std::to_string(nodes.size()) + " vs " +
                            std::to_string(events.size()) + ")");
    }
    ContextScope scope(state_->device);
    state_->require_enabled("set_events");
    if (state_->modified) {
      throw std::runtime_error("the graph changed since it was instantiated; call GraphHandle.instantiate() first");
    }
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (nodes[i] == nullptr) throw py::type_error("nodes must hold EventRecordNodeHandle objects, not None");
      if (nodes[i]->state() != state_) {
        throw py::value_error("nodes[" + std::to_string(i) + "] belongs to another GraphHandle");
      }
      state_->validate_event(events[i], "events");
    }
    CUgraphExec exec = state_->current_exec();
    for (size_t i = 0; i < nodes.size(); ++i) nodes[i]->swap(exec, events[i]);
  }

  void set_timing_enabled(bool enabled) {
    ContextScope scope(state_->device);
    state_->ensure_alive();
    if (enabled == state_->timing_enabled) return;
    if (enabled) state_->enable_timing();
    else state_->disable_timing();
  }

  void instantiate() {
    state_->ensure_alive();
    if (!state_->owner.is_none()) {
      state_->owner.attr("instantiate")();
    } else {
      ContextScope scope(state_->device);
      CUgraphExec exec = nullptr;
      check(driver().cuGraphInstantiateWithFlags(&exec, state_->graph, 0), "cuGraphInstantiateWithFlags");
      if (state_->own_exec != nullptr) driver().cuGraphExecDestroy(state_->own_exec);
      state_->own_exec = exec;
    }
    for (auto& timer : state_->timers) timer->exec_event.reset();
    state_->modified = false;
  }

  void launch(py::object stream_obj) {
    CUstream stream = stream_from_python(stream_obj, "stream");
    CUgraphExec exec = state_->current_exec();
    ContextScope scope(state_->device);
    validate_stream_device(stream, state_->device, "stream");
    py::gil_scoped_release release;
    check(driver().cuGraphLaunch(exec, stream), "cuGraphLaunch");
  }

  void close() {
    if (state_->closed) return;
    state_->closed = true;
    state_->owner = py::none();
  }

 private:
  std::vector<CUgraphNode> neighbours(CUgraphNode node, bool dependencies) {
    std::vector<CUgraphNode> out;
    for (const Edge& e : state_->node_edges(node, dependencies)) out.push_back(dependencies ? e.from : e.to);
    return out;
  }

  std::shared_ptr<GraphState> state_;
};

}  // namespace

void bind_graph(py::module_& m) {
  py::class_<EventRecordNodeHandle>(
      m, "EventRecordNodeHandle",
      "An event-record node of a captured graph (captured with EventHandle.record, or inserted after\n"
      "capture by GraphHandle). Get one from GraphHandle; it stays valid while its GraphHandle lives.")
      .def_property_readonly("node", &EventRecordNodeHandle::node,
                             "The CUgraphNode as an int (0 while timing is disabled).")
      .def_property_readonly("captured", &EventRecordNodeHandle::captured,
                             "True when recorded during capture, False when inserted afterwards.")
      .def_property_readonly("graph_event", &EventRecordNodeHandle::graph_event,
                             "The EventHandle the node records in the graph (and after each instantiate()).")
      .def_property_readonly("event", &EventRecordNodeHandle::event,
                             "The EventHandle the executable graph records now (after set_event swaps).")
      .def("set_event", &EventRecordNodeHandle::set_event, py::arg("event"),
           "Make the executable graph record `event` at this node from the next replay on\n"
           "(cuGraphExecEventRecordNodeSetEvent; replays already enqueued are not affected) and return the\n"
           "event it recorded before. Raises ValueError for an event of another device, RuntimeError when\n"
           "the graph changed since instantiate() or timing is disabled.");

  py::class_<GraphHandle>(
      m, "GraphHandle",
      "A handle on a captured CUDA graph and its executable graph, for timing regions inside replays.\n\n"
      "Wraps torch.cuda.CUDAGraph(keep_graph=True) (re-instantiated through torch) or raw int handles\n"
      "(CUgraph and optionally CUgraphExec). Lists kernel nodes in topological order, finds captured\n"
      "event-record nodes, inserts timer nodes after capture, swaps events between replays and takes\n"
      "timer nodes out of the graph and back (set_timing_enabled) without recapture.")
      .def(py::init<py::object, uintptr_t, int>(), py::arg("graph"), py::arg("exec") = 0, py::arg("device") = -1,
           "graph: torch.cuda.CUDAGraph created with keep_graph=True and captured, or an int CUgraph.\n"
           "exec: an int CUgraphExec for a raw graph (0: instantiate() makes one). device: the CUDA device\n"
           "the graph runs on (-1: the device current on this thread, else 0). Raises TypeError for other\n"
           "objects, ValueError for a graph that was never captured or a null handle.")
      .def_property_readonly("graph", &GraphHandle::graph, "The CUgraph as an int.")
      .def_property_readonly("exec", &GraphHandle::exec,
                             "The current CUgraphExec as an int; RuntimeError when not instantiated.")
      .def_property_readonly("device", &GraphHandle::device, "The CUDA device index.")
      .def_property_readonly("modified", &GraphHandle::modified,
                             "True when nodes changed since the last instantiate() (replays run the old graph).")
      .def_property_readonly("timing_enabled", &GraphHandle::timing_enabled,
                             "False while set_timing_enabled(False) keeps the timer nodes out of the graph.")
      .def("nodes", &GraphHandle::nodes, "Every node (int CUgraphNode) in topological order.")
      .def("node_type", &GraphHandle::node_type, py::arg("node"),
           "The type of `node` ('kernel', 'memcpy', 'event_record', ...). ValueError for a foreign node.")
      .def("kernel_nodes", &GraphHandle::kernel_nodes, "The kernel nodes in topological (capture) order.")
      .def("kernel_names", &GraphHandle::kernel_names,
           "Kernel names of kernel_nodes(), in the same order ('' where the driver cannot name one).")
      .def("event_record_nodes", &GraphHandle::event_record_nodes,
           "The timer nodes known to this handle (found or inserted), in the order they became known.")
      .def("find_event_record_node", &GraphHandle::find_event_record_node, py::arg("event"),
           "The captured event-record node that records `event` (recorded with EventHandle.record on the\n"
           "capturing stream). Raises ValueError when no node of this graph records it.")
      .def("add_event_record_node", &GraphHandle::add_event_record_node, py::arg("event"),
           py::arg("dependencies"), py::arg("dependents"),
           "Insert an event-record node that records `event` after `dependencies` and before `dependents`\n"
           "(lists of int nodes of this graph). Takes effect at the next instantiate().")
      .def("insert_timer_nodes", &GraphHandle::insert_timer_nodes, py::arg("first"), py::arg("last"),
           py::arg("start"), py::arg("end"),
           "Insert a pair of timer nodes around kernel_nodes()[first..last] (inclusive): `start` records\n"
           "before the region's entry nodes, `end` after its exit nodes. Returns the two\n"
           "EventRecordNodeHandle. Takes effect at the next instantiate(). IndexError for bad indices.")
      .def("set_events", &GraphHandle::set_events, py::arg("nodes"), py::arg("events"),
           "Batch form of EventRecordNodeHandle.set_event: node i of this graph records events[i] from\n"
           "the next replay on (one validation of the graph for the whole batch). ValueError for nodes of\n"
           "another GraphHandle, events of another device or lists of different lengths.")
      .def("set_timing_enabled", &GraphHandle::set_timing_enabled, py::arg("enabled"),
           "False takes every timer node out of the graph (keeping the order it implied); True puts them\n"
           "back. Call instantiate() afterwards; no recapture is needed.")
      .def("instantiate", &GraphHandle::instantiate,
           "(Re-)instantiate the executable graph: through torch's CUDAGraph.instantiate() for torch\n"
           "graphs, else cuGraphInstantiateWithFlags. Swapped events revert to each node's graph_event.")
      .def("launch", &GraphHandle::launch, py::arg("stream") = 0,
           "cuGraphLaunch the executable graph on `stream` (releases the GIL). For torch graphs prefer\n"
           "CUDAGraph.replay(), which also advances torch's RNG offsets.")
      .def("close", &GraphHandle::close,
           "Drop the reference to the torch graph; every later call raises RuntimeError.");
}

}  // namespace deepinfer_cuda
