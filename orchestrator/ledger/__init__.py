"""The job's record in its storage: the event ledger, and every view built from it — history, losses, goodput,
metric points (driver, CLI, dashboard).
"""
