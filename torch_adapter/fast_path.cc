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
 * The same holds for DistributedOptimizer's gradient hook (GradientHook,
 * below): it does in C what optimizer.py's hook does in its common case,
 * and calls that hook for everything else.
 *
 * It reaches the core through unison.h, by function pointers that
 * fast_path.py hands it (bind()): the core lives in unison._native, which
 * Python loads privately, so there is nothing to link against.
 */
#include <Python.h>
#include <structmember.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
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
using GraphNodeBegin = int (*)(int64_t);
using GraphNodeEnd = int (*)(void);
Enqueue enqueue = nullptr;
WaitRelease wait_release = nullptr;
GraphNodeBegin graph_node_begin = nullptr;
GraphNodeEnd graph_node_end = nullptr;

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
uint64_t hooked_count = 0;  // and of those, gradients the C hook started itself

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

// Where a Handle keeps its slot `index`: the one place that does the
// pointer arithmetic the three below share.
PyObject** slot_field(PyObject* object, int index) {
  return reinterpret_cast<PyObject**>(reinterpret_cast<char*>(object) + handle_class.offset[index]);
}

// A Handle's slot (borrowed; nullptr where unset).
PyObject* slot(PyObject* object, int index) { return *slot_field(object, index); }

// Sets a slot of a new Handle, still unset.
void fill_slot(PyObject* object, int index, PyObject* value) {
  Py_INCREF(value);
  *slot_field(object, index) = value;
}

// The op's unison.handles.Handle once start() has started it, as
// FrontEnd.allreduce_async_ returns it for a tensor that is its own
// buffer; None, declined; nullptr with a Python error (out of memory) once
// it was started but no Handle could be made. Then nothing holds the
// tensor, so the op must not touch it afterwards: outside a group this
// waits for it first; inside one (in_group: the caller's group is
// discarded when the error reaches it, so the held op never runs) waiting
// would never end, and it does not.
PyObject* start_handle(PyObject* const* args, Py_ssize_t nargs, bool in_group) {
  unison_handle handle;
  if (handle_class.type == nullptr || !start(args, nargs, &handle)) return declined();
  auto let_op_go = [&] {
    if (in_group) return;
    Py_BEGIN_ALLOW_THREADS
    wait_release(handle, -1.0);
    Py_END_ALLOW_THREADS
  };
  PyObject* id = PyLong_FromLongLong(handle);
  PyObject* object = id == nullptr ? nullptr : handle_class.type->tp_alloc(handle_class.type, 0);
  if (object == nullptr) {
    Py_XDECREF(id);
    let_op_go();
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
    let_op_go();
    return nullptr;
  }
  return object;
}

// allreduce_async_(the start_in_place arguments) -> the op's Handle, or
// None: take the Python path.
PyObject* allreduce_async_(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return start_handle(args, nargs, false);
}

// allreduce_many_(tensors, names, reduce_op, prescale_factor,
// postscale_factor, process_set_id) -> the Handles of the leading tensors
// it started, in order: a grouped in-place allreduce's members, one C call
// for the whole group instead of one Python call a member. It stops at
// the first member start_in_place would decline; the caller starts that
// one and the rest the Python way. Called inside the caller's group
// (collective.enqueued_together), which holds the ops until all are in.
PyObject* allreduce_many_(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError, "unison: allreduce_many_(tensors, names, reduce_op, prescale_factor, "
                                     "postscale_factor, process_set_id)");
    return nullptr;
  }
  PyObject* tensors = PySequence_Fast(args[0], "unison: allreduce_many_ takes a sequence of tensors");
  if (tensors == nullptr) return nullptr;
  PyObject* names = PySequence_Fast(args[1], "unison: allreduce_many_ takes a sequence of names");
  PyObject* started = names == nullptr ? nullptr : PyList_New(0);
  if (started == nullptr) {
    Py_DECREF(tensors);
    Py_XDECREF(names);
    return nullptr;
  }
  const Py_ssize_t count = std::min(PySequence_Fast_GET_SIZE(tensors), PySequence_Fast_GET_SIZE(names));
  bool failed = false;
  for (Py_ssize_t i = 0; i < count && !failed; ++i) {
    PyObject* call[6] = {PySequence_Fast_GET_ITEM(tensors, i), PySequence_Fast_GET_ITEM(names, i), args[2], args[3],
                         args[4], args[5]};
    PyObject* handle = start_handle(call, 6, true);
    if (handle == Py_None) {
      Py_DECREF(handle);
      break;
    }
    failed = handle == nullptr || PyList_Append(started, handle) != 0;
    if (failed && handle != nullptr) {  // started, but not in the list the caller would forget
      if (PyDict_DelItem(handle_class.in_flight, slot(handle, 0)) != 0) PyErr_Clear();
    }
    Py_XDECREF(handle);
  }
  if (failed) {
    // The error discards the caller's group, so none of these ops runs and
    // nobody will wait for them: they leave the table of handles in flight.
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(started); ++i) {
      PyObject* handle = PyList_GET_ITEM(started, i);
      if (PyDict_DelItem(handle_class.in_flight, slot(handle, 0)) != 0) PyErr_Clear();
    }
    PyErr_Restore(type, value, traceback);
    Py_CLEAR(started);
  }
  Py_DECREF(tensors);
  Py_DECREF(names);
  return started;
}

