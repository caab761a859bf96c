// Python handles of sequences (by never-reused seq id) and the conversions of their stop and
// finish reasons, shared by the sequence, scheduler and output binders.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "core/scheduler.h"
#include "python/buffer_check.h"

namespace deepinfer {

namespace py = pybind11;

// Python handle of one sequence: the scheduler (kept alive) and the never-reused seq id.
struct SeqHandle {
  py::object owner;
  Scheduler* sched;
  int64_t seq_id;
  const Sequence& get() const {
    const SeqIndex i = sched->find_seq(seq_id);
    if (i == kNoSeq)
      throw py::value_error("seq_id: sequence " + std::to_string(seq_id) +
                            " no longer exists (its request finished and was released)");
    return sched->store().seq(i);
  }
  const SequenceGroup& group() const { return sched->store().groups[get().group]; }
};
struct SeqDataHandle : SeqHandle {};

inline SeqIndex seq_index_or_raise(Scheduler& s, int64_t seq_id) {
  const SeqIndex i = s.find_seq(seq_id);
  if (i == kNoSeq) buf::fail("seq_id", std::to_string(seq_id) + " is not a live sequence of this scheduler");
  return i;
}

inline py::object stop_reason_of(int64_t stop_token, const std::string& stop_string, bool is_string) {
  if (is_string) return py::str(stop_string);
  if (stop_token >= 0) return py::int_(stop_token);
  return py::none();
}

inline py::object finish_reason_of(const char* r) { return r ? py::object(py::str(r)) : py::object(py::none()); }

}  // namespace deepinfer
