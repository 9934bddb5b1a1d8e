#pragma once
// The groups of parameters a pass of a causal language model (CausalLM, MambaLM) reads one after the
// other, and the hook through which ZeRO-3 (train/data_parallel.h) gathers a group's parameters before
// its use and releases them after.
//
// Groups: the embedding, each layer, and the head (the final norm and the lm_head; with a tied head that
// is the embedding, so the Head group reads the embedding's weight too).  The order of uses of a
// model's forward (forward(), loss(), loss_and_gradients()): Embedding, Layer 0 .. L-1, Head (held
// through the loss and, in loss_and_gradients, the head's backward); then the backward: Layer L-1 .. 0
// (the recomputed forward of activation checkpointing inside it); the embedding's backward reads no
// weight.  One group is in use at a time.
#include <cstddef>
#include <exception>
#include <functional>

namespace kcpp::models {

struct ParameterGroup {
  enum class Kind { Embedding, Layer, Head } kind = Kind::Embedding;
  size_t layer = 0;  // Kind::Layer's index
};

// Called with in_use = true before a pass reads a group's parameters and false after its last read of
// them (also when the pass throws).  Unset: nothing is called.
using ParameterUse = std::function<void(const ParameterGroup&, bool in_use)>;

// A group in use from acquire() to release() or the end of its scope.  The hook is read when the group
// is acquired (a model's member: unset, nothing happens).  A failure of the release at the end of the
// scope is thrown from the destructor; when the scope ends by an exception, it is dropped: the error
// under way is the one to report.
class GroupInUse {
 public:
  GroupInUse(const ParameterUse& hook, ParameterGroup::Kind kind, size_t layer = 0) : hook_(hook), group_{kind, layer} {}
  GroupInUse(const GroupInUse&) = delete;
  GroupInUse& operator=(const GroupInUse&) = delete;
  ~GroupInUse() noexcept(false) {
    if (std::uncaught_exceptions() == 0) {
      release();
      return;
    }
    try {
      release();
    } catch (const std::exception&) {
    }
  }
  void acquire() {
    if (on_ || !hook_) return;
    hook_(group_, true);
    on_ = true;
  }
  void release() {
    if (!on_) return;
    on_ = false;
    hook_(group_, false);
  }

 private:
  const ParameterUse& hook_;
  ParameterGroup group_;
  bool on_ = false;
};

}  // namespace kcpp::models
