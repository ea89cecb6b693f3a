"""Tools apart from the runtime they measure: benchmarks, what-if replay, workloads, the
planners' evaluation, the pure-torch references the tests check executors against."""
