"""Deprecated path of :mod:`ultracomm.cuda.loopback`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.cuda.loopback")
