#include "message.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dtype.h"

namespace unison {
namespace {

class Writer {
 public:
  explicit Writer(std::string* out) : out_(out) {}
  template <typename T>
  void put(T v) { out_->append(reinterpret_cast<const char*>(&v), sizeof(T)); }
  void put_string(const std::string& s) {
    put<uint32_t>((uint32_t)s.size());
    out_->append(s);
  }
  template <typename T>
  void put_vector(const std::vector<T>& v) {
    put<uint32_t>((uint32_t)v.size());
    out_->append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }

 private:
  std::string* out_;
};

// The fewest bytes each encodes to: its fixed fields and empty strings and
// vectors (put_request, put_response).
constexpr size_t kLeastRequestBytes = 53, kLeastResponseBytes = 53, kLeastTensorPlanBytes = 16;

// Reads what Writer wrote; every read is bounds-checked so that a corrupt
// message is an error, not a crash.
class Reader {
 public:
  explicit Reader(const std::string& in) : data_(in.data()), left_(in.size()) {}
  template <typename T>
  bool get(T* v) {
    if (left_ < sizeof(T)) return fail();
    std::memcpy(v, data_, sizeof(T));
    advance(sizeof(T));
    return true;
  }
  bool get_string(std::string* s) {
    uint32_t n;
    if (!get(&n) || left_ < n) return fail();
    s->assign(data_, n);
    advance(n);
    return true;
  }
  template <typename T>
  bool get_vector(std::vector<T>* v) {
    uint32_t n;
    if (!get(&n) || left_ / sizeof(T) < n) return fail();
    v->resize(n);
    if (n > 0) std::memcpy(v->data(), data_, n * sizeof(T));  // an empty vector's data() may be null
    advance(n * sizeof(T));
    return true;
  }
  // A count of things that each take at least `least_bytes` of what is
  // left: a peer's count is believed only that far, so that a corrupt one
  // cannot make a reader allocate more than the message could describe.
  bool get_count(uint32_t* n, size_t least_bytes) {
    if (!get(n) || left_ / least_bytes < *n) return fail();
    return true;
  }
  bool ok() const { return ok_; }

