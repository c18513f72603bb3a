/*
 * unison.h: the one public C interface of the unison core.
 *
 * The core knows no framework. It sees pointers, dtypes, shapes and names,
 * negotiates with the other ranks which named tensors are ready, fuses them
 * and moves the bytes on a background thread. Every function returns a
 * status code (UNISON_OK on success); on failure unison_last_error() holds a
 * message for the calling thread.
 *
 * The block between BEGIN CDEF and END CDEF is read verbatim by the cffi
 * builder (native/build_ffi.py), so it holds plain declarations only.
 */
#ifndef UNISON_H
#define UNISON_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* BEGIN CDEF */

/* Status codes. */
enum {
  UNISON_OK = 0,
  UNISON_ERR_INVALID_ARGUMENT = 1,  /* bad input caught before negotiation */
  UNISON_ERR_NOT_INITIALIZED = 2,   /* use before init or after shutdown */
  UNISON_ERR_MISMATCH = 3,          /* ranks disagree on a tensor */
  UNISON_ERR_RANK_FAILED = 4,       /* a peer died or stopped answering */
  UNISON_ERR_TIMEOUT = 5,           /* unison_wait ran out of time; op continues */
  UNISON_ERR_SHUT_DOWN = 6,         /* a rank shut down while the op was pending */
  UNISON_ERR_STALLED = 7,           /* the stall inspector failed the op */
  UNISON_ERR_UNSUPPORTED = 8,       /* valid request this build (or a forked child) cannot do */
  UNISON_ERR_INTERNAL = 9,
  UNISON_ERR_DEADLOCK = 10,         /* every rank waits on an op another never submits */
  UNISON_ERR_OUT_OF_MEMORY = 11     /* an allocation failed; nothing was written */
};

/* Element types. */
enum {
  UNISON_UINT8 = 0,
  UNISON_INT8 = 1,
  UNISON_INT16 = 2,
  UNISON_INT32 = 3,
  UNISON_INT64 = 4,
  UNISON_FLOAT16 = 5,
  UNISON_BFLOAT16 = 6,
  UNISON_FLOAT32 = 7,
  UNISON_FLOAT64 = 8,
  UNISON_BOOL = 9,
  UNISON_UINT16 = 10,
  UNISON_UINT32 = 11,
  UNISON_UINT64 = 12,
  UNISON_COMPLEX64 = 13,            /* two float32: real, imaginary */
  UNISON_COMPLEX128 = 14            /* two float64 */
};

/* Collectives. */
enum {
  UNISON_ALLREDUCE = 0,
  UNISON_ALLGATHER = 1,
  UNISON_BROADCAST = 2,
  UNISON_ALLTOALL = 3,
  UNISON_REDUCESCATTER = 4,
  UNISON_BARRIER = 5,
  UNISON_JOIN = 6,
  /* Negotiated like collectives, but started by unison_add_process_set and
     unison_remove_process_set, not by unison_enqueue. */
  UNISON_ADD_PROCESS_SET = 7,
  UNISON_REMOVE_PROCESS_SET = 8
};

/* Reduce operations. Adasum (allreduce of floating-point tensors only,
   without scale factors) is described in adasum.h. */
enum {
  UNISON_SUM = 0,
  UNISON_AVERAGE = 1,
  UNISON_MIN = 2,
  UNISON_MAX = 3,
  UNISON_PRODUCT = 4,
  UNISON_ADASUM = 5
};

#define UNISON_CPU_DEVICE -1
#define UNISON_GLOBAL_PROCESS_SET 0
#define UNISON_MAX_DIMS 32

typedef int64_t unison_handle;

/* Everything one collective needs. Fields an op does not use are ignored.
   Zero-initialise the struct and fill what the op needs: adding a field
   later does not change any signature. */
