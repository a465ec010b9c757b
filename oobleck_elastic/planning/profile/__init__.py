"""The profile: each layer's measured (or analytic) time and memory, and how it is measured.

The only room of planning that imports torch (profiler, layer_meter, cache, tp); `profile.py`,
`microbatch.py`, `analytic.py` and `progress.py` are plain numbers. Nothing here is imported by the
package's face, so `import oobleck_elastic.planning` does not load torch. docs/planning.md.
"""
