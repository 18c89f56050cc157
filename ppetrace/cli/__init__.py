"""The ``ppetrace`` command line: ``run`` a script traced; ``report``, ``compare``,
``merge`` and ``repair`` trace files.

``report``, ``compare`` and ``merge`` run without torch: they import only
:mod:`exporters` (which needs pandas, scipy and the OpenTelemetry SDK) and
:mod:`ppetrace._version`. ``run`` imports :mod:`ppetrace.integrations` (and
torch) when it starts the script, and exits with the script's own exit code.

Exit codes: 0 on success (``compare``: no gated regression), 1 when
``compare`` finds a gated regression, 2 on bad input (a missing file, a
file that is not a JSON trace, runs with no event in common, a bad option;
with ``--strict-env``, runs from different environments). Bad input gets a
one-line error, never a traceback; so does any unexpected error
(``ppetrace: error: <Type>: <message>``, exit code 2, so that it is never
taken for a regression). A cut-off trace is read up to its last complete
event, with a one-line warning.

The package, one module per concept: ``_main`` (the parser and :func:`main`),
``_parse`` (option types, exit codes), ``_inputs`` (reading the traces given),
``_report``, ``_compare``, ``_files`` (``merge`` and ``repair``), ``_run``,
``_args``, ``_io`` and ``_html`` (arguments, output, ``--html``).
"""

from __future__ import annotations

from ._main import build_parser, main
from ._parse import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_REGRESSION,
    fraction_note,
    parse_duration_ns,
    parse_gate,
    parse_percent,
    parse_threshold,
)

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_OK",
    "EXIT_REGRESSION",
    "build_parser",
    "fraction_note",
    "main",
    "parse_duration_ns",
    "parse_gate",
    "parse_percent",
    "parse_threshold",
]
