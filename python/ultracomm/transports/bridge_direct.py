"""Deprecated path of :mod:`ultracomm.transports.split.bridge_direct`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.transports.split.bridge_direct")
