// Synchronisation of one worker group's host threads: a barrier and a start gate, each a
// mutex + condition variable, so they order only the threads that use them.
// Not std::barrier / std::latch: libstdc++ makes their waiters sleep in a process-wide pool
// whose mutexes also order unrelated threads (other ranks' groups); under ThreadSanitizer
// that hides exactly the cross-rank races the interpreter harness must see.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace ultracomm::host {

class GroupBarrier {
 public:
  explicit GroupBarrier(int threads) : n_(threads) {}
  // Returns once all `threads` arrived; every thread's earlier writes happen before any
  // thread's return (as __syncthreads on a device).
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lk(mu_);
    const uint64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lk, [&] { return gen_ != gen; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int n_;
  int count_ = 0;
  uint64_t gen_ = 0;
};

// Threads wait until open(); `go` tells them whether to run (false: spawning failed).
class StartGate {
 public:
  bool wait() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return open_; });
    return go_;
  }
  void open(bool go) {
    {
      std::lock_guard<std::mutex> g(mu_);
      open_ = true;
      go_ = go;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false, go_ = false;
};

}  // namespace ultracomm::host