// Sets a slot that holds a reference, releasing that one.
void replace_slot(PyObject* object, int index, PyObject* value) {
  PyObject** field = slot_field(object, index);
  PyObject* old = *field;
  Py_INCREF(value);
  *field = value;
  Py_XDECREF(old);
}

// synchronize_many(handles) -> how many of the leading handles are now
// synchronized: a HandleGroup's members waited for in one C call, where
// handles.synchronize takes a Python call each. It does for each what
// synchronize does for an in-place op whose result is its tensor (no
// finisher), waiting in slices so that Ctrl-C is seen, and stops at the
// first handle it cannot finish so (another kind of op, or an op that
// failed): synchronize does that one and the rest, and raises.
PyObject* synchronize_many(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1 || handle_class.type == nullptr) {
    PyErr_SetString(PyExc_TypeError, "unison: synchronize_many(handles), after bind()");
    return nullptr;
  }
  PyObject* members = PySequence_Fast(args[0], "unison: synchronize_many takes a sequence of handles");
  if (members == nullptr) return nullptr;
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(members);
  Py_ssize_t done = 0;
  for (; done < count; ++done) {
    PyObject* handle = PySequence_Fast_GET_ITEM(members, done);
    if (Py_TYPE(handle) != handle_class.type) break;
    PyObject *id = slot(handle, 0), *finish = slot(handle, 3), *finished = slot(handle, 4);
    if (id == nullptr || finish != Py_None || finished == nullptr) break;
    if (finished == Py_True) continue;  // synchronized before: its result stands
    if (finished != Py_False || !PyLong_CheckExact(id)) break;
    const long long handle_id = PyLong_AsLongLong(id);
    if (handle_id == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      break;
    }
    int code;
    for (;;) {
      Py_BEGIN_ALLOW_THREADS
      code = wait_release(handle_id, 0.2);
      Py_END_ALLOW_THREADS
      if (code != UNISON_ERR_TIMEOUT) break;
      if (PyErr_CheckSignals() != 0) {  // Ctrl-C: this op stays in flight, and its tensor with it
        Py_DECREF(members);
        return nullptr;
      }
    }
    if (code != UNISON_OK) break;  // not released: synchronize asks again, and raises the op's error
    Py_INCREF(id);  // the table's reference may be the last but the slot's
    if (PyDict_DelItem(handle_class.in_flight, id) != 0) PyErr_Clear();
    Py_DECREF(id);
    replace_slot(handle, 2, Py_None);  // its buffers: the op no longer needs them
    replace_slot(handle, 4, Py_True);
  }
  Py_DECREF(members);
  return PyLong_FromSsize_t(done);
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

// bind(addresses of unison_enqueue and unison_wait_release,
// unison.handles.Handle, unison.handles._in_flight, addresses of
// unison_graph_node_begin and _end): the core to start ops in, and what a
// started op's handle is.
PyObject* bind(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6 || !PyType_Check(args[2]) || !PyDict_CheckExact(args[3])) {
    PyErr_SetString(PyExc_TypeError, "unison: bind(enqueue, wait_release, Handle, in_flight, graph_node_begin, "
                                     "graph_node_end)");
    return nullptr;
  }
  void* begin_at = PyLong_AsVoidPtr(args[4]);
  void* end_at = begin_at == nullptr ? nullptr : PyLong_AsVoidPtr(args[5]);
  if (begin_at == nullptr || end_at == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "unison: bind() needs the core's functions");
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
  graph_node_begin = reinterpret_cast<GraphNodeBegin>(begin_at);
  graph_node_end = reinterpret_cast<GraphNodeEnd>(end_at);
  Py_RETURN_NONE;
}

