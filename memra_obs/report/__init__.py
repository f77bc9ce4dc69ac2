"""``memra-obs report``: one self-contained HTML page from a worker's log or span file.

    memra-obs report worker.err [-o report.html]        one run
    memra-obs report base.err new.err -o ab.html        A/B: both runs side by side

Modules, one purpose each: :mod:`.inputs` (log / span file -> the observer's records),
:mod:`.stats` (pure functions over records), :mod:`.figures` (matplotlib, inlined),
:mod:`.acceptance` (the acceptance section, one function), :mod:`.page` (the HTML),
:mod:`.main` (the command). Importing this package imports neither matplotlib nor numpy.
"""
