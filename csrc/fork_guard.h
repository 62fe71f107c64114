// Keeps fork() safe while drafter calls and background jobs run on other threads.
//
// A fork copies only the thread that calls it. A drafter whose lock another thread held at that
// moment reached the child locked for good (its first call there blocked), and one whose
// background indexing was halfway through reached it half changed. So every live DrafterCore is
// registered here, and around each fork (pthread_atfork) the forking thread first waits for the
// calls and background jobs in progress on every core and holds each core's locks until fork
// returns: the parent goes on as before, and the child gets every core whole, with fresh, unlocked
// copies of its locks (the old ones may still count the parent's threads as waiters). The
// BackgroundWorker and the propose pool leave their parent's threads behind on their own.
//
// A fork therefore waits for the longest drafter call in progress (microseconds to milliseconds;
// a checkpoint's save or load, longer).
#pragma once

namespace rollout_spec {

class DrafterCore;

class ForkGuard {
 public:
  // Register a core once it is fully made (the first registration installs the handlers).
  static void add(DrafterCore* core);
  // Unregister a core before anything of it is destroyed.
  static void remove(DrafterCore* core) noexcept;

 private:
  struct Registry;
  // This process's live cores; made, and the handlers installed, at the first registration.
  static Registry& registry();
  static void prepare();
  static void in_parent();
  static void in_child();
};

}  // namespace rollout_spec
