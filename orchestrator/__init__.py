"""The job's side of spotrun: the driver that decides and carries out recovery, the workers it places,
the record it keeps, and the commands that read it.

Folders, bottom layer first (each imports only those before it): ``policy`` (pure decisions),
``ledger`` (the record and its views), ``notices``, ``publish``, ``workers`` (rank actors: they run on
the nodes), ``control`` (the driver), ``verify``, ``dashboard``, ``cli``.
"""
