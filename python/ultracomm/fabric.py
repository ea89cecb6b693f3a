"""Deprecated path of :mod:`ultracomm.cuda.fabric`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.cuda.fabric")
