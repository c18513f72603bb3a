/*
 * fast_path.cc: the per-tensor work of unison.torch's in-place allreduce,
 * compiled against the torch the user has installed (fast_path.py builds
 * and caches it). Every gradient of every step starts one such allreduce;
 * in Python, reading the tensor and filling the core's options cost about
 * 3 us a tensor, here a fraction of that, most of it the core's enqueue.
 *
 * It only repeats what the Python path has already done. An op is learned
 * (learn()) after the shared front end has checked it, with every message
 * it gives, and started it once on this thread; start_in_place() then
 * starts the same op (name, dtype, shape, reduce op, factors, process set,
 * device) on this call's memory and stream. Whatever it does not know
 * returns None, and the caller takes the Python path, which starts the op
 * or raises exactly as before: an op not learned on this thread, a tensor
 * whose memory is not the tensor itself (non-contiguous, a view whose sign
 * is in a flag, sparse, nested, a subclass that is not a Parameter), or an
 * enqueue the core refused (the Python path asks again and raises the
 * core's error). So no check lives here, and none can disagree.
 *
 * It reaches the core through unison.h, by a function pointer that
 * fast_path.py hands it (bind()): the core lives in unison._native, which
 * Python loads privately, so there is nothing to link against.
 */
#include <Python.h>
#include <structmember.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "unison.h"

namespace {

using Enqueue = int (*)(const unison_op_options*, unison_handle*);
using WaitRelease = int (*)(unison_handle, double);
Enqueue enqueue = nullptr;
WaitRelease wait_release = nullptr;

// As the Python path's per-thread cache (common/collective.py): a program
// with more distinct ops than this builds the rest per call.
constexpr size_t kKept = 4096;

// One learned op: everything that makes it this op, and its options with
// every field filled but the memory and the stream.
struct Learned {
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
  long reduce_op;
  double prescale_factor, postscale_factor;
  long process_set_id;
  int device;
  std::string name;  // the options point at it: a Learned never moves (held by unique_ptr)
  unison_op_options options{};
};

struct NameHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};

// Per thread, like the Python path's: a thread learns its own ops. Most
// names have one op; the same name with another shape or dtype (a
// different model on the same names) is another entry.
using Table = std::unordered_map<std::string, std::vector<std::unique_ptr<Learned>>, NameHash, std::equal_to<>>;
thread_local Table table;
thread_local size_t learned_count = 0;
// Ops started here, for the tests that show which path an op took (every
// call holds the GIL, so a plain counter is exact).
uint64_t started_count = 0;

