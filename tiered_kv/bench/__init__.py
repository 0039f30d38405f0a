"""The measuring library behind ``benchmarks/*.py`` and ``tiered-kv bench``.

``timing`` (timed runs, round-robin interleaving with a same-run baseline, medians and
percentiles), ``machine`` (machine details, load average, the noise flag), ``report`` (tables and
JSON that always carry the config and the machine), and one module per measurement: ``transfer``
(device <-> host), ``storage`` (LMDB vs files vs O_DIRECT), ``allocator``, ``layerwise``,
``map_write``. The scripts and the command parse arguments and print; they measure nothing
themselves, so the figures in the README and the command's come from the same code.

Imports here stay light (no torch): ``tiered_kv.cli.report`` uses ``report``.
"""
