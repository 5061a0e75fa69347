// The service's own bounded compute executor. gRPC callback reactions must
// not block (gRFC L67), so every kernel call is handed to these threads; a
// full queue is refused at once so overload turns into RESOURCE_EXHAUSTED,
// not into unbounded latency.
//
// Order: weighted fair queueing across callers (docs/scheduler.md). Each
// task carries its caller's key and its priced compute; a task's finish tag
// is max(virtual time, its caller's last tag) + compute, and workers take
// the waiting task with the smallest tag (self-clocked fair queueing). A
// caller with a deep queue of heavy work therefore waits behind its own
// work, not in front of a light caller's; one caller's tasks stay FIFO.
//
// Dead entries: a task may carry its call's StopToken. Once that token fires
// (the call was cancelled, or its deadline passed) while the task waits, the
// task no longer counts anywhere (queue_depth, the capacity, WorkAhead), and
// it is taken out of the queue and run at once, off the workers, by whoever
// notices first (DropStopped, which the service calls from every OnCancel;
// any submit; a worker reaching it): a task with a token must check it first
// and, when it has fired, only abandon (answer, release what it holds),
// never compute. So a cancelled request's memory, session and queue slot go
// back at once, not when a worker would have reached it.
#ifndef ROPEATTN_SERVER_EXECUTOR_H_
#define ROPEATTN_SERVER_EXECUTOR_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/stop.h"

namespace ropeattn::server {

// A task that can run in one pass with others of its kind (the decode steps
// of different sessions, docs/scheduler.md "Cross-session decode batching").
// The executor does not look inside; its batch runner does.
class BatchTask {
 public:
  virtual ~BatchTask() = default;
};

class Executor {
 public:
  // Runs the batch tasks a worker took together, on that worker.
  using BatchRunner = std::function<void(absl::Span<BatchTask* const>)>;

  // `workers` threads; at most `queue_capacity` tasks wait beyond the
  // running. With a runner, a worker that takes a batch task also takes
  // every other batch task then at the head of a caller's queue (smallest
  // finish tags first, up to `max_batch` in all) and hands them to the
  // runner at once: continuous batching, under the same fair queueing.
  // Only batch tasks submitted as joining (decode-sized steps) share a pass:
  // every answer waits for the whole pass, so a one-token step must not wait
  // for other callers' queued prompt-sized steps, which run alone. It still
  // waits for the pass it joins (up to `max_batch` decode-sized steps, of any
  // context length) or the pass or prompt step running when it arrives.
  // `nice` > 0 lowers the workers' scheduling priority (and that of their
  // kernel threads), so the gRPC threads answering control calls and health
  // checks get a core at once while compute saturates the machine; idle
  // cores still go to compute.
  Executor(int workers, int queue_capacity, int max_batch = 1, BatchRunner runner = nullptr,
           int nice = 0);
  ~Executor();  // Shutdown()

