"""The plan: the `Plan` type and its JSON (plan.py), and how one is built (build.py) from templates
instantiated on concrete nodes, placed so that layers stay put, and rebalanced around a straggler.

The type imports nothing from the builder. docs/planning.md.
"""
