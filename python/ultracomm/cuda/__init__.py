"""Platform: CUDA support -- the driver and runtime bindings, loopback launches, SM budgets,
hardware profiles, GPU fabric, stream-ordered work.  Imports without a GPU or ``_cuda``."""
