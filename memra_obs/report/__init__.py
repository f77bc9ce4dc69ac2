"""``memra-obs report``: one self-contained HTML page from a worker's log or span file (two:
A/B). :mod:`.inputs` and :mod:`.spans` read records, :mod:`.stats` computes, :mod:`.figures`
and :mod:`.acceptance` draw, :mod:`.page` writes, :mod:`.main` is the command. Importing this
package imports neither matplotlib nor numpy (the core never needs them)."""
