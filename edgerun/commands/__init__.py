"""The ``edgerun`` subcommands: one module per group, each with its argparse wiring and its ``cmd_*`` functions.

``edgerun/cli.py`` only builds the top-level parser from these modules and dispatches.
"""
