// fake_cuda.h: what the fake CUDA runtime (fake_cuda.cc) and the fake
// NCCL (fake_nccl.cc) share: streams, the pause every piece of device work
// takes, and the 16-bit float types' conversions. Both files build into one
// library (tests/fake_cuda/__init__.py), so there is one set of streams.
#pragma once

#include <stdint.h>
#include <string.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace fake_cuda {

constexpr int kSuccess = 0;

// A stream: a queue of work run in order by a thread of its own.
class Stream {
 public:
  Stream() : worker_([this] { run(); }) {}
  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    worker_.join();
  }

  // The position the work now queued will have reached once done.
  uint64_t push(std::function<void()> work) {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(work));
    changed_.notify_all();
    return ++queued_;
  }
  uint64_t position() {
    std::lock_guard<std::mutex> lock(mutex_);
    return queued_;
  }
  bool reached(uint64_t position) {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_ >= position;
  }
  void wait_until(uint64_t position) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return done_ >= position; });
  }
  void synchronize() { wait_until(position()); }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      std::function<void()> work = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      work();
      lock.lock();
      ++done_;
      changed_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> queue_;
  uint64_t queued_ = 0, done_ = 0;
  bool stopping_ = false;
  std::thread worker_;
};

// The stream a handle names; null names the default stream.
Stream* stream_of(void* handle);

// Every copy, memset and kernel takes this long before it does anything:
// work queued on a GPU finishes well after the call that queued it, so a
// host that reads a result without the stream's say-so reads it early
// every time, not now and then.
constexpr auto kDeviceWorkTakes = std::chrono::microseconds(50);

inline void device_work(const std::function<void()>& work) {
  std::this_thread::sleep_for(kDeviceWorkTakes);
  work();
}

// Loads and stores of a type in the type its arithmetic is done in: the
// 16-bit floats compute in float, as the CUDA kernels do.
template <typename T>
struct Codec {
  using Compute = T;
  static T load(T v) { return v; }
  static T store(T v) { return v; }
};
struct Bfloat16 {
  uint16_t bits;
};
template <>
struct Codec<_Float16> {
  using Compute = float;
  static float load(_Float16 v) { return (float)v; }
  static _Float16 store(float v) { return (_Float16)v; }  // round to nearest even, as __float2half_rn
};
template <>
struct Codec<Bfloat16> {
  using Compute = float;
  static float load(Bfloat16 v) {
    uint32_t bits = (uint32_t)v.bits << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
  }
  static Bfloat16 store(float f) {  // round to nearest even, as __float2bfloat16_rn
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((bits >> 16) | 0x40)};  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return {(uint16_t)(bits >> 16)};
  }
};

}  // namespace fake_cuda
