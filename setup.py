"""The tail's optional C scanner (memra_obs/tail/_scan.c); everything else is in pyproject.toml.

``optional=True``: where no C compiler (or no Python headers) is found, the package installs
without it and ``memra-obs tail`` uses its pure-Python path (same results, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "memra_obs.tail._scan",
            ["memra_obs/tail/_scan.c"],
            optional=True,
            # No fused multiply-adds: every product rounds as Python's does.
            extra_compile_args=["-O2", "-ffp-contract=off", "-fno-fast-math"],
        )
    ]
)
