// One call at a time per engine object. The bindings release the GIL inside their calls, so a
// second Python thread could otherwise mutate a Scheduler, pool, PrepareArgs or SamplerInputs
// while another thread's call is inside it (torn vectors, freed memory). Every mutating entry
// point takes the object's flag for the duration of the call; a call that finds it taken raises
// instead of waiting (a lock would hide the caller's missing synchronisation and could deadlock
// with the GIL).
//
// Every flag is taken and released with the GIL held: the bindings take it on entry, before
// they release the GIL, and drop it after taking the GIL back (declaration order). The GIL
// orders those accesses between threads, so a plain load and store suffice: no locked
// instruction (an atomic exchange cost ~5 ns per flag here, and a step takes a dozen). The
// extension does not declare itself free-threading safe, so a free-threaded interpreter keeps
// the GIL on while it is loaded.
#pragma once

#include <atomic>
#include <stdexcept>
#include <string>

namespace deepinfer {

class BusyFlag {
 public:
  BusyFlag() = default;
  BusyFlag(const BusyFlag&) {}  // a copy of an object is not in use
  BusyFlag& operator=(const BusyFlag&) { return *this; }
  bool try_acquire() {
    if (busy_.load(std::memory_order_relaxed)) return false;
    busy_.store(true, std::memory_order_relaxed);
    return true;
  }
  void release() { busy_.store(false, std::memory_order_relaxed); }

 private:
  std::atomic<bool> busy_{false};
};

// Holds `flag` for its scope; throws std::runtime_error (Python RuntimeError) when it is taken:
// "<object> is being used by another thread: <call> ...".
class BusyGuard {
 public:
  BusyGuard(BusyFlag& flag, const char* object, const char* call) {
    if (!flag.try_acquire())
      throw std::runtime_error(std::string(object) + " is being used by another thread: " + call +
                               " was called while another call on the same " + object +
                               " is running (use one thread per object, or a lock around its calls)");
    flag_ = &flag;
  }
  BusyGuard(const BusyGuard&) = delete;
  BusyGuard& operator=(const BusyGuard&) = delete;
  ~BusyGuard() { flag_->release(); }

 private:
  BusyFlag* flag_ = nullptr;
};

}  // namespace deepinfer
