"""Deprecated path of :mod:`ultracomm.cuda.loopback_launch`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.cuda.loopback_launch")
