#include "background_worker.h"

#include <unistd.h>

namespace rollout_spec {

BackgroundWorker::~BackgroundWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable() && pid_ == static_cast<long>(getpid())) thread_.join();
  else if (thread_.joinable()) thread_.detach();  // a forked child's copy names no thread
}

void BackgroundWorker::start() {
  std::lock_guard<std::mutex> lock(mu_);
  start_locked();
}

void BackgroundWorker::start_locked() {
  const long pid = static_cast<long>(getpid());
  if (thread_.joinable() && pid_ == pid) return;
  std::thread started([this] { loop(); });  // may throw: then nothing here has changed
  if (thread_.joinable()) thread_.detach();
  thread_ = std::move(started);
  pid_ = pid;
}

void BackgroundWorker::post(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    start_locked();
    jobs_.push_back(std::move(job));
  }
  wake_.notify_one();
}

void BackgroundWorker::loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

}  // namespace rollout_spec
