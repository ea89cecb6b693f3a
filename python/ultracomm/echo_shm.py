"""Deprecated path of :mod:`ultracomm.tools.echo_shm`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.tools.echo_shm")
