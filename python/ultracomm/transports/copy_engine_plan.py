"""Deprecated path of :mod:`ultracomm.transports.copy_engine.plan`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.transports.copy_engine.plan")
