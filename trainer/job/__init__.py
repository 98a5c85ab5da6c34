"""The job as the user hands it to spotrun: the :class:`Job` contract, the spec, and how its code is known."""