PyObject* started(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(started_count); }
PyObject* hooked(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(hooked_count); }

// ---- DistributedOptimizer's gradient hook ----------------------------------------
//
// torch_adapter/optimizer.py's hook (_make_hook), in C for its common case:
// a parameter's last backward pass before step(), its dense gradient sent
// as it is (no compression, no group, the global process set, no predivide
// factor). In Python the hook cost 5.5-6.5 us a gradient beyond the start
// of its allreduce (benchmarks/gradient_hooks.py). Whatever else, and any
// start this path declines, calls the optimizer's Python hook, which does
// the whole of it; nothing is changed before the allreduce has started, so
// the Python hook always begins from where it would have.

struct GradientHook {
  PyObject_HEAD
  PyObject* optimizer;      // a weak reference: the hook must not keep it alive
  PyObject* name;           // "allreduce.<the parameter's name>"
  PyObject* python_hook;    // the optimizer's own hook
  PyObject* no_compression; // Compression.none
  PyObject* global_set;     // unison's global process set
  PyObject* methods;        // the optimizer's own _allreduce_grad_async, _wire_tensor and _scale_factors
};

PyTypeObject* gradient_hook_type = nullptr;
PyObject *s_delay, *s_group_of, *s_compression, *s_predivide, *s_process_set, *s_op, *s_stepping, *s_handles,
    *s_grad, *s_version, *s_allreduce_grad_async, *s_wire_tensor, *s_scale_factors, *one_float, *zero_long;

// A new reference to `name` of `object`, or nullptr (no error left set).
PyObject* attribute(PyObject* object, PyObject* name) {
  PyObject* value = PyObject_GetAttr(object, name);
  if (value == nullptr) PyErr_Clear();
  return value;
}

// Whether this optimizer, or its class, has its own version of a method
// the Python hook calls (a subclass, a wrapper, a test counting starts):
// then the Python hook runs, and calls it.
bool overridden(GradientHook* hook, PyObject* optimizer) {
  PyObject** dict = _PyObject_GetDictPtr(optimizer);
  PyObject* const names[] = {s_allreduce_grad_async, s_wire_tensor, s_scale_factors};
  for (int i = 0; i < 3; ++i) {
    if (dict != nullptr && *dict != nullptr &&
        (PyDict_GetItemWithError(*dict, names[i]) != nullptr || PyErr_Occurred()))
      return true;
    if (_PyType_Lookup(Py_TYPE(optimizer), names[i]) != PyTuple_GET_ITEM(hook->methods, i)) return true;
  }
  return false;
}

