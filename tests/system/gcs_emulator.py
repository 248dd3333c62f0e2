"""`python tests/system/gcs_emulator.py PORT BUCKET`: the GCS emulator of PyPI's
gcp-storage-emulator on 127.0.0.1:PORT, in memory, with BUCKET created.

One gap of that emulator is filled here, because tensorstore (orbax's array writer)
depends on it: a media download carries no `x-goog-generation` header, which real GCS
sends. Without it, tensorstore's OCDBT manifest re-read failed 1 of 30 orbax saves with
"Malformed StorageGeneration"; with it, 0 of 80 (this machine, emulator 2026.7.19,
tensorstore 0.1.86). Everything else (uploads, listings, deletes; it ignores
ifGenerationMatch) is the emulator's own.
"""

import logging
import sys
from http import HTTPStatus

from gcp_storage_emulator.handlers import objects
from gcp_storage_emulator.server import create_server

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    if response.status not in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
        return
    obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))


objects.download = download  # objects.get (the JSON API's ?alt=media) calls it by name

if __name__ == "__main__":
    port, bucket = int(sys.argv[1]), sys.argv[2]
    logging.basicConfig(level=logging.WARNING)
    create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket).run()  # until killed
