"""``memra-obs report``: one self-contained HTML page from a worker's log or span file (two: A/B).
:mod:`.inputs` reads records, :mod:`.stats` computes, :mod:`.page` draws and writes, :mod:`.main`
is the command. Importing this package imports neither matplotlib nor numpy (the core never needs
them)."""
