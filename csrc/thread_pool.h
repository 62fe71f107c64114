// A small persistent pool for splitting one call's independent work over several threads.
//
// Workers sleep on a condition variable between jobs (no spinning while the drafter is idle) and
// the calling thread takes part as worker 0, so a pool of n threads starts n - 1 of its own.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace rollout_spec {

class ThreadPool {
 public:
  // `threads` workers in all, the caller included (>= 1). Throws std::system_error, with no
  // thread left running, when the OS refuses one.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(threads_.size()) + 1; }
  // Run fn(worker) once on every worker (0 is the caller) and return when all have returned;
  // the first exception a worker threw is rethrown here. One job at a time (callers serialise).
  void run(const std::function<void(int)>& fn);

 private:
  void loop(int worker);
  void stop_and_join();

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_;  // a new job or stop
  std::condition_variable done_;  // the last worker of a job finished
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;       // bumped per job, so a worker runs each job once
  int running_ = 0;               // pool threads still inside the current job
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace rollout_spec
