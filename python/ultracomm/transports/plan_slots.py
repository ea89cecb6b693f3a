"""Deprecated path of :mod:`ultracomm.transports.tma.plan_slots`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.transports.tma.plan_slots")
