"""The node-local lazy loader of layered EROFS images (`python -m corral_image_cache.loader`).

See service.py for the design and the bus protocol."""
