"""Stress for the C extensions, run by the sanitizer job (``.ci/sanitize``).

Usage: ``python tests/sanitizer/stress.py SCENARIO [--seconds S]`` with SCENARIO one of
``threads``, ``odd``, ``fork``, ``fuzz``. Each repeats its work for at least S seconds
(default 30) and prints one summary line; a wrong result exits with status 1, and
under the sanitizers any memory error aborts the process. pytest does not collect
this file (its name does not start with ``test_``).

- threads: threads mutate attribute dicts (their string values, their keys) that
  other threads trace with and that the flusher encodes, at a switch interval of
  1 us, while rows holding those very dicts go through every C encoder (and the
  detail filter's C fold).
- odd: attribute objects that run Python code inside the encoders: a float whose
  ``__repr__`` rewrites its row, a key whose ``__hash__`` replaces its value, a
  start time whose ``__index__`` empties the batch, ``__str__``/``__hash__`` that
  raise, ints beyond str()'s digit limit; spans made current without being entered.
- fork: forks with spans open (the child closes them and writes its own trace), and
  forks from a finalizer that runs while a span's row is made.
- fuzz: generated batches encoded by C and by Python, compared byte for byte (Chrome
  events) and frame for frame, and folded by the detail filter in C and in Python.
"""

from __future__ import annotations

import argparse
import enum
import gc
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

import ppetrace
from exporters import ChromeTraceExporter, SpanRow, spans_to_frame
from exporters import frame as frame_module
from exporters._accel import SPEEDUPS
from exporters.chrome import _detail, _encode
from ppetrace.tracing import _recorder
from ppetrace.tracing._fold import begin_light

I64 = (-(2**63), 2**63 - 1)


class Failure(Exception):
    """A result that differs from the expected one."""


def check(ok: bool, what: str) -> None:
    if not ok:
        raise Failure(what)


class _Encoder:
    """What _encode_columns needs of a ChromeTraceExporter, without a file."""

    _prefix = ChromeTraceExporter._prefix

    def __init__(self) -> None:
        self._prefixes: dict[int, dict[str, str]] = {}
        self._strs: dict[str, str] = {}
        self._heads: dict[Any, str] = {}
        self._strings: dict[str, str] = {}
        self._values: dict[Any, dict[Any, str]] = {}


def encode(rows: list[SpanRow], origin: int = 0, *, pure: bool = False) -> bytes:
    saved = _encode._speedups
    if pure:
        _encode._speedups = None
    try:
        parts = _encode._encode_columns(_Encoder(), rows, 1, origin, True)  # type: ignore[arg-type]
        return b"".join(data for data, _ in parts)
    finally:
        _encode._speedups = saved


def frame(rows: list[SpanRow], *, pure: bool = False) -> pd.DataFrame:
    saved = frame_module._speedups
    if pure:
        frame_module._speedups = None
    try:
        return spans_to_frame(rows)
    finally:
        frame_module._speedups = saved


def fold(rows: list[SpanRow], starts: list[int], *, pure: bool = False) -> Any:
    """The rows through the detail filter with ``starts`` published on each thread: C
    (fold_lane where it does not decline) or the Python loop alone."""
    saved = _detail.FAST
    _detail.FAST = not pure
    try:
        f = _detail.DetailFilter()
        for tid in dict.fromkeys(r[6] for r in rows):
            for s in starts:
                f.publish(1, tid, s)
        out, summaries = f.take(1, rows)
        f.finish(out, summaries, 0)
        return out, summaries, f.spans_summarised, f.steps_summarised, f.flush_held()
    finally:
        _detail.FAST = saved


