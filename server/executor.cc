#include "server/executor.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"

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
                         absl::AnyInvocable<void() &&> task, const char* kind,
                         const StopToken* stop) {
  std::vector<Task> dropped;
  bool queued;
  {
    absl::MutexLock lock(&mu_);
    Task t;
    t.run = std::move(task);
    t.kind = kind;
    t.stop = stop;
    queued = PushLocked(key, compute, std::move(t), &dropped);
  }
  RunAbandoned(std::move(dropped));
  return queued;
}

bool Executor::TrySubmitBatch(const std::string& key, int64_t compute, BatchTask* task,
                              const char* kind, bool joins, const StopToken* stop) {
  if (!runner_ || task == nullptr) return false;
  std::vector<Task> dropped;
  bool queued;
  {
    absl::MutexLock lock(&mu_);
    Task t;
    t.batch = task;
    t.joins = joins;
    t.kind = kind;
    t.stop = stop;
    queued = PushLocked(key, compute, std::move(t), &dropped);
  }
  RunAbandoned(std::move(dropped));
  return queued;
}

void Executor::DropStopped() {
  std::vector<Task> dropped;
  {
    absl::MutexLock lock(&mu_);
    dropped = TakeStoppedLocked();
  }
  RunAbandoned(std::move(dropped));
}

std::vector<Executor::Task> Executor::TakeStoppedLocked() {
  std::vector<Task> dropped;
  for (auto it = queues_.begin(); it != queues_.end();) {
    std::deque<Task>& tasks = it->second;
    const size_t before = dropped.size();
    for (auto t = tasks.begin(); t != tasks.end();) {
      if (Dead(*t)) {
        dropped.push_back(std::move(*t));
        t = tasks.erase(t);
      } else {
        ++t;
      }
    }
    if (dropped.size() == before) {
      ++it;
      continue;
    }
    waiting_ -= static_cast<int64_t>(dropped.size() - before);
    if (tasks.empty()) {
      last_tag_.erase(it->first);
      queues_.erase(it++);
    } else {
      // A dead last task no longer pushes its caller's next tag back.
      last_tag_[it->first] = tasks.back().tag;
      ++it;
    }
  }
  return dropped;
}

void Executor::RunAbandoned(std::vector<Task> tasks) {
  if (tasks.empty()) return;
  // Not a worker's work: ComputeDone from these must not release the take
  // of a worker that happens to be the caller.
  void* const saved = current_taken;
  current_taken = nullptr;
  std::vector<BatchTask*> batch;
  for (Task& t : tasks) {
    if (t.batch != nullptr) {
      batch.assign(1, t.batch);
      runner_(absl::MakeConstSpan(batch));
    } else if (t.run) {
      std::move(t.run)();
    }
  }
  current_taken = saved;
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
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  Ahead ahead;
  for (const Taken* t : taken_) {
    bool first = true;
    for (const Work& w : t->work) {
      ahead.running.push_back(Running{w.kind, w.compute,
                                      std::max(absl::ZeroDuration(), now - t->started),
                                      w.key == key, /*same_pass=*/!first});
      first = false;
    }
  }
  const double tag = TagLocked(key, compute);
  std::vector<std::pair<double, Queued>> queued;
  for (const auto& [caller, tasks] : queues_) {
    for (const Task& t : tasks) {
      if (t.tag > tag) break;  // a caller's tags only grow
      if (Dead(t)) continue;   // leaves without running
      queued.push_back({t.tag, Queued{t.kind, t.compute}});
    }
  }
  // The order PopLocked takes them in.
  std::stable_sort(queued.begin(), queued.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  ahead.queued.reserve(queued.size());
  for (const auto& [t, q] : queued) ahead.queued.push_back(q);
  return ahead;
}

bool Executor::TryRunInline(absl::FunctionRef<void()> task) {
  std::vector<Task> dropped;
  bool run = false;
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_ && running_ < static_cast<int64_t>(threads_.size())) {
      if (waiting_ > 0) dropped = TakeStoppedLocked();  // dead entries wait for nothing
      if (waiting_ == 0) {
        ++running_;
        run = true;
      }
    }
  }
  RunAbandoned(std::move(dropped));
  if (!run) return false;
  task();
  absl::MutexLock lock(&mu_);
  --running_;
  return true;
}

bool Executor::PushLocked(const std::string& key, int64_t compute, Task task,
                          std::vector<Task>* dropped) {
  if (stopping_) return false;
  // Dead entries go first, whatever the room: they would otherwise wait for
  // a worker (or the next cancel) to be answered.
  *dropped = TakeStoppedLocked();
  if (waiting_ >= capacity_) return false;
  // The last quarter of the queue is kept for callers holding less than an
  // equal share of it: past three quarters full, a caller already holding
  // capacity / (callers waiting + 1) entries is refused, so one caller (or a
  // few) cannot fill the queue and have everyone else refused "queue full"
  // (an external test: one caller's 80 streams importing prefixes held all
  // 64 entries, another caller's small Attends were refused 51-88% of the
  // time).
  if (waiting_ >= capacity_ - capacity_ / 4) {
    const auto it = queues_.find(key);
    const int64_t mine = it == queues_.end() ? 0 : static_cast<int64_t>(it->second.size());
    // (A caller holding nothing always gets in while there is room.)
    const int64_t callers = static_cast<int64_t>(queues_.size());
    if (mine > 0 && mine >= capacity_ / (callers + 1)) return false;
  }
  const double tag = TagLocked(key, compute);
  last_tag_[key] = tag;
  task.tag = tag;
  task.compute = std::max<int64_t>(1, compute);
  task.key = key;
  const bool dead = Dead(task);
  queues_[key].push_back(std::move(task));
  ++waiting_;
  // Its call ended before it was queued (its OnCancel found nothing to
  // drop): it is abandoned now all the same, by the caller.
  if (dead) {
    for (Task& t : TakeStoppedLocked()) dropped->push_back(std::move(t));
  }
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
  int64_t live = 0;
  for (const auto& [caller, tasks] : queues_) {
    for (const Task& t : tasks) live += Dead(t) ? 0 : 1;
  }
  return live;
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
      taken.started = absl::Now();
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
