"""Deprecated path of :mod:`ultracomm.tools.reference`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.tools.reference")
