"""Deprecated path of :mod:`ultracomm.tools.workloads`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.tools.workloads")