 private:
  bool fail() { ok_ = false; return false; }
  void advance(size_t n) { data_ += n; left_ -= n; }
  const char* data_;
  size_t left_;
  bool ok_ = true;
};

void put_request(Writer& w, const Request& r) {
  w.put<int32_t>(r.rank);
  w.put<int32_t>(r.op);
  w.put_string(r.name);
  w.put<int32_t>(r.dtype);
  w.put_vector(r.shape);
  w.put<int32_t>(r.reduce_op);
  w.put<double>(r.prescale);
  w.put<double>(r.postscale);
  w.put<int32_t>(r.root);
  w.put_vector(r.splits);
  w.put<int32_t>(r.device);
  w.put<uint8_t>(r.placeholder ? 1 : 0);
}

bool get_request(Reader& rd, Request* r) {
  int32_t rank = 0, op = 0, dtype = 0, reduce_op = 0, root = 0, device = 0;
  uint8_t placeholder = 0;
  bool ok = rd.get(&rank) && rd.get(&op) && rd.get_string(&r->name) && rd.get(&dtype) &&
            rd.get_vector(&r->shape) && rd.get(&reduce_op) && rd.get(&r->prescale) &&
            rd.get(&r->postscale) && rd.get(&root) && rd.get_vector(&r->splits) && rd.get(&device) &&
            rd.get(&placeholder);
  r->rank = rank; r->op = op; r->dtype = dtype; r->reduce_op = reduce_op; r->root = root;
  r->device = device; r->placeholder = placeholder != 0;
  return ok;
}

void put_response(Writer& w, const Response& r) {
  w.put<int32_t>(r.op);
  w.put<int32_t>(r.dtype);
  w.put<int32_t>(r.reduce_op);
  w.put<double>(r.prescale);
  w.put<double>(r.postscale);
  w.put<int32_t>(r.root);
  w.put<int32_t>(r.device);
  w.put<int32_t>(r.error_code);
  w.put_string(r.error);
  w.put<int32_t>(r.last_joined_rank);
  w.put<uint8_t>((r.cacheable ? 1 : 0) | (r.unused_everywhere ? 2 : 0));
  w.put<uint32_t>((uint32_t)r.tensors.size());
  for (const TensorPlan& t : r.tensors) {
    w.put_string(t.name);
    w.put_vector(t.shape);
    w.put_vector(t.first_dims);
    w.put_vector(t.splits);
  }
}

bool get_response(Reader& rd, Response* r) {
  int32_t op = 0, dtype = 0, reduce_op = 0, root = 0, device = 0, error_code = 0, last = 0;
  uint8_t flags = 0;
  uint32_t n;
  if (!(rd.get(&op) && rd.get(&dtype) && rd.get(&reduce_op) && rd.get(&r->prescale) &&
        rd.get(&r->postscale) && rd.get(&root) && rd.get(&device) && rd.get(&error_code) &&
        rd.get_string(&r->error) && rd.get(&last) && rd.get(&flags) && rd.get_count(&n, kLeastTensorPlanBytes)))
    return false;
  r->op = op; r->dtype = dtype; r->reduce_op = reduce_op; r->root = root; r->device = device;
  r->error_code = error_code; r->last_joined_rank = last;
  r->cacheable = (flags & 1) != 0;
  r->unused_everywhere = (flags & 2) != 0;
  r->tensors.resize(n);
  for (TensorPlan& t : r->tensors) {
    if (!(rd.get_string(&t.name) && rd.get_vector(&t.shape) && rd.get_vector(&t.first_dims) &&
          rd.get_vector(&t.splits)))
      return false;
  }
  return true;
}

Status corrupt(const char* what) {
  return Status::Error(UNISON_ERR_INTERNAL, std::string("unison: received a corrupt ") + what);
}

}  // namespace

std::string encode(const CycleMessage& m) {
  std::string out;
  Writer w(&out);
  w.put<uint32_t>(m.flags);
  w.put_vector(m.ready_bits);
  w.put_vector(m.invalid_bits);
  w.put_vector(m.busy_sets);
  w.put<uint32_t>((uint32_t)m.requests.size());
  for (const Request& r : m.requests) put_request(w, r);
  if (m.flags & CycleMessage::kTuning) {
    w.put<uint64_t>(m.tuned_fusion_threshold);
    w.put<double>(m.tuned_cycle_time_ms);
    w.put<uint8_t>(m.tuned_cache);
    w.put<uint8_t>(m.tuned_hierarchical);
    w.put<uint8_t>(m.tuned_settled);
  }
  return out;
}

Status decode(const std::string& bytes, CycleMessage* m) {
  Reader rd(bytes);
  uint32_t n = 0;
  if (!(rd.get(&m->flags) && rd.get_vector(&m->ready_bits) && rd.get_vector(&m->invalid_bits) &&
        rd.get_vector(&m->busy_sets) && rd.get_count(&n, kLeastRequestBytes)))
    return corrupt("cycle message");
  m->requests.resize(n);
  for (Request& r : m->requests)
    if (!get_request(rd, &r)) return corrupt("request");
  if ((m->flags & CycleMessage::kTuning) &&
      !(rd.get(&m->tuned_fusion_threshold) && rd.get(&m->tuned_cycle_time_ms) && rd.get(&m->tuned_cache) &&
        rd.get(&m->tuned_hierarchical) && rd.get(&m->tuned_settled)))
    return corrupt("tuning");
  return Status::OK();
}

std::string encode(const ResponseList& m) {
  std::string out;
  Writer w(&out);
  w.put<uint8_t>(m.more_ready ? 1 : 0);
  w.put<uint32_t>((uint32_t)m.responses.size());
  for (const Response& r : m.responses) put_response(w, r);
  return out;
}

Status decode(const std::string& bytes, ResponseList* m) {
  Reader rd(bytes);
  uint8_t more = 0;
  uint32_t n = 0;
  if (!(rd.get(&more) && rd.get_count(&n, kLeastResponseBytes))) return corrupt("response list");
  m->more_ready = more != 0;
  m->responses.resize(n);
  for (Response& r : m->responses)
    if (!get_response(rd, &r)) return corrupt("response");
  return Status::OK();
}

size_t encoded_size(const Request& r) {
  std::string out;
  Writer w(&out);
  put_request(w, r);
  return out.size();
}

size_t encoded_size(const Response& r) {
  std::string out;
  Writer w(&out);
  put_response(w, r);
  return out.size();
}

Response error_response(const std::string& name, int code, const std::string& message) {
  Response r;
  r.error_code = code;
  r.error = message;
  r.cacheable = false;
  r.tensors.push_back(TensorPlan{name, {}, {}, {}});
  return r;
}

int64_t element_count(const std::vector<int64_t>& shape) {
  // A count past int64_t saturates, rather than wrapping to a small one
  // that every size check downstream would let through.
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t n = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n)) return INT64_MAX;
  return n;
}

size_t row_bytes(const std::vector<int64_t>& shape, int dtype) {
  // Saturates as element_count does: a row too large for memory is then
  // refused by size, never taken for a small one.
  if (shape.size() > 1 && std::find(shape.begin() + 1, shape.end(), 0) != shape.end()) return 0;
  int64_t n = 1;
  for (size_t d = 1; d < shape.size(); ++d)
    if (shape[d] < 0 || __builtin_mul_overflow(n, shape[d], &n)) return SIZE_MAX;
  size_t bytes = 0;
  return __builtin_mul_overflow((size_t)n, (size_t)dtype_size(dtype), &bytes) ? SIZE_MAX : bytes;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace unison
