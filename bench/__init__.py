"""Benchmarks that print tables: checkpoint stall, training overhead, restart cost, Ray Train side by side.

Every figure a table shows is a ratio against a baseline measured in the same
process and run, so the machine's noise (other jobs on two shared cores)
cancels out as far as it can. ``make bench`` runs them all and assembles
``bench/RESULTS.md``; ``--quick`` runs each in a tiny mode (the smoke test).
"""
