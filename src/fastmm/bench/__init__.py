"""fastmm-bench: side-by-side benchmarks of ``torch.utils.data.DataLoader`` and ``fastmm.DataLoader``.

Run ``fastmm-bench --help``. Nothing in fastmm imports this package; it sits on top of the loader.
Modules: ``cli`` (the command), ``workloads`` (datasets and the per-batch consumer), ``corpus``
(the cached synthetic JPEG corpus), ``harness`` (one timed repetition, the PSS sampler),
``stats`` (medians, spread, bootstrap CIs), ``env`` (environment capture), ``report`` (tables).
"""
