"""The page's acceptance section: one function, a run's RoundRecords in, an HTML fragment out.

The slot for ``memra_obs.analysis`` (acceptance by position with intervals, expected
tokens per round, throughput vs k with the recommended k: ``estimate_acceptance(rounds)``,
``advise(rounds, ...)``). Until it lands this shows the exact by-position counts the
estimator starts from, and says that the estimates are pending. Replacing the body of
:func:`section` is all it takes: the page calls it once per run and lays the fragments
side by side. A figure: draw a ``matplotlib.figure.Figure`` and return
``figures.inline(fig, alt, caption)`` (matplotlib is importable here: the report needs it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..timeline import RoundRecord

__all__ = ["section"]


def section(rounds: Sequence[RoundRecord]) -> str:
    """Drafted and accepted tokens per draft position (0-based, as vLLM's ``per_pos``) over
    the rounds whose k and j are known (j >= 0): position p was drafted when k > p and
    accepted when j > p."""
    k = np.fromiter((r.k for r in rounds), np.int64, len(rounds))
    j = np.fromiter((r.j for r in rounds), np.int64, len(rounds))
    known = (k >= 0) & (j >= 0)
    k, j = k[known], j[known]
    note = (
        '<p class="pending"><b>Estimator pending.</b> Acceptance by position with intervals, '
        "expected tokens per round and throughput vs k with the recommended k are estimates "
        "from <code>memra_obs.analysis</code>, not in this build yet. Below: exact counts over "
        f"the {len(k)} rounds whose k and j are known ({int((~known).sum())} without are left "
        "out).</p>"
    )
    if not len(k) or k.max() <= 0:
        return note + "<p>No round with a known k &gt; 0.</p>"
    drafted = np.array([(k > p).sum() for p in range(int(k.max()))])
    accepted = np.array([(j > p).sum() for p in range(int(k.max()))])
    rows = "".join(
        f'<tr><td>{p}</td><td data-key="drafted_{p}">{d}</td><td data-key="accepted_{p}">{a}</td>'
        f"<td>{a / d:.3f}</td></tr>"
        for p, (d, a) in enumerate(zip(drafted, accepted, strict=True))
    )
    return (
        f"{note}<table><tr><th>position</th><th>drafted</th><th>accepted</th>"
        f"<th>accepted / drafted</th></tr>{rows}</table>"
    )
