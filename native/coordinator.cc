#include "coordinator.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>

#include "dtype.h"

namespace unison {
namespace {

// "rank 0 float32, rank 1 int32": each rank's value of one field, by
// global rank.
std::string per_rank(const std::vector<const Request*>& requests, const std::vector<int>& names,
                     const std::function<std::string(const Request&)>& field) {
  std::string out;
  for (const Request* r : requests) {
    if (!out.empty()) out += ", ";
    out += "rank " + std::to_string(names.empty() ? r->rank : names[r->rank]) + " " + field(*r);
  }
  return out;
}

std::string number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

std::vector<int64_t> tail(const std::vector<int64_t>& shape) {
  return shape.empty() ? shape : std::vector<int64_t>(shape.begin() + 1, shape.end());
}

}  // namespace

void Coordinator::set_rank_names(const std::vector<int>& global_ranks, int process_set_id) {
  rank_names_ = global_ranks;
  set_label_ = process_set_id == 0 ? "" : " (process set " + std::to_string(process_set_id) + ")";
}

bool Coordinator::complete(const Pending& p) const {
  for (int r = 0; r < size_; ++r)
    if (!p.submitted[r] && !joined_[r]) return false;
  return true;
}

void Coordinator::add(const Request& request, double now) {
  if (request.op == UNISON_JOIN) {
    if (!joined_[request.rank]) {
      joined_[request.rank] = true;
      ++joined_count_;
    }
    last_joined_ = request.rank;
    // Tensors that waited only for the ranks now joined can run.
    std::vector<std::string> names = arrival_order_;
    for (const std::string& name : names)
      if (complete(table_[name])) finish(name);
    if (joined_count_ == size_) {
      Response r;
      r.op = UNISON_JOIN;
      r.last_joined_rank = last_joined_;
      r.cacheable = false;
      r.tensors.push_back(TensorPlan{request.name, {}, {}, {}});
      ready_.push_back(r);
      joined_.assign(size_, false);
      joined_count_ = 0;
    }
    return;
  }
  auto [it, inserted] = table_.try_emplace(request.name);
  Pending& p = it->second;
  if (inserted) {
    p.requests.resize(size_);
    p.submitted.assign(size_, false);
    p.since = now;
    arrival_order_.push_back(request.name);
  }
  if (!p.submitted[request.rank]) {
    p.submitted[request.rank] = true;
    ++p.count;
  }
  p.requests[request.rank] = request;
  if (complete(p)) finish(request.name);
}

void Coordinator::finish(const std::string& name) {
  ready_.push_back(build(table_[name]));
  table_.erase(name);
  arrival_order_.erase(std::find(arrival_order_.begin(), arrival_order_.end(), name));
}

Status well_formed(const Request& r, int size) {
  auto refuse = [&](const std::string& why) {
    return Status::Error(UNISON_ERR_INTERNAL, std::string(op_name(r.op)) + " '" + r.name + "': " + why);
  };
  if (r.op < UNISON_ALLREDUCE || r.op > UNISON_REMOVE_PROCESS_SET) return refuse("operation " + std::to_string(r.op));
  if (r.op != UNISON_BARRIER && r.op != UNISON_JOIN && r.op != UNISON_ADD_PROCESS_SET &&
      r.op != UNISON_REMOVE_PROCESS_SET && dtype_size(r.dtype) == 0)
    return refuse("dtype " + std::to_string(r.dtype));
  for (int64_t d : r.shape)
    if (d < 0) return refuse("shape " + shape_string(r.shape));
  if (r.op == UNISON_BROADCAST && (r.root < 0 || r.root >= size)) return refuse("root " + std::to_string(r.root));
  const int64_t rows = r.shape.empty() ? 0 : r.shape[0];
  const bool splits_rows = r.op == UNISON_ALLTOALL || (r.op == UNISON_REDUCESCATTER && !r.splits.empty());
  if (splits_rows) {
    int64_t sum = 0;
    bool wraps = r.splits.size() != (size_t)size;
    for (int64_t split : r.splits) wraps |= split < 0 || __builtin_add_overflow(sum, split, &sum);
    if (wraps || sum != rows) return refuse("splits " + shape_string(r.splits) + " for shape " + shape_string(r.shape));
  }
  return Status::OK();
}

Response Coordinator::build(const Pending& p) const {
  std::vector<const Request*> present;
  for (int r = 0; r < size_; ++r)
    if (p.submitted[r]) present.push_back(&p.requests[r]);
  const Request& first = *present[0];

  Response response;
  response.op = first.op;
  response.dtype = first.dtype;
  response.reduce_op = first.reduce_op;
  response.prescale = first.prescale;
  response.postscale = first.postscale;
  response.root = first.root;
  response.device = first.device;
  response.cacheable = joined_count_ == 0;
  TensorPlan plan;
  plan.name = first.name;
  plan.shape = first.shape;

  auto fail = [&](const std::string& what, const std::function<std::string(const Request&)>& field) {
    response.error_code = UNISON_ERR_MISMATCH;
    response.error = std::string("unison: ") + op_name(first.op) + " '" + first.name + "'" + set_label_ +
                     ": ranks disagree on " + what + ": " + per_rank(present, rank_names_, field);
    response.tensors.assign(1, plan);
    return response;
  };
  auto differs = [&](const std::function<bool(const Request&)>& same) {
    for (const Request* r : present)
      if (!same(*r)) return true;
    return false;
  };

  // As Horovod: while a rank waits in join() only allreduce can go on, the
  // joined ranks adding zeros. Every other collective would need data those
  // ranks no longer have (an allgather's rows, a broadcast's root), so it
  // fails on every rank that called it, and they stay in step.
  if (joined_count_ > 0 && first.op != UNISON_ALLREDUCE && first.op != UNISON_BARRIER) {
    std::string joined;
    for (int r = 0; r < size_; ++r)
      if (joined_[r]) joined += (joined.empty() ? "" : ", ") + std::to_string(rank_names_.empty() ? r : rank_names_[r]);
    response.error_code = UNISON_ERR_MISMATCH;
    response.error = std::string("unison: ") + op_name(first.op) + " '" + first.name + "': rank" +
                     (joined_count_ > 1 ? "s " : " ") + joined + (joined_count_ > 1 ? " have" : " has") +
                     " joined; while a rank has joined only allreduce can run (call join() on every rank first)";
    response.tensors.assign(1, plan);
    return response;
  }
  if (differs([&](const Request& r) { return r.op == first.op; }))
    return fail("the operation", [](const Request& r) { return std::string(op_name(r.op)); });
  // Adding a set carries its ranks as splits, removing one its id as root.
  if (first.op == UNISON_ADD_PROCESS_SET) {
    if (differs([&](const Request& r) { return r.splits == first.splits; }))
      return fail("the new process set's ranks", [](const Request& r) { return shape_string(r.splits); });
    plan.splits = first.splits;
  }
  if (first.op == UNISON_REMOVE_PROCESS_SET && differs([&](const Request& r) { return r.root == first.root; }))
    return fail("the process set to remove", [](const Request& r) { return std::to_string(r.root); });
  if (differs([&](const Request& r) { return r.dtype == first.dtype; }))
    return fail("dtype", [](const Request& r) { return std::string(dtype_name(r.dtype)); });
  if (differs([&](const Request& r) { return r.device == first.device; }))
    return fail("device", [](const Request& r) { return std::string(r.device == UNISON_CPU_DEVICE ? "CPU" : "GPU"); });
  const bool reduces = first.op == UNISON_ALLREDUCE || first.op == UNISON_REDUCESCATTER;
  if (reduces) {
    if (differs([&](const Request& r) { return r.reduce_op == first.reduce_op; }))
      return fail("the reduce op", [](const Request& r) { return std::string(reduce_op_name(r.reduce_op)); });
    if (differs([&](const Request& r) { return r.prescale == first.prescale; }))
      return fail("prescale_factor", [](const Request& r) { return number(r.prescale); });
    if (differs([&](const Request& r) { return r.postscale == first.postscale; }))
      return fail("postscale_factor", [](const Request& r) { return number(r.postscale); });
  }
  if (first.op == UNISON_BROADCAST) {
    // Roots travel as set ranks; the message names them as the caller did.
    const std::vector<int>& names = rank_names_;
    if (differs([&](const Request& r) { return r.root == first.root; }))
      return fail("the root rank", [&names](const Request& r) {
        return std::to_string(names.empty() ? r.root : names[r.root]);
      });
  }
  const bool ragged = first.op == UNISON_ALLGATHER || first.op == UNISON_ALLTOALL;
  auto shape_text = [](const Request& r) { return shape_string(r.shape); };
  if (ragged) {
    if (differs([&](const Request& r) { return r.shape.size() == first.shape.size() && tail(r.shape) == tail(first.shape); }))
      return fail("shape (all but the first dimension must match)", shape_text);
    plan.first_dims.assign(size_, 0);
    for (const Request* r : present) plan.first_dims[r->rank] = r->shape.empty() ? 0 : r->shape[0];
    // What any rank will receive must be a byte count that does not wrap:
    // every rank's rows (allgather), or every sender's rows to one rank
    // (alltoall), times the bytes of a row.
    const size_t row = row_bytes(first.shape, first.dtype);
    bool wraps = row == SIZE_MAX;
    for (int receiver = 0; receiver < size_ && !wraps; ++receiver) {
      size_t bytes = 0, part = 0;
      for (const Request* r : present) {
        const int64_t rows = first.op == UNISON_ALLGATHER ? (r->shape.empty() ? 0 : r->shape[0]) : r->splits[receiver];
        wraps |= __builtin_mul_overflow((size_t)rows, row, &part) || __builtin_add_overflow(bytes, part, &bytes);
      }
      if (first.op == UNISON_ALLGATHER) break;  // every rank receives the same
    }
    if (wraps) {
      response.error_code = UNISON_ERR_INVALID_ARGUMENT;
      response.error = std::string("unison: ") + op_name(first.op) + " '" + first.name + "'" + set_label_ +
                       ": what a rank would receive is more bytes than memory can address: " +
                       per_rank(present, rank_names_, shape_text);
      response.tensors.assign(1, plan);
      return response;
    }
    if (first.op == UNISON_ALLTOALL) {
      plan.splits.assign((size_t)size_ * size_, 0);
      for (const Request* r : present)
        std::copy(r->splits.begin(), r->splits.end(), plan.splits.begin() + (size_t)r->rank * size_);
    }
  } else if (first.op != UNISON_BARRIER) {
    if (differs([&](const Request& r) { return r.shape == first.shape; }))
      return fail("shape", shape_text);
  }
  if (first.op == UNISON_REDUCESCATTER) {
    if (differs([&](const Request& r) { return r.splits == first.splits; }))
      return fail("splits (the rows each rank receives)", [](const Request& r) { return shape_string(r.splits); });
    plan.splits = first.splits;
  }
  if (reduces) {
    // A joined rank adds zeros too: it has no tensor of its own either.
    bool any_placeholder = false, all_placeholders = true;
    for (const Request* r : present) {
      any_placeholder |= r->placeholder;
      all_placeholders &= r->placeholder;
    }
    response.unused_everywhere = all_placeholders;
    // The next step's placeholders may differ; a response with any is
    // negotiated afresh each time rather than remembered.
    if (any_placeholder) response.cacheable = false;
  }
  response.tensors.push_back(plan);
  return response;
}

std::vector<Response> Coordinator::take_ready(size_t budget_bytes, bool* more) {
  std::vector<Response> out;
  size_t used = 0;
  while (!ready_.empty()) {
    size_t bytes = encoded_size(ready_.front());
    if (!out.empty() && used + bytes > budget_bytes) break;
    used += bytes;
    out.push_back(std::move(ready_.front()));
    ready_.pop_front();
  }
  *more = !ready_.empty();
  return out;
}

std::vector<Waiting> Coordinator::waiting() const {
  std::vector<Waiting> out;
  for (const std::string& name : arrival_order_) {
    const Pending& p = table_.at(name);
    int op = 0;
    for (int r = 0; r < size_; ++r)
      if (p.submitted[r]) op = p.requests[r].op;
    out.push_back(Waiting{name, op, p.submitted, p.since});
  }
  return out;
}

double Coordinator::oldest_since() const {
  return arrival_order_.empty() ? std::numeric_limits<double>::infinity() : table_.at(arrival_order_.front()).since;
}

void Coordinator::fail(const std::string& name, int code, const std::string& message) {
  auto it = table_.find(name);
  if (it == table_.end()) return;
  ready_.push_back(error_response(name, code, message));
  table_.erase(it);
  arrival_order_.erase(std::find(arrival_order_.begin(), arrival_order_.end(), name));
}

}  // namespace unison