typedef struct {
  const char* name;         /* unique among this rank's ops in flight */
  int op;                   /* UNISON_ALLREDUCE, ... */
  int dtype;                /* UNISON_FLOAT32, ... */
  int ndim;                 /* 0 for a scalar, at most UNISON_MAX_DIMS */
  const int64_t* shape;     /* ndim entries, each >= 0 */
  const void* input;
  /* Output buffer. Allreduce and broadcast write here (it may equal input).
     Allgather, alltoall and reducescatter may pass NULL: their output size
     is known only after negotiation, and the core allocates it; read it
     with unison_handle_result(). A caller that knows the size may pass a
     buffer of output_bytes instead (an allgather's input may be its own
     part of it: in place); a result that would not fit fails the op on
     this rank, and the others go on. */
  void* output;
  int64_t output_bytes;     /* allgather, alltoall, reducescatter: capacity of output */
  int reduce_op;            /* allreduce, reducescatter */
  double prescale_factor;   /* multiplies each input before reducing; 0 means 1 */
  double postscale_factor;  /* multiplies the result; 0 means 1 */
  int root_rank;            /* broadcast */
  /* alltoall: rows sent to each rank; reducescatter: rows each rank
     receives (every rank passes the same). NULL for an even split. */
  const int64_t* splits;
  int nsplits;
  int process_set_id;       /* the set the op runs among; root_rank stays a global rank */
  /* UNISON_CPU_DEVICE, or the CUDA device that input and output are on.
     For a GPU op, `stream` is the cudaStream_t (NULL: the default stream)
     whose work produces the input and will use the output: the collective
     starts after what was queued on it before the enqueue, and work queued
     on it after the op completes runs after the collective. The host never
     waits for the device. A core-allocated result is device memory. */
  int device;
  void* stream;
  /* NULL: the input is ready now. Otherwise the input is ready once
     *input_ready is non-zero, for producers that finish after the enqueue
     (a device stream writes it when it gets there). Until then the op is
     not offered for negotiation; the timeline shows the wait as
     WAIT_FOR_DATA. The int must outlive the op. */
  const int32_t* input_ready;
  /* Allreduce and reducescatter: non-zero when this rank has no tensor of
     its own under this name (a parameter it did not use this step) and
     contributes the zeros in `input`. Where every rank's contribution is a placeholder, no rank
     had the tensor, which is not the same as a tensor of zeros: the op
     completes with unison_handle_unused() set, so that the caller can leave
     it absent, as one process would have. */
  int placeholder;
  /* For an op that no thread will wait for with unison_wait, because the
     framework's graph node that started it has returned (TensorFlow's
     asynchronous kernels): a non-zero key for the thread that waits for
     the graph instead. The deadlock test (caller_activity.h) counts that
     thread as blocked while the op is pending, asking the function given
     to unison_set_waiter_finder which thread the key means only when it
     needs to know; the thread that enqueues is not counted as a submitter.
     0: the usual op. */
  int64_t awaited_by;
} unison_op_options;

/* Called once when an op completes (unison_on_done). */
typedef void (*unison_done_fn)(void* arg, unison_handle handle, int status);
/* Turns an op's awaited_by key into the Linux thread id of the thread that
   waits for it (0: not known). */
typedef int64_t (*unison_waiter_finder)(int64_t awaited_by);

/* Lifecycle. Rank, size and the job id come from the environment the
   launcher sets (UNISON_RANK, UNISON_SIZE, ...); without it a process is
   rank 0 of 1. Init after shutdown starts a fresh session. A process
   forked from a rank after init keeps the queries' answers, but every call
   that would act for the rank (ops, waits, handles, timelines) fails with
   UNISON_ERR_UNSUPPORTED there, and init and shutdown do nothing. */
int unison_init(void);
int unison_shutdown(void);
int unison_is_initialized(void);
/* Ends an init in progress on another thread with UNISON_ERR_RANK_FAILED
   and `reason`; does nothing when no init is starting. An elastic worker
   calls it when its driver reports that a member of the round it is
   starting in died (that member may never have reached this rank). */
void unison_abort_start(const char* reason);
/* Reads `count` variables (names[i]=values[i], and nothing else) as init
   reads the environment, and fails as init would on the first setting it
   cannot use, naming it and its value. Starts nothing. unisonrun checks
   the environment it is about to give its ranks with it, so that a bad
   setting stops the job before any rank starts instead of failing every
   rank's init. */
int unison_check_settings(const char* const* names, const char* const* values, int count);

/* The settings init reads, one row each, in the order it reads them: the
   one table (config.cc) that the launcher's checks and the docs' settings
   page are made from. kind is integer, bytes, number, flag, auto-or-flag,
   choice, text, secret or core-list; minimum and maximum are the range an
   integer, bytes, number or core-list accepts, and a secret's least length
   in bytes; choices lists a choice's words, separated by '|'. NULL past
   the last row. The strings live as long as the process. */
typedef struct unison_setting {
  const char* name;
  const char* horovod_name; /* NULL where Horovod has no such knob */
  const char* kind;
  double minimum;
  double maximum;
  const char* choices; /* NULL unless kind is choice */
  const char* default_value;
  const char* description;
  const char* flag;       /* unisonrun's option for it, or NULL */
  const char* flag_unit;  /* the unit that option takes where not the variable's ("MiB"), or NULL */
  const char* config_key; /* the key of horovodrun's config file ("params.cycle_time_ms"), or NULL */
} unison_setting;
const unison_setting* unison_setting_at(int index);

/* The timeline (timeline.h): rank 0 writes a Chrome trace of every
   tensor's phases to `path` until stopped; on other ranks these do
   nothing. Starting again ends the file before and begins a new one. */
int unison_start_timeline(const char* path, int mark_cycles);
int unison_stop_timeline(void);

/* The settings in force, the same on every rank: the configured ones, or
   the autotuner's (UNISON_AUTOTUNE); settled is 1 once it has chosen. */
int unison_tuned_settings(int64_t* fusion_threshold_bytes, double* cycle_time_ms, int* cache, int* hierarchical,
                          int* settled);

/* Queries; each fails with UNISON_ERR_NOT_INITIALIZED before init. */
int unison_rank(int* out);
int unison_size(int* out);
int unison_local_rank(int* out);
int unison_local_size(int* out);
int unison_cross_rank(int* out);
int unison_cross_size(int* out);
/* 1 when every host runs the same number of ranks, else 0. */
int unison_is_homogeneous(int* out);
/* 1 when this job's ranks meet through MPI (it was started by mpirun or
   srun with more than one rank), else 0. */
