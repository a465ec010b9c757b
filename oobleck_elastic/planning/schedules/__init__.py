"""Pipeline schedules: per-device action orders, one simulation of them, their cost, and the choice.

Imports the templates and profile rooms, never the plan. docs/schedules.md.
"""
