"""`python tests/system/gcs_emulator.py PORT BUCKET`: the GCS emulator of PyPI's
gcp-storage-emulator on 127.0.0.1:PORT, in memory, with BUCKET created.

Two gaps of that emulator are filled here, where a client depends on them:
- a media download carries no `x-goog-generation` header, which real GCS sends. Without
  it, tensorstore's (orbax's array writer's) OCDBT manifest re-read failed 1 of 30 orbax
  saves with "Malformed StorageGeneration"; with it, 0 of 80 (this machine, emulator
  2026.7.19, tensorstore 0.1.86);
- it has no `moveTo` (GCS's move of an object within its bucket), which gcsfs 2026.10
  tries first for every rename (epath's `replace`): answered 501, gcsfs retried it for
  33 s with backoff before copying and deleting instead, so each rename into a bucket
  took 33 s in the tests. It is a copy and a delete here, answered with the moved
  object as GCS answers.
Everything else (uploads, listings, copies, deletes; it ignores ifGenerationMatch) is
the emulator's own.
"""

import logging
import sys
from http import HTTPStatus

from gcp_storage_emulator import server, settings
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    if response.status not in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
        return
    obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))


objects.download = download  # objects.get (the JSON API's ?alt=media) calls it by name


def move(request, response, storage, *args, **kwargs):
    bucket, source = request.params["bucket_name"], request.params["object_id"]
    try:
        moved = objects._copy(request.base_url, storage, bucket, source, bucket,
                              request.params["dest_object_id"])
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
        return
    storage.delete_file(bucket, source)
    response.json(moved)


# Before the routes of one object, whose pattern would take ".../moveTo/o/..." as its name.
server.HANDLERS = tuple(
    (rf"^{prefix}/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/"
     rf"(?P<dest_object_id>.*[^/]+)$", {server.POST: move})
    for prefix in (settings.API_ENDPOINT, "")) + server.HANDLERS

if __name__ == "__main__":
    port, bucket = int(sys.argv[1]), sys.argv[2]
    logging.basicConfig(level=logging.WARNING)
    server.create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket).run()  # until killed