// Starts the gradient's allreduce and records it as the Python hook would:
// 1 when done; 0 where the Python hook must do it, with nothing changed;
// -1 with a Python error set where the allreduce started but could not be
// recorded (out of memory), which the hook raises.
int hook_gradient(GradientHook* hook, PyObject* optimizer, PyObject* parameter) {
  int result = 0;
  PyObject *delays = nullptr, *groups = nullptr, *compression = nullptr, *predivide = nullptr, *set = nullptr,
           *op = nullptr, *stepping = nullptr, *handles = nullptr, *grad = nullptr, *version = nullptr,
           *entry = nullptr, *handle = nullptr;
  do {
    delays = attribute(optimizer, s_delay);
    groups = attribute(optimizer, s_group_of);
    compression = attribute(optimizer, s_compression);
    predivide = attribute(optimizer, s_predivide);
    set = attribute(optimizer, s_process_set);
    op = attribute(optimizer, s_op);
    stepping = attribute(optimizer, s_stepping);
    handles = attribute(optimizer, s_handles);
    grad = attribute(parameter, s_grad);
    if (!delays || !groups || !compression || !predivide || !set || !op || !stepping || !handles || !grad) break;
    if (overridden(hook, optimizer)) break;
    if (!PyDict_CheckExact(delays) || !PyDict_CheckExact(groups) || !PyDict_CheckExact(handles)) break;
    // The last pass before step() (a countdown at 1), in no group.
    PyObject* delay = PyDict_GetItemWithError(delays, parameter);  // borrowed
    if (delay == nullptr || !PyLong_CheckExact(delay) || PyLong_AsLong(delay) != 1) break;
    if (PyDict_GetItemWithError(groups, parameter) != Py_None) break;
    if (compression != hook->no_compression || set != hook->global_set || !PyLong_CheckExact(op) ||
        !PyLong_CheckExact(stepping))
      break;
    if (!(PyFloat_CheckExact(predivide) || PyLong_CheckExact(predivide)) || PyFloat_AsDouble(predivide) != 1.0)
      break;
    const int64_t waiting_thread = PyLong_AsLongLong(stepping);
    if (PyErr_Occurred()) break;
    // What the record needs, made before the start, so that once the
    // allreduce is under way nothing but the record itself can fail:
    // (handle, no compression context, (the gradient, its version)).
    version = attribute(grad, s_version);
    PyObject* sent = version == nullptr ? nullptr : PyTuple_Pack(2, grad, version);
    entry = sent == nullptr ? nullptr : PyTuple_New(3);
    if (entry == nullptr) {
      Py_XDECREF(sent);
      break;
    }
    Py_INCREF(Py_None);
    PyTuple_SET_ITEM(entry, 1, Py_None);
    PyTuple_SET_ITEM(entry, 2, sent);
    PyObject* args[6] = {grad, hook->name, op, one_float, one_float, zero_long};
    graph_node_begin(waiting_thread);
    handle = allreduce_async_(nullptr, args, 6);
    graph_node_end();
    if (handle == Py_None) break;  // declined: the Python hook starts it, or says why not
    if (handle == nullptr) {
      // Started and waited for, but no Handle could be made (out of
      // memory): the op has run, so the Python hook must not start it again.
      result = -1;
      break;
    }
    Py_INCREF(handle);
    PyTuple_SET_ITEM(entry, 0, handle);  // the tuple is this function's alone until recorded
    result = PyDict_SetItem(handles, parameter, entry) == 0 && PyDict_SetItem(delays, parameter, zero_long) == 0
                 ? 1
                 : -1;
  } while (false);
  Py_XDECREF(delays); Py_XDECREF(groups); Py_XDECREF(compression); Py_XDECREF(predivide); Py_XDECREF(set);
  Py_XDECREF(op); Py_XDECREF(stepping); Py_XDECREF(handles); Py_XDECREF(grad); Py_XDECREF(version);
  Py_XDECREF(entry); Py_XDECREF(handle);
  if (result == 0) PyErr_Clear();
  return result;
}

PyObject* gradient_hook_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  auto* hook = reinterpret_cast<GradientHook*>(self);
  if (kwargs == nullptr && PyTuple_GET_SIZE(args) == 1 && graph_node_begin != nullptr) {
    PyObject* optimizer = PyWeakref_GetObject(hook->optimizer);  // borrowed
    if (optimizer != nullptr && optimizer != Py_None) {
      Py_INCREF(optimizer);
      const int done = hook_gradient(hook, optimizer, PyTuple_GET_ITEM(args, 0));
      Py_DECREF(optimizer);
      if (done == 1) {
        ++hooked_count;
        Py_RETURN_NONE;
      }
      if (done < 0) return nullptr;
    }
    PyErr_Clear();
  }
  return PyObject_Call(hook->python_hook, args, kwargs);
}

int gradient_hook_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* hook = reinterpret_cast<GradientHook*>(self);
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(hook->optimizer);
  Py_VISIT(hook->name);
  Py_VISIT(hook->python_hook);
  Py_VISIT(hook->no_compression);
  Py_VISIT(hook->global_set);
  Py_VISIT(hook->methods);
  return 0;
}

int gradient_hook_clear(PyObject* self) {
  auto* hook = reinterpret_cast<GradientHook*>(self);
  Py_CLEAR(hook->optimizer);
  Py_CLEAR(hook->name);
  Py_CLEAR(hook->python_hook);
  Py_CLEAR(hook->no_compression);
  Py_CLEAR(hook->global_set);
  Py_CLEAR(hook->methods);
  return 0;
}

