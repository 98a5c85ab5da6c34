"""Storage backends behind one small protocol, addressed by relative keys.

The package's modules import downwards only: :mod:`.base` (the :class:`Storage` protocol, its errors,
:func:`check_key`), :mod:`.outage` (how a storage path rides out an outage), the backends
:mod:`.local` and :mod:`.s3` (each on ``base``), and :mod:`.open`
(:func:`open_storage`, above the backends). The S3 backend (boto3) is imported only when an
``s3://`` storage is opened. To change how :class:`LocalStorage` writes (``DIRECT_MIN_BYTES``),
patch :mod:`spotrun.trainer.storage.local`, where it is read.
"""

from spotrun.trainer.storage.base import (
    Storage,
    StorageError,
    StorageFullError,
    StoragePermanentError,
    StorageUnavailableError,
    UnsafeKeyError,
    check_key,
    list_versions,
)
from spotrun.trainer.storage.local import Chunks, LocalStorage
from spotrun.trainer.storage.open import open_storage
from spotrun.trainer.storage.outage import Outage

__all__ = ["Chunks", "LocalStorage", "Outage", "Storage", "StorageError", "StorageFullError", "StoragePermanentError",
           "StorageUnavailableError", "UnsafeKeyError", "check_key", "list_versions", "open_storage"]
