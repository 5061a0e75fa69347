#include "server/answer_watch.h"

#include <utility>

namespace ropeattn::server {

void AnswerWatch::Handle::Ended() {
  {
    absl::MutexLock lock(&mu_);
    const std::thread::id self = std::this_thread::get_id();
    auto done = [this, self]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !cancelling_ || canceller_ == self;
    };
    mu_.Await(absl::Condition(&done));
    ctx_ = nullptr;
    armed_ = false;
  }
  watch_->Dequeue(this);
}

void AnswerWatch::Handle::Disarm() {
  absl::MutexLock lock(&mu_);
  armed_ = false;
}

bool AnswerWatch::Handle::TimedOut() {
  absl::MutexLock lock(&mu_);
  return timed_out_;
}

AnswerWatch::AnswerWatch(absl::Duration timeout)
    : timeout_(std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(timeout))) {
  thread_ = std::thread([this] { Loop(); });
}

AnswerWatch::~AnswerWatch() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

std::shared_ptr<AnswerWatch::Handle> AnswerWatch::Watch(grpc::ServerContextBase* ctx) {
  return std::make_shared<Handle>(this, ctx);
}

void AnswerWatch::Arm(const std::shared_ptr<Handle>& h) {
  {
    absl::MutexLock lock(&h->mu_);
    if (h->ctx_ == nullptr) return;  // ended already
    h->armed_ = true;
    h->due_ = Clock::now() + timeout_;
  }
  absl::MutexLock lock(&mu_);
  EnqueueLocked(h);
}

void AnswerWatch::EnqueueLocked(const std::shared_ptr<Handle>& h) {
  if (h->queued_) return;  // its entry stays; the loop sees the new deadline
  if (fifo_.empty()) kick_ = true;
  h->pos_ = fifo_.insert(fifo_.end(), h);
  h->queued_ = true;
}

void AnswerWatch::Dequeue(Handle* h) {
  absl::MutexLock lock(&mu_);
  if (!h->queued_) return;
  h->queued_ = false;
  fifo_.erase(h->pos_);  // may drop the last reference: h is not used after
}

size_t AnswerWatch::queued() const {
  absl::MutexLock lock(&mu_);
  return fifo_.size();
}

int64_t AnswerWatch::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

// TryCancel runs without the handle's lock held (gRPC may run the call's
// OnCancel and OnDone inside it, on this thread), the call pinned by
// `cancelling_`: an OnDone on another thread waits in Ended() until it
// returns, so the context outlives the TryCancel.
bool AnswerWatch::CancelIfDue(const std::shared_ptr<Handle>& h, bool* cancelled) {
  grpc::ServerContextBase* ctx;
  {
    absl::MutexLock hl(&h->mu_);
    if (h->ctx_ == nullptr || !h->armed_) return false;
    if (h->due_ > Clock::now()) return true;  // a later write moved it
    ctx = h->ctx_;
    h->armed_ = false;
    h->timed_out_ = true;  // before TryCancel, which may run OnDone here
    h->cancelling_ = true;
    h->canceller_ = std::this_thread::get_id();
  }
  ctx->TryCancel();
  *cancelled = true;
  absl::MutexLock hl(&h->mu_);
  h->cancelling_ = false;
  return false;
}

void AnswerWatch::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    // The front's deadline is the earliest (one timeout for all): sleep to
    // it, or until the FIFO stops being empty, or the stop.
    Clock::duration wait = std::chrono::seconds(1);
    if (!fifo_.empty()) {
      std::shared_ptr<Handle> front = fifo_.front();
      mu_.Unlock();
      Clock::time_point due;
      {
        absl::MutexLock hl(&front->mu_);
        due = front->armed_ ? front->due_ : Clock::now();
      }
      mu_.Lock();
      wait = std::max(Clock::duration::zero(), due - Clock::now());
    }
    kick_ = false;
    if (wait > Clock::duration::zero()) {
      mu_.AwaitWithTimeout(absl::Condition(this, &AnswerWatch::Woken),
                           absl::FromChrono(std::chrono::duration_cast<std::chrono::nanoseconds>(wait)));
    }
    if (stop_ || fifo_.empty()) continue;
    std::shared_ptr<Handle> h = fifo_.front();
    fifo_.pop_front();
    h->queued_ = false;
    bool cancelled = false;
    mu_.Unlock();  // Arm and Ended may run from the callbacks TryCancel triggers
    const bool again = CancelIfDue(h, &cancelled);
    mu_.Lock();
    if (cancelled) ++cancelled_;
    // Not for a call that ended meanwhile: its Ended() found no entry to
    // take out (this one was popped), so one put back now would stay until
    // the loop came round to it (a test saw a stale entry; lock order
    // mu_ -> Handle::mu_ holds everywhere).
    bool live = false;
    if (again) {
      absl::MutexLock hl(&h->mu_);
      live = h->ctx_ != nullptr;
    }
    if (live) EnqueueLocked(h);
  }
}

}  // namespace ropeattn::server
