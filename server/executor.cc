#include "server/executor.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

namespace ropeattn::server {
namespace {

// What the worker on this thread is running, if it is a worker.
thread_local void* current_taken = nullptr;

}  // namespace

Executor::Executor(int workers, int queue_capacity, int max_batch, BatchRunner runner,
                   int nice)
    : capacity_(queue_capacity), max_batch_(std::max(1, max_batch)), runner_(std::move(runner)) {
  for (int i = 0; i < std::max(1, workers); ++i) {
    threads_.emplace_back([this, nice] {
      // Linux keeps a nice value per thread, and the kernel threads of this
      // worker's parallel regions (created from it) inherit it.
      if (nice > 0) setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), nice);
      WorkerLoop();
    });
  }
}

Executor::~Executor() { Shutdown(); }

bool Executor::TrySubmit(const std::string& key, int64_t compute,
                         absl::AnyInvocable<void() &&> task, const char* kind) {
  absl::MutexLock lock(&mu_);
  return PushLocked(key, compute, Task{0, std::move(task), nullptr, true, 1, kind});
}

bool Executor::TrySubmitBatch(const std::string& key, int64_t compute, BatchTask* task,
                              const char* kind, bool joins) {
  if (!runner_ || task == nullptr) return false;
  absl::MutexLock lock(&mu_);
  return PushLocked(key, compute, Task{0, nullptr, task, joins, 1, kind});
}

double Executor::TagLocked(const std::string& key, int64_t compute) const {
  // A caller that had nothing waiting starts from the current virtual time:
  // idling earns no credit.
  auto last = last_tag_.find(key);
  const double start = last == last_tag_.end() || queues_.find(key) == queues_.end()
                           ? virtual_time_
                           : std::max(virtual_time_, last->second);
  return start + static_cast<double>(std::max<int64_t>(1, compute));
}

Executor::Ahead Executor::WorkAhead(const std::string& key, int64_t compute) const {
  absl::MutexLock lock(&mu_);
  Ahead ahead;
  ahead.running = running_units_;
  for (const Taken* t : taken_) {
    for (const Work& w : t->work) {
      if (w.key == key) {
        ahead.own_running[w.kind] += w.compute;
      } else {
        ahead.others_running.emplace_back(w.kind, w.compute);
      }
    }
  }
  const double tag = TagLocked(key, compute);
  for (const auto& [caller, tasks] : queues_) {
    for (const Task& t : tasks) {
      if (t.tag > tag) break;  // a caller's tags only grow
      ahead.queued[t.kind] += t.compute;
    }
  }
  return ahead;
}

bool Executor::TryRunInline(absl::FunctionRef<void()> task) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || waiting_ > 0 || running_ >= static_cast<int64_t>(threads_.size())) {
      return false;
    }
    ++running_;
  }
  task();
  absl::MutexLock lock(&mu_);
  --running_;
  return true;
}

bool Executor::PushLocked(const std::string& key, int64_t compute, Task task) {
  if (stopping_ || waiting_ >= capacity_) return false;
  const double tag = TagLocked(key, compute);
  last_tag_[key] = tag;
  task.tag = tag;
  task.compute = std::max<int64_t>(1, compute);
  task.key = key;
  queues_[key].push_back(std::move(task));
  ++waiting_;
  return true;
}

bool Executor::PopLocked(bool batch_only, Task* out) {
  auto best = queues_.end();
  for (auto it = queues_.begin(); it != queues_.end(); ++it) {
    const Task& head = it->second.front();
    if (batch_only && (head.batch == nullptr || !head.joins)) continue;
    if (best == queues_.end() || head.tag < best->second.front().tag) best = it;
  }
  if (best == queues_.end()) return false;
  Task task = std::move(best->second.front());
  best->second.pop_front();
  if (best->second.empty()) {
    last_tag_.erase(best->first);
    queues_.erase(best);
  }
  --waiting_;
  virtual_time_ = std::max(virtual_time_, task.tag);
  *out = std::move(task);
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
  return waiting_;
}

int64_t Executor::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

void Executor::ComputeDone() {
  if (current_taken == nullptr) return;
  Taken& taken = *static_cast<Taken*>(current_taken);
  taken.owner->Release(taken);
}

void Executor::Release(Taken& taken) {
  absl::MutexLock lock(&mu_);
  if (taken.released) return;
  taken.released = true;
  running_ -= static_cast<int64_t>(taken.work.size());
  for (const Work& w : taken.work) {
    if ((running_units_[w.kind] -= w.compute) <= 0) running_units_.erase(w.kind);
  }
  taken_.erase(&taken);
}

void Executor::WorkerLoop() {
  std::vector<BatchTask*> batch;
  Taken taken;
  taken.owner = this;
  while (true) {
    Task task;
    batch.clear();
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || waiting_ > 0; };
      mu_.Await(absl::Condition(&ready));
      if (waiting_ == 0) return;  // stopping and drained
      PopLocked(/*batch_only=*/false, &task);
      taken.work.clear();
      taken.released = false;
      taken.work.push_back(Work{task.kind, task.compute, task.key});
      if (task.batch != nullptr) {
        // Steps ready now join this pass, unless it is one that runs alone.
        batch.push_back(task.batch);
        Task more;
        while (task.joins && static_cast<int>(batch.size()) < max_batch_ &&
               PopLocked(true, &more)) {
          batch.push_back(more.batch);
          taken.work.push_back(Work{more.kind, more.compute, more.key});
        }
      }
      running_ += static_cast<int64_t>(taken.work.size());
      for (const Work& w : taken.work) running_units_[w.kind] += w.compute;
      taken_.insert(&taken);
    }
    current_taken = &taken;
    if (batch.empty()) {
      std::move(task.run)();
    } else {
      runner_(absl::MakeConstSpan(batch));
    }
    current_taken = nullptr;
    Release(taken);
  }
}

}  // namespace ropeattn::server
