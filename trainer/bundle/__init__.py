"""Bundles: the manifest (the commit marker), the tensor file, digests, and writing, finding and loading them (runs
on each rank; readers in the driver).
"""
