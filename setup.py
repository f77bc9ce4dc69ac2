"""Two optional C helpers; everything else is in pyproject.toml.

- ``memra_obs/tail/_scan.c``: ``memra-obs tail``'s line scanner for the common line shapes.
- ``memra_obs/prom/_hist.c``: a batch of integer observations into a histogram's buckets
  (the Prometheus exporter's aggregated path: the tail, the agent, backlogs).

``optional=True``: where no C compiler (or no Python headers) is found, the package installs
without them and uses its pure-Python paths (the same results, slower).
"""

from setuptools import Extension, setup

# No fused multiply-adds, no fast math: every operation rounds as Python's does.
FLAGS = ["-O2", "-ffp-contract=off", "-fno-fast-math"]

setup(
    ext_modules=[
        Extension(
            "memra_obs.tail._scan", ["memra_obs/tail/_scan.c"], optional=True, extra_compile_args=FLAGS
        ),
        Extension(
            "memra_obs.prom._hist", ["memra_obs/prom/_hist.c"], optional=True, extra_compile_args=FLAGS
        ),
    ]
)
