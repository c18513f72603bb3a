// fake_nccl.cc: the fake NCCL, for tests/fake_cuda (fake_cuda.cc says why
// there is a fake). Its ranks are separate processes that meet in shared
// memory.
//
// A communicator of n ranks is a shared-memory segment named by its unique
// id, with a one-way channel for every ordered pair of ranks. Each call
// runs when its stream reaches it, as NCCL's kernels do, and moves its
// bytes as messages on those channels:
// - a broadcast's root sends to every other rank;
// - a reduce's ranks send to the root, which combines the n inputs in rank
//   order;
// - an allreduce's ranks send to every other rank, and each combines the n
//   inputs in rank order, so that every rank ends with the same bits;
// - ncclSend and ncclRecv are one message each.
// The calls between ncclGroupStart and ncclGroupEnd run as one piece of
// stream work whose messages all progress together, so a group of sends
// and receives that would deadlock one by one completes, as in NCCL.
//
// Each message starts with its length and its call's kind and type. A
// receiver checks them against its own call and stops the process naming
// both: that is how a core that issued its calls in another order, or with
// other sizes, on two ranks shows up here (a GPU would hang or corrupt). A
// wait of over two minutes for a peer also stops it, naming who waited for
// whom, rather than hanging the test.
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "fake_cuda.h"

using namespace fake_cuda;

namespace {

constexpr int kNcclSystemError = 2;
constexpr int kNcclInvalidUsage = 5;
constexpr int kNcclRemoteError = 6;
constexpr size_t kChannelBytes = 256 << 10;
constexpr auto kPeerTimeout = std::chrono::seconds(120);

[[noreturn]] void stop(const std::string& why) {
  fprintf(stderr, "fake NCCL: %s\n", why.c_str());
  fflush(stderr);
  abort();
}

// One writer, one reader; the ring holds bytes [read, written) and both
// counters only grow. A new segment is zeros, which is where both counters
// start, so no rank has to set it up before the others map it.
struct Channel {
  alignas(64) std::atomic<uint64_t> written;
  alignas(64) std::atomic<uint64_t> read;
  alignas(64) char ring[kChannelBytes];
};
struct SharedHead {
  alignas(64) std::atomic<int> joined;
};  // followed by ranks * ranks channels, from * ranks + to

struct Comm {
  int ranks = 1, rank = 0;
  char* shared = nullptr;  // a SharedHead and the channels; none for one rank
  size_t shared_bytes = 0;
  std::atomic<bool> aborted{false};
  std::atomic<int> async_error{0};  // what ncclCommGetAsyncError says

