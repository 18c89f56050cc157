"""``trace.again(arg)``: one span object entered block after block; ``trace.mark(arg)``:
the span of an empty block; rows the cycle collector does not walk (issue 17: the
objects of the Trainer's step path). Each test
runs on the C hot path (where it is built) and on the pure-Python one, in this process."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from opentelemetry import trace as otel_trace

import ppetrace
from exporters._spans import FrozenAttributes
from ppetrace.runtime import PyTorchRuntime
from ppetrace.tracing import _recorder

IMPLEMENTATIONS = [pytest.param(_recorder.PySpan, id="python")]
if _recorder.IMPLEMENTATION == "c":
    IMPLEMENTATIONS.insert(0, pytest.param(_recorder.Span, id="c"))

RowSink = Any  # conftest.py's row_sink fixture


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_each_block_of_a_reused_span_is_its_own_span(trace: Any, row_sink: RowSink) -> None:
    span = trace("step")
    seen = []
    for step in range(3):
        attrs = FrozenAttributes({"ppetrace.step": step})
        entered = span.again(attrs)
        assert entered is span and span.arg is attrs
        with entered, trace("inner", {"k": step}):
            seen.append(span.span_id)
    ppetrace.flush()
    steps = [r for r in row_sink.rows if r.name == "step"]
    inner = [r for r in row_sink.rows if r.name == "inner"]
    assert [r.attributes["ppetrace.step"] for r in steps] == [0, 1, 2]
    assert [r.span_id for r in steps] == seen and len(set(seen)) == 3
    # each inner block is the child of the block it ran in, not of the object's last one
    assert [r.parent_id for r in inner] == seen
    assert [r.attributes["k"] for r in inner] == [0, 1, 2]


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_a_reused_span_sees_the_context_of_each_block(trace: Any, row_sink: RowSink) -> None:
    # The C span keeps the context it made for the next block entered in the same one:
    # each block must still see its own context, whichever it was entered in.
    from opentelemetry import context as otel_context

    span, parents = trace("inner"), [trace("a"), trace("b")]
    seen = []
    for k in (0, 0, 1, 0, 1, 1):
        parent = parents[k]
        token = otel_context.attach(otel_context.set_value("which", k))
        try:
            with parent, span.again({"k": k}):
                assert otel_trace.get_current_span() is span
                assert otel_context.get_value("which") == k
                seen.append((k, parent.span_id))
            assert otel_trace.get_current_span() is not span
        finally:
            otel_context.detach(token)
    ppetrace.flush()
    inner = [r for r in row_sink.rows if r.name == "inner"]
    assert [(r.attributes["k"], r.parent_id) for r in inner] == seen
    # what it keeps holds the span itself: a cycle, which the collector frees
    ref = weakref.ref(span)
    del span
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_again_on_an_open_span_gives_a_new_one(trace: Any, row_sink: RowSink) -> None:
    span = trace("outer", {"a": 1})
    with span:
        nested = span.again({"a": 2})
        assert nested is not span and type(nested) is type(span)
        assert nested.name == "outer" and nested.arg == {"a": 2}
        assert span.arg == {"a": 1}  # the open block keeps its arg
        with nested:
            pass
    ppetrace.flush()
    rows = {r.attributes["a"]: r for r in row_sink.rows}
    assert rows[2].parent_id == rows[1].span_id


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_again_while_disabled_records_nothing(trace: Any, row_sink: RowSink) -> None:
    span = trace("quiet")
    ppetrace.configure(enabled=False, exporters=[row_sink])
    try:
        with span.again({"a": 1}):
            assert span.again({"a": 2}) is span  # a disabled block is not open
    finally:
        ppetrace.configure(exporters=[row_sink])
    with span.again({"a": 3}):
        pass
    ppetrace.flush()
    assert [r.attributes for r in row_sink.rows] == [{"a": 3}]


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_mark_records_an_empty_block_under_the_current_span(trace: Any, row_sink: RowSink) -> None:
    hook = trace("hook")
    with trace("step") as step:
        hook.mark({"i": 0})
        hook.mark({"i": 1})
        assert otel_trace.get_current_span() is step
        with hook.again({"i": 2}):
            hook.mark({"i": 3})  # open: a new span, under the open one
    ppetrace.configure(enabled=False, exporters=[row_sink])
    try:
        hook.mark({"i": 4})
    finally:
        ppetrace.configure(exporters=[row_sink])
    ppetrace.flush()
    rows = {r.attributes["i"]: r for r in row_sink.rows if r.name == "hook"}
    (step_row,) = [r for r in row_sink.rows if r.name == "step"]
    assert sorted(rows) == [0, 1, 2, 3]  # nothing while disabled
    assert rows[0].parent_id == rows[1].parent_id == rows[2].parent_id == step_row.span_id
    assert rows[3].parent_id == rows[2].span_id
    assert len({r.span_id for r in rows.values()}) == 4
    for r in (rows[0], rows[1]):
        assert step_row.start_ns <= r.start_ns <= r.end_ns <= step_row.end_ns
        assert r.status == "UNSET" and r.error == "" and r.trace_id == step_row.trace_id
    assert rows[0].end_ns <= rows[1].start_ns


class _Probe(torch.nn.Module):
    """A Linear that keeps the current span of each forward run with grad on (``grad``)
    or off: the span of ``module.train_step``, or of the evaluation step."""

    def __init__(self, grad: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.grad = grad
        self.currents: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() == self.grad:
            self.currents.append(otel_trace.get_current_span())
        return self.lin(x)


def _pairs(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(2, 4), torch.tensor([0, 1])) for _ in range(n)]


def test_the_trainer_enters_one_object_per_event_and_step(row_sink: RowSink) -> None:
    model = _Probe(grad=True)
    trainer = ppetrace.Trainer(max_epochs=1, progress=False, val_every_n_epochs=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer.fit(model, _pairs(3), optimizer=opt, loss_fn=torch.nn.functional.cross_entropy)
    ppetrace.flush()
    currents = model.currents
    assert len(currents) == 3 and all(c is currents[0] for c in currents)
    train = [r for r in row_sink.rows if r.name == "module.train_step"]
    steps = {r.span_id: r for r in row_sink.rows if r.name == "trainer.step"}
    assert len(train) == 3 and len({r.span_id for r in train}) == 3
    assert [steps[r.parent_id].attributes["ppetrace.batch_idx"] for r in train] == [0, 1, 2]


@pytest.mark.parametrize("trace", IMPLEMENTATIONS)
def test_recorded_rows_are_left_out_of_the_cycle_collector(trace: Any, row_sink: RowSink) -> None:
    attrs = FrozenAttributes({"ppetrace.step": 1})
    with trace("counted", attrs):
        pass
    ppetrace.flush()
    (row,) = row_sink.rows
    assert row.attributes is attrs and row.name == "counted" and row.status == "UNSET"
    if trace is _recorder.Span and _recorder.IMPLEMENTATION == "c":
        # no young collection walks the rows waiting in the buffers (the Python twin's
        # rows are tracked: Python cannot untrack an object; the rows are the same)
        assert not gc.is_tracked(row)


def test_validation_enters_one_object_per_event_and_batch(row_sink: RowSink) -> None:
    model = _Probe(grad=False)
    trainer = ppetrace.Trainer(max_epochs=1, progress=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.functional.cross_entropy
    trainer.fit(model, _pairs(2), val_loaders=_pairs(3), optimizer=opt, loss_fn=loss_fn)
    ppetrace.flush()
    currents = model.currents
    assert len(currents) == 3 and all(c is currents[0] for c in currents)
    steps = {r.span_id: r for r in row_sink.rows if r.name == "evaluator.step"}
    inner = [r for r in row_sink.rows if r.parent_id in steps and r.name.startswith("module.")]
    assert len(steps) == 3 and len(inner) == 3
    assert [steps[r.parent_id].attributes["ppetrace.batch_idx"] for r in inner] == [0, 1, 2]


def test_a_runtime_with_its_own_trace_opens_every_step_hook_through_it(
    row_sink: RowSink,
) -> None:
    opened: list[tuple[str, Any]] = []

    class Own(PyTorchRuntime):
        @classmethod
        @contextlib.contextmanager
        def trace(cls, event_name: str | None, arg: Any) -> Iterator[None]:
            index = arg.get("ppetrace.batch_idx") if isinstance(arg, dict) else None
            opened.append((str(event_name), index))
            with super().trace(event_name, arg):
                yield

    model = torch.nn.Linear(4, 2)
    trainer = ppetrace.Trainer(max_epochs=1, progress=False, device=Own("cpu", {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.functional.cross_entropy
    trainer.fit(model, _pairs(2), val_loaders=_pairs(2), optimizer=opt, loss_fn=loss_fn)
    ppetrace.flush()
    for event in ("runtime.train_pre_step", "runtime.train_post_step"):
        assert [i for e, i in opened if e == event] == [0, 1]
    for event in ("runtime.eval_pre_step", "runtime.eval_post_step"):
        assert [i for e, i in opened if e == event] == [0, 1]
    recorded = [r.name for r in row_sink.rows]
    assert recorded.count("runtime.train_pre_step") == recorded.count("runtime.eval_post_step") == 2


@pytest.mark.skipif(_recorder.IMPLEMENTATION != "c", reason="the C hot path is not built here")
def test_a_span_whose_init_never_ran_is_refused_in_a_sentence() -> None:
    class Skips(_recorder.Span):  # type: ignore[misc,valid-type]
        def __init__(self, event_name: str, arg: Any = None) -> None:
            pass  # never calls super().__init__

    span = Skips("never")
    for call in (lambda: span.again(1), lambda: span.mark(1), span.__enter__):
        with pytest.raises(TypeError, match="__init__ was not run"):
            call()
