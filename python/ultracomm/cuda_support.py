"""Deprecated path of :mod:`ultracomm.cuda.support`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.cuda.support")
