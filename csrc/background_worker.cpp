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

void BackgroundWorker::post(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
    const long pid = static_cast<long>(getpid());
    if (!thread_.joinable() || pid_ != pid) {
      if (thread_.joinable()) thread_.detach();
      pid_ = pid;
      thread_ = std::thread([this] { loop(); });
    }
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
