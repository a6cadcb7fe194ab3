"""Reading and costing built graphs (layers 3-5): traffic per device pair, the
timeline, the cost model and the host probe, the profiler, the planner.

Importing the package imports none of its modules.
"""
