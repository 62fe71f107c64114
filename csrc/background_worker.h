// One persistent thread that runs posted jobs in order, so that a caller can hand off work that
// needs no Python (the drafter's indexing after an extend) and go on with its own.
//
// The thread starts at start() or the first post. A forked child has no copy of the thread, and
// its copy of the queue's mutex and condition variable may still count the parent's thread as a
// waiter (destroying or signalling them would then block for good), so a child leaves that state
// behind, unused and never freed, and starts afresh; jobs the parent had queued are not run there.
// A job must not throw: the owner catches and keeps its errors (DrafterCore::extend_in_background).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace rollout_spec {

class BackgroundWorker {
 public:
  BackgroundWorker();
  ~BackgroundWorker();
  BackgroundWorker(const BackgroundWorker&) = delete;
  BackgroundWorker& operator=(const BackgroundWorker&) = delete;

  // Start the thread in this process if it is not running; throws std::system_error when the
  // OS refuses it. A caller that changes state before posting starts it first.
  void start();
  // Queue `job` behind the jobs posted before it and return at once; a refused thread throws
  // before anything is queued.
  void post(std::function<void()> job);

 private:
  // What the thread shares with its owner; held by pointer so a forked child can abandon it.
  struct State {
    std::thread thread;
    std::mutex mu;
    std::condition_variable wake;
    std::deque<std::function<void()>> jobs;
    bool stop = false;
  };

  static void loop(State& state);
  // The state of this process: a forked child's inherited one is left behind for a new one.
  State& own_state();
  void start_locked(State& state);

  std::unique_ptr<State> state_;
  long pid_ = 0;  // process that started state_->thread (0: not started)
};

}  // namespace rollout_spec
