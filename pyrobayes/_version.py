"""The package version, in a leaf module so that submodules can read it without importing
``pyrobayes`` itself (which imports them)."""

__version__ = "0.1.0"
