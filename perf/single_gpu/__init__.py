"""The modules of perf/bench_gpu.py, the single-GPU bench (its entry point: arguments, main, results).

perf/ is no package; bench_gpu.py loads this folder as the package ``single_gpu`` by its path.  One
idea a module: ``constants`` (sections, sizes, shapes, impl names), ``rows`` (Row, the tables),
``targets`` (issue 8's goals, issues 33 and 34's target lines), ``hw_profile`` (the hardware profile),
``timing`` (Timer, cudaMemcpyAsync through ctypes), ``loopback`` (the one-GPU loopback domain),
``lb_rows`` / ``lb_domain`` (lb_prefetch's rows and its domain), ``gpu`` (Gpu: the device, its
bookkeeping, and the sections by what they measure: ``launch``, ``control``, ``copies``, ``reduce``,
``relay``, ``lb_prefetch``)."""
