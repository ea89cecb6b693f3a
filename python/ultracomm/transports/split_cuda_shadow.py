"""Deprecated path of :mod:`ultracomm.transports.split.cuda_shadow`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.transports.split.cuda_shadow")
