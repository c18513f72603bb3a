// kernels_xla.cc: allreduce and grouped allreduce inside functions that
// XLA compiles (tf.function(jit_compile=True), Keras's jit_compile=True).
//
// XLA compiles a function's TensorFlow ops into one program, so the op
// kernels of kernels.cc never run there: each op needs a lowering, which
// XLA asks of its XlaOpKernel while compiling. UnisonAllreduce lowers to
// one custom call, "unison_allreduce", whose handler XLA calls when the
// program runs, with the inputs' and outputs' buffers. The handler
// enqueues every tensor of the node into the core as one group (so a
// grouped allreduce fuses, as it does outside XLA) and waits for them.
//
// Why it waits: XLA's programs run to the end on the calling thread; a
// handler that returned before its outputs were written would hand XLA
// unwritten buffers. The thread that waits is the one that called the
// compiled function, which waits for its results anyway.
//
// Why only on the CPU: XLA:GPU runs a custom call on a CUDA stream, which
// needs the core's CUDA path and a handler registered for the "CUDA"
// platform, and this is built and tested on machines without a GPU
// (tf_adapter/README.md). XLA:CPU runs only custom calls written against
// its typed FFI (xla/ffi/api/ffi.h); the older status-returning form is
// refused when the program is compiled.
//
// The node's attributes travel in the custom call's backend_config, an
// MLIR dictionary XLA decodes for the handler. Names are hex-encoded
// there: a tensor's name may hold any character, and hex needs no quoting.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kernels_core.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/core/framework/kernel_def_builder.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "xla/ffi/api/ffi.h"
#include "xla/hlo/builder/xla_builder.h"

// The FFI API of the XLA inside TensorFlow's own library
// (libtensorflow_cc.so.2), where XLA:CPU looks handlers up. Its header is
// not in the wheel; the function is.
namespace xla::ffi {
const XLA_FFI_Api* GetXlaFfiApi();
}

