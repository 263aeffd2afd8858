"""One module per ``fedge`` subcommand: its one-line help (``HELP``), its parser (``add``) and its handler (``run``).

The flags they share are built by :mod:`fedge_cli.flags`; :mod:`fedge_cli.main` assembles the parser and runs the
command.
"""
