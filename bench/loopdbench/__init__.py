"""loopd's benchmark harness, shared by bench/run and bench/tls.

Modules, by what they hold:

- ``config``: ``Config``, every setting of one run, passed explicitly (no globals)
- ``session``: ``Session``, what a run owns (processes, loop devices, temp dirs,
  the signal it was interrupted by, the progress line) and its cleanup
- ``units``: sizes, durations, number formatting
- ``host``: the bench image, the page cache, /proc figures, machine facts
- ``systems``: the systems under test and ``Served``, one running system
- ``workloads``: ``Case``, the cases of each workload, the duration estimate
- ``fio``: fio's command line and JSON, one case run, setup latency
- ``stats``: figures derived from rows (rates, µs per request, ratios, medians)
- ``report``: report.md and results.csv; ``plots``: the PNGs
- ``results_md``: bench/RESULTS.md's current tables and its history list
- ``run``: bench/run's command line and main loop; ``tls``: bench/tls's

Unit tests: ``bench/tests`` (``python3 -m unittest discover -s bench/tests``).
"""
