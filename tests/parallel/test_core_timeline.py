"""The timeline from one rank's point of view: started and stopped at run
time, rank 0's file is a Chrome trace with a row per tensor and its
phases (queued, waiting for its data, negotiating with the ranks it waited
for, the collective named by the backend, the backend's parts on the
group's row), cycle markers when asked, nothing after the stop; python -m
unison.timeline summarises it. Every rank checks rank 0's file."""
import json
import os
import threading
import time

import numpy as np

import unison
import unison.numpy as unp
from unison import collective, handles, timeline
from unison._native import ffi, lib

unison.init()
RANK, SIZE = unison.rank(), unison.size()
# A file per test: rank 0 starts the next test's timeline while the others
# may still read the last one.
PATH = "/tmp/unison-timeline-test-%s-%%s.json" % os.environ.get("UNISON_JOB_ID", "solo")
SLOW = 1 if SIZE > 1 else 0


def rows_and_spans(events):
    rows = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    return rows, timeline.spans(events)


def test_start_and_stop_at_run_time_give_every_phase_of_named_tensors():
    path = PATH % "phases"
    unison.start_timeline(path, mark_cycles=True)
    for step in range(3):
        handles = [unp.allreduce_async(np.full(1000 * (i + 1), RANK, np.float32), name="tl.grad.%d" % i)
                   for i in range(3)]
        for h in handles:
            unp.synchronize(h)
    unp.allgather(np.full((RANK + 1, 2), RANK, np.int32), name="tl.gather")
    unp.broadcast(np.arange(4.0), 0, name="tl.bcast")
    if RANK == SLOW:
        time.sleep(0.5)  # every other rank waits for this one
    unp.allreduce(np.ones(5), name="tl.slow")
    unison.stop_timeline()
    unp.allreduce(np.ones(5), name="tl.after_stop")
    unp.barrier()
    with open(path) as f:
        events = json.load(f)  # stopped: the file is whole
    rows, spans = rows_and_spans(events)
    names = set(rows.values())
    assert {"tl.grad.0", "tl.grad.1", "tl.grad.2", "tl.gather", "tl.bcast", "tl.slow", "cycles"} <= names
    assert "tl.after_stop" not in names
    backend = unison.backend_name().upper()
    phases = {(row, phase) for row, phase, _, _, _ in spans}
    for name, op in [("tl.grad.0", "ALLREDUCE"), ("tl.gather", "ALLGATHER"), ("tl.bcast", "BROADCAST")]:
        assert {(name, "QUEUED"), (name, "NEGOTIATE"), (name, "%s_%s" % (backend, op))} <= phases, (name, phases)
    # Each gradient's collective names the fused group it ran in (how many
    # fuse depends on when they arrived); the groups hold all 9 exactly once.
    collectives = [(args["group"], start, args["tensors"]) for row, phase, start, _, args in spans
                   if row.startswith("tl.grad.") and phase.endswith("_ALLREDUCE")]
    assert len(collectives) == 9, collectives
    groups = {group for group, _, _ in collectives}
    assert groups <= names
    on_group_rows = [args["tensors"] for row, phase, _, _, args in spans
                     if row in groups and phase.endswith("_ALLREDUCE")]
    assert sum(on_group_rows) == 9, on_group_rows
    assert all(d >= 0 for _, _, _, d, _ in spans)
    # The backend's own phases, on the groups' rows (these allreduces are
    # small: TCP exchanges whole inputs, MPI allgathers them).
    # (Hierarchical layouts show the phases of the backends they are made of.)
    expected_parts = {"SHM": {"PACK", "WAIT_FOR_PEERS"}, "TCP": {"EXCHANGE", "REDUCE"},
                      "MPI": {"PACK", "MPI_IALLGATHER", "REDUCE", "UNPACK"}}
    if SIZE > 1:
        parts = {phase for row, phase, _, _, _ in spans if row in groups}
        assert expected_parts.get(backend, set()) <= parts, parts
    slow = [args for row, phase, _, _, args in spans if row == "tl.slow" and phase == "NEGOTIATE"]
    assert slow == [{"waited_for": [SLOW] if SIZE > 1 else []}]
    assert any(e["name"] == "CYCLE_START" for e in events)
    summary = timeline.summarize(events)
    assert "tl.slow" in summary and "NEGOTIATE" in summary
    if SIZE > 1:
        assert "rank %d " % SLOW in summary


def test_a_second_start_begins_a_new_file():
    first, second = PATH % "first", PATH % "second"
    unison.start_timeline(first)
    unp.allreduce(np.ones(3), name="tl.first")
    unison.start_timeline(second)
    unp.allreduce(np.ones(3), name="tl.second")
    unison.stop_timeline()
    unison.stop_timeline()  # stopping twice is harmless
    unp.barrier()
    with open(first) as f:
        rows = {e["args"]["name"] for e in json.load(f) if e["ph"] == "M"}
    assert "tl.first" in rows and "tl.second" not in rows
    with open(second) as f:
        rows = {e["args"]["name"] for e in json.load(f) if e["ph"] == "M"}
    assert "tl.second" in rows and "tl.first" not in rows


