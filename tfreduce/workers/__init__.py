"""Several workers (layers 0 and 5): the cluster, heartbeats and the watchdog, who
is lost after a failure, the check that workers agree, the cross-worker stage.

Importing the package imports none of its modules.
"""
