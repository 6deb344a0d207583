"""Kinds, families and the reductions that make events mean one thing."""
