#include "thread_pool.h"

namespace rollout_spec {

ThreadPool::ThreadPool(int threads) {
  threads_.reserve(threads > 1 ? threads - 1 : 0);
  try {
    for (int w = 1; w < threads; ++w) threads_.emplace_back([this, w] { loop(w); });
  } catch (...) {  // the OS refused a thread: the ones started must stop before the members go
    stop_and_join();
    throw;
  }
}

ThreadPool::~ThreadPool() { stop_and_join(); }

void ThreadPool::stop_and_join() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ThreadPool::loop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    std::exception_ptr error;
    try {
      (*job)(worker);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (error && !error_) error_ = error;
    if (--running_ == 0) done_.notify_one();
  }
}

void ThreadPool::run(const std::function<void(int)>& fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    running_ = static_cast<int>(threads_.size());
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  std::exception_ptr error;
  try {
    fn(0);
  } catch (...) {
    error = std::current_exception();
  }
  // Every worker must be out of fn before it (and what it captures) goes away, even on error.
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return running_ == 0; });
  if (!error) error = error_;
  job_ = nullptr;
  lock.unlock();
  if (error) std::rethrow_exception(error);
}

}  // namespace rollout_spec
