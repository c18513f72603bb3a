// kernels.cc: unison's collectives as asynchronous TensorFlow op kernels.
//
// Inside a tf.function or a TF1 graph, each collective call is one node of
// an op below. Its kernel enqueues the node's tensors into the core through
// unison.h (all of them in one group, so a grouped op's members fuse) and
// returns: no TensorFlow thread is held while the ranks negotiate. The core
// calls back when each op completes (unison_on_done), on its engine's
// thread; the last callback hands the rest (copying results the core
// allocated, setting the status, done()) to TensorFlow's own worker pool,
// because done() may run the graph's next nodes inline, and those must not
// run on the thread that moves every rank's bytes.
//
// The library is built on the user's machine against the installed
// TensorFlow (unison.adapter_extension, tf_adapter/kernels.py) and links to
// nothing of unison's: the core's functions are handed to it once loaded
// (unison_tf_bind), as the cffi module already has them.
//
// What the kernels take from Python, fixed when the graph is traced: the
// core's name of each tensor ("" lets the core number it in the order the
// ops are enqueued, which chaining makes program order; tf_adapter/ops.py),
// the reduce op and factors, the process set, and awaited_by, the key by
// which the core's deadlock test finds the thread that waits for the graph.
// Every check that needs Python (names, ops, factors, shapes where tracing
// knows them) was made while tracing; the core checks the rest at enqueue.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "kernels_core.h"

namespace unison_tf {

using tensorflow::AsyncOpKernel;
using tensorflow::DataType;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::shape_inference::InferenceContext;

// The core's element type for a TensorFlow dtype; false where it has none
// (strings, resources, quantized types).
bool core_dtype(DataType type, int* code) {
  switch (type) {
    case tensorflow::DT_UINT8: *code = UNISON_UINT8; return true;
    case tensorflow::DT_INT8: *code = UNISON_INT8; return true;
    case tensorflow::DT_UINT16: *code = UNISON_UINT16; return true;
    case tensorflow::DT_INT16: *code = UNISON_INT16; return true;
    case tensorflow::DT_UINT32: *code = UNISON_UINT32; return true;
    case tensorflow::DT_INT32: *code = UNISON_INT32; return true;
    case tensorflow::DT_UINT64: *code = UNISON_UINT64; return true;
    case tensorflow::DT_INT64: *code = UNISON_INT64; return true;
    case tensorflow::DT_HALF: *code = UNISON_FLOAT16; return true;
    case tensorflow::DT_BFLOAT16: *code = UNISON_BFLOAT16; return true;
    case tensorflow::DT_FLOAT: *code = UNISON_FLOAT32; return true;
    case tensorflow::DT_DOUBLE: *code = UNISON_FLOAT64; return true;
    case tensorflow::DT_BOOL: *code = UNISON_BOOL; return true;
    case tensorflow::DT_COMPLEX64: *code = UNISON_COMPLEX64; return true;
    case tensorflow::DT_COMPLEX128: *code = UNISON_COMPLEX128; return true;
    default: return false;
  }
}

// What a kernel reads from its attrs; those an op does not have keep the
// core's defaults.
struct Common {
  std::vector<std::string> names;
  int process_set = UNISON_GLOBAL_PROCESS_SET;
  int64_t awaited_by = 0;
  int reduce_op = UNISON_SUM;
  double prescale = 1.0, postscale = 1.0;
  int root_rank = 0;

  explicit Common(OpKernelConstruction* c) {
    OP_REQUIRES_OK(c, c->GetAttr("names", &names));
    int64_t id = 0, key = 0;
    OP_REQUIRES_OK(c, c->GetAttr("process_set", &id));
    OP_REQUIRES_OK(c, c->GetAttr("awaited_by", &key));
    process_set = static_cast<int>(id);
    awaited_by = key;
    if (c->HasAttr("reduce_op")) {
      int64_t op = 0, pre = 0, post = 0;
      OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &op));
      OP_REQUIRES_OK(c, c->GetAttr("prescale_bits", &pre));
      OP_REQUIRES_OK(c, c->GetAttr("postscale_bits", &post));
      reduce_op = static_cast<int>(op);
      prescale = factor_of(pre);
      postscale = factor_of(post);
    }
    if (c->HasAttr("root_rank")) {
      int64_t root = 0;
      OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root));
      root_rank = static_cast<int>(root);
    }
  }
  const char* name(size_t i) const { return i < names.size() && !names[i].empty() ? names[i].c_str() : nullptr; }
};

