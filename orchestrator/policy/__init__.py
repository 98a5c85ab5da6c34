"""Pure decisions the supervisor carries out: recovery, topology, restart budgets, the checkpoint interval (run in
the driver; no I/O).
"""
