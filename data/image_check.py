"""Is an image readable? Asked once per sample when ``vitray data prepare`` writes it, so that
training never meets a zero-byte file or a ``.jpg`` that holds text.

Cheap on purpose (preparing reads every image of a dataset): Pillow identifies the format from
the header and ``verify()`` walks the file's structure (PNG chunk checksums, JPEG markers)
without decoding pixels. Subtler damage (a JPEG cut short in its entropy-coded data) is left to
the readers, which skip and count such samples.
"""

from __future__ import annotations

import io
import re
import warnings

from PIL import Image

# How an image over Pillow's decompression-bomb limit, and one of another format, are described
# (BadImagesError tells them from the damaged ones by these: their fixes are others).
TOO_LARGE = "too large"
OTHER_FORMAT = "not a PNG/JPEG image"


def image_problem(data: bytes) -> str | None:
    """Why ``data`` is not a readable PNG/JPEG image, in a few words; None when it is."""
    if not data:
        return "empty file (0 bytes)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow's warnings about odd but readable files
            with Image.open(io.BytesIO(data)) as image:
                if image.format not in ("PNG", "JPEG", "MPO"):  # MPO: a JPEG with extra frames
                    return f"{OTHER_FORMAT} ({image.format})"
                image.verify()
    except Image.UnidentifiedImageError:
        return "not an image (unidentifiable bytes)"
    except Image.DecompressionBombError as error:
        # A valid image, but vitray's readers open every image with Pillow (the training crop's
        # reduced JPEG decode, the evaluation decode, the CPU fallback of GPU decoding), which refuses
        # it the same way: it would be skipped as corrupt at every epoch. Lifting the limit here
        # would not make it readable there (nor cheap: 400 megapixels are 1.2 GB of RGB per decode).
        return too_large(error)
    except Exception as error:
        return f"undecodable ({type(error).__name__}: {' '.join(str(error).split())[:120]})"
    return None


def too_large(error: Image.DecompressionBombError) -> str:
    """ "too large: 400 megapixels, over Pillow's limit of 179 megapixels" (Pillow refuses to open an
    image of more than twice ``Image.MAX_IMAGE_PIXELS``; it says the size only in its message)."""
    limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
    found = re.search(r"\((\d+) pixels\)", str(error))
    size = f"{int(found.group(1)) / 1e6:,.0f} megapixels, " if found else ""
    return f"{TOO_LARGE}: {size}over Pillow's limit of {limit / 1e6:,.0f} megapixels"