namespace unison_tf {
namespace {

namespace ffi = xla::ffi;

constexpr char kTarget[] = "unison_allreduce";

std::string to_hex(const std::string& bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// The names the XlaOpKernel joined with '\0' and hex-encoded; false where
// the text is not what it wrote.
bool names_of(std::string_view hex, std::vector<std::string>* names) {
  if (hex.size() % 2 != 0) return false;
  std::string joined;
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int high = hex_digit(hex[i]), low = hex_digit(hex[i + 1]);
    if (high < 0 || low < 0) return false;
    joined += static_cast<char>(high * 16 + low);
  }
  size_t start = 0;
  for (size_t i = 0; i <= joined.size(); ++i) {
    if (i == joined.size() || joined[i] == '\0') {
      names->push_back(joined.substr(start, i - start));
      start = i + 1;
    }
  }
  return true;
}

// The core's element type for one of XLA's; false where it has none (the
// op's own type list keeps those out while tracing: this is a guard).
bool core_dtype(ffi::DataType type, int* code) {
  switch (type) {
    case ffi::DataType::U8: *code = UNISON_UINT8; return true;
    case ffi::DataType::S8: *code = UNISON_INT8; return true;
    case ffi::DataType::U16: *code = UNISON_UINT16; return true;
    case ffi::DataType::S16: *code = UNISON_INT16; return true;
    case ffi::DataType::U32: *code = UNISON_UINT32; return true;
    case ffi::DataType::S32: *code = UNISON_INT32; return true;
    case ffi::DataType::U64: *code = UNISON_UINT64; return true;
    case ffi::DataType::S64: *code = UNISON_INT64; return true;
    case ffi::DataType::F16: *code = UNISON_FLOAT16; return true;
    case ffi::DataType::BF16: *code = UNISON_BFLOAT16; return true;
    case ffi::DataType::F32: *code = UNISON_FLOAT32; return true;
    case ffi::DataType::F64: *code = UNISON_FLOAT64; return true;
    case ffi::DataType::PRED: *code = UNISON_BOOL; return true;
    case ffi::DataType::C64: *code = UNISON_COMPLEX64; return true;
    case ffi::DataType::C128: *code = UNISON_COMPLEX128; return true;
    default: return false;
  }
}

// A status as the FFI's error: XLA hands its code and message back to
// TensorFlow, so Python sees the same class as outside XLA
// (FailedPreconditionError "MismatchError: ...", as_tensorflow).
ffi::Error as_ffi(const absl::Status& status) {
  return ffi::Error(static_cast<ffi::ErrorCode>(status.code()), std::string(status.message()));
}

ffi::Error allreduce(ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view names_hex, int64_t reduce_op,
                     int64_t prescale_bits, int64_t postscale_bits, int64_t process_set) {
  if (!bound.load()) return as_ffi(as_tensorflow(UNISON_ERR_NOT_INITIALIZED, "unison: the XLA lowering is not bound"));
  std::vector<std::string> names;
  if (!names_of(names_hex, &names) || args.size() != rets.size() || names.size() != args.size())
    return as_ffi(as_tensorflow(UNISON_ERR_INVALID_ARGUMENT, "unison: a unison_allreduce custom call this library "
                                                             "did not write (its names or tensors do not agree)"));
  const size_t n = args.size();
  std::vector<unison_op_options> ops(n);
  std::vector<std::vector<int64_t>> shapes(n);
  for (size_t i = 0; i < n; ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    int dtype = 0;
    if (!core_dtype(in->element_type(), &dtype))
      return as_ffi(as_tensorflow(UNISON_ERR_INVALID_ARGUMENT,
                                  "unison: allreduce '" + names[i] + "': a dtype unison does not reduce"));
    auto dims = in->dimensions();
    shapes[i].assign(dims.begin(), dims.end());
    unison_op_options& o = ops[i];
    o.name = names[i].empty() ? nullptr : names[i].c_str();
    o.op = UNISON_ALLREDUCE;
    o.dtype = dtype;
    o.ndim = static_cast<int>(shapes[i].size());
    o.shape = shapes[i].data();
    o.input = in->untyped_data();
    o.output = (*out)->untyped_data();
    o.process_set_id = static_cast<int>(process_set);
    o.device = UNISON_CPU_DEVICE;
    o.reduce_op = static_cast<int>(reduce_op);
    o.prescale_factor = factor_of(prescale_bits);
    o.postscale_factor = factor_of(postscale_bits);
  }
  std::vector<unison_handle> handles(n, 0);
  const bool grouped = n > 1;
  if (grouped) core.group_begin();
  int code = UNISON_OK;
  for (size_t i = 0; i < n && code == UNISON_OK; ++i) code = core.enqueue(&ops[i], &handles[i]);
  const std::string refused = code != UNISON_OK ? core.last_error() : "";
  if (grouped) core.group_end(code != UNISON_OK);
  if (code != UNISON_OK) {
    for (unison_handle h : handles)
      if (h != 0) core.release(h);
    return as_ffi(as_tensorflow(code, refused));
  }
  // Every handle is waited for, even after one failed, so that none is
  // released while the core still writes its output.
  absl::Status status;
  for (size_t i = 0; i < n; ++i) {
    const int done = core.wait(handles[i], -1.0);
    if (done != UNISON_OK && status.ok()) {
      char text[4096] = {0};
      core.handle_error(handles[i], text, sizeof text);
      status = as_tensorflow(done, text);
    }
  }
  for (unison_handle h : handles) core.release(h);
  return status.ok() ? ffi::Error::Success() : as_ffi(status);
}

XLA_FFI_DEFINE_HANDLER(allreduce_handler, allreduce,
                       ffi::Ffi::Bind()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attr<std::string_view>("names")
                           .Attr<int64_t>("reduce_op")
                           .Attr<int64_t>("prescale_bits")
                           .Attr<int64_t>("postscale_bits")
                           .Attr<int64_t>("process_set"));

XLA_FFI_REGISTER_HANDLER(xla::ffi::GetXlaFfiApi(), kTarget, "Host", allreduce_handler);

// UnisonAllreduce's lowering: one custom call taking every tensor of the
// node and returning a tuple of the reduced ones. It has a side effect
// (the other ranks wait for it), so XLA neither drops nor merges it.
class AllreduceLowering : public tensorflow::XlaOpKernel {
 public:
  explicit AllreduceLowering(tensorflow::OpKernelConstruction* c) : XlaOpKernel(c) {
    std::vector<std::string> names;
    int64_t reduce_op = 0, prescale = 0, postscale = 0, process_set = 0;
    OP_REQUIRES_OK(c, c->GetAttr("names", &names));
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &reduce_op));
    OP_REQUIRES_OK(c, c->GetAttr("prescale_bits", &prescale));
    OP_REQUIRES_OK(c, c->GetAttr("postscale_bits", &postscale));
    OP_REQUIRES_OK(c, c->GetAttr("process_set", &process_set));
    std::string joined;
    for (size_t i = 0; i < names.size(); ++i) {
      if (i > 0) joined += '\0';
      joined += names[i];
    }
    config_ = "{names = \"" + to_hex(joined) + "\", reduce_op = " + std::to_string(reduce_op) +
              " : i64, prescale_bits = " + std::to_string(prescale) + " : i64, postscale_bits = " +
              std::to_string(postscale) + " : i64, process_set = " + std::to_string(process_set) + " : i64}";
  }