  // Queues a task of caller `key` costing `compute` (>= 1 is used); false
  // (task dropped, not run) when the queue is full or the executor is
  // shutting down. Thread-safe.
  // `kind` (a string literal, e.g. the method) groups tasks for WorkAhead.
  // `stop` (optional; must outlive the task): the call's token, see "Dead
  // entries" above.
  bool TrySubmit(const std::string& key, int64_t compute, absl::AnyInvocable<void() &&> task,
                 const char* kind = "", const StopToken* stop = nullptr);
  // The same for the server's own small tasks (its own key, cost 1).
  bool TrySubmit(absl::AnyInvocable<void() &&> task) { return TrySubmit("", 1, std::move(task)); }
  // Queues a batch task (not owned: it must live until the runner has
  // seen it). False as TrySubmit.
  // `joins` false: the task runs alone (it neither joins another batch nor
  // takes others into its pass).
  // A stopped batch task is handed to the runner alone (it must then only
  // abandon, as above).
  bool TrySubmitBatch(const std::string& key, int64_t compute, BatchTask* task,
                      const char* kind = "", bool joins = true, const StopToken* stop = nullptr);
  // Takes every waiting task whose stop token has fired out of the queue and
  // runs it on the calling thread (it abandons). Thread-safe; cheap when
  // there is none (one pass over the queue).
  void DropStopped();
  // The work that would run before a task of caller `key` costing `compute`
  // submitted now: `running`, every running task with its priced compute and
  // how long it has run (an estimate subtracts that, so the wait it gives
  // counts down while the work runs), `own` when it is `key`'s, the tasks of
  // one worker's pass (a batch) together; and `queued`, one by one in the
  // order the workers take them (smallest finish tag first), every live
  // waiting task with a smaller finish tag than the new one would get. A
  // light caller behind a heavy caller's deep queue sees only the running
  // work and about one task of each other caller. Workers with no entry in
  // `running` are idle (or running a small task inline, TryRunInline).
  struct Running {
    const char* kind;
    int64_t compute;         // priced, whole
    absl::Duration elapsed;  // since a worker took it
    bool own;                // the asking caller's
    // Runs in the same pass, on the same worker, as the entry before it (a
    // batch's other tasks); false: the first (or only) task of its worker.
    bool same_pass = false;
  };
  struct Queued {
    const char* kind;
    int64_t compute;  // priced
  };
  struct Ahead {
    std::vector<Running> running;
    std::vector<Queued> queued;
    // The queued units of `kind`, all together.
    int64_t QueuedUnits(absl::string_view kind) const {
      int64_t units = 0;
      for (const Queued& q : queued) {
        if (kind == q.kind) units += q.compute;
      }
      return units;
    }
  };
  Ahead WorkAhead(const std::string& key, int64_t compute) const;
  // Runs `task` on the calling thread, now, if a worker is free and nothing
  // waits (it then counts as running on that worker); false otherwise, and
  // the task is not run. For requests so small that handing them to a
  // worker thread would cost more than computing them.
  bool TryRunInline(absl::FunctionRef<void()> task);
  // Called by a task running on a worker once its compute is over, before it
  // answers its caller: from then on its work no longer counts as running
  // (WorkAhead, the busy-worker count). A caller sends its next request the
  // moment it has the answer, and that request must not be priced as
  // waiting behind work that has already ended (it was refused as too slow
  // when the worker, at --compute_nice, lost its core right after
  // answering). A no-op off a worker thread or when called again.
  static void ComputeDone();

  // Stops accepting, runs every queued task, joins the workers. Idempotent.
  void Shutdown();

  int64_t queue_depth() const;  // waiting (live: stopped tasks do not count), not running
  int64_t running() const;
  int capacity() const { return capacity_; }
  int workers() const { return static_cast<int>(threads_.size()); }

 private:
  void WorkerLoop();
  // The work a worker took, counted in running_ and taken_ until it
  // is released (ComputeDone, or when the task returns).
  struct Work {
    const char* kind;
    int64_t compute;
    std::string key;  // the caller
  };
  struct Taken {
    Executor* owner = nullptr;
    std::vector<Work> work;
    absl::Time started;  // when the worker took it
    bool released = false;
  };
  void Release(Taken& taken);

  struct Task {
    double tag = 0;  // virtual finish time
    absl::AnyInvocable<void() &&> run;
    BatchTask* batch = nullptr;  // instead of run
    bool joins = true;           // a batch task that may share a pass
    int64_t compute = 1;
    const char* kind = "";
    std::string key;  // the caller
    const StopToken* stop = nullptr;  // the call's, if any
  };
  // Whether a waiting task is dead: its call was cancelled or its deadline
  // passed.
  static bool Dead(const Task& t) { return ShouldStop(t.stop); }
  // Removes the dead waiting tasks (to be run, abandoning, outside mu_).
  std::vector<Task> TakeStoppedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs tasks TakeStoppedLocked removed, on this thread (not counted as a
  // worker's work); mu_ not held.
  void RunAbandoned(std::vector<Task> tasks);
  // The finish tag a task of `key` costing `compute` would get now.
  double TagLocked(const std::string& key, int64_t compute) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues `task` unless the queue is full of live tasks (dead ones are
  // moved to `*dropped` to make room) or the executor is stopping.
  bool PushLocked(const std::string& key, int64_t compute, Task task, std::vector<Task>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The waiting task with the smallest tag (only batch tasks when
  // `batch_only`), removed; its caller's queue is dropped once empty. False
  // when there is none.
  bool PopLocked(bool batch_only, Task* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int capacity_;
  const int max_batch_;
  const BatchRunner runner_;
  mutable absl::Mutex mu_;
  // Per caller, FIFO; callers with nothing waiting have no entry.
  absl::flat_hash_map<std::string, std::deque<Task>> queues_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, double> last_tag_ ABSL_GUARDED_BY(mu_);
  int64_t waiting_ ABSL_GUARDED_BY(mu_) = 0;  // queued, dead ones included
  double virtual_time_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t running_ ABSL_GUARDED_BY(mu_) = 0;
  // The work of every worker's current take (not yet released).
  absl::flat_hash_set<const Taken*> taken_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_EXECUTOR_H_
