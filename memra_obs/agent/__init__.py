"""Agent mode: workers write shared-memory rings (:mod:`.ring`, :mod:`.format`), one
``memra-obs agent`` per host reads (:mod:`.reader`) and publishes them (:mod:`.main`).
Imports nothing, so the worker's side never pulls in the agent's."""
