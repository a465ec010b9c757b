"""Templates: the exact split of the model into stages for every node count, and its cost model.

Imports only the profile room (and `comm`, `errors`). docs/planning.md.
"""
