// Ends calls whose answers are not taken. gRPC has no write timeout: a
// client that keeps its connection alive (it answers pings) but never opens
// its flow-control window leaves an answer pending forever, and the call
// keeps what it holds (its memory reservation, a Decode stream's share of
// the budget) as long as it stays. A call arms its handle when it hands an
// answer to gRPC and disarms it when gRPC reports the write done; a handle
// still armed `timeout` later has its call cancelled (TryCancel), which ends
// it and frees what it held.
#ifndef ROPEATTN_SERVER_ANSWER_WATCH_H_
#define ROPEATTN_SERVER_ANSWER_WATCH_H_

#include <cstdint>
#include <memory>
#include <queue>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace ropeattn::server {

class AnswerWatch {
 public:
  // One call's handle: created with the call, told when the call ends.
  class Handle {
   public:
    explicit Handle(grpc::ServerContextBase* ctx) : ctx_(ctx) {}
    // From the call's OnDone: its context is about to go. Waits while the
    // watch is cancelling it on another thread (gRPC may also run OnDone
    // inside that TryCancel, on the watch's own thread: no wait then).
    void Ended();
    // The pending write completed.
    void Disarm();

   private:
    friend class AnswerWatch;
    absl::Mutex mu_;
    grpc::ServerContextBase* ctx_ ABSL_GUARDED_BY(mu_);
    bool armed_ ABSL_GUARDED_BY(mu_) = false;
    uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
    bool cancelling_ ABSL_GUARDED_BY(mu_) = false;
    std::thread::id canceller_ ABSL_GUARDED_BY(mu_);
  };

  explicit AnswerWatch(absl::Duration timeout);
  ~AnswerWatch();
  AnswerWatch(const AnswerWatch&) = delete;
  AnswerWatch& operator=(const AnswerWatch&) = delete;

  // An answer was handed to gRPC: its call is cancelled if the handle is
  // still armed for this write `timeout` from now.
  void Arm(const std::shared_ptr<Handle>& handle);
  // Calls cancelled so far.
  int64_t cancelled() const;

 private:
  struct Due {
    absl::Time at;
    std::weak_ptr<Handle> handle;
    uint64_t generation;
    bool operator>(const Due& o) const { return at > o.at; }
  };
  void Loop();
  bool Woken() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || due_.size() != seen_;
  }
  static void CancelIfArmed(const std::shared_ptr<Handle>& h, uint64_t generation, bool* did);

  const absl::Duration timeout_;
  mutable absl::Mutex mu_;
  std::priority_queue<Due, std::vector<Due>, std::greater<Due>> due_ ABSL_GUARDED_BY(mu_);
  size_t seen_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t cancelled_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_ANSWER_WATCH_H_
