#include "fork_guard.h"

#include <algorithm>
#include <mutex>
#include <new>
#include <vector>

#include <pthread.h>

#include "drafter_core.h"
#include "huge_pages.h"

namespace rollout_spec {

struct ForkGuard::Registry {
  std::mutex mu;                    // held from prepare until the fork has returned
  std::vector<DrafterCore*> cores;  // every live core of this process
};

// Never destroyed, like the arena: cores may be freed during static destruction.
ForkGuard::Registry& ForkGuard::registry() {
  static Registry* r = [] {
    Registry* made = new Registry;
    // Handlers installed later prepare first: the cores' waits for their calls (which may take
    // the arena's lock) must come before the arena takes its lock.
    install_arena_fork_handlers();
    pthread_atfork(&ForkGuard::prepare, &ForkGuard::in_parent, &ForkGuard::in_child);
    return made;
  }();
  return *r;
}

void ForkGuard::add(DrafterCore* core) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.cores.push_back(core);
}

void ForkGuard::remove(DrafterCore* core) noexcept {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.cores.erase(std::find(r.cores.begin(), r.cores.end(), core));
}

void ForkGuard::prepare() {
  Registry& r = registry();
  r.mu.lock();
  for (DrafterCore* core : r.cores) core->hold_for_fork();
}

void ForkGuard::in_parent() {
  Registry& r = registry();
  for (DrafterCore* core : r.cores) core->release_in_parent();
  r.mu.unlock();
}

void ForkGuard::in_child() {
  Registry& r = registry();
  for (DrafterCore* core : r.cores) core->reset_in_child();
  new (&r.mu) std::mutex();  // the only thread here holds it: a fresh one, unlocked
}

}  // namespace rollout_spec
