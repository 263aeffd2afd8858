"""Exported programs: what a program is, and which programs a client will need in a run."""
