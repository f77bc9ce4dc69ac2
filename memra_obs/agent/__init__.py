"""Agent mode: workers write shared-memory rings (:mod:`.ring`, :mod:`.format`), one
``memra-obs agent`` per host reads (:mod:`.reader`, :mod:`.loop`) and publishes them
(:mod:`.main`). Imports nothing, so the worker's side never pulls in the agent's."""
