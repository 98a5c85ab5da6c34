"""The driver of one job: preflight, launch, and the supervisor's state machine that carries out recovery decisions
(runs in the driver).
"""
