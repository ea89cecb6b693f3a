"""Deprecated path of :mod:`ultracomm.tools.whatif`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.tools.whatif")
