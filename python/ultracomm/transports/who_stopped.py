"""Deprecated path of :mod:`ultracomm.transports.host.who_stopped`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.transports.host.who_stopped")
