"""Applications above the core: the ``kvpage`` subcommands and trace replay.

``engine_cli`` (generate, replay), ``replay`` (a trace through a real engine),
``sim_cli`` (plan, profile), ``simulate_cli`` (simulate) and ``cli_util``. The
dispatcher is :mod:`kvpage.cli`; nothing in the core imports this package.
"""