// How long a kernel drives its ops itself before it hands them to the
// engine's thread and returns (Pending::start).
constexpr double kDriveSeconds = 0.002;

// One node's ops, from its enqueue to done().
class Pending {
 public:
  using Finish = std::function<absl::Status(Pending*)>;

  Pending(OpKernelContext* context, AsyncOpKernel::DoneCallback done, size_t ops)
      : context(context), handles(ops, 0), codes(ops, UNISON_OK), done_(std::move(done)), slots_(ops),
        remaining_(static_cast<int>(ops)) {
    for (size_t i = 0; i < ops; ++i) slots_[i] = {this, i};
  }

  // Starts the ops that enqueue_all() enqueues, as one group when there
  // are several; on a failure, none of them runs and the node fails.
  void start(const std::function<int(Pending*)>& enqueue_all, Finish finish) {
    finish_ = std::move(finish);
    if (!bound.load()) {  // loaded by hand, not through unison.tensorflow
      context->SetStatus(absl::FailedPreconditionError(
          "NotInitializedError: unison: the kernels are not bound to unison's core; import unison.tensorflow"));
      done_();
      delete this;
      return;
    }
    const bool grouped = handles.size() > 1;
    if (grouped) core.group_begin();
    const int code = enqueue_all(this);
    std::string message = code != UNISON_OK ? core.last_error() : "";
    if (grouped) core.group_end(code != UNISON_OK);
    if (code != UNISON_OK) {
      for (unison_handle h : handles)
        if (h != 0) core.release(h);
      context->SetStatus(as_tensorflow(code, message));
      done_();
      delete this;
      return;
    }
    // Drive the ops from here for a moment, as a waiting caller would
    // (engine_driver.cc): where every rank gets to the node at about the
    // same time, which is the usual case, the op is done before the
    // moment is up, and the node ends on this thread with no hand-off.
    // Handing a small op to the engine's thread and its completion back to
    // a TensorFlow worker costs each rank two thread wake-ups, several
    // hundred microseconds on a machine whose cores are all busy. Beyond
    // the moment the thread is given back, so no node holds one while it
    // waits for a late peer.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(kDriveSeconds);
    size_t finished = 0;
    for (; finished < handles.size(); ++finished) {
      const double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
      const int code = core.wait(handles[finished], left > 0 ? left : 0.0);
      if (code == UNISON_ERR_TIMEOUT) break;
      codes[finished] = code;
    }
    if (finished == handles.size()) {
      complete();
      return;
    }
    // The last callback may end the node, and delete it, before on_done
    // returns: nothing of it is read after that call.
    Slot* slots = slots_.data();
    const size_t n = slots_.size();
    for (size_t i = 0; i < n; ++i) {
      const unison_handle h = handles[i];
      const int code = core.on_done(h, &Pending::one_done, &slots[i]);
      if (code != UNISON_OK) one_done(&slots[i], h, code);
    }
  }

  OpKernelContext* const context;
  std::vector<unison_handle> handles;
  std::vector<int> codes;

 private:
  struct Slot {
    Pending* pending;
    size_t index;
  };

  // The core's callback, on whichever thread completed the op.
  static void one_done(void* arg, unison_handle, int status) {
    Slot* slot = static_cast<Slot*>(arg);
    Pending* p = slot->pending;
    p->codes[slot->index] = status;
    if (p->remaining_.fetch_sub(1) != 1) return;
    p->context->device()->tensorflow_cpu_worker_threads()->workers->Schedule([p] { p->complete(); });
  }

  void complete() {
    absl::Status status;
    for (size_t i = 0; i < handles.size() && status.ok(); ++i) {
      if (codes[i] == UNISON_OK) continue;
      char message[4096] = {0};
      core.handle_error(handles[i], message, sizeof message);
      status = as_tensorflow(codes[i], message);
    }
    if (status.ok()) status = finish_(this);
    for (unison_handle h : handles) core.release(h);
    if (!status.ok()) context->SetStatus(status);
    AsyncOpKernel::DoneCallback done = std::move(done_);
    delete this;
    done();
  }