// The tensor of a Python object, when its memory is the tensor itself and
// the core may read and write it through a pointer: a dense, strided,
// contiguous CPU or CUDA tensor, not a view whose sign lives in a flag.
// A plain torch.Tensor or a Parameter only: a subclass may redefine what
// its data is.
const at::Tensor* plain_tensor(PyObject* object) {
  if (!THPVariable_CheckExact(object)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(object);
  if (!t.defined() || t.layout() != c10::kStrided || t.is_nested()) return nullptr;
  if (!(t.is_cpu() || t.is_cuda())) return nullptr;
  if (!t.is_contiguous() || t.is_conj() || t.is_neg()) return nullptr;
  return &t;
}

bool same_op(const Learned& l, const at::Tensor& t, long reduce_op, double prescale, double postscale,
             long process_set_id, int device) {
  return l.dtype == t.scalar_type() && l.reduce_op == reduce_op && l.prescale_factor == prescale &&
         l.postscale_factor == postscale && l.process_set_id == process_set_id && l.device == device &&
         t.sizes().equals(l.shape);
}

// The arguments both functions take, as C values; false (with no Python
// error set) where one is not what the Python path ever learns.
struct Arguments {
  const at::Tensor* tensor;
  std::string_view name;
  long reduce_op;
  double prescale_factor, postscale_factor;
  long process_set_id;
};

// May throw (c10::Error) for a tensor torch cannot describe: callers catch.
bool read_arguments(PyObject* const* args, Py_ssize_t nargs, Arguments* out) {
  // Exactly the types the Python path keys its ops by: a str name, int op
  // and set id, and float or int factors (not bool, not an IntEnum).
  if (nargs < 6 || !PyUnicode_CheckExact(args[1]) || !PyLong_CheckExact(args[2]) ||
      !(PyFloat_CheckExact(args[3]) || PyLong_CheckExact(args[3])) ||
      !(PyFloat_CheckExact(args[4]) || PyLong_CheckExact(args[4])) || !PyLong_CheckExact(args[5]))
    return false;
  out->tensor = plain_tensor(args[0]);
  if (out->tensor == nullptr) return false;
  Py_ssize_t length = 0;
  const char* name = PyUnicode_AsUTF8AndSize(args[1], &length);
  if (name == nullptr) {
    PyErr_Clear();  // a string UTF-8 cannot hold: the Python path says so
    return false;
  }
  out->name = std::string_view(name, (size_t)length);
  out->reduce_op = PyLong_AsLong(args[2]);
  out->process_set_id = PyLong_AsLong(args[5]);
  out->prescale_factor = PyFloat_AsDouble(args[3]);
  out->postscale_factor = PyFloat_AsDouble(args[4]);
  if (PyErr_Occurred()) {  // an int too large for a long or a double: the Python path says so
    PyErr_Clear();
    return false;
  }
  return true;
}

// The tensor's device for the core, and the stream its producer and
// consumers run on: torch's current stream on that device, read without
// making a Python stream object (which alone cost 1.7 us a call).
void placement(const at::Tensor& t, int* device, void** stream) {
  if (!t.is_cuda()) {
    *device = UNISON_CPU_DEVICE;
    *stream = nullptr;
    return;
  }
  const c10::Device where = t.device();
  const auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  *device = where.index();
  *stream = guard->getStream(where).native_handle();
}

PyObject* declined() { Py_RETURN_NONE; }

// Starts the learned op that the arguments name on the tensor's memory:
// true with its handle id, or false, declined.
bool start(PyObject* const* args, Py_ssize_t nargs, unison_handle* handle) {
  if (enqueue == nullptr) return false;
  try {
    Arguments a;
    if (!read_arguments(args, nargs, &a)) return false;
    const auto found = table.find(a.name);
    if (found == table.end()) return false;
    int device;
    void* stream;
    placement(*a.tensor, &device, &stream);
    for (const auto& learned : found->second) {
      if (!same_op(*learned, *a.tensor, a.reduce_op, a.prescale_factor, a.postscale_factor, a.process_set_id,
                   device))
        continue;
      unison_op_options& options = learned->options;
      void* memory = a.tensor->numel() ? a.tensor->data_ptr() : nullptr;
      options.input = memory;
      options.output = memory;
      options.stream = stream;
      if (enqueue(&options, handle) != UNISON_OK) return false;
      ++started_count;
      return true;
    }
  } catch (const std::exception&) {
    // torch could not describe the tensor (a functorch wrapper, a tensor
    // without storage, no CUDA in this build): the Python path asks again
    // and says why. No C++ exception may cross into Python.
  }
  return false;
}

// start_in_place(tensor, name, reduce_op, prescale_factor, postscale_factor,
// process_set_id) -> the core's handle id, or None: take the Python path.
PyObject* start_in_place(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  unison_handle handle;
  if (!start(args, nargs, &handle)) return declined();
  return PyLong_FromLongLong(handle);
}

// unison.handles.Handle, made here for an in-place op as its constructor
// would make it (common/handles.py): the object with its slots filled, in
// the table of handles in flight. Its Python constructor alone cost
// 0.4-0.6 us, as much as all the rest of the start.
struct HandleClass {
  PyTypeObject* type = nullptr;
  PyObject* in_flight = nullptr;  // handles._in_flight
  // Byte offsets of the slots, in this order (bind() checks that these
  // are all the slots there are).
  static constexpr const char* kSlots[] = {"id", "name", "_buffers", "_finish", "_done", "_result"};
  Py_ssize_t offset[6] = {};
} handle_class;

void fill_slot(PyObject* object, int slot, PyObject* value) {
  Py_INCREF(value);
  *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(object) + handle_class.offset[slot]) = value;
}

// allreduce_async_(the start_in_place arguments) -> the op's Handle, as
// FrontEnd.allreduce_async_ returns it for a tensor that is its own
// buffer, or None: take the Python path.
PyObject* allreduce_async_(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  unison_handle handle;
  if (handle_class.type == nullptr || !start(args, nargs, &handle)) return declined();
  PyObject* id = PyLong_FromLongLong(handle);
  PyObject* object = id == nullptr ? nullptr : handle_class.type->tp_alloc(handle_class.type, 0);
  if (object == nullptr) {
    // The op is started and nothing holds its tensor: wait for it, so the
    // memory outlives it, before saying that Python is out of memory.
    Py_XDECREF(id);
    Py_BEGIN_ALLOW_THREADS
    wait_release(handle, -1.0);
    Py_END_ALLOW_THREADS
    return nullptr;
  }
  fill_slot(object, 0, id);
  fill_slot(object, 1, args[1]);
  fill_slot(object, 2, args[0]);  // the tensor, alive until the op completes
  fill_slot(object, 3, Py_None);  // no finisher: the result is the tensor itself
  fill_slot(object, 4, Py_False);
  fill_slot(object, 5, args[0]);
  const int kept = PyDict_SetItem(handle_class.in_flight, id, object);
  Py_DECREF(id);
  if (kept != 0) {
    Py_DECREF(object);
    Py_BEGIN_ALLOW_THREADS
    wait_release(handle, -1.0);
    Py_END_ALLOW_THREADS
    return nullptr;
  }
  return object;
}

