"""Deprecated path of :mod:`ultracomm.transports.split.cuda`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.transports.split.cuda")