  AsyncOpKernel::DoneCallback done_;
  Finish finish_;
  std::vector<Slot> slots_;
  std::atomic<int> remaining_;
};

// unison_op_options for one tensor: its dtype, shape and memory.
struct TensorOp {
  unison_op_options options{};
  std::vector<int64_t> shape;

  absl::Status describe(const Tensor& input, const char* name, int op, const Common& common) {
    int code;
    if (!core_dtype(input.dtype(), &code))
      return absl::InvalidArgumentError(std::string("InvalidArgumentError: unison: tensor ") +
                                        (name ? name : "(unnamed)") + " has dtype " +
                                        tensorflow::DataTypeString(input.dtype()) + ", which unison cannot move");
    if (input.dims() > UNISON_MAX_DIMS)
      return absl::InvalidArgumentError("InvalidArgumentError: unison: a tensor of " + std::to_string(input.dims()) +
                                        " dimensions; at most " + std::to_string(UNISON_MAX_DIMS) + " are supported");
    shape.resize(input.dims());
    for (int d = 0; d < input.dims(); ++d) shape[d] = input.dim_size(d);
    options.name = name;
    options.op = op;
    options.dtype = code;
    options.ndim = input.dims();
    options.shape = shape.data();
    options.input = input.tensor_data().data();
    options.process_set_id = common.process_set;
    options.device = UNISON_CPU_DEVICE;
    options.awaited_by = common.awaited_by;
    options.reduce_op = common.reduce_op;
    options.prescale_factor = common.prescale;
    options.postscale_factor = common.postscale;
    options.root_rank = common.root_rank;
    return absl::OkStatus();
  }
};

// Enqueues each of `ops` under the node's handles; the first failure's code.
int enqueue_each(std::vector<TensorOp>& ops, Pending* p) {
  for (size_t i = 0; i < ops.size(); ++i) {
    const int code = core.enqueue(&ops[i].options, &p->handles[i]);
    if (code != UNISON_OK) return code;
  }
  return UNISON_OK;
}

// Copies the result the core allocated for handle `h` into output `index`.
absl::Status copy_core_result(OpKernelContext* context, int index, unison_handle h) {
  void* data = nullptr;
  int64_t bytes = 0;
  int ndim = 0;
  int64_t dims[UNISON_MAX_DIMS];
  if (core.handle_result(h, 0, &data, &bytes, &ndim, dims) != UNISON_OK)
    return absl::InternalError(std::string("UnisonInternalError: ") + core.last_error());
  TensorShape shape;
  for (int d = 0; d < ndim; ++d) shape.AddDim(dims[d]);
  Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(context->allocate_output(index, shape, &out));
  if (static_cast<int64_t>(out->tensor_data().size()) != bytes)
    return absl::InternalError("UnisonInternalError: unison: the core's result has " + std::to_string(bytes) +
                               " bytes, its shape " + shape.DebugString() + " needs " +
                               std::to_string(out->tensor_data().size()));
  if (bytes > 0) std::memcpy(const_cast<char*>(out->tensor_data().data()), data, bytes);
  return absl::OkStatus();
}

// What every kernel is: asynchronous, and run where the graph's executor
// is, rather than handed to its thread pool as CPU kernels are by default.
// The kernel only enqueues and drives for a moment (Pending::start), and a
// hand-off to the pool would cost the wake-up that driving saves.
class CollectiveKernel : public AsyncOpKernel {
 public:
  explicit CollectiveKernel(OpKernelConstruction* c) : AsyncOpKernel(c), common_(c) {}
  bool IsExpensive() override { return false; }

 protected:
  Common common_;
};

// ---- allreduce, broadcast, allgather, reducescatter: a list of tensors -------