// learn(tensor, name, reduce_op, prescale_factor, postscale_factor,
// process_set_id, dtype_code): remembers an op the Python path has just
// checked and started, so that start_in_place() can start its repeats.
// True when learned; False for what this path does not take.
PyObject* learn(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7 || !PyLong_CheckExact(args[6]) || learned_count >= kKept) Py_RETURN_FALSE;
  try {
    Arguments a;
    if (!read_arguments(args, nargs, &a)) Py_RETURN_FALSE;
    const at::Tensor& t = *a.tensor;
    if (t.dim() > UNISON_MAX_DIMS) Py_RETURN_FALSE;
    auto learned = std::make_unique<Learned>();
    void* stream;
    placement(t, &learned->device, &stream);
    auto& entries = table[std::string(a.name)];
    for (const auto& known : entries)
      if (same_op(*known, t, a.reduce_op, a.prescale_factor, a.postscale_factor, a.process_set_id,
                  learned->device))
        Py_RETURN_TRUE;
    learned->dtype = t.scalar_type();
    learned->shape = t.sizes().vec();
    learned->reduce_op = a.reduce_op;
    learned->prescale_factor = a.prescale_factor;
    learned->postscale_factor = a.postscale_factor;
    learned->process_set_id = a.process_set_id;
    learned->name = std::string(a.name);
    // The values the Python path has just enqueued, so each fits its field.
    unison_op_options& o = learned->options;
    o.name = learned->name.c_str();
    o.op = UNISON_ALLREDUCE;
    o.dtype = (int)PyLong_AsLong(args[6]);
    o.ndim = (int)learned->shape.size();
    o.shape = learned->shape.empty() ? nullptr : learned->shape.data();
    o.reduce_op = (int)a.reduce_op;
    o.prescale_factor = a.prescale_factor;
    o.postscale_factor = a.postscale_factor;
    o.process_set_id = (int)a.process_set_id;
    o.device = learned->device;
    entries.push_back(std::move(learned));
    ++learned_count;
    Py_RETURN_TRUE;
  } catch (const std::exception&) {
    Py_RETURN_FALSE;  // not learned: its repeats go the Python way
  }
}

// bind(address of unison_enqueue, address of unison_wait_release,
// unison.handles.Handle, unison.handles._in_flight): the core to start
// ops in, and what a started op's handle is.
PyObject* bind(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyType_Check(args[2]) || !PyDict_CheckExact(args[3])) {
    PyErr_SetString(PyExc_TypeError, "unison: bind(enqueue, wait_release, Handle, in_flight)");
    return nullptr;
  }
  void* enqueue_at = PyLong_AsVoidPtr(args[0]);
  void* wait_release_at = enqueue_at == nullptr ? nullptr : PyLong_AsVoidPtr(args[1]);
  if (enqueue_at == nullptr || wait_release_at == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "unison: bind() needs the core's functions");
    return nullptr;
  }
  // The Handle's slots must be exactly the ones filled above: a Handle
  // with another slot would be made with it unset.
  auto* type = reinterpret_cast<PyTypeObject*>(args[2]);
  PyObject* slots = PyObject_GetAttrString(args[2], "__slots__");
  if (slots == nullptr) return nullptr;
  const bool tuple = PyTuple_Check(slots);
  const Py_ssize_t count = tuple ? PyTuple_GET_SIZE(slots) : 0;
  Py_DECREF(slots);
  HandleClass found;
  found.type = type;
  found.in_flight = args[3];
  int filled = 0;
  for (int i = 0; i < 6; ++i) {
    PyObject* slot = PyObject_GetAttrString(args[2], HandleClass::kSlots[i]);
    if (slot == nullptr) return nullptr;
    if (Py_TYPE(slot) == &PyMemberDescr_Type) {
      found.offset[i] = reinterpret_cast<PyMemberDescrObject*>(slot)->d_member->offset;
      ++filled;
    }
    Py_DECREF(slot);
  }
  // Six slots and __weakref__, nothing else.
  if (!tuple || count != 7 || filled != 6) {
    PyErr_SetString(PyExc_TypeError, "unison: Handle's slots are not the ones fast_path.cc fills");
    return nullptr;
  }
  Py_INCREF(type);
  Py_INCREF(found.in_flight);
  handle_class = found;
  enqueue = reinterpret_cast<Enqueue>(enqueue_at);
  wait_release = reinterpret_cast<WaitRelease>(wait_release_at);
  Py_RETURN_NONE;
}

PyObject* started(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(started_count); }

PyMethodDef methods[] = {
    {"start_in_place", (PyCFunction)(void (*)(void))start_in_place, METH_FASTCALL,
     "start_in_place(tensor, name, reduce_op, prescale_factor, postscale_factor, process_set_id): the core's "
     "handle id, or None to take the Python path."},
    {"learn", (PyCFunction)(void (*)(void))learn, METH_FASTCALL,
     "learn(tensor, name, reduce_op, prescale_factor, postscale_factor, process_set_id, dtype_code): remember "
     "an op the Python path has checked and started."},
    {"allreduce_async_", (PyCFunction)(void (*)(void))allreduce_async_, METH_FASTCALL,
     "allreduce_async_(the arguments of start_in_place): the op's unison.handles.Handle, or None to take the "
     "Python path."},
    {"started", started, METH_NOARGS, "started(): how many ops this path has started in this process"},
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(address of unison_enqueue, address of unison_wait_release, Handle, handles._in_flight)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "unison_torch_fast_path", "unison.torch's compiled per-tensor path",
                      -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_unison_torch_fast_path(void) { return PyModule_Create(&module); }