def every_c_encoder(rows: list[SpanRow]) -> None:
    """Every C entry point on these rows (results unchecked: the rows may be changing)."""
    encode(rows)
    frame(rows)
    fold(rows, [r[4] for r in rows if r[0] == "row"][::3])
    if SPEEDUPS is not None:
        attrs = [r.attributes for r in rows]
        SPEEDUPS.attr_table(attrs)
        SPEEDUPS.typed_column(attrs, "s")
        SPEEDUPS.encode_attrs(attrs, {}, {}, _encode._head_of, _encode._encode_value)
        SPEEDUPS.span_columns(rows)
        SPEEDUPS.distinct_ints(rows, 6)
        SPEEDUPS.dict_encode([a.get("s") if isinstance(a.get("s"), str) else None for a in attrs])


# -- threads ---------------------------------------------------------------------------


def scenario_threads(seconds: float, tmp: Path) -> str:
    sys.setswitchinterval(1e-6)
    exporter = ChromeTraceExporter(tmp / "threads.json")
    ppetrace.configure(exporters=[exporter], buffer_spans=500)
    shared: dict[str, Any] = {"s": "start", "n": 1, "f": 0.5, "t": ("a", 1)}
    row_dicts = [dict(shared) for _ in range(8)]
    rows = [SpanRow("row", i + 1, 0, 7, i, i + 9, 1, d) for i, d in enumerate(row_dicts)]
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"spans": 0, "encodes": 0, "mutations": 0}

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                while not stop.is_set():
                    fn()
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
                stop.set()

        return run

    def mutate() -> None:
        i = counts["mutations"] = counts["mutations"] + 1
        for d in (shared, *row_dicts):
            d["s"] = "".join(["value-", str(i)])  # frees the old string
            d.pop("tmp", None)
            if i % 3:
                d["tmp"] = (str(i), i)  # a tuple: the C encoder calls Python for it
            d["n"] = i

    def trace() -> None:
        with ppetrace.trace("outer", shared), ppetrace.trace("inner", {"k": str(counts["spans"])}):
            counts["spans"] += 2

    def flush() -> None:
        ppetrace.flush()
        every_c_encoder(rows)
        counts["encodes"] += 1

    threads = [threading.Thread(target=guarded(f)) for f in (mutate, mutate, trace, trace, flush)]
    end = time.monotonic() + seconds
    for t in threads:
        t.start()
    while time.monotonic() < end and not stop.is_set():
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    ppetrace.flush()
    exporter.shutdown()
    ppetrace.configure()
    written = [e for e in json.loads((tmp / "threads.json").read_text())["traceEvents"]]
    x = sum(1 for e in written if e["ph"] == "X")
    stats = ppetrace.stats()
    check(exporter.errors == 0, f"the exporter failed {exporter.errors} times")
    check(x + stats.dropped >= counts["spans"], f"{x} events + {stats.dropped} dropped < spans")
    return f"{counts['spans']} spans, {counts['encodes']} encoder rounds, {x} events written"


# -- odd objects ------------------------------------------------------------------------


class Rewriting(float):
    """A float whose repr rewrites every string of its row's attributes."""

    row: ClassVar[dict[str, Any]] = {}

    def __repr__(self) -> str:
        for key in list(Rewriting.row):
            if isinstance(Rewriting.row[key], str):
                Rewriting.row[key] = "".join(["rewritten-", key])
        return float.__repr__(self)


class HashKey(str):
    target: dict[Any, Any] | None = None

    def __hash__(self) -> int:
        target, HashKey.target = HashKey.target, None
        if target is not None:
            target[self] = "".join(["replaced-", str(len(target))])
        return str.__hash__(self)


class Start:
    rows: ClassVar[list[Any]] = []

    def __index__(self) -> int:
        Start.rows.clear()
        return 13

    def __lt__(self, other: object) -> bool:
        return other > 13  # type: ignore[operator]

    def __gt__(self, other: object) -> bool:
        return other < 13  # type: ignore[operator]


class NoStr:
    def __str__(self) -> str:
        raise RuntimeError("no str")

    __repr__ = __str__


class NoHash(str):
    def __hash__(self) -> int:
        raise ValueError("no hash")


class KeyStr(str):
    """A str subclass as a key: the C encoders hand its batch to Python."""


