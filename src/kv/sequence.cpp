// Sequence: hands everything back to its manager when destroyed.
#include "kv/sequence.h"

#include "kv/state_manager.h"

namespace bg {

Sequence::~Sequence() { manager_->release(*this); }

StepPools Sequence::pools() const { return manager_->step_pools(); }

}  // namespace bg
