"""Deprecated path of :mod:`ultracomm.tools.planted`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.tools.planted")
