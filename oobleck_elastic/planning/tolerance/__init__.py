"""Fault tolerance of a plan: the copies of each layer, what the templates guarantee for f, and
host-memory shadow copies. Imports the plan room, never the other way round. docs/shadows.md.
"""
