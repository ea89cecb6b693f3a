"""Deprecated path of :mod:`ultracomm.tools.bench`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.tools.bench")
