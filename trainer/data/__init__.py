"""The data pipeline, in the order records flow through it.

    listing (sorted, versioned) -> order (f(seed, epoch)) -> shuffle buffer
    -> packer (remainder) -> planner (update, rank, microstep)
    -> loader (prefetch workers; never committed state) -> transform (f(seed, occurrence))

Everything stateful (buffer, packer, planner) runs in the rank's main process
and only moves occurrence *ids*; workers turn a plan into tensors as a pure
function, which is why their number can change across a restore.
"""
