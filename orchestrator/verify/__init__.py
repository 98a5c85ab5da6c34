"""``spotrun verify``: the oracle that proves the recovery contract on the user's own job, its fault plan and
comparisons (runs in the driver).
"""
