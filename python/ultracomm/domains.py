"""Deprecated path of :mod:`ultracomm.dataplane.domains`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.dataplane.domains")