class Rearm:
    """An arg whose release re-arms the span that held it (``again`` from a finalizer)."""

    span: ClassVar[Any] = None

    def __del__(self) -> None:
        span, Rearm.span = Rearm.span, None
        if span is not None:
            span.again({"rearmed": 1})


class Reenter:
    """A context value whose release enters the span that kept its context (the reused
    span's context cache lets the old context go while the span is being entered)."""

    def __init__(self, span: Any) -> None:
        self.span = span

    def __del__(self) -> None:
        span, self.span = self.span, None
        if span is not None:
            with span.again({"reentered": 1}):
                pass


class Publish:
    """A light step's publish callback that traces while it runs and when it is released
    (the fold holds its last reference, which light_finish releases)."""

    def __call__(self, pair: tuple[int, tuple[Any, ...]]) -> None:
        _, agg = pair
        check(len(agg) % 4 == 0, "light aggregates")
        with ppetrace.trace("in-publish", {"n": len(agg)}):
            pass

    def __del__(self) -> None:
        with ppetrace.trace("publish-released"):
            pass


def light_step(rounds: int) -> None:
    """A light step with odd args, an error, a span freed while open, a mark whose arg
    re-arms its span, and a span left open past the step."""
    step = ppetrace.trace("trainer.step", {"r": rounds})
    late = ppetrace.trace("late")
    with step:
        check(begin_light(step, Publish(), frozenset({"trainer.step"})), "begin_light")
        with ppetrace.trace("h", NoStr()):
            dropped = ppetrace.trace("dropped")
            dropped.__enter__()
            del dropped  # freed while open: its frame's address is only compared
            with ppetrace.trace("trainer.step"):  # in full, inside a light span
                pass
        try:
            with ppetrace.trace("err", NoStr()):
                raise KeyError("x")
        except KeyError:
            pass
        marked = ppetrace.trace("m", Rearm())
        Rearm.span = marked
        marked.mark({"m": 1})
        late.__enter__()
    late.__exit__(None, None, None)  # after its fold: recorded in full


def scenario_odd(seconds: float, tmp: Path) -> str:
    from opentelemetry import context as otel_context
    from opentelemetry import trace as otel_trace

    end = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < end:
        rounds += 1
        # a repr that rewrites its own row while C encodes it
        row = {"a": Rewriting(1.5), "b": "".join(["old-", str(rounds)]), "c": "x" * 30}
        Rewriting.row = row
        out = json.loads("[" + encode([SpanRow("r", 1, 0, 7, 0, 5, 1, row)]).decode() + "]")
        check(out[0]["attrs"]["b"] in (f"old-{rounds}", "rewritten-b"), "freed bytes in b")
        # a key whose hash replaces its own value
        attrs = [{HashKey("k"): "".join(["v-", str(i) * 20])} for i in range(4)]
        HashKey.target = attrs[0]
        f = frame([SpanRow(f"e{i}", i + 1, 0, 7, i, i + 5, 1, a) for i, a in enumerate(attrs)])
        check(f["k"].tolist()[1:] == ["v-" + str(i) * 20 for i in range(1, 4)], "frame column k")
        # a start time that empties the batch when C converts it
        rows = [SpanRow(f"n{i}", i + 1, 0, 7, 10 + i, 20 + i, 1, {"s": "x"}) for i in range(30)]
        rows[5] = SpanRow("n5", 6, 0, 7, Start(), 23, 1, {})
        Start.rows = rows
        check(len(encode(list(rows)).split(b",\n")) == 30, "events of the emptied batch")
        # values that cannot be encoded, keys that are not strings: C and Python agree
        odd = [
            SpanRow("o", 1, 0, 7, 0, 5, 1, {"huge": 10**5000, "bad": NoStr(), 3: NoHash("h")}),
            SpanRow("o", 2, 0, 7, I64[0], I64[1], 1, {"z": -0.0, "t": (NoStr(), 1.5)}),
        ]
        check(encode(odd) == encode(odd, pure=True), "odd values: C and Python differ")
        # the recorder: odd args, spans made current without being entered, used tokens
        never = ppetrace.trace("never")
        with otel_trace.use_span(never, end_on_exit=False), ppetrace.trace("child", NoStr()):
            pass
        try:
            with ppetrace.trace("reset") as span:
                assert _recorder._CTXVAR is not None
                _recorder._CTXVAR.reset(span._token)
                raise KeyError("own")
        except KeyError:
            pass
        # again(): the old arg's release re-arms the same span; an open span gives a new one
        reused = ppetrace.trace("again", Rearm())
        Rearm.span = reused
        with reused.again({"n": rounds}) as entered:
            fresh = entered.again(Rearm())
        check(fresh is not reused and reused.arg == {"rearmed": 1}, "again on an odd span")
        reused.again(Rearm())
        Rearm.span = reused
        reused.mark({"m": rounds})  # releasing the Rearm re-arms the span mark records
        check(reused.arg == {"rearmed": 1}, "mark on an odd span")
        # a reused span keeps the context it was last entered in: entered in a new one, it
        # releases the old one, whose value then enters the same span again
        kept = ppetrace.trace("kept")
        for k in range(4):
            token = otel_context.attach(otel_context.set_value("k", Reenter(kept)))
            with kept.again({"k": k}):
                check(otel_context.get_value("k") is not None, "the kept span's context")
            otel_context.detach(token)
        del kept
        light_step(rounds)
        if rounds % 50 == 0:
            ppetrace.flush()
            _recorder.RECORDER.discard_buffered()
    return f"{rounds} rounds"


