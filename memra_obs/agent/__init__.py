"""Agent mode: workers write records into shared-memory rings; one ``memra-obs agent`` per
host publishes them. :mod:`.format` (the file), :mod:`.ring` (the worker's ``RingSink``),
:mod:`.reader` (one ring, the agent's side), :mod:`.loop` (the ``Agent``), :mod:`.main`
(``build_agent``, its metrics, the command). docs/AGENT.md tells the whole story. This face
imports nothing, so the worker's side never pulls in the agent's.
"""
