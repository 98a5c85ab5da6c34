"""Everything that runs once per rank: state, loop, data pipeline, bundles, storage.

``trainer`` never imports ``orchestrator``: the orchestrator drives it through
:class:`spotrun.trainer.run.session.TrainSession`.
"""

__version__ = "0.1.0"
