// Ends calls whose answers are not taken. gRPC has no write timeout: a
// client that keeps its connection alive (it answers pings) but never opens
// its flow-control window leaves an answer pending forever, and the call
// keeps what it holds (its memory reservation, a Decode stream's share of
// the budget) as long as it stays. A call arms its handle when it hands an
// answer to gRPC and disarms it when gRPC reports the write done; a handle
// still armed `timeout` later has its call cancelled (TryCancel), which ends
// it and frees what it held.
//
// One timeout for every write, so deadlines come in arming order: the watch
// keeps a FIFO with at most one entry per live call (a call's later writes
// move its deadline, not its entry; an ended call leaves the FIFO at once),
// timed on the monotonic clock. A call whose deadline a later write moved
// goes to the FIFO's back when its entry comes up: it is cancelled within
// one to two timeouts of its last unfinished write.
#ifndef ROPEATTN_SERVER_ANSWER_WATCH_H_
#define ROPEATTN_SERVER_ANSWER_WATCH_H_

#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace ropeattn::server {

class AnswerWatch {
 public:
  using Clock = std::chrono::steady_clock;
  class Handle;

  explicit AnswerWatch(absl::Duration timeout);
  ~AnswerWatch();
  AnswerWatch(const AnswerWatch&) = delete;
  AnswerWatch& operator=(const AnswerWatch&) = delete;

  // A call's handle, to arm for each answer and end with the call.
  std::shared_ptr<Handle> Watch(grpc::ServerContextBase* ctx);
  // An answer was handed to gRPC: its call is cancelled if the handle is
  // still armed for this write `timeout` from now.
  void Arm(const std::shared_ptr<Handle>& handle);
  // Calls cancelled so far.
  int64_t cancelled() const;
  // Entries in the FIFO (at most one per live call that has armed).
  size_t queued() const;

  class Handle {
   public:
    Handle(AnswerWatch* watch, grpc::ServerContextBase* ctx) : watch_(watch), ctx_(ctx) {}
    // From the call's OnDone: its context is about to go. Waits while the
    // watch is cancelling it on another thread (gRPC may also run OnDone
    // inside that TryCancel, on the watch's own thread: no wait then).
    void Ended();
    // The pending write completed.
    void Disarm();
    // True once the watch has cancelled the call because an answer stayed
    // untaken past the timeout: the call's own view of its end (OnDone,
    // OnWriteDone(false)) then counts and logs it as cancelled unread, not
    // under the code it was answered with.
    bool TimedOut();

   private:
    friend class AnswerWatch;
    AnswerWatch* const watch_;
    absl::Mutex mu_;
    grpc::ServerContextBase* ctx_ ABSL_GUARDED_BY(mu_);
    bool armed_ ABSL_GUARDED_BY(mu_) = false;
    Clock::time_point due_ ABSL_GUARDED_BY(mu_);
    bool cancelling_ ABSL_GUARDED_BY(mu_) = false;
    bool timed_out_ ABSL_GUARDED_BY(mu_) = false;
    std::thread::id canceller_ ABSL_GUARDED_BY(mu_);
    // Its FIFO entry (the watch's lock).
    bool queued_ = false;
    std::list<std::shared_ptr<Handle>>::iterator pos_;
  };

 private:
  void Loop();
  // Adds `h` to the FIFO unless it is there (watch lock held).
  void EnqueueLocked(const std::shared_ptr<Handle>& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Dequeue(Handle* h);
  bool Woken() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || kick_; }
  // Cancels h's call if it is armed and due; true if it is armed but its
  // deadline moved (a later write): to be queued again.
  bool CancelIfDue(const std::shared_ptr<Handle>& h, bool* cancelled);

  const Clock::duration timeout_;
  mutable absl::Mutex mu_;
  std::list<std::shared_ptr<Handle>> fifo_ ABSL_GUARDED_BY(mu_);
  bool kick_ ABSL_GUARDED_BY(mu_) = false;  // the FIFO went from empty to not
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t cancelled_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_ANSWER_WATCH_H_
