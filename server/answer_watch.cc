#include "server/answer_watch.h"

#include <utility>

namespace ropeattn::server {

void AnswerWatch::Handle::Ended() {
  absl::MutexLock lock(&mu_);
  const std::thread::id self = std::this_thread::get_id();
  mu_.Await(absl::Condition(
      +[](std::pair<Handle*, std::thread::id>* s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return !s->first->cancelling_ || s->first->canceller_ == s->second;
      },
      std::make_unique<std::pair<Handle*, std::thread::id>>(this, self).get()));
  ctx_ = nullptr;
  armed_ = false;
}

void AnswerWatch::Handle::Disarm() {
  absl::MutexLock lock(&mu_);
  armed_ = false;
}

AnswerWatch::AnswerWatch(absl::Duration timeout) : timeout_(timeout) {
  thread_ = std::thread([this] { Loop(); });
}

AnswerWatch::~AnswerWatch() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void AnswerWatch::Arm(const std::shared_ptr<Handle>& handle) {
  uint64_t generation;
  {
    absl::MutexLock lock(&handle->mu_);
    if (handle->ctx_ == nullptr) return;  // ended already
    handle->armed_ = true;
    generation = ++handle->generation_;
  }
  absl::MutexLock lock(&mu_);
  due_.push(Due{absl::Now() + timeout_, handle, generation});
}

int64_t AnswerWatch::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

// TryCancel runs without the handle's lock held (gRPC may run the call's
// OnCancel and OnDone inside it, on this thread), the call pinned by
// `cancelling_`: an OnDone on another thread waits in Ended() until it
// returns, so the context outlives the TryCancel.
void AnswerWatch::CancelIfArmed(const std::shared_ptr<Handle>& h, uint64_t generation,
                                bool* did) {
  grpc::ServerContextBase* ctx;
  {
    absl::MutexLock hl(&h->mu_);
    if (h->ctx_ == nullptr || !h->armed_ || h->generation_ != generation) return;
    ctx = h->ctx_;
    h->armed_ = false;
    h->cancelling_ = true;
    h->canceller_ = std::this_thread::get_id();
  }
  ctx->TryCancel();
  *did = true;
  absl::MutexLock hl(&h->mu_);
  h->cancelling_ = false;
}

void AnswerWatch::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    const absl::Time wake = due_.empty() ? absl::Now() + absl::Seconds(1) : due_.top().at;
    seen_ = due_.size();
    mu_.AwaitWithDeadline(absl::Condition(this, &AnswerWatch::Woken), wake);
    const absl::Time now = absl::Now();
    while (!stop_ && !due_.empty() && due_.top().at <= now) {
      Due d = due_.top();
      due_.pop();
      std::shared_ptr<Handle> h = d.handle.lock();
      if (h == nullptr) continue;
      bool did = false;
      mu_.Unlock();  // Arm may run from the callbacks TryCancel triggers
      CancelIfArmed(h, d.generation, &did);
      mu_.Lock();
      if (did) ++cancelled_;
    }
  }
}

}  // namespace ropeattn::server
