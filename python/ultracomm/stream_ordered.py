"""Deprecated path of :mod:`ultracomm.cuda.stream_ordered`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.cuda.stream_ordered")
