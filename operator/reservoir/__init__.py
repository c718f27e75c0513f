"""Reservoir: hold capacity for branching AI workflows before the work runs, settle it
back exactly once after."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("reservoir")
except PackageNotFoundError:  # a source tree without an install
    __version__ = "0+unknown"
