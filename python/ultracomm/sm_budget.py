"""Deprecated path of :mod:`ultracomm.cuda.sm_budget`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.cuda.sm_budget")