// Allreduce and broadcast write into the node's outputs, allocated before
// the enqueue (the input's own buffer where TensorFlow can forward it: the
// core works in place). Allgather's and reducescatter's sizes are known only
// after negotiation: the core allocates their results, copied out once.
class TensorsKernel : public CollectiveKernel {
 public:
  TensorsKernel(OpKernelConstruction* c, int op) : CollectiveKernel(c), op_(op) {}

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    const int n = context->num_inputs();
    const bool into_outputs = op_ == UNISON_ALLREDUCE || op_ == UNISON_BROADCAST;
    std::vector<TensorOp> ops(n);
    for (int i = 0; i < n; ++i) {
      const Tensor& input = context->input(i);
      OP_REQUIRES_OK_ASYNC(context, ops[i].describe(input, common_.name(i), op_, common_), done);
      if (into_outputs) {
        Tensor* output = nullptr;
        OP_REQUIRES_OK_ASYNC(context, context->forward_input_or_allocate_output({i}, i, input.shape(), &output),
                             done);
        ops[i].options.output = const_cast<char*>(output->tensor_data().data());
      }
    }
    auto* pending = new Pending(context, std::move(done), n);
    pending->start([&ops](Pending* p) { return enqueue_each(ops, p); }, [into_outputs](Pending* p) {
      for (size_t i = 0; i < p->handles.size() && !into_outputs; ++i)
        TF_RETURN_IF_ERROR(copy_core_result(p->context, static_cast<int>(i), p->handles[i]));
      return absl::OkStatus();
    });
  }

 private:
  int op_;
};

template <int kOp>
class KernelOf : public TensorsKernel {
 public:
  explicit KernelOf(OpKernelConstruction* c) : TensorsKernel(c, kOp) {}
};

// ---- alltoall: a tensor and its splits in; the rows and the received splits out

class AlltoallKernel : public CollectiveKernel {
 public:
  explicit AlltoallKernel(OpKernelConstruction* c) : CollectiveKernel(c) {}

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    const Tensor& splits = context->input(1);
    const int64_t ranks = splits.NumElements();
    std::vector<TensorOp> ops(1);
    OP_REQUIRES_OK_ASYNC(context, ops[0].describe(context->input(0), common_.name(0), UNISON_ALLTOALL, common_), done);
    ops[0].options.splits = splits.flat<int64_t>().data();   // alive until done(): an input
    ops[0].options.nsplits = static_cast<int>(ranks);
    auto* pending = new Pending(context, std::move(done), 1);
    pending->start([&ops](Pending* p) { return enqueue_each(ops, p); },
                   [ranks](Pending* p) {
                     TF_RETURN_IF_ERROR(copy_core_result(p->context, 0, p->handles[0]));
                     Tensor* received = nullptr;
                     TF_RETURN_IF_ERROR(p->context->allocate_output(1, TensorShape({ranks}), &received));
                     core.received_splits(p->handles[0], received->flat<int64_t>().data(), static_cast<int>(ranks));
                     return absl::OkStatus();
                   });
  }

};

// ---- barrier and join: no tensor; an int32 out ---------------------------------

class NoTensorKernel : public CollectiveKernel {
 public:
  NoTensorKernel(OpKernelConstruction* c, int op) : CollectiveKernel(c), op_(op) {}

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    auto* pending = new Pending(context, std::move(done), 1);
    const int op = op_;
    const Common& common = common_;
    pending->start(
        [op, &common](Pending* p) {
          unison_op_options o{};
          o.name = common.name(0);
          o.op = op;
          o.process_set_id = common.process_set;
          o.device = UNISON_CPU_DEVICE;
          o.awaited_by = common.awaited_by;
          return core.enqueue(&o, &p->handles[0]);
        },
        [op](Pending* p) {
          Tensor* out = nullptr;
          TF_RETURN_IF_ERROR(p->context->allocate_output(0, TensorShape({}), &out));
          int last = 0;
          if (op == UNISON_JOIN) core.join_rank(p->handles[0], &last);
          out->scalar<int32_t>()() = last;
          return absl::OkStatus();
        });
  }

 private:
  int op_;
};

class BarrierKernel : public NoTensorKernel {
 public:
  explicit BarrierKernel(OpKernelConstruction* c) : NoTensorKernel(c, UNISON_BARRIER) {}
};

class JoinKernel : public NoTensorKernel {
 public:
  explicit JoinKernel(OpKernelConstruction* c) : NoTensorKernel(c, UNISON_JOIN) {}
};

absl::Status same_shapes(InferenceContext* c) {
  for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
  return absl::OkStatus();
}

