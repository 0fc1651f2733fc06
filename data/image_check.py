"""Is an image readable? Asked once per sample when ``vitray data prepare`` writes it, so that
training never meets a zero-byte file or a ``.jpg`` that holds text.

Cheap on purpose (preparing reads every image of a dataset): Pillow identifies the format from
the header and ``verify()`` walks the file's structure (PNG chunk checksums, JPEG markers)
without decoding pixels. Subtler damage (a JPEG cut short in its entropy-coded data) is left to
the readers, which skip and count such samples.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image


def image_problem(data: bytes) -> str | None:
    """Why ``data`` is not a readable PNG/JPEG image, in a few words; None when it is."""
    if not data:
        return "empty file (0 bytes)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow's warnings about odd but readable files
            with Image.open(io.BytesIO(data)) as image:
                if image.format not in ("PNG", "JPEG", "MPO"):  # MPO: a JPEG with extra frames
                    return f"not a PNG/JPEG image ({image.format})"
                image.verify()
    except Image.UnidentifiedImageError:
        return "not an image (unidentifiable bytes)"
    except Exception as error:
        return f"undecodable ({type(error).__name__}: {' '.join(str(error).split())[:120]})"
    return None
