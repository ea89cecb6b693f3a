"""Deprecated path of :mod:`ultracomm.transports.split.stream`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.transports.split.stream")