absl::Status unknown_rows(InferenceContext* c) {
  // The first dimension comes from negotiation; the rest are the input's.
  for (int i = 0; i < c->num_outputs(); ++i) {
    tensorflow::shape_inference::ShapeHandle in = c->input(i), out;
    if (c->RankKnown(in) && c->Rank(in) > 0) {
      TF_RETURN_IF_ERROR(c->ReplaceDim(in, 0, c->UnknownDim(), &out));
      c->set_output(i, out);
    } else {
      c->set_output(i, c->UnknownShape());
    }
  }
  return absl::OkStatus();
}

// Every op is stateful: it must run once per step, in its place, and never
// be merged with an identical-looking one, folded or pruned by Grappler.
#define UNISON_COMMON_ATTRS \
  Attr("process_set: int = 0").Attr("awaited_by: int = 0").SetIsStateful()

REGISTER_OP("UnisonAllreduce")
    .Input("tensors: T").Output("reduced: T")
    .Attr("T: list(type) >= 1").Attr("names: list(string)")
    .Attr("reduce_op: int").Attr("prescale_bits: int = 0").Attr("postscale_bits: int = 0")
    .UNISON_COMMON_ATTRS.SetShapeFn(same_shapes);
REGISTER_OP("UnisonBroadcast")
    .Input("tensors: T").Output("received: T")
    .Attr("T: list(type) >= 1").Attr("names: list(string)").Attr("root_rank: int")
    .UNISON_COMMON_ATTRS.SetShapeFn(same_shapes);
REGISTER_OP("UnisonAllgather")
    .Input("tensors: T").Output("gathered: T")
    .Attr("T: list(type) >= 1").Attr("names: list(string)")
    .UNISON_COMMON_ATTRS.SetShapeFn(unknown_rows);
REGISTER_OP("UnisonReducescatter")
    .Input("tensors: T").Output("scattered: T")
    .Attr("T: list(type) >= 1").Attr("names: list(string)")
    .Attr("reduce_op: int").Attr("prescale_bits: int = 0").Attr("postscale_bits: int = 0")
    .UNISON_COMMON_ATTRS.SetShapeFn(unknown_rows);
REGISTER_OP("UnisonAlltoall")
    .Input("tensor: T").Input("splits: int64").Output("received: T").Output("received_splits: int64")
    .Attr("T: type").Attr("names: list(string)")
    .UNISON_COMMON_ATTRS.SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(unknown_rows(c));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return absl::OkStatus();
    });
REGISTER_OP("UnisonBarrier").Output("done: int32").Attr("names: list(string) = []")
    .UNISON_COMMON_ATTRS.SetShapeFn(tensorflow::shape_inference::ScalarShape);
REGISTER_OP("UnisonJoin").Output("last_rank: int32").Attr("names: list(string) = []")
    .UNISON_COMMON_ATTRS.SetShapeFn(tensorflow::shape_inference::ScalarShape);

REGISTER_KERNEL_BUILDER(Name("UnisonAllreduce").Device(tensorflow::DEVICE_CPU), KernelOf<UNISON_ALLREDUCE>);
REGISTER_KERNEL_BUILDER(Name("UnisonBroadcast").Device(tensorflow::DEVICE_CPU), KernelOf<UNISON_BROADCAST>);
REGISTER_KERNEL_BUILDER(Name("UnisonAllgather").Device(tensorflow::DEVICE_CPU), KernelOf<UNISON_ALLGATHER>);
REGISTER_KERNEL_BUILDER(Name("UnisonReducescatter").Device(tensorflow::DEVICE_CPU), KernelOf<UNISON_REDUCESCATTER>);
REGISTER_KERNEL_BUILDER(Name("UnisonAlltoall").Device(tensorflow::DEVICE_CPU), AlltoallKernel);
REGISTER_KERNEL_BUILDER(Name("UnisonBarrier").Device(tensorflow::DEVICE_CPU), BarrierKernel);
REGISTER_KERNEL_BUILDER(Name("UnisonJoin").Device(tensorflow::DEVICE_CPU), JoinKernel);

}  // namespace unison_tf

// The core's functions, by the addresses the cffi module has (in the order
// tf_adapter/kernels.py lists them). Called once, before any graph runs.
extern "C" __attribute__((visibility("default"))) int unison_tf_bind(const uintptr_t* functions, int count) {
  return unison_tf::bind_core(functions, count);
}