# -- fork ------------------------------------------------------------------------------


def scenario_fork(seconds: float, tmp: Path) -> str:
    end = time.monotonic() + seconds
    forks = 0
    state: dict[str, Any] = {"armed": False, "child": None}

    class Forker:
        def __del__(self) -> None:
            if state["armed"] and state["child"] is None:
                state["armed"] = False
                state["child"] = os.fork()

    def child_work(path: Path) -> int:
        """In a child: record, write a trace, check it; the exit status says whether ok."""
        try:
            exporter = ChromeTraceExporter(path)
            ppetrace.configure(exporters=[exporter])
            for i in range(50):
                with ppetrace.trace("child.span", {"i": i, "s": str(i)}):
                    pass
            ppetrace.flush()
            exporter.shutdown()
            events = json.loads(path.read_text())["traceEvents"]
            return 0 if sum(e["ph"] == "X" for e in events) >= 50 else 3
        except BaseException:
            return 2

    while time.monotonic() < end:
        forks += 1
        path = tmp / f"child{forks % 4}.json"
        if forks % 2:
            # spans open across the fork; both sides close them
            with ppetrace.trace("outer", {"n": forks}), ppetrace.trace("inner"):
                pid = os.fork()
                if pid == 0:
                    status = child_work(path)
            if pid == 0:
                os._exit(status)
        else:
            # a fork from a finalizer while a span's row is made
            state["child"] = None
            gc.collect()
            gc.disable()
            with ppetrace.trace("outer", {"n": forks}):
                f = Forker()
                f.cycle = f  # type: ignore[attr-defined]
                del f
                state["armed"] = True
                gc.enable()
                gc.set_threshold(1)
            gc.set_threshold(700)
            pid = state["child"]
            if pid is None:
                continue
            if pid == 0:
                recorded = ppetrace.stats().recorded
                os._exit(child_work(path) if recorded >= 1 else 4)
        _, status = os.waitpid(pid, 0)
        check(os.waitstatus_to_exitcode(status) == 0, f"child exit status {status}")
        if forks % 20 == 0:
            _recorder.RECORDER.discard_buffered()
    return f"{forks} forks"


# -- fuzz ------------------------------------------------------------------------------


class Color(enum.IntEnum):
    RED = 1


