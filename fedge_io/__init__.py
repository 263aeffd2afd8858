"""I/O shared by the roles: the MQTT link, experiment set-up and run directories.

This layer sits on the pure core (:mod:`fedge`) and below the roles (coordinator, edge client, export), which may
import it; it imports no role.
"""
