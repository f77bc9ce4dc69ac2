"""The Collector's ``${env:NAME:-default}`` expansion with every NAME unset: what a shipped
collector config means in the deployment it was written for (the compose stack, the
Kubernetes layout). Its addresses are variables so that tests/peers/ can run the very same
files on free 127.0.0.1 ports."""

from __future__ import annotations

import re
from typing import Any

import yaml

_REF = re.compile(r"\$\{env:(\w+)(?::-([^}]*))?\}")


def with_defaults(tree: Any) -> Any:
    """``tree`` (a loaded config) with each ``${env:NAME:-default}`` replaced by its default.
    A value that is one whole reference becomes the default's YAML value (``8888`` an int),
    as the Collector does."""
    if isinstance(tree, dict):
        return {k: with_defaults(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [with_defaults(v) for v in tree]
    if isinstance(tree, str):
        m = _REF.fullmatch(tree)
        if m:
            return yaml.safe_load(m[2] or "")
        return _REF.sub(lambda m: m[2] or "", tree)
    return tree
