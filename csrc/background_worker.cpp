#include "background_worker.h"

#include <unistd.h>

namespace rollout_spec {

namespace {
long this_process() { return static_cast<long>(getpid()); }
}  // namespace

BackgroundWorker::BackgroundWorker() : state_(std::make_unique<State>()) {}

BackgroundWorker::~BackgroundWorker() {
  if (pid_ != 0 && pid_ != this_process()) {
    (void)state_.release();  // a forked child's copy: see the header
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
  }
  state_->wake.notify_one();
  if (state_->thread.joinable()) state_->thread.join();
}

BackgroundWorker::State& BackgroundWorker::own_state() {
  if (pid_ != 0 && pid_ != this_process()) {
    (void)state_.release();
    state_ = std::make_unique<State>();
    pid_ = 0;
  }
  return *state_;
}

void BackgroundWorker::start() {
  State& state = own_state();
  std::lock_guard<std::mutex> lock(state.mu);
  start_locked(state);
}

void BackgroundWorker::start_locked(State& state) {
  if (state.thread.joinable()) return;
  state.thread = std::thread([&state] { loop(state); });  // may throw: then nothing has changed
  pid_ = this_process();
}

void BackgroundWorker::post(std::function<void()> job) {
  State& state = own_state();
  {
    std::lock_guard<std::mutex> lock(state.mu);
    start_locked(state);
    state.jobs.push_back(std::move(job));
  }
  state.wake.notify_one();
}

void BackgroundWorker::loop(State& state) {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(state.mu);
      state.wake.wait(lock, [&] { return state.stop || !state.jobs.empty(); });
      if (state.jobs.empty()) return;  // stopping, nothing left
      job = std::move(state.jobs.front());
      state.jobs.pop_front();
    }
    job();
  }
}

}  // namespace rollout_spec
