"""Deprecated path of :mod:`ultracomm.transports.split.shadow`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.transports.split.shadow")
