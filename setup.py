"""Builds the optional C parts: the hot path of ``ppetrace.trace``
(``ppetrace.tracing._speedups``) and the Chrome event assembly of the exporters
(``exporters._speedups``).

Everything else is configured in pyproject.toml. When no C compiler is present,
the builds are skipped and both packages use their pure-Python implementations
of the same work.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ppetrace.tracing._speedups",
            sources=["ppetrace/tracing/_speedups.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "exporters._speedups",
            sources=["exporters/_speedups.c"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
    ]
)
