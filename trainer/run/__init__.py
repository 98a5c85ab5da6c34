"""One rank's attempt: the session the driver calls, the update loop, collectives, device, sharding, warm restore
(runs on each rank).
"""
