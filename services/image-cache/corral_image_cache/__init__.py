"""corral image-cache: the image catalog's one writer (EROFS layers in content-addressed chunks,
manifests in KV) and, in `loader/`, the per-node FUSE loader that fetches those chunks lazily."""
