"""The control room: what a Context does to a plan before anything moves.

* :mod:`.microbatches` -- the micro-batch slots (``vid``) in flight and what each holds;
* :mod:`.schedules` -- the schedule of a plan: built by the builder the call names (the host
  builder, the portable one, or the device build's inputs), cached by plan digest;
* :mod:`.plans` -- a plan checked against the Context, and the ranks' agreement on it.

Free functions and small state objects the Context owns; nothing here moves data.
"""
