"""Shared by the wheel trimmers: write the kept members of a wheel with a RECORD that matches them."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from collections.abc import Iterable


def write_kept(zin: zipfile.ZipFile, kept: Iterable[str], dist_info: str, dest: str) -> str:
    """Copy members ``kept`` of ``zin`` into a new wheel ``dest`` with a fresh ``RECORD``; returns ``dest``."""
    record = []
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for n in kept:
            data = zin.read(n)
            zout.writestr(zin.getinfo(n), data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{n},sha256={digest},{len(data)}")
        record.append(f"{dist_info}/RECORD,,")
        zout.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return dest
