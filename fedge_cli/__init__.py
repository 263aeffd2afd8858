"""The ``fedge`` command: the top layer, dispatching to every role (see :mod:`fedge_cli.main`)."""