  void Compile(tensorflow::XlaOpKernelContext* ctx) override {
    std::vector<xla::XlaOp> inputs;
    std::vector<xla::Shape> shapes;
    for (int i = 0; i < ctx->num_inputs(); ++i) {
      auto shape = ctx->InputXlaShape(i);
      OP_REQUIRES_OK(ctx, shape.status());
      inputs.push_back(ctx->Input(i));
      shapes.push_back(*shape);
    }
    xla::XlaOp call = xla::CustomCall(ctx->builder(), kTarget, inputs, xla::ShapeUtil::MakeTupleShape(shapes), config_,
                                      /*has_side_effect=*/true, /*output_operand_aliasing=*/{}, /*literal=*/nullptr,
                                      xla::CustomCallSchedule::SCHEDULE_NONE,
                                      xla::CustomCallApiVersion::API_VERSION_TYPED_FFI);
    for (int i = 0; i < ctx->num_inputs(); ++i) ctx->SetOutput(i, xla::GetTupleElement(call, i));
  }

 private:
  std::string config_;
};

REGISTER_XLA_OP(Name("UnisonAllreduce"), AllreduceLowering);

tensorflow::OpKernel* make_lowering(tensorflow::OpKernelConstruction* c) { return new AllreduceLowering(c); }

// Read from TensorFlow's listing in words: its KernelList is a protocol
// buffer, whose inline code from the wheel's headers need not match the
// protobuf TensorFlow was built with.
bool has_jit_kernel() {
  return tensorflow::KernelsRegisteredForOp("UnisonAllreduce").find(std::string("device='") +
                                                                    tensorflow::DEVICE_CPU_XLA_JIT + "'") !=
         std::string::npos;
}

// XLA finds an op's lowering as a TensorFlow kernel for its compilation
// device (XLA_CPU_JIT), which it makes once for every REGISTER_XLA_OP it
// knows, when TensorFlow first sets up its devices: usually before this
// library is loaded, which is the first time a collective is traced under
// XLA (kernels.py). So that kernel is made here, once, unless XLA made it
// (this library loaded before TensorFlow's devices were set up). XLA is
// asked to make its kernels first, so that it cannot make a second later.
void register_jit_kernel() {
  tensorflow::XlaOpRegistry::RegisterCompilationKernels();
  if (has_jit_kernel()) return;
  const tensorflow::KernelDef* def =
      tensorflow::KernelDefBuilder("UnisonAllreduce")
          .Device(tensorflow::DEVICE_CPU_XLA_JIT)
          .TypeConstraint("T", {tensorflow::DT_UINT8, tensorflow::DT_INT8, tensorflow::DT_UINT16,
                                tensorflow::DT_INT16, tensorflow::DT_UINT32, tensorflow::DT_INT32,
                                tensorflow::DT_UINT64, tensorflow::DT_INT64, tensorflow::DT_HALF,
                                tensorflow::DT_BFLOAT16, tensorflow::DT_FLOAT, tensorflow::DT_DOUBLE,
                                tensorflow::DT_BOOL, tensorflow::DT_COMPLEX64, tensorflow::DT_COMPLEX128})
          .Build();
  static tensorflow::kernel_factory::OpKernelRegistrar registrar(def, "AllreduceLowering", make_lowering);
}

}  // namespace
}  // namespace unison_tf

// The core's functions, as unison_tf_bind takes them (kernels.cc); and
// allreduce's XLA kernel made where XLA did not make it. 0 when both are done.
extern "C" __attribute__((visibility("default"))) int unison_tf_xla_bind(const uintptr_t* functions, int count) {
  if (unison_tf::bind_core(functions, count) != 0) return 1;
  unison_tf::register_jit_kernel();
  return unison_tf::has_jit_kernel() ? 0 : 2;
}
