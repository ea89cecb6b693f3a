"""Tools apart from the runtime they measure: benchmarks, what-if replay, the planners'
evaluation, the pure-torch references the tests check executors against.  The workloads they
(and the simulator, ``ultracomm.sim``) use live below both, in ``ultracomm.scenarios``."""
