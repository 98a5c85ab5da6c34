"""A rank's runtime: the device its tensors live on, FSDP2 sharding, the collectives ranks do together,
and the process's global random streams (runs on each rank)."""
