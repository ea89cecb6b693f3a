"""Deprecated path of :mod:`ultracomm.tools.planner_refs`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.tools.planner_refs")
