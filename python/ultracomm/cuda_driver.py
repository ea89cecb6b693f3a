"""Deprecated path of :mod:`ultracomm.cuda.driver`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.cuda.driver")
