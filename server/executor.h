// The service's own bounded compute executor. gRPC callback reactions must
// not block (gRFC L67), so every kernel call is handed to these threads; a
// full queue is refused at once so overload turns into RESOURCE_EXHAUSTED,
// not into unbounded latency.
#ifndef ROPEATTN_SERVER_EXECUTOR_H_
#define ROPEATTN_SERVER_EXECUTOR_H_

#include <cstdint>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace ropeattn::server {

class Executor {
 public:
  // `workers` threads; at most `queue_capacity` tasks wait beyond the running.
  Executor(int workers, int queue_capacity);
  ~Executor();  // Shutdown()

  // Queues a task; false (task dropped, not run) when the queue is full or
  // the executor is shutting down. Thread-safe.
  bool TrySubmit(absl::AnyInvocable<void() &&> task);

  // Stops accepting, runs every queued task, joins the workers. Idempotent.
  void Shutdown();

  int64_t queue_depth() const;  // waiting, not running
  int64_t running() const;
  int capacity() const { return capacity_; }
  int workers() const { return static_cast<int>(threads_.size()); }

 private:
  void WorkerLoop();

  const int capacity_;
  mutable absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void() &&>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_EXECUTOR_H_