def test_a_bad_path_is_a_clear_error_on_rank_0():
    if RANK == 0:
        try:
            unison.start_timeline("/nonexistent-dir/t.json")
        except unison.InvalidArgumentError as e:
            assert "cannot write the timeline to '/nonexistent-dir/t.json'" in str(e)
        else:
            raise AssertionError("no error")
    else:
        unison.start_timeline("/nonexistent-dir/t.json")  # only rank 0 writes


def test_an_input_whose_producer_has_not_finished_waits_for_its_data_outside_negotiation():
    # A producer that finishes after the enqueue (a device stream) sets the
    # op's input_ready flag when it gets there. Here a thread plays that
    # producer on rank 0, the rank that writes the timeline: it writes the
    # input, then the flag. An input read before the flag would be -1000s.
    path = PATH % "data"
    unison.start_timeline(path)
    values = np.full(6, -1000.0 if RANK == 0 else RANK + 1, np.float32)
    flag = np.zeros(1, np.int32)
    pointer = ffi.cast("void*", values.ctypes.data)
    handle_id = collective.enqueue(lib.UNISON_ALLREDUCE, "tl.data", lib.UNISON_FLOAT32, values.shape, pointer,
                                   pointer, reduce_op=lib.UNISON_SUM,
                                   input_ready=ffi.cast("int32_t*", flag.ctypes.data) if RANK == 0 else ffi.NULL)

    def produce():
        values[:] = 1.0
        flag[0] = 1

    producer = threading.Timer(0.3, produce) if RANK == 0 else None
    if producer is not None:
        producer.start()
    started = time.monotonic()
    handles.synchronize(handles.Handle(handle_id, "tl.data", (), lambda _: None))
    if RANK == 0:
        assert time.monotonic() - started >= 0.25
    assert values.tolist() == [SIZE * (SIZE + 1) / 2] * 6  # every rank's r + 1
    unp.allreduce(np.ones(2), name="tl.after_data")  # and the engine goes on
    unison.stop_timeline()
    unp.barrier()
    with open(path) as f:
        _, spans = rows_and_spans(json.load(f))
    data = {phase: duration for row, phase, _, duration, _ in spans if row == "tl.data"}
    assert {"QUEUED", "WAIT_FOR_DATA", "NEGOTIATE"} <= set(data), data
    assert data["WAIT_FOR_DATA"] >= 0.25e6, data  # microseconds
    assert "WAIT_FOR_DATA" not in {phase for row, phase, _, _, _ in spans if row == "tl.after_data"}


def test_a_grouped_call_runs_as_one_fused_group():
    # A grouped call is queued whole (unison_group_begin/end), so one cycle
    # takes and fuses all of it, even where the engine's thread takes ops
    # the moment they arrive (tests/test_parallel.py also runs this suite
    # with UNISON_OVERLAP=1). Its tensors are enqueued one by one, which
    # left the thread time to start on the first few.
    path = PATH % "grouped"
    count = 64
    unison.start_timeline(path)
    for step in range(3):
        outs = unp.grouped_allreduce([np.full(1024, RANK + i + step, np.float32) for i in range(count)],
                                     op=unison.Sum, name="tl.group")
        for i, out in enumerate(outs):
            assert out.tolist() == [SIZE * (i + step) + SIZE * (SIZE - 1) / 2] * 1024
    unison.stop_timeline()
    unp.barrier()
    with open(path) as f:
        _, spans = rows_and_spans(json.load(f))
    groups = [args["group"] for row, phase, _, _, args in spans
              if row.startswith("tl.group.") and phase.endswith("_ALLREDUCE")]
    assert len(groups) == 3 * count
    sizes = [args["tensors"] for row, phase, _, _, args in spans if row in set(groups) and phase.endswith("_ALLREDUCE")]
    assert sizes == [count] * 3, sizes


def test_a_grouped_call_that_refuses_a_tensor_starts_none_of_them():
    # The group's third name is in flight already: the call fails there,
    # and the two tensors before it are never started, on any rank, so
    # their names are free at once and nothing is left running.
    # The blocker stays in flight until its input is declared ready.
    values, flag = np.ones(3), np.zeros(1, np.int32)
    pointer = ffi.cast("void*", values.ctypes.data)
    blocker = collective.enqueue(lib.UNISON_ALLREDUCE, "tl.refused.2", lib.UNISON_FLOAT64, values.shape, pointer,
                                 pointer, reduce_op=lib.UNISON_SUM, input_ready=ffi.cast("int32_t*", flag.ctypes.data))
    try:
        unp.grouped_allreduce([np.ones(3)] * 4, op=unison.Sum, name="tl.refused")
    except unison.InvalidArgumentError as e:
        assert "'tl.refused.2': a tensor of this name is already in flight on rank %d" % RANK in str(e)
    else:
        raise AssertionError("no error")
    flag[0] = 1
    handles.synchronize(handles.Handle(blocker, "tl.refused.2", (values,), lambda _: None))
    assert values.tolist() == [SIZE] * 3
    outs = unp.grouped_allreduce([np.full(3, RANK + i, np.float64) for i in range(4)], op=unison.Sum,
                                 name="tl.refused")
    assert [o.tolist() for o in outs] == [[SIZE * i + SIZE * (SIZE - 1) / 2] * 3 for i in range(4)]
    assert not any(h.name.startswith("tl.refused") for h in handles._in_flight.values())
