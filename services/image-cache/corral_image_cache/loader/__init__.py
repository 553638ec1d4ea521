"""The node-local lazy loader of layered EROFS images: `python -m corral_image_cache.loader`.

One process per node. It mounts a read-only FUSE filesystem at `--mount` holding one regular file
per prepared layer, `<mount>/<layer digest>`, whose bytes are the layer's EROFS image; the
node-agent mounts that file with mount(2) as EROFS (file-backed; util-linux's mount(8) would put
a loop device in between) and stacks the layers in overlayfs. Chunks are fetched on first read,
verified against the manifest's sha256 and kept in `--cache-dir`.

Bus protocol (request/reply, JSON; errors are `{"ok": false, "error": {"code", "message"}}`):

`corral.node.<node>.loader.prepare` `{"image": "name" | "", "layers": ["sha256-<hex>", ...]}`
    → `{"ok": true, "paths": {digest: "<mount>/<digest>"}, "prefetch_chunks": N, "recording": bool}`
    Loads the manifests, makes the files visible, counts one use of each layer (per occurrence),
    then replays the image's stored trace as prefetch, or records one if none is stored.
    Errors: invalid_request (malformed JSON, unknown field, bad digest or image name, no layers),
    not_found (a layer the catalog does not know), internal (a manifest that does not decode or is
    inconsistent), conflict (a layer in use whose manifest changed its chunking). All or nothing.
`corral.node.<node>.loader.release` `{"layers": [...]}` → `{"ok": true, "released": [...], "not_prepared": [...]}`
`corral.node.<node>.loader.stats` `{}` → counters, cache size, fetch latency, per-layer cached/total.
`corral.node.<node>.loader.evict` `{"layer"?: digest}` → `{"ok": true, "evicted": [...], "cache_bytes": N}`
    (a named layer in use: conflict; not on the node: not_found; no layer: every unused layer).

A chunk that cannot be fetched or fails verification gives the reader EIO and publishes an
AuditEvent (kind "error", sandbox "loader", op "chunk_fetch") on `corral.audit.<node>.loader`.

Modules: `service` (the Loader: bus handlers and the life of the parts), `node_cache` (the layers on
the node, single-flight chunk loads, the size cap), `cache` (one layer's data file and bitmap),
`fetcher` (the prioritised fetch pool), `traces` (record and replay start traces), `fusefs` (the
FUSE callbacks), `fusemount` (libfuse's thread, mount to unmount), `mounts` (mountinfo and umount),
`config`, `meters`."""
