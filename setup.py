"""Builds the optional C parts: the hot path of ``ppetrace.trace``
(``ppetrace.tracing._speedups``) and the Chrome event assembly of the exporters
(``exporters._speedups``).

Everything else is configured in pyproject.toml. When no C compiler is present,
the builds are skipped and both packages use their pure-Python implementations
of the same work.

Two environment variables serve the sanitizer job (``.ci/sanitize``):
``PPETRACE_EXTRA_CFLAGS`` (and the usual ``CFLAGS``/``LDFLAGS``, which
setuptools reads) add compiler flags, and ``PPETRACE_REQUIRE_SPEEDUPS=1``
makes a failed build an error instead of a silent fallback.
"""

import os
import shlex

from setuptools import Extension, setup

_required = os.environ.get("PPETRACE_REQUIRE_SPEEDUPS") == "1"
_extra = shlex.split(os.environ.get("PPETRACE_EXTRA_CFLAGS", ""))
_flags = ["-O2", *_extra]  # later flags win: the extra ones may lower -O2

setup(
    ext_modules=[
        Extension(
            "ppetrace.tracing._speedups",
            sources=["ppetrace/tracing/_speedups.c"],
            optional=not _required,
            extra_compile_args=_flags,
            extra_link_args=_extra,
        ),
        Extension(
            "exporters._speedups",
            sources=["exporters/_speedups.c"],
            optional=not _required,
            extra_compile_args=_flags,
            extra_link_args=_extra,
        ),
    ]
)
