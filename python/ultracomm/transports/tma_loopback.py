"""Deprecated path of :mod:`ultracomm.transports.tma.loopback`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.transports.tma.loopback")
