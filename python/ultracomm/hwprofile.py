"""Deprecated path of :mod:`ultracomm.cuda.hwprofile`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.cuda.hwprofile")
