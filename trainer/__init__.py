"""The rank's side of spotrun: everything one rank runs, and the formats the driver reads back.

Folders, bottom layer first (each imports only those before it): ``storage``, ``job``, ``runtime``,
``data``, ``metrics``, ``state``, ``observe``, ``bundle``, ``run``. ``trainer`` never imports
``orchestrator``: the orchestrator drives it through :class:`spotrun.trainer.run.session.TrainSession`.
"""

__version__ = "0.1.0"