void gradient_hook_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  gradient_hook_clear(self);
  type->tp_free(self);
  Py_DECREF(type);
}

// gradient_hook(weak reference to the optimizer, name, its Python hook,
// Compression.none, the global process set, the optimizer's own methods
// the hook calls): the hook to register.
PyObject* gradient_hook(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6 || !PyWeakref_CheckRef(args[0]) || !PyUnicode_CheckExact(args[1]) || !PyCallable_Check(args[2]) ||
      !PyTuple_CheckExact(args[5]) || PyTuple_GET_SIZE(args[5]) != 3) {
    PyErr_SetString(PyExc_TypeError, "unison: gradient_hook(optimizer weakref, name, python hook, "
                                     "Compression.none, global process set, (3 methods))");
    return nullptr;
  }
  PyObject* self = PyType_GenericAlloc(gradient_hook_type, 0);
  if (self == nullptr) return nullptr;
  auto* hook = reinterpret_cast<GradientHook*>(self);
  PyObject** fields[] = {&hook->optimizer, &hook->name, &hook->python_hook, &hook->no_compression,
                         &hook->global_set, &hook->methods};
  for (int i = 0; i < 6; ++i) {
    Py_INCREF(args[i]);
    *fields[i] = args[i];
  }
  return self;
}

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
    {"allreduce_many_", (PyCFunction)(void (*)(void))allreduce_many_, METH_FASTCALL,
     "allreduce_many_(tensors, names, reduce_op, prescale_factor, postscale_factor, process_set_id): the Handles "
     "of the leading members of a grouped in-place allreduce it started, inside the caller's group."},
    {"synchronize_many", (PyCFunction)(void (*)(void))synchronize_many, METH_FASTCALL,
     "synchronize_many(handles): how many of the leading handles it synchronized (in-place ops that succeeded)."},
    {"started", started, METH_NOARGS, "started(): how many ops this path has started in this process"},
    {"hooked", hooked, METH_NOARGS, "hooked(): how many of them the C gradient hook started itself"},
    {"gradient_hook", (PyCFunction)(void (*)(void))gradient_hook, METH_FASTCALL,
     "gradient_hook(optimizer weakref, name, python hook, Compression.none, global process set, methods): "
     "DistributedOptimizer's hook for a parameter, in C for its common case"},
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(enqueue, wait_release, Handle, handles._in_flight, graph_node_begin, graph_node_end)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "unison_torch_fast_path", "unison.torch's compiled per-tensor path",
                      -1, methods};

}  // namespace

PyType_Slot gradient_hook_slots[] = {{Py_tp_call, (void*)gradient_hook_call},
                                     {Py_tp_traverse, (void*)gradient_hook_traverse},
                                     {Py_tp_clear, (void*)gradient_hook_clear},
                                     {Py_tp_dealloc, (void*)gradient_hook_dealloc},
                                     {0, nullptr}};
PyType_Spec gradient_hook_spec = {"unison_torch_fast_path.GradientHook", sizeof(GradientHook), 0,
                                  Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, gradient_hook_slots};

PyMODINIT_FUNC PyInit_unison_torch_fast_path(void) {
  struct Interned {
    PyObject** target;
    const char* text;
  } names[] = {{&s_delay, "_allreduce_delay"}, {&s_group_of, "_group_of"}, {&s_compression, "_compression"},
               {&s_predivide, "gradient_predivide_factor"}, {&s_process_set, "process_set"}, {&s_op, "op"},
               {&s_stepping, "_stepping_thread"}, {&s_handles, "_handles"}, {&s_grad, "grad"},
               {&s_version, "_version"}, {&s_allreduce_grad_async, "_allreduce_grad_async"},
               {&s_wire_tensor, "_wire_tensor"}, {&s_scale_factors, "_scale_factors"}};
  for (const Interned& n : names)
    if ((*n.target = PyUnicode_InternFromString(n.text)) == nullptr) return nullptr;
  one_float = PyFloat_FromDouble(1.0);
  zero_long = PyLong_FromLong(0);
  gradient_hook_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&gradient_hook_spec));
  if (one_float == nullptr || zero_long == nullptr || gradient_hook_type == nullptr) return nullptr;
  return PyModule_Create(&module);
}
