"""torchrun entry point of the bandwidth test; the same as ``python -m ultracomm.tools.bench``.

torchrun --nproc-per-node 4 perf/bench_bandwidth.py all --workload zipf:1.5,2,3 --experts-per-rank 8 --top-k 2 --json out.json
"""

from ultracomm.tools.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
