#include "server/executor.h"

#include <utility>

namespace ropeattn::server {

Executor::Executor(int workers, int queue_capacity) : capacity_(queue_capacity) {
  for (int i = 0; i < std::max(1, workers); ++i) {
    threads_.emplace_back([this] { WorkerLoop(); });
  }
}

Executor::~Executor() { Shutdown(); }

bool Executor::TrySubmit(absl::AnyInvocable<void() &&> task) {
  absl::MutexLock lock(&mu_);
  if (stopping_ || static_cast<int64_t>(queue_.size()) >= capacity_) return false;
  queue_.push_back(std::move(task));
  return true;
}

void Executor::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
  }
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

int64_t Executor::queue_depth() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(queue_.size());
}

int64_t Executor::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

void Executor::WorkerLoop() {
  while (true) {
    absl::AnyInvocable<void() &&> task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    std::move(task)();
    absl::MutexLock lock(&mu_);
    --running_;
  }
}

}  // namespace ropeattn::server
