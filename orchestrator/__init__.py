"""Everything that runs once per job: spec loading, the run driver, ledger, CLI."""
