"""Deprecated path of :mod:`ultracomm.transports.split.cuda_watchdog`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.transports.split.cuda_watchdog")
