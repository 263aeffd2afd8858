"""The ``fedge`` command: the top layer, dispatching to every role (see :mod:`cli.main`)."""
