"""The training state of one rank: every owner of state, captured at boundaries and described in manifests (runs on
each rank).
"""
