"""The package version (one place: the package, its OTel scope, report pages)."""

__version__ = "0.1.0"