  Channel* channel(int from, int to) const {
    return reinterpret_cast<Channel*>(shared + sizeof(SharedHead)) + (size_t)from * ranks + to;
  }
};

enum CallKind : uint32_t { kAllReduceCall, kBroadcastCall, kReduceCall, kPointToPointCall };
const char* kind_name(uint32_t kind) {
  static const char* names[] = {"an allreduce", "a broadcast", "a reduce", "a send"};
  return kind < 4 ? names[kind] : "something unknown";
}

struct Call {
  uint32_t kind;
  const void* from;
  void* to;
  size_t count;
  int type, op;
  int root;  // or the peer of a send or a receive
  bool sending;
};

size_t nccl_type_size(int type) {
  static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
  return type >= 0 && type < 10 ? sizes[type] : 0;
}

struct Header {
  uint64_t bytes;
  uint32_t kind, type;
  bool operator==(const Header& o) const { return bytes == o.bytes && kind == o.kind && type == o.type; }
};

struct Message {
  int peer;
  bool sending;
  char* data;     // the payload: read when sending, written when receiving
  Header header;  // what is sent, or what is expected
  Header arrived{};
  size_t moved = 0;  // of the header and payload
  size_t total() const { return sizeof(Header) + header.bytes; }
};

std::string describe(const Header& h) {
  return std::string(kind_name(h.kind)) + " of " + std::to_string(h.bytes) + " bytes of NCCL type " +
         std::to_string(h.type);
}

// Moves `n` bytes of `m`, from where it is, between it and `ring`.
void move_bytes(Message& m, char* ring, size_t n) {
  for (size_t done = 0; done < n;) {
    const size_t at = m.moved + done;
    const bool in_header = at < sizeof(Header);
    char* mine = in_header ? reinterpret_cast<char*>(m.sending ? &m.header : &m.arrived) + at
                           : m.data + (at - sizeof(Header));
    const size_t part = std::min(n - done, in_header ? sizeof(Header) - at : m.total() - at);
    if (m.sending) memcpy(ring + done, mine, part);
    else memcpy(mine, ring + done, part);
    done += part;
  }
}

// Moves as much of `m` as its channel allows now; returns how much.
size_t advance(const Comm& c, Message& m) {
  Channel* ch = m.sending ? c.channel(c.rank, m.peer) : c.channel(m.peer, c.rank);
  size_t moved = 0;
  while (m.moved < m.total()) {
    const uint64_t written = ch->written.load(std::memory_order_acquire);
    const uint64_t read = ch->read.load(std::memory_order_acquire);
    const uint64_t at = m.sending ? written : read;
    const size_t ready = m.sending ? kChannelBytes - (written - read) : written - read;
    size_t n = std::min({ready, m.total() - m.moved, kChannelBytes - at % kChannelBytes});
    if (!m.sending && m.moved < sizeof(Header)) n = std::min(n, sizeof(Header) - m.moved);  // to check it first
    if (n == 0) break;
    move_bytes(m, ch->ring + at % kChannelBytes, n);
    m.moved += n;
    moved += n;
    (m.sending ? ch->written : ch->read).store(at + n, std::memory_order_release);
    if (!m.sending && m.moved == sizeof(Header) && !(m.arrived == m.header))
      stop("rank " + std::to_string(c.rank) + " expected " + describe(m.header) + " from rank " +
           std::to_string(m.peer) + ", which sent " + describe(m.arrived) +
           ": the ranks' calls on this communicator differ");
  }
  return moved;
}

// Runs `messages` together; a message waits for the earlier ones on its
// channel, since the channel carries them in order.
void exchange(Comm& c, std::vector<Message>& messages) {
  auto last_progress = std::chrono::steady_clock::now();
  unsigned idle = 0;
  for (;;) {
    std::vector<char> sending_busy(c.ranks), receiving_busy(c.ranks);
    const Message* waiting = nullptr;
    size_t moved = 0;
    for (Message& m : messages) {
      if (m.moved == m.total()) continue;
      char& busy = m.sending ? sending_busy[m.peer] : receiving_busy[m.peer];
      if (busy) continue;
      moved += advance(c, m);
      if (m.moved < m.total()) {
        busy = true;
        if (waiting == nullptr) waiting = &m;
      }
    }
    if (waiting == nullptr || c.aborted.load()) return;
    if (moved > 0) {
      last_progress = std::chrono::steady_clock::now();
      idle = 0;
    } else if (++idle < 64) {
      std::this_thread::yield();
    } else {
      if (std::chrono::steady_clock::now() - last_progress > kPeerTimeout)
        stop("rank " + std::to_string(c.rank) + " waited " + std::to_string(kPeerTimeout.count()) + " s for rank " +
             std::to_string(waiting->peer) + (waiting->sending ? " to take " : " to send ") +
             describe(waiting->header) + ": a peer never made the matching call");
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

template <typename T>
void reduce_into(T* acc, const T* in, size_t n, int op) {
  using C = typename Codec<T>::Compute;
  for (size_t i = 0; i < n; ++i) {
    const C a = Codec<T>::load(acc[i]), b = Codec<T>::load(in[i]);
    C r;
    if constexpr (std::is_integral_v<C>) {  // wrapping, as NCCL's integers do
      using U = std::make_unsigned_t<C>;
      r = op == 0 ? (C)(U)((U)a + (U)b) : op == 1 ? (C)(U)((U)a * (U)b) : op == 2 ? std::max(a, b) : std::min(a, b);
    } else {
      r = op == 0 ? a + b : op == 1 ? a * b : op == 2 ? (a < b ? b : a) : (b < a ? b : a);
    }
    acc[i] = Codec<T>::store(r);
  }
}

void reduce_into(char* acc, const char* in, size_t count, int type, int op) {
  switch (type) {
    case 0: return reduce_into((int8_t*)acc, (const int8_t*)in, count, op);
    case 1: return reduce_into((uint8_t*)acc, (const uint8_t*)in, count, op);
    case 2: return reduce_into((int32_t*)acc, (const int32_t*)in, count, op);
    case 3: return reduce_into((uint32_t*)acc, (const uint32_t*)in, count, op);
    case 4: return reduce_into((int64_t*)acc, (const int64_t*)in, count, op);
    case 5: return reduce_into((uint64_t*)acc, (const uint64_t*)in, count, op);
    case 6: return reduce_into((_Float16*)acc, (const _Float16*)in, count, op);
    case 7: return reduce_into((float*)acc, (const float*)in, count, op);
    case 8: return reduce_into((double*)acc, (const double*)in, count, op);
    case 9: return reduce_into((Bfloat16*)acc, (const Bfloat16*)in, count, op);
  }
}

// Scratch kept by each stream's thread from call to call. A buffer made
// for each large collective cost its pages' faults every time (and under
// ThreadSanitizer its shadow's, and a check of every zeroed byte): 3% of
// the fake-GPU grid's CPU at 4 ranks under ThreadSanitizer. What fits is
// reused as it is; every receive fills what it reads.
char* scratch(std::vector<char>& buffer, size_t bytes) {
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

// The ranks' inputs combined in rank order into `to` (which may be one of them).
void combine(const std::vector<const char*>& inputs, void* to, const Call& call) {
  thread_local std::vector<char> combined;
  const size_t bytes = call.count * nccl_type_size(call.type);
  char* result = scratch(combined, bytes);
  memcpy(result, inputs[0], bytes);
  for (size_t r = 1; r < inputs.size(); ++r) reduce_into(result, inputs[r], call.count, call.type, call.op);
  memcpy(to, result, bytes);
}

// FAKE_NCCL_ASYNC_ERROR=1 makes this process's collectives fail as NCCL's
// do when the network goes: the work hangs on the stream, and only
// ncclCommGetAsyncError says so, until the communicator is aborted.
bool hung_as_if_the_network_went(Comm& c) {
  const char* fail = getenv("FAKE_NCCL_ASYNC_ERROR");
  if (c.ranks == 1 || fail == nullptr || atoi(fail) != 1) return false;
  c.async_error = kNcclRemoteError;
  const auto started = std::chrono::steady_clock::now();
  while (!c.aborted.load()) {
    if (std::chrono::steady_clock::now() - started > kPeerTimeout)
      stop("rank " + std::to_string(c.rank) + " reported a remote error and was not aborted for " +
           std::to_string(kPeerTimeout.count()) + " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

void run_calls(Comm& c, const std::vector<Call>& calls) {
  if (hung_as_if_the_network_went(c)) return;
  std::vector<Message> messages;
  thread_local std::vector<std::vector<char>> received;  // peers' inputs to a reduction (scratch())
  size_t receiving = 0;
  std::vector<std::function<void()>> then;  // each call's work once every message is through
  for (const Call& call : calls) {
    const Header header{call.count * nccl_type_size(call.type), call.kind, (uint32_t)call.type};
    char* from = const_cast<char*>(static_cast<const char*>(call.from));
    char* to = static_cast<char*>(call.to);
    auto send = [&](int peer) { messages.push_back({peer, true, from, header}); };
    auto receive = [&](int peer, char* into) { messages.push_back({peer, false, into, header}); };
    if (call.kind == kPointToPointCall) {
      if (call.sending) send(call.root);
      else receive(call.root, to);
    } else if (call.kind == kBroadcastCall) {
      for (int p = 0; p < c.ranks && c.rank == call.root; ++p)
        if (p != c.rank) send(p);
      if (c.rank != call.root) receive(call.root, to);
      if (c.rank == call.root && from != to) then.push_back([=] { memmove(to, from, header.bytes); });
    } else {  // a reduce or an allreduce
      const bool gets_result = call.kind == kAllReduceCall || c.rank == call.root;
      std::vector<const char*> inputs(c.ranks);
      inputs[c.rank] = from;
      for (int p = 0; p < c.ranks; ++p) {
        if (p == c.rank) continue;
        if (call.kind == kAllReduceCall || p == call.root) send(p);
        if (!gets_result) continue;
        if (receiving == received.size()) received.emplace_back();
        char* into = scratch(received[receiving++], header.bytes);  // a moved vector keeps its bytes where they are
        inputs[p] = into;
        receive(p, into);
      }
      if (gets_result) then.push_back([=] { combine(inputs, to, call); });
    }
  }
  exchange(c, messages);
  if (!c.aborted.load())
    for (auto& work : then) work();
}

thread_local int group_depth = 0;
thread_local std::vector<Call> group_calls;
thread_local Comm* group_comm = nullptr;
thread_local void* group_stream = nullptr;

void run_on_stream(Comm* c, std::vector<Call> calls, void* stream) {
  stream_of(stream)->push([c, calls = std::move(calls)] { device_work([&] { run_calls(*c, calls); }); });
}

int enqueue(void* comm, const Call& call, void* stream) {
  Comm* c = static_cast<Comm*>(comm);
  if (c == nullptr || nccl_type_size(call.type) == 0 || call.root < 0 || call.root >= c->ranks) return kNcclInvalidUsage;
  if (call.kind == kPointToPointCall && call.root == c->rank) return kNcclInvalidUsage;  // the core copies its own rows
  if ((call.kind == kAllReduceCall || call.kind == kReduceCall) && (call.op < 0 || call.op > 3))
    return kNcclInvalidUsage;
  if (group_depth == 0) {
    run_on_stream(c, {call}, stream);
    return kSuccess;
  }
  // A group runs as one piece of work: on one communicator and stream here.
  if (!group_calls.empty() && (group_comm != c || group_stream != stream)) return kNcclInvalidUsage;
  group_comm = c;
  group_stream = stream;
  group_calls.push_back(call);
  return kSuccess;
}

}  // namespace

extern "C" {

int ncclGetVersion(int* version) {
  *version = 22803;
  return kSuccess;
}
const char* ncclGetErrorString(int code) {
  switch (code) {
    case kNcclSystemError: return "system error: shared memory for the communicator (fake NCCL)";
    case kNcclInvalidUsage: return "invalid usage (fake NCCL)";
    case kNcclRemoteError: return "remote process exited or there was a network error (fake NCCL)";
    default: return "an error (fake NCCL)";
  }
}
struct NcclUniqueId {
  char internal[128];
};
// Names the communicator's shared-memory segment.
int ncclGetUniqueId(NcclUniqueId* id) {
  static std::atomic<unsigned> made{0};
  memset(id->internal, 0, sizeof id->internal);
  snprintf(id->internal, sizeof id->internal, "/unison-fake-nccl-%d-%u-%llx", (int)getpid(), made++,
           (unsigned long long)std::chrono::steady_clock::now().time_since_epoch().count());
  return kSuccess;
}
// Waits for the others to join, as NCCL does; the last to join unlinks the
// name, so nothing is left in /dev/shm once all have it mapped.
//
// A test can make this process's init go wrong where a real one can, after
// the ids went round, to see that its peers are told rather than left
// waiting: FAKE_NCCL_INIT_FAILURES=n fails the process's first n inits
// after a pause, without joining (so the peers wait, as NCCL's do for a
// rank that never connects); FAKE_NCCL_INIT_EXITS=1 ends the process there.
int ncclCommInitRank(void** comm, int ranks, NcclUniqueId id, int rank) {
  if (ranks < 1 || rank < 0 || rank >= ranks) return kNcclInvalidUsage;
  static std::atomic<int> failed_inits{0};
  if (const char* failures = getenv("FAKE_NCCL_INIT_FAILURES"); failures != nullptr && failed_inits < atoi(failures)) {
    ++failed_inits;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    return kNcclSystemError;
  }
  if (const char* exits = getenv("FAKE_NCCL_INIT_EXITS"); exits != nullptr && atoi(exits) == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    _exit(3);
  }
  auto c = std::make_unique<Comm>();
  c->ranks = ranks;
  c->rank = rank;
  if (ranks > 1) {
    id.internal[sizeof id.internal - 1] = 0;
    c->shared_bytes = sizeof(SharedHead) + sizeof(Channel) * ranks * ranks;
    const int fd = shm_open(id.internal, O_CREAT | O_RDWR, 0600);
    if (fd < 0) return kNcclSystemError;
    void* mapped = ftruncate(fd, (off_t)c->shared_bytes) == 0
                       ? mmap(nullptr, c->shared_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                       : MAP_FAILED;
    close(fd);
    if (mapped == MAP_FAILED) return kNcclSystemError;
    c->shared = static_cast<char*>(mapped);
    auto* head = reinterpret_cast<SharedHead*>(c->shared);
    if (head->joined.fetch_add(1) + 1 == ranks) shm_unlink(id.internal);
    const auto started = std::chrono::steady_clock::now();
    while (head->joined.load() < ranks) {
      if (std::chrono::steady_clock::now() - started > kPeerTimeout)
        stop("rank " + std::to_string(rank) + " of " + std::to_string(ranks) + " waited " +
             std::to_string(kPeerTimeout.count()) + " s for the others to join communicator " + id.internal);
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  *comm = c.release();
  return kSuccess;
}
int ncclCommDestroy(void* comm) {
  Comm* c = static_cast<Comm*>(comm);
  if (c->shared != nullptr) munmap(c->shared, c->shared_bytes);
  delete c;
  return kSuccess;
}
// Work under way stops at its next wait; the communicator is kept, since
// that work may still be reading it.
int ncclCommAbort(void* comm) {
  static_cast<Comm*>(comm)->aborted = true;
  return kSuccess;
}
int ncclCommGetAsyncError(void* comm, int* state) {
  *state = static_cast<Comm*>(comm)->async_error.load();
  return kSuccess;
}

int ncclAllReduce(const void* from, void* to, size_t count, int type, int op, void* comm, void* stream) {
  return enqueue(comm, {kAllReduceCall, from, to, count, type, op, 0, false}, stream);
}
int ncclBroadcast(const void* from, void* to, size_t count, int type, int root, void* comm, void* stream) {
  return enqueue(comm, {kBroadcastCall, from, to, count, type, 0, root, false}, stream);
}
int ncclReduce(const void* from, void* to, size_t count, int type, int op, int root, void* comm, void* stream) {
  return enqueue(comm, {kReduceCall, from, to, count, type, op, root, false}, stream);
}
int ncclSend(const void* from, size_t count, int type, int peer, void* comm, void* stream) {
  return enqueue(comm, {kPointToPointCall, from, nullptr, count, type, 0, peer, true}, stream);
}
int ncclRecv(void* to, size_t count, int type, int peer, void* comm, void* stream) {
  return enqueue(comm, {kPointToPointCall, nullptr, to, count, type, 0, peer, false}, stream);
}
int ncclGroupStart() {
  ++group_depth;
  return kSuccess;
}
int ncclGroupEnd() {
  if (group_depth == 0) return kNcclInvalidUsage;
  if (--group_depth > 0 || group_calls.empty()) return kSuccess;
  run_on_stream(group_comm, std::move(group_calls), group_stream);
  group_calls.clear();
  return kSuccess;
}

}  // extern "C"
