"""The one compiled part of vitray: region decoding of JPEGs (`data/_jpeg_region.c`).

Everything else is declared in pyproject.toml. The extension is optional: where libjpeg's headers
are missing (Debian/Ubuntu: `apt install libjpeg-dev`) the build leaves it out and the loaders
decode whole images instead (`vitray.data.transforms.REGION_DECODE` says which path is in use).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "vitray.data._jpeg_region",
            sources=["data/_jpeg_region.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