int unison_mpi_enabled(int* out);
/* 1 when MPI is in use and lets any thread call it (MPI_THREAD_MULTIPLE),
   so the application may use MPI itself (mpi4py) beside unison; else 0. */
int unison_mpi_threads_supported(int* out);
/* Name of the data plane in use ("shm", "solo"). */
const char* unison_backend_name(void);
/* Comma-separated list of the data planes this build contains. */
const char* unison_built_backends(void);
/* Where GPU tensors can go, in words: the CUDA runtime and devices found,
   and NCCL. Both are loaded at run time; this loads them if need be. */
const char* unison_device_support(void);

/* Start a collective. Validates what one rank can check alone (dtype,
   shape, pointers, root, splits, name not already in flight) and returns
   at once; everything else is decided by negotiation. */
int unison_enqueue(const unison_op_options* options, unison_handle* out);
/* Groups: the collectives this thread enqueues between unison_group_begin
   and unison_group_end (which nest) are held back and queued together when
   the outermost group ends, so they are negotiated and fused as one, as a
   grouped allreduce needs. With discard set (at any depth), they are never
   started: their handles fail and their names are free again (a group that
   failed part way). Barrier, join and process-set ops are never held.
   Ending a group this thread has not begun does nothing. */
int unison_group_begin(void);
int unison_group_end(int discard);

/* For a front end whose collectives run as nodes of a framework's graph,
   on the framework's worker threads (a TensorFlow tf.function, PyTorch's
   gradient hooks, which run on a GPU's autograd thread): bracket
   each node's enqueues and waits with these. Inside, this thread submits
   collectives; after, it does not. waiting_thread is the Linux thread id
   of the thread that called the graph and waits for it (0: unknown); it
   counts as blocked while this node is. Without them the deadlock test
   would see idle workers and the waiting caller as busy (caller_activity.h).
   Both work before init and after shutdown. */
int unison_graph_node_begin(int64_t waiting_thread);
int unison_graph_node_end(void);

/* Handles. */
int unison_poll(unison_handle handle, int* done);
/* Waits up to timeout_seconds (negative: forever). Returns the op's status,
   UNISON_ERR_TIMEOUT if it is still running. Releases no resources. */
int unison_wait(unison_handle handle, double timeout_seconds);
/* unison_wait, and when the op succeeded also unison_release, in one call:
   for ops whose result the caller already holds (in place, or into its
   own output). A failed op's handle stays for unison_handle_error. */
int unison_wait_release(unison_handle handle, double timeout_seconds);
/* Calls done(arg, handle, status) once, when the op completes: on the
   thread that completes it (the engine's, or a caller's that drives it), or
   on this one, before returning, if it already has. For front ends whose
   framework completes an op by a callback instead of a wait (TensorFlow's
   asynchronous kernels). done must return soon and wait for no op; it may
   read the handle (unison_handle_error, _result, ...) and release it. An
   op given a callback is taken into a cycle at once, as a polled one is
   (engine_driver.cc). Releasing the handle before it completes drops the
   callback. */
int unison_on_done(unison_handle handle, unison_done_fn done, void* arg);
/* The function that turns awaited_by keys into threads (NULL: none, and
   such ops count no thread as blocked). It is called from the thread that
   runs the deadlock test, with no lock of the core held. */
int unison_set_waiter_finder(unison_waiter_finder finder);
/* Copies the failed op's message (NUL-terminated, truncated to capacity). */
int unison_handle_error(unison_handle handle, char* buffer, int64_t capacity);
/* The result of a completed op: data, its byte count and its shape.
   For ops that wrote into the caller's output this is that buffer. For
   core-allocated results ownership passes to the caller if take_ownership
   is set (free it with unison_free), else it dies with the handle. */
int unison_handle_result(unison_handle handle, int take_ownership, void** data,
                         int64_t* nbytes, int* ndim, int64_t* shape);
/* Alltoall: rows received from each rank (size entries). */
int unison_handle_received_splits(unison_handle handle, int64_t* splits, int n);
/* Process sets. Both are collective over every rank of the job and block
   until every rank has made the same call, in the same order. Adding gives
   the new set's id (ids are never reused within a session); `ranks` must be
   ascending global ranks, and no existing set may have the same ones.
   Removing fails the set's pending ops; the global set cannot be removed. */
int unison_add_process_set(const int* ranks, int nranks, int* process_set_id);
int unison_remove_process_set(int process_set_id);
/* Join: the last rank to join. */
int unison_handle_join_rank(unison_handle handle, int* last_rank);
/* Allreduce, reducescatter: 1 when every rank's contribution was a placeholder. */
int unison_handle_unused(unison_handle handle, int* unused);
int unison_release(unison_handle handle);
void unison_free(void* data);

/* The message of the last failed call on this thread. */
const char* unison_last_error(void);

/* END CDEF */

#ifdef __cplusplus
}
#endif

#endif /* UNISON_H */
