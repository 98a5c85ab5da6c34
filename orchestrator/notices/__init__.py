"""Preemption notices: every source (signals, each cloud's metadata endpoint), one shape, one queue (watchers run
beside each rank).
"""
