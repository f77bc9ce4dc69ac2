"""Agent mode: workers write records into shared-memory rings (:mod:`.ring`, the file is
:mod:`.format`); one ``memra-obs agent`` per host reads them (:mod:`.reader`, :mod:`.loop`)
and publishes (:mod:`.main`). See docs/AGENT.md. This face imports nothing, so the worker's
side never pulls in the agent's.
"""
