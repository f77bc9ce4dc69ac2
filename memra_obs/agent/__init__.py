"""Agent mode: workers write records into shared-memory rings; one ``memra-obs agent`` per
host publishes them (spans, one ``/metrics`` with a ``worker`` label and exemplars).

    MEMRA_OBS_AGENT=/dev/shm/memra-obs MEMRA_OBS_SINKS=otel,prometheus  <worker ...>   # each rank
    MEMRA_OBS_AGENT=/dev/shm/memra-obs memra-obs agent                                  # once per host

Modules: :mod:`.format` (file layout, record codec), :mod:`.ring` (``RingSink``, the
worker's side), :mod:`.reader` (one ring, the agent's side), :mod:`.stream` (session ids
and context per ring), :mod:`.loop` (the ``Agent``), :mod:`.metrics` (its own health),
:mod:`.main` (``build_agent`` and ``memra-obs agent``). See the README, "Agent mode".
This face imports nothing, so the worker's side (:mod:`.ring`) never pulls in the agent's.
"""
