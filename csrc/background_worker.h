// One persistent thread that runs posted jobs in order, so that a caller can hand off work that
// needs no Python (the drafter's indexing after an extend) and go on with its own.
//
// The thread starts at start() or the first post (again in a forked child, which has no copy of
// it). A job must not throw: the owner catches and keeps its errors
// (DrafterCore::extend_in_background).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace rollout_spec {

class BackgroundWorker {
 public:
  BackgroundWorker() = default;
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
  void loop();
  void start_locked();

  std::thread thread_;
  long pid_ = 0;  // process that started thread_
  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
};

}  // namespace rollout_spec