def _value(rnd: random.Random, odd: bool) -> Any:
    kinds = [
        lambda: None,
        lambda: rnd.random() < 0.5,
        lambda: rnd.randint(-(2**70), 2**70),
        lambda: rnd.randint(*I64),
        lambda: rnd.choice([0.0, -0.0, 1.5, float("nan"), float("inf"), -1e300, 5e-324]),
        lambda: rnd.uniform(-1e6, 1e6),
        lambda: "".join(rnd.choice('ab"\\é\ud800\n') for _ in range(rnd.randint(0, 5))),
    ]
    if odd:
        kinds += [
            lambda: NoHash(rnd.choice("xyz")),
            lambda: NoStr(),
            lambda: Color.RED,
            lambda: 10**5000,
            lambda: (rnd.random(), "t"),
        ]
    return rnd.choice(kinds)()


def _batch(rnd: random.Random, odd: bool) -> list[SpanRow]:
    keys = ["a", "b", "status", "span_id", "é", "k\n"] + ([1, KeyStr("x")] if odd else [])
    shared = {rnd.choice(keys): _value(rnd, odd) for _ in range(rnd.randint(0, 5))}
    rows = []
    for _ in range(rnd.randint(1, 40)):
        if rnd.random() < 0.5:
            attrs = dict(shared)
        else:
            attrs = {rnd.choice(keys): _value(rnd, odd) for _ in range(rnd.randint(0, 6))}
        start = rnd.choice([rnd.randint(*I64), rnd.randint(0, 10**6)])
        end = rnd.choice([rnd.randint(*I64), start + rnd.randint(0, 10**6)])
        end = max(I64[0], min(I64[1], end))
        rows.append(
            SpanRow(
                rnd.choice(["trainer.step", "module.x", "user é"]),
                rnd.randint(0, 2**64 - 1),
                rnd.randint(0, 2**64 - 1),
                rnd.randint(0, 2**128 - 1),
                start,
                end,
                rnd.randint(-(2**31), 2**31),
                attrs,
                rnd.choice(["UNSET", "OK", "ERROR"]),
                rnd.choice(["", "E: x\ny"]),
            )
        )
    return rows


def scenario_fuzz(seconds: float, tmp: Path) -> str:
    rnd = random.Random(18)
    end = time.monotonic() + seconds
    batches = 0
    while time.monotonic() < end:
        batches += 1
        odd = batches % 2 == 0
        rows = _batch(rnd, odd)
        origin = rnd.choice([0, rnd.randint(*I64), I64[0] - 1])
        fast, slow = encode(rows, origin), encode(rows, origin, pure=True)
        check(fast == slow, f"batch {batches}: the C and Python events differ")
        json.loads("[" + fast.decode("ascii") + "]")
        if not odd:
            pd.testing.assert_frame_equal(frame(rows), frame(rows, pure=True))
        steps = [r[4] for r in rows if r[0] == "trainer.step" and rnd.random() < 0.8]
        starts = sorted(steps + [rnd.randint(*I64) for _ in range(rnd.randint(0, 2))])
        for some in (rows, [r._replace(tid=5) for r in rows]):  # many threads, and one
            check(fold(some, starts) == fold(some, starts, pure=True), f"batch {batches}: folds")
    return f"{batches} batches compared"


SCENARIOS = {
    "threads": scenario_threads,
    "odd": scenario_odd,
    "fork": scenario_fork,
    "fuzz": scenario_fuzz,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args(argv)
    implementations = (_recorder.IMPLEMENTATION, "c" if SPEEDUPS is not None else "python")
    if implementations != ("c", "c"):
        print(f"stress: expected both C extensions, found {implementations}", file=sys.stderr)
        return 1
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            summary = SCENARIOS[args.scenario](args.seconds, Path(tmp))
        except Failure as exc:
            print(f"stress {args.scenario}: FAILED: {exc}", file=sys.stderr)
            return 1
    took = time.monotonic() - started
    where = os.path.dirname(os.path.dirname(SPEEDUPS.__file__))
    print(f"stress {args.scenario}: ok, {summary} in {took:.1f} s (C built in {where})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
