"""Deprecated path of :mod:`ultracomm.tools.planner_eval`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.tools.planner_eval")
