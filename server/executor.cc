#include "server/executor.h"

#include <algorithm>
#include <utility>

namespace ropeattn::server {

Executor::Executor(int workers, int queue_capacity) : capacity_(queue_capacity) {
  for (int i = 0; i < std::max(1, workers); ++i) {
    threads_.emplace_back([this] { WorkerLoop(); });
  }
}

Executor::~Executor() { Shutdown(); }

bool Executor::TrySubmit(const std::string& key, int64_t compute,
                         absl::AnyInvocable<void() &&> task) {
  absl::MutexLock lock(&mu_);
  if (stopping_ || waiting_ >= capacity_) return false;
  // A caller that had nothing waiting starts from the current virtual time:
  // idling earns no credit.
  auto last = last_tag_.find(key);
  const double start = last == last_tag_.end() || queues_.find(key) == queues_.end()
                           ? virtual_time_
                           : std::max(virtual_time_, last->second);
  const double tag = start + static_cast<double>(std::max<int64_t>(1, compute));
  last_tag_[key] = tag;
  queues_[key].push_back(Task{tag, std::move(task)});
  ++waiting_;
  return true;
}

Executor::Task Executor::PopLocked() {
  auto best = queues_.end();
  for (auto it = queues_.begin(); it != queues_.end(); ++it) {
    if (best == queues_.end() || it->second.front().tag < best->second.front().tag) best = it;
  }
  Task task = std::move(best->second.front());
  best->second.pop_front();
  if (best->second.empty()) {
    last_tag_.erase(best->first);
    queues_.erase(best);
  }
  --waiting_;
  virtual_time_ = std::max(virtual_time_, task.tag);
  return task;
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
  return waiting_;
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
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || waiting_ > 0; };
      mu_.Await(absl::Condition(&ready));
      if (waiting_ == 0) return;  // stopping and drained
      task = PopLocked().run;
      ++running_;
    }
    std::move(task)();
    absl::MutexLock lock(&mu_);
    --running_;
  }
}

}  // namespace ropeattn::server
