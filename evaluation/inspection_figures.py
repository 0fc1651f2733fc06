"""The paper's inspection figures as PNG files, each with the numbers behind it beside it.

:func:`inspect_model` writes into one folder:

| figure (PNG) | numbers | paper |
| --- | --- | --- |
| `patch_embedding_pcs.png` | `patch_embedding_pcs.json` | Fig. 7 left: top principal components of the RGB embedding filters |
| `position_embedding_similarity.png` | `position_embedding_similarity.parquet` | Fig. 7 center: cosine similarity of position embeddings |
| `attention_distance.png` | `attention_distance.json` | Fig. 7 right / Fig. 11: mean attention distance per head and layer |
| `attention_rollout.png` | `attention_rollout.json` | Fig. 6 / 14: attention rollout from the output token to the image |

and `inspection.json`, listing them and any figure that does not apply to the model (the filter
PCA of a hybrid, whose embedding acts on ResNet features rather than RGB pixels). Figures are
drawn with matplotlib's object API on the Agg canvas (no pyplot state; safe in workers).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from vitray.evaluation.inspection_math import (
    PAPER_NUM_COMPONENTS,
    AttentionStatistics,
    attention_statistics,
    patch_embedding_pcs,
    posemb_similarity,
)

FIGURES = ("patch_embedding_pcs", "position_embedding_similarity", "attention_distance", "attention_rollout")
DPI = 110


@dataclass
class InspectionFiles:
    """What :func:`inspect_model` wrote: figure name -> PNG, name -> numbers file, name -> why skipped."""

    out_dir: Path
    figures: dict[str, Path] = field(default_factory=dict)
    numbers: dict[str, Path] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    titles: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, title: str, figure: Path, numbers: Path) -> None:
        self.titles[name], self.figures[name], self.numbers[name] = title, figure, numbers

    def markdown(self, link_prefix: str = "") -> str:
        """A Markdown section showing the figures; image links are ``link_prefix + file name``."""
        lines = ["## Model inspection (paper section 4.5)", ""]
        for name in FIGURES:
            if name in self.figures:
                title = self.titles.get(name, name.replace("_", " "))
                lines += [
                    f"**{title}**",
                    "",
                    f"![{name.replace('_', ' ')}]({link_prefix}{self.figures[name].name})",
                    "",
                    f"Numbers: [{self.numbers[name].name}]({link_prefix}{self.numbers[name].name})",
                    "",
                ]
            elif name in self.skipped:
                lines += [f"*{name.replace('_', ' ')}: skipped: {self.skipped[name]}*", ""]
        return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------
# The whole set
# ---------------------------------------------------------------------------------------------


def inspect_model(
    model: torch.nn.Module,
    images: torch.Tensor,
    out_dir: str | Path,
    *,
    captions: list[str] | None = None,
    label: str | None = None,
    num_components: int = PAPER_NUM_COMPONENTS,
    rollout_images: int = 8,
    batch_size: int = 32,
    metadata: dict[str, Any] | None = None,
) -> InspectionFiles:
    """Computes every inspection figure of ``model`` and writes PNGs + numbers into ``out_dir``.

    ``images`` are uint8 ``(n, 3, img_size, img_size)`` at the model's resolution (as the
    evaluation transform gives them): all of them go into the attention distance, the first
    ``rollout_images`` into the rollout figure, captioned by ``captions`` (e.g. file names).
    ``label`` names the model in titles; ``metadata`` (e.g. the checkpoint) is stored in every
    numbers file.
    """
    from vitray.data import to_model_range

    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected uint8 images (n, 3, H, W), got {images.dtype} {tuple(images.shape)}")
    expected = (model.img_size, model.img_size)
    if tuple(images.shape[2:]) != expected:
        raise ValueError(f"images are {tuple(images.shape[2:])} but the model takes {expected}: resize them first")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    label = label or model.name
    captions = list(captions) if captions is not None else [f"image {i}" for i in range(images.shape[0])]
    meta = {
        "model": model.name,
        "img_size": model.img_size,
        "patch_size": model.patch_size,
        "grid_size": model.grid_size,
        "head": model.head_type,
        **(metadata or {}),
    }
    files = InspectionFiles(out)

    if model.variant.is_hybrid:
        files.skipped["patch_embedding_pcs"] = (
            f"{model.name} is a hybrid: its patch embedding is a 1x1 projection of ResNet features, not a filter "
            "over RGB pixels, so the principal components of the RGB embedding filters (Fig. 7 left) are not defined"
        )
    else:
        components, explained = patch_embedding_pcs(model.patch_embed.weight, num_components)
        title = f"{label}: RGB embedding filters (first {len(components)} principal components)"
        files.add(
            "patch_embedding_pcs",
            title,
            plot_patch_embedding_pcs(components, explained, out / "patch_embedding_pcs.png", title=title),
            _write_json(
                out / "patch_embedding_pcs.json",
                {
                    **meta,
                    "figure": "paper Fig. 7 left",
                    "num_components": len(components),
                    "explained_variance_ratio": explained.tolist(),
                    "components": components.tolist(),
                },
            ),
        )

    similarity = posemb_similarity(model.pos_embed, model.grid_size)
    title = f"{label}: cosine similarity of position embeddings"
    files.add(
        "position_embedding_similarity",
        title,
        plot_posemb_similarity(similarity, out / "position_embedding_similarity.png", title=title),
        _write_similarity_parquet(
            out / "position_embedding_similarity.parquet", similarity, {**meta, "figure": "paper Fig. 7 center"}
        ),
    )

    stats = attention_statistics(model, to_model_range(images), batch_size=batch_size)
    title = f"{label}: mean attention distance per head over {stats.num_images} images"
    files.add(
        "attention_distance",
        title,
        plot_attention_distance(
            stats.mean_distance, out / "attention_distance.png", img_size=model.img_size, title=title
        ),
        _write_json(
            out / "attention_distance.json",
            {
                **meta,
                "figure": "paper Fig. 7 right / Fig. 11",
                "num_images": stats.num_images,
                "unit": "pixels",
                "layers": int(stats.mean_distance.shape[0]),
                "heads": int(stats.mean_distance.shape[1]),
                "mean_distance": stats.mean_distance.tolist(),
            },
        ),
    )

    shown = min(rollout_images, images.shape[0])
    readout = "class token" if model.cls_token is not None else "mean of the patch tokens (GAP head: no class token)"
    title = f"{label}: attention rollout from the {readout}"
    predicted = list(zip(captions[:shown], stats.predictions[:shown].tolist(), stats.confidences[:shown].tolist()))
    files.add(
        "attention_rollout",
        title,
        plot_attention_rollout(
            images[:shown].numpy(),
            stats.rollout[:shown],
            out / "attention_rollout.png",
            captions=[f"{c}\npred {p} ({q:.2f})" if p >= 0 else c for c, p, q in predicted],
            title=title,
        ),
        _write_json(
            out / "attention_rollout.json",
            {
                **meta,
                "figure": "paper Fig. 6 / 14",
                "readout": readout,
                "images": [
                    {
                        "caption": c,
                        "prediction": p if p >= 0 else None,
                        "confidence": q if p >= 0 else None,
                        "rollout": m.tolist(),
                    }
                    for (c, p, q), m in zip(predicted, stats.rollout[:shown])
                ],
            },
        ),
    )

    _write_json(
        out / "inspection.json",
        {
            **meta,
            "figures": {k: v.name for k, v in files.figures.items()},
            "numbers": {k: v.name for k, v in files.numbers.items()},
            "skipped": files.skipped,
        },
    )
    return files


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def plot_patch_embedding_pcs(components: np.ndarray, explained: np.ndarray, path: Path, *, title: str) -> Path:
    """Each component ``(3, p, p)`` shown as an RGB patch, min-max scaled on its own (as in Fig. 7)."""
    count = len(components)
    cols = min(7, count)
    rows = math.ceil(count / cols)
    fig = _figure(1.3 * cols + 0.4, 1.45 * rows + 0.6)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    for i, ax in enumerate(axes):
        ax.set_axis_off()
        if i >= count:
            continue
        rgb = components[i].transpose(1, 2, 0)
        span = rgb.max() - rgb.min()
        ax.imshow((rgb - rgb.min()) / span if span > 0 else np.zeros_like(rgb), interpolation="nearest")
        ax.set_title(f"PC{i + 1} {100 * explained[i]:.1f}%", fontsize="x-small")
    fig.suptitle(title, fontsize="medium")
    fig.savefig(path, dpi=DPI)
    return path


def plot_posemb_similarity(similarity: np.ndarray, path: Path, *, title: str) -> Path:
    """One tile per patch position (row, column): its similarity to every other position."""
    grid = similarity.shape[0]
    cell = grid + 1  # one blank pixel between tiles
    mosaic = np.full((grid * cell - 1, grid * cell - 1), np.nan)
    for r in range(grid):
        for c in range(grid):
            mosaic[r * cell : r * cell + grid, c * cell : c * cell + grid] = similarity[r, c]
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    fig = _figure(7, 6.2)
    ax = fig.add_subplot()
    shown = ax.imshow(mosaic, cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
    ticks = [i * cell + (grid - 1) / 2 for i in range(grid)]
    step = max(1, grid // 8)
    ax.set_xticks(ticks[::step], [str(i + 1) for i in range(grid)][::step])
    ax.set_yticks(ticks[::step], [str(i + 1) for i in range(grid)][::step])
    ax.set_xlabel("input patch column")
    ax.set_ylabel("input patch row")
    fig.colorbar(shown, ax=ax, label="cosine similarity", shrink=0.85)
    ax.set_title(title, fontsize="medium")
    fig.savefig(path, dpi=DPI)
    return path


def plot_attention_distance(mean_distance: np.ndarray, path: Path, *, img_size: int, title: str) -> Path:
    """One dot per head at each layer (network depth on x), as in Fig. 7 right."""
    import matplotlib

    layers, heads = mean_distance.shape
    fig = _figure(6.5, 4.5)
    ax = fig.add_subplot()
    depth = np.arange(1, layers + 1)
    # A colour of its own for each head: the default cycle has 10, and L/16 and H/14 have 16 heads.
    colours = matplotlib.colormaps["tab20" if heads <= 20 else "viridis"](np.linspace(0, 1, heads))
    for head in range(heads):
        ax.scatter(depth, mean_distance[:, head], s=14, color=colours[head], label=f"head {head + 1}")
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_xlim(0.5, layers + 0.5)
    # Half the diagonal holds nearly every head; one that looks at far corners is not cut off.
    ax.set_ylim(0, max(img_size * math.sqrt(2) / 2, float(np.nanmax(mean_distance)) * 1.05))
    ax.set_xticks(depth[:: max(1, layers // 12)])
    if heads <= 16:
        ax.legend(fontsize="x-small", ncols=2 if heads > 8 else 1, loc="lower right")
    ax.set_title(f"{title}\n(image width {img_size} px)", fontsize="medium")
    fig.savefig(path, dpi=DPI)
    return path


def plot_attention_rollout(
    images: np.ndarray, rollout: np.ndarray, path: Path, *, captions: list[str], title: str
) -> Path:
    """Per image: the input, and the input weighted by its rollout map (as Fig. 6) with the map
    over it as a heat map."""
    count = len(images)
    cols = min(4, count)
    rows = math.ceil(count / cols)
    fig = _figure(3.6 * cols, 2.0 * rows + 0.6)
    axes = fig.subplots(rows, 2 * cols, squeeze=False)
    for ax in axes.ravel():
        ax.set_axis_off()
    size = images.shape[-1]
    for i in range(count):
        row, col = divmod(i, cols)
        picture = images[i].transpose(1, 2, 0)
        mask = _upsample(rollout[i], size)
        axes[row, 2 * col].imshow(picture, interpolation="nearest")
        axes[row, 2 * col].set_title(captions[i], fontsize="x-small")
        masked = (picture.astype(np.float64) * mask[..., None]).astype(np.uint8)
        axes[row, 2 * col + 1].imshow(masked, interpolation="nearest")
        axes[row, 2 * col + 1].imshow(mask, cmap="inferno", alpha=0.35, vmin=0, vmax=1, interpolation="bilinear")
        axes[row, 2 * col + 1].set_title("attention", fontsize="x-small")
    fig.suptitle(title, fontsize="medium")
    fig.savefig(path, dpi=DPI)
    return path


def _upsample(grid_map: np.ndarray, size: int) -> np.ndarray:
    """A rollout map scaled to [0, 1] and resized bilinearly to the image."""
    tensor = torch.as_tensor(grid_map, dtype=torch.float32)[None, None]
    resized = torch.nn.functional.interpolate(tensor, size=(size, size), mode="bilinear", align_corners=False)[0, 0]
    low, high = float(resized.min()), float(resized.max())
    return ((resized - low) / (high - low)).numpy() if high > low else np.ones((size, size), dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# Numbers files
# ---------------------------------------------------------------------------------------------


def _write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.write_text(json.dumps(payload))
    return path


def _write_similarity_parquet(path: Path, similarity: np.ndarray, meta: dict[str, Any]) -> Path:
    """Long format, one row per (query patch, key patch): grid**4 rows (1.9M for H/14 at 518 px)."""
    grid = similarity.shape[0]
    qr, qc, kr, kc = np.meshgrid(*[np.arange(grid, dtype=np.int32)] * 4, indexing="ij")
    table = pa.table(
        {
            "query_row": qr.ravel(),
            "query_col": qc.ravel(),
            "key_row": kr.ravel(),
            "key_col": kc.ravel(),
            "cosine_similarity": similarity.ravel().astype(np.float32),
        }
    ).replace_schema_metadata({"vitray": json.dumps(meta)})
    pq.write_table(table, path)
    return path


__all__ = [
    "FIGURES",
    "AttentionStatistics",
    "InspectionFiles",
    "inspect_model",
    "plot_attention_distance",
    "plot_attention_rollout",
    "plot_patch_embedding_pcs",
    "plot_posemb_similarity",
]
