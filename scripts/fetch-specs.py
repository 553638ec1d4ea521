#!/usr/bin/env python3
"""Download the AsyncAPI 3.0.0 JSON Schema (from the pinned `@asyncapi/specs` npm package, checked by
its sha256) into $CORRAL_SPEC_DIR (default /var/lib/corral/specs), so the test that validates
docs/contract/asyncapi.json runs offline. Run by `make setup`; a cached copy is reused."""
from __future__ import annotations

import hashlib
import io
import os
import sys
import tarfile
import urllib.request

PACKAGE = "@asyncapi/specs"
VERSION = "6.11.1"
URL = f"https://registry.npmjs.org/{PACKAGE}/-/specs-{VERSION}.tgz"
SHA256 = "01af8744dc33c0c7eb2e908f6a955319ee58b70ecadc9387d1aeb16c0cd28928"
MEMBER = "package/schemas/3.0.0-without-$id.json"  # references are local (#/definitions/...)


def spec_dir() -> str:
    return os.environ.get("CORRAL_SPEC_DIR", "/var/lib/corral/specs")


def spec_path() -> str:
    return os.path.join(spec_dir(), f"asyncapi-3.0.0-{VERSION}.json")


def main() -> int:
    dest = spec_path()
    if os.path.exists(dest):
        print(dest)
        return 0
    try:
        with urllib.request.urlopen(URL, timeout=120) as r:
            data = r.read()
    except OSError as e:
        print(f"fetch-specs: cannot download {URL}: {e}", file=sys.stderr)
        return 1
    got = hashlib.sha256(data).hexdigest()
    if got != SHA256:
        print(f"fetch-specs: {URL} has sha256 {got}, expected {SHA256}", file=sys.stderr)
        return 1
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        f = tf.extractfile(MEMBER)
        if f is None:
            print(f"fetch-specs: {MEMBER} missing from {URL}", file=sys.stderr)
            return 1
        schema = f.read()
    os.makedirs(spec_dir(), exist_ok=True)
    tmp = dest + ".tmp"
    with open(tmp, "wb") as out:
        out.write(schema)
    os.replace(tmp, dest)
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
