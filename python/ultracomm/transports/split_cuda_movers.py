"""Deprecated path of :mod:`ultracomm.transports.split.cuda_movers`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.transports.split.cuda_movers")
