"""Builds the optional C hot path of ``ppetrace.trace`` (``ppetrace._speedups``).

Everything else is configured in pyproject.toml. When no C compiler is present,
the build of the extension is skipped and ppetrace uses its pure-Python
implementation of the same hot path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ppetrace._speedups",
            sources=["ppetrace/_speedups.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
