"""Deprecated path of :mod:`ultracomm.transports.p2p.messengers`."""
from ultracomm._moved import alias

alias(globals(), "ultracomm.transports.p2p.messengers")
