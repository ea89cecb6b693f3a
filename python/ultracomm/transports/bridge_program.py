"""Deprecated path of :mod:`ultracomm.transports.split.bridge_program`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.transports.split.bridge_program")
